"""The distill recipe: the anchored head starts as the target's own predictor, only response
positions train, frozen tensors get no gradient, the schedule and step weights, the bound and
the recommended k, and --corpus conversations (both formats) as data."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from test_distill import eagle_spec, small_opts

from trtspec.distill.corpus import read_conversations, tokenize_conversations
from trtspec.distill.costs import recommend_k
from trtspec.distill.data import capture, collate
from trtspec.distill.heads import new_head
from trtspec.distill.ttt import step_weights, ttt_loss, unrolled_logits
from trtspec.engines.torch.engine import ForwardItem
from trtspec.errors import SpecError
from trtspec.recipe import DistillRecipe

ROLE_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_ckpts):
    """The tiny target built as an engine, with its HF config."""
    from transformers import AutoConfig

    from trtspec.engines.build import build
    from trtspec.engines.torch.engine import TorchEngine
    from trtspec.spec import load_spec

    folder = tmp_path_factory.mktemp("recipe")
    loaded = load_spec(eagle_spec(folder, tiny_ckpts["target"]))
    build(loaded, folder / "engines", roles=["target"])
    engine_dir = folder / "engines" / "target"
    return engine_dir, AutoConfig.from_pretrained(engine_dir), TorchEngine


@pytest.mark.parametrize("layer_ids", [(0,), (0, 1)])  # a copy of the last layer / the last layer's own output
def test_an_anchored_head_starts_as_the_targets_own_prediction(target, layer_ids):
    """Untrained, the anchored head's step-0 logits at position t are the target's logits at t
    over the draft vocabulary: fc passes the late feature through and the layer is the target
    layer after it (or the identity when the feature is the last layer's output)."""
    folder, hf, engine_cls = target
    eng = engine_cls.load(folder, slots=1)
    eng.capture_features(layer_ids)
    draft_ids = list(range(0, hf.vocab_size, 3))
    head, _ = new_head(hf, folder, layer_ids, draft_ids, seed=0)
    tokens = [5 + (7 * i) % 300 for i in range(24)]
    s = capture(eng, tokens[:10], tokens[10:])
    batch = collate([s], 64)
    with torch.no_grad():
        lg = unrolled_logits(head, eng.model.model.embed_tokens, batch, 1, eng.cos, eng.sin)[0][0]  # [T, draft]
        want = eng.run([ForwardItem(tokens, len(tokens))])[0]  # [T, vocab]
    assert torch.allclose(lg, want[:, draft_ids], atol=1e-4, rtol=1e-4)
    unanchored, _ = new_head(hf, folder, layer_ids, draft_ids, seed=0, anchor=False)
    with torch.no_grad():
        other = unrolled_logits(unanchored, eng.model.model.embed_tokens, batch, 1, eng.cos, eng.sin)[0][0]
    assert not torch.allclose(other, want[:, draft_ids], atol=1e-2)


def test_only_response_positions_train_and_frozen_tensors_get_no_gradient(target):
    """Changing the labels of prompt positions changes nothing; changing a response label does.
    The LM head (frozen by default) and the shared embeddings get no gradient."""
    folder, hf, engine_cls = target
    eng = engine_cls.load(folder, slots=1)
    eng.capture_features((0, 1))
    draft_ids = list(range(hf.vocab_size))
    head, _ = new_head(hf, folder, (0, 1), draft_ids, seed=0)
    head.lm_head.weight.requires_grad_(False)
    t2d = torch.arange(hf.vocab_size)
    tokens = [5 + (11 * i) % 300 for i in range(30)]
    s = capture(eng, tokens[:12], tokens[12:])
    embed = eng.model.model.embed_tokens

    def loss(sample) -> torch.Tensor:
        return ttt_loss(head, embed, collate([sample], 64), 2, t2d, eng.cos, eng.sin, weights=step_weights(2, 0.8))[0]

    base = loss(s)
    prompt_relabelled = type(s)(**{**s.__dict__, "labels": s.labels.clone()})
    prompt_relabelled.labels[:10] = (prompt_relabelled.labels[:10] + 1) % hf.vocab_size
    assert loss(prompt_relabelled).item() == base.item()
    response_relabelled = type(s)(**{**s.__dict__, "labels": s.labels.clone()})
    response_relabelled.labels[20] = (response_relabelled.labels[20] + 1) % hf.vocab_size
    assert loss(response_relabelled).item() != base.item()
    base.backward()
    assert head.lm_head.weight.grad is None and embed.weight.grad is None
    assert head.fc.weight.grad is not None and float(head.fc.weight.grad.abs().sum()) > 0


def test_step_weights_and_the_schedule():
    w = step_weights(3, 0.8)
    assert sum(w) == pytest.approx(1.0) and w[1] / w[0] == pytest.approx(0.8) and w[2] / w[1] == pytest.approx(0.8)
    assert DistillRecipe().step_decay == 0.5  # the measured default: 1, 0.5, 0.25 for 3 steps
    assert step_weights(2, 1.0) == [0.5, 0.5]

    from types import SimpleNamespace

    from trtspec.distill.trainer import Trainer

    t = Trainer.__new__(Trainer)
    t.opts = SimpleNamespace(schedule="cosine", warmup=0.1, max_steps=100)
    f = [t.lr_factor(s) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # 10 warmup steps
    assert f[10] == pytest.approx(1.0) and f[-1] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # decays monotonically
    assert f[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))
    t.opts = SimpleNamespace(schedule="constant", warmup=0.1, max_steps=100)
    assert {t.lr_factor(s) for s in range(100)} == {1.0}


def test_the_bound_and_the_recommended_k():
    costs = {"verify": [1.1, 1.2, 1.3], "head": 0.05}
    k, bound = recommend_k([0.6, 0.5, 0.4], costs)
    assert bound == [round(1.6 / 1.15, 3), round((1.6 + 0.3) / 1.3, 3), round((1.6 + 0.3 + 0.12) / 1.45, 3)]
    assert k == 2  # 1.462 > 1.393 > 1.391
    assert recommend_k([0.1, 0.1, 0.1], costs)[0] == 0  # nothing beats target-only


def test_corpus_formats_and_refusals(tmp_path):
    openai = tmp_path / "chats.jsonl"
    openai.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "no answer"}]})
        + "\n"
    )
    assert read_conversations(openai) == [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]]
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "system", "value": "be brief"},
                        {"from": "human", "value": "a"},
                        {"from": "gpt", "value": "b"},
                    ]
                }
            ]
        )
    )
    assert [m["role"] for m in read_conversations(sharegpt)[0]] == ["system", "user", "assistant"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "plain"}\n')
    with pytest.raises(SpecError, match="line 1: expected"):
        read_conversations(bad)
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(SpecError, match="not UTF-8"):
        read_conversations(bad)
    with pytest.raises(SpecError, match="no conversation with an assistant turn"):
        read_conversations(_write(tmp_path / "q.jsonl", {"messages": [{"role": "user", "content": "only"}]}))


