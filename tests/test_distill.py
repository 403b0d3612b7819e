"""`trtspec distill`: training-time test on tiny targets, resume, refusals, atomic output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import write_spec
from safetensors.torch import load_file
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.distill.run import DistillOptions, distill
from trtspec.errors import TrtspecError
from trtspec.spec import load_spec

runner = CliRunner()
PROMPTS = [
    "The quick brown fox",
    "Speculative decoding makes",
    "def fibonacci(n):",
    "Summarise the following text",
    "Triton serves models",
    "Pack my box with",
    "Rewrite the paragraph",
    "TensorRT-LLM builds engines",
    "A small draft model proposes",
    "The large target model checks",
]


def prompts_file(folder: Path, prompts=PROMPTS) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def eagle_spec(folder: Path, target: Path) -> Path:
    return write_spec(folder, {"target": target, "head": folder / "head"}, "head", **{"speculative.method": "eagle3"})


def small_opts(folder: Path, **kw) -> DistillOptions:
    base = dict(
        prompts=prompts_file(folder),
        max_steps=6,
        eval_every=3,
        max_tokens=12,
        draft_vocab=120,
        batch_size=4,
        held_out=0.2,
        gen_batch=4,
    )
    base.update(kw)
    return DistillOptions(**base)


def interrupted_distill(monkeypatch, loaded, folder: Path, at_batch: int) -> list[int]:
    """Distill ``loaded`` (small_opts in ``folder``) with Ctrl-C as data generation starts its
    ``at_batch``-th batch; the sizes of the batches it was asked for, that one included."""
    import trtspec.distill.data as data

    real, calls = data.generate, []

    def generate_then_interrupt(*args, **kwargs):
        calls.append(len(args[0]))
        if len(calls) == at_batch:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(data, "generate", generate_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        distill(loaded, small_opts(folder))
    return calls


def spy_training_steps(monkeypatch, pick) -> list:
    """What ``pick(args, kwargs)`` takes from each training step's ttt_loss call (the trainer's
    own loss still runs), in step order."""
    import trtspec.distill.ttt as ttt

    seen, real = [], ttt.ttt_loss

    def spy(*a, **kw):
        seen.append(pick(a, kw))
        return real(*a, **kw)

    monkeypatch.setattr("trtspec.distill.trainer.ttt_loss", spy)
    return seen


def test_resume_after_an_interrupt_equals_an_uninterrupted_run(tmp_path, tiny_ckpts):
    straight = distill(load_spec(eagle_spec(tmp_path / "a", tiny_ckpts["target"])), small_opts(tmp_path / "a"))

    b = tmp_path / "b"
    loaded = load_spec(eagle_spec(b, tiny_ckpts["target"]))

    def interrupt(row):
        if row["step"] == 4:  # between checkpoints (eval_every 3): the interrupt itself saves
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(loaded, small_opts(b), on_step=interrupt)
    assert not (b / "head").exists()  # nothing half-written where build would look
    assert (b / ".head.distill" / "checkpoint.pt").is_file()
    resumed = distill(loaded, small_opts(b, resume=True))

    assert resumed.steps == straight.steps == 6
    wa = load_file(str(tmp_path / "a" / "head" / "model.safetensors"))
    wb = load_file(str(b / "head" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    assert resumed.metrics == straight.metrics
    manifest = json.loads((b / "head" / "trtspec-head.json").read_text())
    assert manifest["steps"] == 6 and manifest["seed"] == 0
    # the spec's two verify prompts ("The quick brown fox", "Speculative decoding makes") are
    # left out: the gate measures on prompts the head never saw
    assert manifest["data"]["prompts_used"] == 8
    assert manifest["data"]["held_out_prompts"] == 2 and manifest["data"]["train_prompts"] == 6
    assert (b / "head" / "training-curve.png").stat().st_size > 0


def test_an_interrupt_while_generating_keeps_the_finished_responses(tmp_path, tiny_ckpts, monkeypatch, capsys):
    """Ctrl-C during data generation keeps every finished batch (features and labels as
    captured while generating); the rerun generates only the rest and trains on data equal to
    an uninterrupted run's (same head, bit for bit)."""
    import trtspec.distill.data as data
    from trtspec.engines.torch import native

    # Bit for bit needs a row's features not to depend on the batch it ran in: the rerun batches
    # the remaining prompts otherwise. The panel kernel adds each row's products alike in any
    # batch; a measured split between two kernels by row count would not.
    monkeypatch.setenv("TRTSPEC_ONEDNN", "panel" if native.panel_kernel() is not None else "0")

    straight = distill(load_spec(eagle_spec(tmp_path / "a", tiny_ckpts["target"])), small_opts(tmp_path / "a"))
    b = tmp_path / "b"
    loaded = load_spec(eagle_spec(b, tiny_ckpts["target"]))
    real = data.generate
    calls = interrupted_distill(monkeypatch, loaded, b, at_batch=2)
    (parts,) = (b / ".head.distill").glob("parts-*")
    kept = calls[0]
    (survived,) = (parts / "responses").iterdir()  # the first batch, named by its requests
    assert survived.name.startswith("part-00000-") and survived.suffix == ".safetensors"
    rerun: list[int] = []
    monkeypatch.setattr(data, "generate", lambda *a, **k: rerun.append(len(a[0])) or real(*a, **k))
    capsys.readouterr()
    resumed = distill(loaded, small_opts(b))
    # 8 training/held-out prompts (10 less the 2 that are verify prompts) + the spec's verify
    # prompts, generated once as the unseen evaluation set
    total = 8 + len(set(loaded.verify_prompts()))
    assert f"target responses {kept}/{total} found in {parts / 'responses'}" in capsys.readouterr().err.replace("\n", "")
    assert sum(rerun) == total - kept  # only the prompts without a response were generated
    assert not parts.exists()  # the finished store replaces the batches
    wa = load_file(str(tmp_path / "a" / "head" / "model.safetensors"))
    wb = load_file(str(b / "head" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa) and resumed.metrics == straight.metrics


@pytest.mark.slow
def test_a_trained_head_beats_an_untrained_one(tmp_path, tiny_ckpts):
    """Trained on the target's responses to 8 prompts; measured through the runtime on the
    spec's verify prompts (none of them trained on): identical outputs, higher acceptance."""
    from exact_head import make_bigram_target
    from transformers import AutoConfig

    from trtspec.distill.heads import new_head, save_head
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment

    target = make_bigram_target(tmp_path / "target", tiny_ckpts["target"], hidden=64)
    loaded = load_spec(eagle_spec(tmp_path, target))
    result = distill(loaded, small_opts(tmp_path, max_steps=60, eval_every=20, max_tokens=24, draft_vocab=100))
    assert result.metrics["held_out_acceptance_length"] > 2.0  # of 1 + 3 possible at k = 3

    def acceptance(head_dir: Path) -> float:
        out = tmp_path / f"engines-{head_dir.name}"
        build(loaded, out, force=True)
        dep = Deployment(loaded, out)
        reqs = [dep.request(dep.encode(p), 40, 4) for p in loaded.spec.verify.prompts[:4]]
        base, spec = dep.generate(reqs, speculative=False), dep.generate(reqs)
        assert [s.output_ids for s in spec] == [b.output_ids for b in base]
        drafted = sum(s.metrics.drafted for s in spec)
        assert drafted > 0
        return sum(s.metrics.accepted for s in spec) / drafted

    trained = acceptance(tmp_path / "head")
    # The untrained head: the same (anchored) initialisation, vocabulary and layers, no training step.
    d2t = load_file(str(tmp_path / "head" / "model.safetensors"))["d2t"]
    hf = AutoConfig.from_pretrained(target)
    untrained, config = new_head(hf, tmp_path / "engines" / "target", (0, 1), (torch.arange(len(d2t)) + d2t).tolist(), seed=0)
    save_head(tmp_path / "head", untrained, config)
    before = acceptance(tmp_path / "head")
    assert trained > before + 0.3, (trained, before)


def test_soft_labels_of_a_certain_target_are_the_hard_labels():
    """The soft loss is cross-entropy against the target's top-k distribution over the draft
    vocabulary: where the target puts (almost) all its mass on its greedy token, it equals the
    hard loss; where it hesitates, it is a different objective (its runner-up counts)."""
    from trtspec.distill.ttt import Batch, ttt_loss
    from trtspec.engines.eagle3_checkpoint import HeadConfig
    from trtspec.engines.torch.eagle3_head import Eagle3Head

    torch.manual_seed(0)
    cfg = HeadConfig(
        hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6,
        vocab_size=20, draft_vocab_size=12, target_hidden_size=16, layer_ids=(0, 1, 2), target_num_layers=3, raw={},
    )  # fmt: skip
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.copy_(torch.ones_like(param) if name.endswith("norm.weight") else torch.randn_like(param) * 0.3)
    embed = torch.nn.Embedding(20, 16)
    b, t, k = 2, 7, 4
    tokens = torch.randint(0, 20, (b, t))
    ids = torch.stack([torch.randperm(20)[:k] for _ in range(b * t)]).view(b, t, k)
    t2d = torch.full((20,), -1, dtype=torch.long)
    t2d[:12] = torch.arange(12)
    ids[..., 0] = torch.randint(0, 12, (b, t))  # the greedy token is in the draft vocabulary
    sure = torch.tensor([60.0, 0.0, -1.0, -2.0]).expand(b, t, k).clone()
    angles = torch.outer(torch.arange(t).float(), 1.0 / torch.arange(1, 5).float()).repeat(1, 2)  # [t, head_dim]
    cos, sin = torch.cos(angles), torch.sin(angles)
    feats = torch.randn(b, t, 48)
    resp = torch.arange(t).view(1, t) >= torch.tensor([[1], [2]])  # response text from position 1 / 2

    def loss(top_logits, soft):
        batch = Batch(tokens, feats, ids[..., 0].clone(), resp, ids, top_logits)
        return float(ttt_loss(head, embed, batch, 2, t2d, cos, sin, soft=soft)[0].detach())

    assert loss(sure, soft=True) == pytest.approx(loss(sure, soft=False), rel=1e-5)
    unsure = torch.tensor([1.0, 0.9, 0.5, -1.0]).expand(b, t, k).clone()
    assert loss(unsure, soft=True) != pytest.approx(loss(unsure, soft=False), rel=1e-3)


def test_soft_label_runs_resume_as_their_own_and_refuse_a_hard_checkpoint(tmp_path, tiny_ckpts):
    """Soft labels (the default) train (the loss is finite on tiny data), record themselves in
    the manifest, and a hard run's checkpoint is not resumed as a soft one."""
    a = tmp_path / "a"
    loaded = load_spec(eagle_spec(a, tiny_ckpts["target"]))
    soft = distill(loaded, small_opts(a, max_steps=6))  # the default
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in soft.curve)
    manifest = json.loads((a / "head" / "trtspec-head.json").read_text())
    assert manifest["recipe"]["labels"] == "soft"

    def interrupt(row):
        if row["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(loaded, small_opts(a, force=True, labels="hard"), on_step=interrupt)  # hard labels, interrupted
    with pytest.raises(TrtspecError, match="other data, seed or training options \\(--labels"):
        distill(loaded, small_opts(a, force=True, resume=True, labels="soft"))


# ------------------------------------------------------------------------------ refusals


def test_existing_output_without_force(tmp_path, tiny_ckpts):
    spec = eagle_spec(tmp_path, tiny_ckpts["target"])
    (tmp_path / "head").mkdir()
    r = runner.invoke(app, ["distill", str(spec), "--prompts", str(prompts_file(tmp_path))])
    assert r.exit_code == 2
    assert "already exists; pass --force" in r.output


def test_a_budget_spent_before_the_first_step_writes_no_head_and_keeps_the_data(tmp_path, tiny_ckpts):
    spec = eagle_spec(tmp_path, tiny_ckpts["target"])
    with pytest.raises(TrtspecError, match=r"spent before the first training step .* no head written. Raise --time-budget"):
        distill(load_spec(spec), small_opts(tmp_path, time_budget=0.001))
    assert not (tmp_path / "head").exists()
    assert list((tmp_path / ".head.distill").glob("data-*.safetensors"))  # the capture, reused by the next run
    result = distill(load_spec(spec), small_opts(tmp_path, time_budget=None))
    assert result.steps == 6 and (tmp_path / "head" / "config.json").is_file()


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "holds 0 prompt(s); distill needs at least 2"),
        ('{"prompt": "only one"}\n', "holds 1 prompt(s)"),
        (b"\xff\xfe\x00garbage", "not UTF-8 text (byte 0xff at byte offset 0)"),
        ('{"text": "no prompt key"}\n', 'expected {"prompt": "<non-empty text>"}'),
    ],
)
def test_bad_prompts_file(tmp_path, tiny_ckpts, content, message):
    spec = eagle_spec(tmp_path, tiny_ckpts["target"])
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    r = runner.invoke(app, ["distill", str(spec), "--prompts", str(path)])
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert not (tmp_path / "head").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompts", "missing.jsonl"], "does not exist"),
        (["--resume"], "--resume: no checkpoint"),
        (["--time-budget", "ten minutes"], "--time-budget takes a positive duration"),
        (["--layers", "0,x"], "--layers takes comma-separated"),
    ],
)
def test_bad_flags(tmp_path, tiny_ckpts, args, message):
    spec = eagle_spec(tmp_path, tiny_ckpts["target"])
    r = runner.invoke(app, ["distill", str(spec), *args])
    assert r.exit_code == 2, r.output
    assert message in r.output


