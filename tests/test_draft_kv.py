"""A self-draft adopts the target's K/V for the context (speculative.draft_kv: target) instead
of prefilling it: the rows it copies, what it then computes, the pairs that never adopt, and
greedy output token-identical to target-only either way."""

from __future__ import annotations

import pytest
import torch
from conftest import write_spec

from trtspec.engines.torch.engine import ForwardItem, SlotPool
from trtspec.errors import SpecError
from trtspec.spec import load_spec
from trtspec.speculative.drafters import engine_drafter

PROMPTS = [
    "Summarise the following text in one sentence. Speculative decoding makes inference faster.",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
]
# The demo's kind of pair: the target's own weights as a 4-bit bfloat16 draft.
INT4_SELF = {"draft.quantization": "int4_wo", "draft.dtype": "bfloat16"}


def _prefilled(dep, prompt: str) -> list[int]:
    """The prompt's ids, prefilled by the target alone (as a sequence's first step is)."""
    ids = dep.encode(prompt)
    dep.forget_prefixes()
    dep.target.run([ForwardItem(ids, 1)])
    return ids


def _slot_of(engine, tokens: list[int]) -> int:
    return next(s for s, held in enumerate(engine.pool.tokens) if held == tokens)


def test_adopt_copies_the_targets_rows_converted_and_the_draft_computes_only_the_rest(built):
    dep = built("same", **INT4_SELF)
    assert dep.draft.kv_mismatch(dep.target) is None
    ids = _prefilled(dep, PROMPTS[0])
    seq = ids + [17]
    assert dep.draft.adopt(dep.target, [seq], min_gain=len(ids)) == [0]  # not more than min_gain: kept
    assert not any(dep.draft.pool.tokens)
    assert dep.draft.adopt(dep.target, [seq]) == [len(ids)]
    src, dst = _slot_of(dep.target, ids), _slot_of(dep.draft, ids)
    for layer in range(dep.draft.config.num_layers):
        for mine, theirs in ((dep.draft.cache.k, dep.target.cache.k), (dep.draft.cache.v, dep.target.cache.v)):
            assert mine[layer].dtype == torch.bfloat16 and theirs[layer].dtype == torch.float32
            assert torch.equal(mine[layer][dst, :, : len(ids)], theirs[layer][src, :, : len(ids)].to(torch.bfloat16))
    forwards = dep.draft.forwards
    dep.draft.run([ForwardItem(seq, 1)])
    assert dep.draft.forwards == forwards + 1
    assert dep.draft.last_use == [(len(ids), len(ids))] and dep.draft.last_slots == [dst]  # one position computed
    assert dep.draft.adopt(dep.target, [seq + [18]]) == [0]  # the draft holds all the target does


def test_the_pool_is_sure_of_a_reuse_only_where_assign_would_continue_the_slot():
    pool = SlotPool(2, rollback=3)
    pool.commit(0, list(range(10)))
    assert pool.continues(list(range(8)), 7) and pool.assign([list(range(8))]) == [(0, 8)]
    # 5 of its 10 tokens: not that sequence coming back, so it goes to the free slot, reusing nothing
    assert not pool.continues(list(range(5)), 4) and pool.assign([list(range(5))]) == [(1, 0)]
    assert not pool.continues([0, 1, 2, 99], 4) and pool.continues([5], 0)


def test_a_float32_self_draft_after_adoption_scores_as_after_its_own_prefill(built):
    dep = built("same", **{"speculative.draft_kv": "target"})
    ids = _prefilled(dep, PROMPTS[2])
    seq = ids + [17, 18, 19]
    assert dep.draft.adopt(dep.target, [seq]) == [len(ids)]
    (adopted,) = dep.draft.run([ForwardItem(seq, 3)])
    assert dep.draft.last_use[0][0] == len(ids)
    dep.draft.forget_prefixes()
    (own,) = dep.draft.run([ForwardItem(seq, 3)])
    torch.testing.assert_close(adopted, own, rtol=1e-5, atol=1e-5)  # the same weights: float32 rounding only