def _write(path: Path, row: dict) -> Path:
    path.write_text(json.dumps(row) + "\n")
    return path


def test_assistant_turns_are_the_response_positions(tiny_ckpts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_ckpts["target"])
    tok.chat_template = ROLE_TEMPLATE
    msgs = [
        {"role": "user", "content": "one two"},
        {"role": "assistant", "content": "three four"},
        {"role": "user", "content": "five"},
        {"role": "assistant", "content": "six"},
    ]
    (conv,), skipped = tokenize_conversations(tok, [msgs], max_len=512)
    assert skipped == 0
    text = [tok.decode([t]) for t, r in zip(conv.tokens, conv.response.tolist()) if r]
    assert "".join(text).replace(" ", "") == "threefour<|end|>six<|end|>".replace(" ", "")
    tok.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    assert tokenize_conversations(tok, [msgs], max_len=512) == ([], 1)  # a template that hides the turns


def test_distill_trains_on_a_corpus(tmp_path, tiny_ckpts):
    """--corpus: conversations captured without generation join the training data (their
    assistant turns only); the unseen prompts are still scored."""
    from trtspec.distill.run import distill
    from trtspec.spec import load_spec

    ckpt = tmp_path / "target"
    shutil.copytree(tiny_ckpts["target"], ckpt)
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ROLE_TEMPLATE
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    (ckpt / "chat_template.jinja").unlink(missing_ok=True)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": f"{w} {w} {w}"}]})
            + "\n"
            for w in ("fox", "box", "pack", "quick", "brown")
        )
    )
    loaded = load_spec(eagle_spec(tmp_path, ckpt))
    res = distill(loaded, small_opts(tmp_path, corpus=corpus, max_steps=3))
    man = json.loads((tmp_path / "head" / "trtspec-head.json").read_text())
    assert man["data"]["corpus_conversations"] == 5 and man["data"]["rates"]["sequences"]["corpus"] == 5
    assert man["data"]["rates"]["captured_tokens"] > 0
    assert res.metrics["unseen_chains"] > 0 and len(res.metrics["unseen_accepted"]) >= 3