def test_unknown_layer_ids(tmp_path, tiny_ckpts):
    spec = eagle_spec(tmp_path, tiny_ckpts["target"])
    r = runner.invoke(app, ["distill", str(spec), "--prompts", str(prompts_file(tmp_path)), "--layers", "0,7"])
    assert r.exit_code == 2, r.output
    assert "must be distinct ascending ids in 0..1" in r.output
    assert not (tmp_path / "head").exists()


def test_a_spec_without_an_eagle3_head_needs_output(tmp_path, tiny_ckpts):
    spec = write_spec(tmp_path, tiny_ckpts)
    r = runner.invoke(app, ["distill", str(spec)])
    assert r.exit_code == 2
    assert "set speculative.method: eagle3 and draft.path, or pass --output" in r.output


def test_an_interrupted_write_leaves_nothing_build_accepts(tmp_path, tiny_ckpts, monkeypatch):
    import trtspec.distill.heads as heads

    spec = eagle_spec(tmp_path, tiny_ckpts["target"])

    def fail(tmp, folder):  # every file written, then the rename never happens
        raise KeyboardInterrupt

    monkeypatch.setattr(heads, "swap_into_place", fail)
    with pytest.raises(KeyboardInterrupt):
        distill(load_spec(spec), small_opts(tmp_path, max_steps=2))
    assert not (tmp_path / "head").exists()
    assert not list(tmp_path.glob(".head.tmp-*"))
    monkeypatch.undo()
    r = runner.invoke(app, ["build", str(spec)])
    assert r.exit_code == 2
    assert "is not a folder; train the EAGLE-3 head there with `trtspec distill" in r.output
    assert not (tmp_path / "engines" / "draft").exists()


