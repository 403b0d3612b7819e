"""method eagle3: the head layout, the target check, target features, and the drafter through
the one loop (exact token identity on tiny models)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import write_spec
from exact_head import bigram_map, make_bigram_target, make_exact_head
from safetensors import safe_open
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.distill.heads import new_head, save_head
from trtspec.engines.eagle3_checkpoint import default_layer_ids

runner = CliRunner()

# The names TensorRT-LLM (modeling_speculative.py@00679c66), vLLM (llama_eagle3.py@00bd1493)
# and SGLang (llama_eagle3.py@03d5a777) read from an EAGLE-3 head (../shared/reference/codesign.md).
LOADER_TENSORS = {
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
}
DRAFT_IDS = list(range(7, 300, 2))  # a reduced, non-contiguous draft vocabulary


def random_head(target: Path, out: Path, seed: int = 0, scale: float = 0.3, draft_ids=DRAFT_IDS) -> Path:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(target)
    head, config = new_head(hf, target, default_layer_ids(hf.num_hidden_layers), list(draft_ids), seed, scale=scale, anchor=False)
    save_head(out, head, config)
    return out


@pytest.fixture(scope="module")
def heads(tmp_path_factory, tiny_ckpts):
    root = tmp_path_factory.mktemp("heads")
    bigram = make_bigram_target(root / "bigram-target", tiny_ckpts["target"])
    return {
        "random": random_head(tiny_ckpts["target"], root / "random"),
        "bigram-target": bigram,
        "exact": make_exact_head(bigram, root / "exact"),
    }


@pytest.fixture(scope="module")
def eagle_deploy(tmp_path_factory, tiny_ckpts, heads):
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec

    cache = {}

    def get(head: str, target: str = "target"):
        if (head, target) not in cache:
            ck = {"target": heads.get(target) or tiny_ckpts[target], "head": heads[head]}
            folder = tmp_path_factory.mktemp(f"eagle-{head}")
            loaded = load_spec(write_spec(folder, ck, "head", **{"speculative.method": "eagle3"}))
            build(loaded, loaded.output_dir())
            cache[(head, target)] = Deployment(loaded, loaded.output_dir())
        return cache[(head, target)]

    return get


def generate_both(dep, prompts, k, max_tokens=40):
    reqs = [dep.request(dep.encode(p), max_tokens, k) for p in prompts]
    dep.forget_prefixes()
    base = dep.generate(reqs, speculative=False)
    dep.forget_prefixes()
    spec = dep.generate(reqs, speculative=True)
    return base, spec


# ------------------------------------------------------------------------------ layout


def assert_loader_layout(folder: Path, target_folder: Path) -> tuple[dict, torch.Tensor]:
    """What vLLM's, SGLang's and TensorRT-LLM's EAGLE-3 loaders read of a head folder, for the
    target in ``target_folder``; its config.json and d2t."""
    from transformers import AutoConfig

    cfg = json.loads((folder / "config.json").read_text())
    target = AutoConfig.from_pretrained(target_folder)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == target.vocab_size
    assert cfg["target_hidden_size"] == cfg["hidden_size"] == target.hidden_size
    # vLLM counts the INPUT of a layer: our layer-output ids + 1.
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in cfg["trtspec"]["target_layer_ids"]]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as st:
        names = set(st.keys())
        shapes = {n: tuple(st.get_slice(n).get_shape()) for n in names}
        d2t = st.get_tensor("d2t")
    assert names == LOADER_TENSORS  # no embed_tokens (shared with the target), no t2d
    h, n_layers = target.hidden_size, len(cfg["trtspec"]["target_layer_ids"])
    assert shapes["fc.weight"] == (h, n_layers * h)
    assert shapes["midlayer.self_attn.q_proj.weight"][1] == 2 * h  # [embeds; state]
    assert shapes["lm_head.weight"] == (cfg["draft_vocab_size"], h)
    assert d2t.dtype == torch.int64 and d2t.shape == (cfg["draft_vocab_size"],)
    return cfg, d2t


def test_head_folder_has_the_names_the_loaders_read(heads, tiny_ckpts):
    cfg, d2t = assert_loader_layout(heads["random"], tiny_ckpts["target"])
    assert cfg["draft_vocab_size"] == len(DRAFT_IDS) and cfg["vocab_size"] == 400
    assert (torch.arange(len(DRAFT_IDS)) + d2t).tolist() == DRAFT_IDS  # target id = draft id + d2t


def test_head_shapes_and_id_mapping(heads):
    from safetensors.torch import load_file

    from trtspec.engines.eagle3_checkpoint import read_head_config
    from trtspec.engines.torch.eagle3_head import Eagle3Head

    cfg = read_head_config(heads["random"], 2)
    head = Eagle3Head.from_state_dict(cfg, load_file(str(heads["random"] / "model.safetensors")))
    assert cfg.layer_ids == (0, 1) and cfg.n_features == 2
    ids = head.to_target_ids(torch.tensor([0, 1, len(DRAFT_IDS) - 1]))
    assert ids.tolist() == [DRAFT_IDS[0], DRAFT_IDS[1], DRAFT_IDS[-1]]
    x = torch.randn(3, cfg.hidden_size)
    assert head.draft_logits(x).shape == (3, len(DRAFT_IDS))


# ------------------------------------------------------------------------------ check


def _edited_head(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for dotted, value in changes.items():
        node = cfg
        *parents, last = dotted.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"trtspec__target_layer_ids": [0, 5], "eagle_aux_hidden_state_layer_ids": [1, 6]},
            "reads layer id(s) [5], the target has layers 0..1",
        ),
        ({"vocab_size": 512}, "maps into a vocabulary of 512, the target's has 400"),
        ({"trtspec__target_num_layers": 30}, "made for a target of 30 layers, this one has 2"),
    ],
)
def test_check_refuses_a_head_for_another_target(tmp_path, tiny_ckpts, heads, changes, message):
    bad = _edited_head(heads["random"], tmp_path / "bad-head", **changes)
    spec = write_spec(tmp_path, {"target": tiny_ckpts["target"], "head": bad}, "head", **{"speculative.method": "eagle3"})
    r = runner.invoke(app, ["check", str(spec)])
    assert r.exit_code == 2, r.output
    assert "this EAGLE-3 head was made for another target" in r.output
    assert message in r.output
    r = runner.invoke(app, ["build", str(spec)])
    assert r.exit_code == 2 and message in r.output
    assert not (tmp_path / "engines" / "draft").exists()


def test_check_refuses_a_head_for_a_wider_target(tmp_path, tiny_ckpts, heads):
    # The exact head was made for the one-hot bigram target (hidden 400), not the tiny one (64).
    spec = write_spec(
        tmp_path, {"target": tiny_ckpts["target"], "head": heads["exact"]}, "head", **{"speculative.method": "eagle3"}
    )
    r = runner.invoke(app, ["check", str(spec)])
    assert r.exit_code == 2
    assert "it reads hidden size 400, the target's is 64" in r.output


def test_check_refuses_a_plain_model_as_head(tmp_path, tiny_ckpts):
    spec = write_spec(tmp_path, tiny_ckpts, "draft", **{"speculative.method": "eagle3"})
    r = runner.invoke(app, ["check", str(spec)])
    assert r.exit_code == 2
    assert "is not an EAGLE-3 head" in r.output and "trtspec distill" in r.output


def test_check_accepts_a_head_made_for_the_target(tmp_path, tiny_ckpts, heads):
    spec = write_spec(
        tmp_path, {"target": tiny_ckpts["target"], "head": heads["random"]}, "head", **{"speculative.method": "eagle3"}
    )
    r = runner.invoke(app, ["check", str(spec), "--json"])
    assert r.exit_code == 0, r.output
    rows = {m["role"]: m for m in json.loads(r.stdout)["models"]}
    assert rows["draft"]["architecture"] == "LlamaForCausalLMEagle3"
    assert rows["draft"]["vocab"] == len(DRAFT_IDS)


def test_spec_eagle3_needs_a_head(tmp_path, tiny_ckpts):
    spec = write_spec(tmp_path, tiny_ckpts, None, **{"speculative.method": "eagle3"})
    r = runner.invoke(app, ["check", str(spec)])
    assert r.exit_code == 2
    assert "method eagle3 needs `draft`" in r.output


# ------------------------------------------------------------------------------ runtime


def test_target_features_are_the_layer_outputs(tiny_ckpts, eagle_deploy):
    """The features the head reads equal transformers' hidden states of those layers."""
    from transformers import AutoModelForCausalLM

    dep = eagle_deploy("random")
    ids = dep.encode("The quick brown fox")
    dep.forget_prefixes()
    dep.target.run([__import__("trtspec.engines.torch.engine", fromlist=["ForwardItem"]).ForwardItem(ids, 1)])
    feats = dep.target.features_of(ids, 0, len(ids))  # [T, 2 * hidden]
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpts["target"], dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    h = hf.config.hidden_size
    torch.testing.assert_close(feats[:, :h], hs[1][0], rtol=1e-4, atol=1e-4)  # output of layer 0
    # transformers' last entry is after the final norm; ours is the layer output before it.
    torch.testing.assert_close(hf.model.norm(feats[:, h:]), hs[2][0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_untrained_head_still_gives_identical_outputs(eagle_deploy, k):
    dep = eagle_deploy("random")
    prompts = dep.spec.verify.prompts[:4]
    base, spec = generate_both(dep, prompts, k)
    for b, s in zip(base, spec):
        assert s.output_ids == b.output_ids
        assert s.finish_reason == b.finish_reason
    assert sum(s.metrics.drafted for s in spec) > 0


def test_head_that_reproduces_the_target_accepts_every_draft(eagle_deploy):
    dep = eagle_deploy("exact", target="bigram-target")
    prompts = ["The quick brown fox", "def fibonacci(n):", "Pack my box", "Triton serves models"]
    base, spec = generate_both(dep, prompts, k=6, max_tokens=45)
    for b, s in zip(base, spec):
        assert s.output_ids == b.output_ids
        assert s.metrics.drafted > 0
        assert s.metrics.accepted == s.metrics.drafted  # every draft accepted
        # the target really is x -> g(x): the drafts had something to get right
        g = bigram_map(400)
        assert all(g[a] == c for a, c in zip(s.output_ids, s.output_ids[1:]))
    # 45 tokens: 1 prefill step, then 6 drafts + 1 per step
    assert all(s.metrics.target_forwards == 1 + -(-44 // 7) for s in spec)


def test_drafter_chain_equals_the_unrolled_training_steps(eagle_deploy):
    """The drafter (KV cache, rollback, feedback) proposes exactly the argmax of the
    training-time-test forward over context + drafts: training trains what runs."""
    from trtspec.distill.data import capture, collate
    from trtspec.distill.ttt import unrolled_logits
    from trtspec.engines.torch.engine import ForwardItem

    dep = eagle_deploy("random")
    target, head = dep.target, dep.head
    drafter = dep.drafter()
    dep.forget_prefixes()
    ctx = dep.encode("Speculative decoding makes inference")
    k = 5

    def unrolled(context, drafts):
        s = capture(target, context, drafts)
        with torch.no_grad():
            lg = unrolled_logits(head.head, target.model.model.embed_tokens, collate([s], 1000), k, target.cos, target.sin)
        n = len(context)
        return [int(head.head.to_target_ids(torch.argmax(lg[j][0, n - 2 + j]).view(1))) for j in range(k)]

    target.run([ForwardItem(ctx, 1)])  # the target scores the context first, as the loop's prefill
    d1 = drafter.propose([ctx], [k])[0]
    assert len(d1) == k
    assert d1 == unrolled(ctx, d1)
    # Accept two drafts plus a correction: the head rewinds to the target's features.
    target.run([ForwardItem(ctx + d1, k + 1)])
    ctx2 = ctx + d1[:2] + [(d1[2] + 1) % 300]
    target.run([ForwardItem(ctx2, 1)])
    d2 = drafter.propose([ctx2], [k])[0]
    assert d2 == unrolled(ctx2, d2)


def test_the_scored_positions_path_equals_the_unrolled_steps_there(eagle_deploy):
    """unrolled_logits(at=...) runs the LM head at the marked positions and each deeper step on
    their chains only: the same logits, and the same gradients, as the full unrolled steps read
    at those positions (two rows of other lengths, a two-turn response, dropout masks drawn
    from the same seed)."""
    from trtspec.distill.data import capture, collate
    from trtspec.distill.ttt import step_targets, unrolled_logits

    dep = eagle_deploy("random")
    target, head = dep.target, dep.head.head
    a = capture(target, dep.encode("Speculative decoding makes inference"), list(range(40, 52)))
    b = capture(target, dep.encode("Pack my box"), list(range(60, 67)))
    b.response = torch.zeros(len(b.tokens), dtype=torch.bool)
    b.response[3:6] = True  # two assistant turns, as a corpus conversation has
    b.response[8:] = True
    batch = collate([a, b], 1000)
    steps = 3
    at = [tgt >= 0 for tgt in step_targets(batch, steps)]
    assert 0 < int(at[0].sum()) < at[0].numel() and int(at[2].sum()) > 0
    embed = target.model.model.embed_tokens
    head.train()
    try:

        def run(chains: bool):
            head.zero_grad()
            gen = torch.Generator().manual_seed(7)
            lg = unrolled_logits(head, embed, batch, steps, target.cos, target.sin, 0.2, gen, at=at if chains else None)
            lg = lg if chains else [x[m] for x, m in zip(lg, at)]
            sum((x * torch.linspace(-1, 1, x.shape[-1])).sum() for x in lg).backward()
            return [x.detach() for x in lg], {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

        (full, full_grad), (chain, chain_grad) = run(False), run(True)
    finally:
        head.zero_grad()
        head.eval()
    assert [x.shape for x in chain] == [x.shape for x in full]
    for x, y in zip(chain, full):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert chain_grad.keys() == full_grad.keys() and "fc.weight" in chain_grad
    for name in full_grad:
        torch.testing.assert_close(chain_grad[name], full_grad[name], rtol=1e-4, atol=1e-5)


def test_no_features_yet_means_no_drafts(eagle_deploy):
    dep = eagle_deploy("random")
    dep.forget_prefixes()
    drafter = dep.drafter()
    assert drafter.propose([dep.encode("Pack my box with five dozen")], [4]) == [[]]
    assert drafter.missing_features == 1


# ------------------------------------------------------------------------------ Triton (cores)


def _eagle_orchestrator(dep, log=None, settings=None):
    """The text endpoint's logic with its BLS calls going to the target engine model's core in
    this process: a separate TorchEngine, as inside tritonserver (its own process). ``settings``:
    the orchestrator's (default: method eagle3's over ``dep``'s folders)."""
    import numpy as np

    from trtspec.engines.torch.engine import TorchEngine
    from trtspec.speculative.requests import Limits
    from trtspec.triton.backend.engine_core import EngineCore
    from trtspec.triton.backend.orchestrator_core import Orchestrator, OrchestratorSettings

    engines = dep.loaded.output_dir()
    target = TorchEngine.load(engines / "target")
    target.capture_features(dep.head.cfg.layer_ids)
    lim = dep.spec.limits("target")
    core = EngineCore(
        target.run,
        Limits(target.vocab_size, target.max_seq_len, dep.spec.speculative.max_draft_len, max_batch_size=lim.max_batch_size),
        features_of=target.features_of,
    )

    def call(model, inputs, names):
        assert model == "tensorrt_llm"  # no draft engine model: the head runs in the orchestrator
        if log is not None:
            log.append("features" if "hidden_states_from" in inputs else "verify")
        (answer,) = core.infer([inputs])
        if isinstance(answer, Exception):
            raise answer
        return {n: answer[n] for n in names}

    settings = settings or OrchestratorSettings(
        mode="speculative",
        decoupled=False,
        target_model="tensorrt_llm",
        draft_model=None,
        method="eagle3",
        max_ngram=3,
        min_ngram=1,
        limits=dep.limits,
        eagle3_head_dir=str(engines / "draft"),
        eagle3_target_dir=str(engines / "target"),
    )
    orch = Orchestrator(settings, call, dep.tokenizer, dep.end_ids)

    def request(prompt, k, max_tokens=30):
        return {
            "text_input": np.array([[prompt.encode()]], dtype=np.object_),
            "max_tokens": np.array([[max_tokens]], dtype=np.int32),
            "num_draft_tokens": np.array([[k]], dtype=np.int32),
            "apply_chat_template": np.array([[True]]),
            "exclude_input_in_output": np.array([[True]]),
            "return_perf_metrics": np.array([[True]]),
        }

    return orch, request


@pytest.mark.parametrize("head, target", [("random", "target"), ("exact", "bigram-target")])
def test_triton_orchestrator_runs_the_same_eagle3_loop_as_in_process(eagle_deploy, head, target):
    from trtspec.speculative.metrics import metrics_from_json

    dep = eagle_deploy(head, target=target)
    log: list[str] = []
    orch, request = _eagle_orchestrator(dep, log)
    for prompt in ["The quick brown fox", "def fibonacci(n):"]:
        dep.forget_prefixes()
        (out,) = orch.run([request(prompt, 4)])
        (ref,) = dep.generate([dep.request(dep.encode(prompt), 30, 4)], speculative=True)
        (base,) = dep.generate([dep.request(dep.encode(prompt), 30, 4)], speculative=False)
        ids = out["output_ids"][0, : out["sequence_length"][0, 0]].tolist()
        assert ids == ref.output_ids == base.output_ids
        assert metrics_from_json(out["perf_metrics_json"][0, 0].decode()) == ref.metrics
        assert ref.metrics.drafted > 0
    assert "features" in log and "verify" in log


def test_compare_methods_over_one_target(eagle_deploy):
    from trtspec.bench.methods import compare_methods
    from trtspec.speculative.drafters import NgramDrafter

    dep = eagle_deploy("exact", target="bigram-target")
    reqs = [dep.request(dep.encode(p), 20, 0) for p in ["The quick brown fox", "Pack my box"]]
    stats = compare_methods(
        dep.verifier(), {"eagle3": (dep.drafter, 4), "ngram": (NgramDrafter, 4)}, reqs, dep.forget_prefixes, rounds=1
    )
    base, eagle, ngram = stats
    assert [s.name for s in stats] == ["target-only", "eagle3", "ngram"]
    assert base.tokens == eagle.tokens == ngram.tokens == 40
    assert eagle.identical and ngram.identical
    assert eagle.metrics.acceptance_rate == 1.0 and eagle.metrics.drafted > 0
    row = eagle.to_dict(base)
    assert row["mean_acceptance_length"] > 3 and row["draft_cost_c"] > 0


def test_verify_and_bench_commands_on_an_eagle3_spec(eagle_deploy, tmp_path):
    dep = eagle_deploy("exact", target="bigram-target")
    spec = str(dep.loaded.path)
    report = tmp_path / "verify.json"
    r = runner.invoke(app, ["verify", spec, "--json-file", str(report), "--max-tokens", "20"])
    assert r.exit_code == 0, r.output
    data = json.loads(report.read_text())
    assert data["identical"] and data["metrics"]["accepted"] == data["metrics"]["drafted"] > 0
    bench = tmp_path / "bench.json"
    r = runner.invoke(
        app,
        [
            "bench",
            spec,
            "-p",
            "The quick brown fox",
            "--max-tokens",
            "12",
            "--sweep",
            "none",
            "-c",
            "1",
            "-o",
            str(tmp_path / "bench"),
            "--json-file",
            str(bench),
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(bench.read_text())["metrics"]["drafted"] > 0


def test_bench_methods_compares_eagle3_draft_target_ngram_on_one_target(eagle_deploy, built, tmp_path):
    """`trtspec bench --methods` on an eagle3 spec, the draft_target draft taken from another
    built spec with the same target: every method identical, every row measured."""
    dep = eagle_deploy("random")
    pair = built("draft")  # the tiny draft_target spec, same target checkpoint
    bench = tmp_path / "bench.json"
    args = ["bench", str(dep.loaded.path), "-p", "The quick brown fox", "-p", "Pack my box", "--max-tokens", "12"]
    args += ["--sweep", "none", "-c", "1", "-o", str(tmp_path / "out"), "--json-file", str(bench)]
    r = runner.invoke(app, [*args, "--methods", "eagle3,draft_target,ngram", "--draft-from", str(pair.loaded.path)])
    assert r.exit_code == 0, r.output
    assert "drafting methods" in r.stdout
    data = json.loads(bench.read_text())
    rows = {row["method"].split()[0]: row for row in data["methods"]}
    assert list(rows) == ["target-only", "eagle3", "draft_target", "ngram"]
    assert {row["tokens"] for row in rows.values()} == {rows["target-only"]["tokens"]} and rows["eagle3"]["tokens"] > 0
    assert all(row["identical_to_target_only"] for row in rows.values())
    assert rows["eagle3"]["drafted"] > 0 and rows["draft_target"]["drafted"] > 0
    assert data["costs"]["draft_step"] > 0  # the head's own step cost, not "no draft model"
    assert (tmp_path / "out" / "methods.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_methods_refuses_what_it_cannot_compare(eagle_deploy, built, tmp_path):
    dep = eagle_deploy("exact", target="bigram-target")  # another target's weights
    pair = built("draft")
    base = ["bench", str(dep.loaded.path), "-p", "x y", "--max-tokens", "4", "--sweep", "none", "-c", "1"]
    base += ["-o", str(tmp_path)]
    r = runner.invoke(app, [*base, "--methods", "eagle3,draft_target"])
    assert r.exit_code == 2 and "--draft-from" in r.output
    r = runner.invoke(app, [*base, "--methods", "draft_target", "--draft-from", str(pair.loaded.path)])
    assert r.exit_code == 2 and "target weights differ" in r.output
    r = runner.invoke(app, [*base, "--methods", "medusa"])
    assert r.exit_code == 2 and "unknown method 'medusa'" in r.output


def test_compare_methods_times_no_methods_first_meeting_with_its_engine(eagle_deploy):
    """A drafter's first call compiles or loads its engine's programs (tens of seconds where
    none is saved): the comparison meets each method once untimed before it times any."""
    from trtspec.bench.methods import compare_methods
    from trtspec.speculative.drafters import NgramDrafter

    first = []

    class SlowFirst(NgramDrafter):
        def propose(self, contexts, draft_lens):
            if not first:
                first.append(True)
                time.sleep(1.0)  # a first meeting, as a compile is
            return super().propose(contexts, draft_lens)

    dep = eagle_deploy("exact", target="bigram-target")
    reqs = [dep.request(dep.encode("The quick brown fox"), 12, 0)]
    base, slow = compare_methods(dep.verifier(), {"ngram": (SlowFirst, 4)}, reqs, dep.forget_prefixes)
    assert first and slow.tokens == base.tokens == 12  # the warm-up's tokens are not counted
    assert slow.seconds < 1.0