def test_norms_train_an_eagle31_head_that_check_accepts(tmp_path, tiny_ckpts):
    """--norms: the head is made with speculators' default norms (the fused features normed
    before fc, the hidden-normed residual, the normed output fed back), trains them, and writes
    a folder the checkpoint check accepts; without it the head has none."""
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from trtspec.cli.app import app
    from trtspec.distill.heads import NORMS
    from trtspec.distill.run import distill
    from trtspec.spec import load_spec

    spec = eagle_spec(tmp_path, tiny_ckpts["target"])
    distill(load_spec(spec), small_opts(tmp_path, norms=True))
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert {k: config.get(k) for k in NORMS} == NORMS
    weights = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert not torch.equal(weights["input_norm.weight"], torch.ones_like(weights["input_norm.weight"]))  # it trained
    assert json.loads((tmp_path / "head" / "trtspec-head.json").read_text())["recipe"]["norms"] is True
    assert CliRunner().invoke(app, ["check", str(spec)]).exit_code == 0
    plain = tmp_path / "plain"
    plain.mkdir()
    distill(load_spec(eagle_spec(plain, tiny_ckpts["target"])), small_opts(plain))
    assert "input_norm.weight" not in load_file(str(plain / "head" / "model.safetensors"))
    assert not any(json.loads((plain / "head" / "config.json").read_text()).get(k) for k in NORMS)


def test_costs_are_measured_within_an_engine_sized_to_short_data(target):
    """distill sizes the target's KV cache to its longest prompt + response; the cost timing
    must fit in it (a 57-position engine once failed with 'sequence of 128 tokens exceeds')."""
    from trtspec.distill.costs import measure_costs

    folder, hf, engine_cls = target
    eng = engine_cls.load(folder, slots=2, max_seq_len=20)
    head, _ = new_head(hf, folder, (0, 1), list(range(hf.vocab_size)), seed=0)
    costs = measure_costs(eng, head, 3)
    assert len(costs["verify"]) == 3 and costs["decode_ms"] > 0 and costs["head"] > 0