def test_sampled_responses_add_training_contexts_only(tmp_path, tiny_ckpts):
    """--samples-per-prompt 3: each training prompt gets its greedy response and two sampled
    ones (seeded: two runs give the same data and head); held-out prompts keep their greedy
    response only, and every label is still the target's greedy next token."""
    import trtspec.distill.store as store

    runs = []
    for name in ("a", "b"):
        loaded = load_spec(eagle_spec(tmp_path / name, tiny_ckpts["target"]))
        res = distill(loaded, small_opts(tmp_path / name, samples_per_prompt=3, max_steps=2, eval_every=1))
        runs.append((res, json.loads((tmp_path / name / "head" / "trtspec-head.json").read_text())))
    (res_a, man), (res_b, _) = runs
    assert man["data"]["train_sequences"] == 3 * man["data"]["train_prompts"] == 18
    assert man["data"]["held_out_prompts"] == 2 and man["data"]["samples_per_prompt"] == 3
    assert res_a.metrics == res_b.metrics
    (index,) = (tmp_path / "a" / ".head.distill").glob("data-*.safetensors")
    samples = store.open_store(index.parent, index.name.removeprefix("data-").removesuffix(".safetensors")).samples
    unseen = len(set(loaded.verify_prompts()))
    # every prompt's greedy response, the unseen (verify) prompts', then 2 sampled per training prompt
    assert len(samples) == 8 + unseen + 12
    greedy = {tuple(s.tokens[: s.prompt_len].tolist()): s for s in samples[:8]}
    differs = relabelled = 0
    for s in samples[: 8 + unseen]:  # greedy: each label is the next token, from the last prompt position on
        p = s.prompt_len
        assert torch.equal(s.labels[p - 1 : -1], s.tokens[p:]) and bool((s.labels[: p - 1] == -1).all())
    for s in samples[8 + unseen :]:
        g = greedy[tuple(s.tokens[: s.prompt_len].tolist())]  # a training prompt's sample
        differs += not torch.equal(s.tokens, g.tokens)
        p = s.prompt_len
        relabelled += int((s.labels[p - 1 : -1] != s.tokens[p:]).sum())  # the target's greedy token, not the sampled one
    assert differs > 0  # sampling gave other contexts than the greedy ones
    assert relabelled > 0