def _spied(monkeypatch, engine) -> list[list[int]]:
    """What each of ``engine``'s adopt calls returned, recorded as it runs."""
    calls: list[list[int]] = []
    adopt = type(engine).adopt

    def spy(*args, **kwargs):
        calls.append(adopt(engine, *args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(engine, "adopt", spy)
    return calls


@pytest.mark.parametrize("draft_kv", ["target", "own"])
def test_the_drafter_adopts_the_prompt_once_and_computes_each_step_itself(built, monkeypatch, draft_kv):
    dep = built("same", **INT4_SELF)
    calls = _spied(monkeypatch, dep.draft)
    ids = _prefilled(dep, PROMPTS[0])
    drafter = engine_drafter(dep.target, dep.draft, draft_kv=draft_kv)
    (draft,) = drafter.propose([ids + [17]], [1])
    assert len(draft) == 1
    assert dep.draft.last_use[0][0] == (len(ids) if draft_kv == "target" else 0)  # 0: it prefilled the prompt
    (more,) = drafter.propose([ids + [17] + draft], [3])  # a step's gap: the draft's own K/V
    assert len(more) == 3
    assert calls == ([[len(ids)], [0], [0], [0]] if draft_kv == "target" else [])


def test_sampled_drafts_compute_their_own_kv_so_a_seed_draws_alike_whatever_came_first(built, monkeypatch):
    from trtspec.speculative.sampling import SamplingParams

    dep = built("same", **INT4_SELF)
    calls = _spied(monkeypatch, dep.draft)
    ids = _prefilled(dep, PROMPTS[0])
    drafter = engine_drafter(dep.target, dep.draft, draft_kv="target")
    params = SamplingParams(temperature=0.8, seed=7)
    (first,) = drafter.propose_sampled([ids + [17]], [3], [params], [params.generator()])
    assert calls == [] and dep.draft.last_use[0][0] == len(ids) + 2  # it prefilled the prompt itself
    dep.draft.forget_prefixes()
    dep.draft.run([ForwardItem(ids, 1)])  # the draft computed the prompt first this time
    (again,) = drafter.propose_sampled([ids + [17]], [3], [params], [params.generator()])
    assert again[0] == first[0] and torch.equal(again[1], first[1])


@pytest.mark.parametrize("draft_kv", ["target", "own"])
@pytest.mark.parametrize(
    "overrides",
    [
        INT4_SELF,
        {"speculative.tree.dynamic.top_k": 2, "speculative.tree.dynamic.nodes": 10},
        {"speculative.suffix.threshold": 2},  # suffix drafting layered on the model's
    ],
    ids=["int4-draft", "tree", "layered"],
)
def test_greedy_output_is_token_identical_to_target_only_with_and_without_adoption(built, monkeypatch, draft_kv, overrides):
    dep = built("draft", **overrides, **{"speculative.draft_kv": draft_kv})
    calls = _spied(monkeypatch, dep.draft)
    reqs = [dep.request(dep.encode(p), 32, 4) for p in PROMPTS]
    singles = [dep.generate([r], speculative=False)[0].output_ids for r in reqs]
    dep.forget_prefixes()
    for batch in ([reqs[0]], reqs):  # one sequence, then a batch of all three
        results = dep.generate(batch, speculative=True)
        assert [r.output_ids for r in results] == singles[: len(batch)]
        assert all(len(r.output_ids) == 32 for r in results) and sum(r.metrics.drafted for r in results) > 0
    # the first prompt once, then the two the draft had not met (the first one it holds already)
    assert sum(n > 0 for call in calls for n in call) == (3 if draft_kv == "target" else 0)


def _shaped(tmp_path, layers: int = 2, **config):
    """A tiny checkpoint like the target's but for ``layers`` and the ``config`` values."""
    from transformers import LlamaForCausalLM

    from trtspec.testing.tiny import llama_config, make_tokenizer

    tok = make_tokenizer()
    cfg = llama_config(400, tok, layers=layers)
    for name, value in config.items():
        setattr(cfg, name, value)
    folder = tmp_path / "shaped"
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "shape, reason",
    [
        ({"layers": 1}, "num_layers 1 differs from the source's 2"),
        ({"num_key_value_heads": 1}, "num_kv_heads 1 differs from the source's 2"),
        ({"rope_parameters": {"rope_theta": 500.0, "rope_type": "default"}}, "the RoPE tables differ (rope_theta or scaling)"),
    ],
)
def test_a_draft_whose_cache_differs_from_the_targets_never_adopts(tmp_path, tiny_ckpts, shape, reason):
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment

    ckpts = {"target": tiny_ckpts["target"], "draft": _shaped(tmp_path, **shape)}
    loaded = load_spec(write_spec(tmp_path, ckpts, **{"speculative.draft_kv": "target"}))
    build(loaded, loaded.output_dir())
    dep = Deployment(loaded, loaded.output_dir())
    assert dep.draft.kv_mismatch(dep.target) == reason
    drafter = dep.drafter()
    assert drafter.adopt is None  # paired without adopting
    ids = _prefilled(dep, PROMPTS[0])
    drafter.propose([ids + [17]], [1])
    assert dep.draft.last_use[0][0] == 0  # it prefilled the prompt itself
    req = dep.request(ids, 16, 4)
    assert dep.generate([req], speculative=True)[0].output_ids == dep.generate([req], speculative=False)[0].output_ids


def test_an_engine_that_captures_features_never_adopts(built):
    dep = built("same", **{"speculative.draft_kv": "target", "build.max_batch_size": 2})
    assert dep.target.kv_mismatch(dep.draft) is None
    dep.target.capture_features((0,))
    assert (
        dep.target.kv_mismatch(dep.draft) == "this engine captures features (an EAGLE-3 target), which adopting would leave stale"
    )
    assert dep.draft.kv_mismatch(dep.draft) == "an engine does not adopt its own K/V"


def test_a_bad_draft_kv_is_refused_with_one_clear_error(tmp_path, tiny_ckpts):
    assert load_spec(write_spec(tmp_path / "default", tiny_ckpts)).spec.speculative.draft_kv == "own"  # as served
    with pytest.raises(SpecError) as e:
        load_spec(write_spec(tmp_path, tiny_ckpts, **{"speculative.draft_kv": "shared"}))
    assert e.value.exit_code == 2
    assert str(e.value).splitlines() == [
        f"{tmp_path / 'spec.yaml'}: speculative.draft_kv: Input should be 'target' or 'own' (got 'shared')"
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--draft-kv", "own"], None),
        (["--draft-kv", "shared"], "Error: --draft-kv shared: Input should be 'target' or 'own'"),
        (
            ["--draft-kv", "own", "--url", "127.0.0.1:8001"],
            "Error: --draft-kv applies in process; a served deployment's draft runs in its own engine model and "
            "computes its own K/V: drop --draft-kv or --url",
        ),
    ],
)
def test_bench_draft_kv_replaces_the_specs_in_process_and_refuses_what_it_cannot(
    tmp_path, tiny_ckpts, monkeypatch, args, message
):
    from typer.testing import CliRunner

    from trtspec.cli.app import app
    from trtspec.errors import RuntimeFailure

    seen = []

    def run(loaded, engines, opts, progress):  # what bench's run is handed, then stop
        seen.append(loaded.spec.speculative.draft_kv)
        raise RuntimeFailure("stopped by the test")

    monkeypatch.setattr("trtspec.bench.run.run", run)
    spec = write_spec(tmp_path, tiny_ckpts, **{"speculative.draft_kv": "target"})
    r = CliRunner().invoke(app, ["bench", str(spec), *args])
    if message is None:
        assert r.exit_code == 3 and seen == ["own"] and "stopped by the test" in r.output
    else:
        assert r.exit_code == 2 and seen == []
        assert " ".join(r.output.split()) == message