def test_a_verify_cost_never_falls_with_k_so_noise_does_not_recommend_a_longer_draft(target, monkeypatch):
    """A neighbour during the 1-token timing made verify(2) look cheaper than verify(1) (the
    demo head's manifest: 1.318 / 1.188 / 1.352) and recommend k=2 for a head whose second
    draft is right 4.5% of the time; a longer verify does a shorter one's work and more."""
    from trtspec.distill import costs as costs_mod
    from trtspec.distill.costs import measure_costs, recommend_k

    folder, hf, engine_cls = target
    eng = engine_cls.load(folder, slots=2, max_seq_len=40)
    head, _ = new_head(hf, folder, (0, 1), list(range(hf.vocab_size)), seed=0)
    timings = iter([1.0, 1.318, 1.188, 1.352, 0.0234])  # decode, verify k=1..3, head step
    monkeypatch.setattr(costs_mod, "best_seconds", lambda fn, repeats=costs_mod.REPEATS: next(timings))
    costs = measure_costs(eng, head, 3)
    assert costs["verify"] == [1.318, 1.318, 1.352]
    assert recommend_k([0.401, 0.045, 0.158], costs)[0] == 1  # k=2 with the noisy 1.188
    assert recommend_k([0.401, 0.045, 0.158], costs | {"verify": [1.318, 1.188, 1.352]})[0] == 2
    # A loaded machine flattens the verify costs: a third draft right 9% of the time after a
    # second right 3% wins by 0.2%, not enough to recommend k=3 over k=1.
    flat = {"verify": [1.0, 1.0, 1.0], "head": 0.003}
    k, bounds = recommend_k([0.34, 0.03, 0.09], flat)
    assert k == 1 and bounds[2] > bounds[0]
    assert recommend_k([0.8, 0.8, 0.8], flat)[0] == 3  # a deeper draft that pays is still recommended


def test_the_generation_batch_is_the_fastest_measured_and_kept_per_machine(target, tmp_path, monkeypatch):
    """A CPU generates at the batch with the most tokens per second on it (the fewest rows within
    3% of that), measured once per machine and model and cached, so the same command gives the
    same batches, the same data and the same head however loaded the machine is later."""
    from trtspec.distill import costs

    assert costs.fastest_rows({16: 100.0, 32: 150.0, 64: 170.0, 128: 172.0}) == 64  # 128 is within 3%
    assert costs.fastest_rows({16: 100.0, 32: 144.0, 64: 119.0, 128: 105.0}) == 32  # a CPU bound by compute past 32
    folder, hf, _ = target
    key = costs.generation_key(folder, hf)
    rows, rates, how = costs.generation_rows_for(folder, "cpu", key, tmp_path)
    assert how == "measured" and set(rates) == set(costs.GEN_ROWS_CANDIDATES) and all(v > 0 for v in rates.values())
    assert rows == costs.fastest_rows(rates)
    monkeypatch.setattr(costs, "measure_generation_rows", lambda *a, **k: pytest.fail("measured again"))
    assert costs.generation_rows_for(folder, "cpu", key, tmp_path) == (rows, rates, "cached")
    monkeypatch.setattr(costs, "measure_generation_rows", lambda *a, **k: {16: 1.0, 32: 9.0, 64: 2.0, 128: 1.0})
    assert costs.generation_rows_for(folder, "cpu", key + "another machine", tmp_path)[:2] == (
        32,
        {16: 1.0, 32: 9.0, 64: 2.0, 128: 1.0},
    )
    (tmp_path / costs.GEN_ROWS_FILE).write_text("{not json")  # a damaged cache is measured again
    assert costs.generation_rows_for(folder, "cpu", key, tmp_path)[2] == "measured"


def test_the_data_scaling_curve_is_measured_and_plotted(tmp_path, tiny_ckpts):
    """--scaling 0.5: the same recipe on half the training sequences (half the steps), scored on
    the unseen prompts, beside the full run; the plot lands in the head folder."""
    from trtspec.distill.run import distill
    from trtspec.spec import load_spec

    loaded = load_spec(eagle_spec(tmp_path, tiny_ckpts["target"]))
    distill(loaded, small_opts(tmp_path, scaling=(0.5,), max_steps=4))
    man = json.loads((tmp_path / "head" / "trtspec-head.json").read_text())
    half, full = man["scaling"]
    assert (half["fraction"], full["fraction"]) == (0.5, 1.0)
    assert half["sequences"] == round(full["sequences"] / 2) and 0 < half["response_tokens"] < full["response_tokens"]
    assert full["unseen_accepted"] == man["metrics"]["unseen_accepted"]
    assert (tmp_path / "head" / "data-scaling.png").stat().st_size > 0