def test_shipped_prompts_are_unique_and_never_a_gate_or_bench_prompt():
    """The shipped set must leave the figures honest: no prompt that trtspec/bench/prompts.jsonl or a
    shipped spec's verify list measures on (distill drops the latter, bench relies on this)."""
    import yaml

    from trtspec.distill.data import SHIPPED_PROMPTS, distill_prompts

    root = Path(__file__).resolve().parents[1]
    shipped = distill_prompts(SHIPPED_PROMPTS)
    assert len(shipped) == len(set(shipped)) >= 500
    measured = set(distill_prompts(root / "trtspec" / "bench" / "prompts.jsonl"))
    for spec in sorted((root / "engine_specs").glob("*.yaml")):
        verify = (yaml.safe_load(spec.read_text()) or {}).get("verify") or {}
        measured |= set(verify.get("prompts") or [])
    assert measured and not measured & set(shipped)


def test_an_averaged_run_writes_its_average_and_resumes_to_the_same_head(tmp_path, tiny_ckpts):
    """--ema D: the head written is the running average of the weights (kept in the checkpoint
    beside the last weights), and an interrupted run resumes to the same average, bit for bit."""
    straight = distill(load_spec(eagle_spec(tmp_path / "a", tiny_ckpts["target"])), small_opts(tmp_path / "a", ema=0.5))
    written = load_file(str(tmp_path / "a" / "head" / "model.safetensors"))
    ckpt = torch.load(tmp_path / "a" / ".head.distill" / "checkpoint.pt", weights_only=True)
    trained = [name for name, w in ckpt["head"].items() if name in written and not torch.equal(w, written[name])]
    assert trained and len(ckpt["average"]) > 0  # the last weights are not what was written
    last = distill(load_spec(eagle_spec(tmp_path / "c", tiny_ckpts["target"])), small_opts(tmp_path / "c"))
    plain = load_file(str(tmp_path / "c" / "head" / "model.safetensors"))
    assert any(not torch.equal(plain[name], written[name]) for name in trained)
    assert last.steps == straight.steps

    b = tmp_path / "b"
    loaded = load_spec(eagle_spec(b, tiny_ckpts["target"]))

    def interrupt(row):
        if row["step"] == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distill(loaded, small_opts(b, ema=0.5), on_step=interrupt)
    resumed = distill(loaded, small_opts(b, ema=0.5, resume=True))
    wb = load_file(str(b / "head" / "model.safetensors"))
    for name in written:
        assert torch.equal(written[name], wb[name]), name
    assert resumed.metrics == straight.metrics


def test_the_weight_average_moves_by_one_minus_the_decay_toward_the_weights():
    from trtspec.distill.options import DistillOptions as Options
    from trtspec.distill.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.opts = Options(ema=0.75)
    trainer.params = [torch.nn.Parameter(torch.full((3,), 4.0)), torch.nn.Parameter(torch.zeros(2))]
    trainer.average = [torch.zeros(3), torch.full((2,), 8.0)]
    trainer._update_average()
    assert torch.equal(trainer.average[0], torch.full((3,), 1.0))  # 0.75 x 0 + 0.25 x 4
    assert torch.equal(trainer.average[1], torch.full((2,), 6.0))  # 0.75 x 8 + 0.25 x 0
    with trainer._averaged():
        assert torch.equal(trainer.params[0].detach(), torch.full((3,), 1.0))
    assert torch.equal(trainer.params[0].detach(), torch.full((3,), 4.0))  # the last weights back
