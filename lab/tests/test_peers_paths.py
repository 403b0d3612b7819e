"""The peers harness's own paths (lab/peers.py) on the tiny deployments: trtspec's paths and
transformers' assisted generation give target-only tokens, and the vLLM suffix settings it
writes are fields vLLM knows (tests/vllm_fields.py's inventory)."""

from __future__ import annotations

from test_suffix_serve import PROMPTS

from trtspec.spec import SuffixSpec


def test_peers_on_an_eagle3_spec_add_hf_assisted_with_the_pair_draft(eagle_deploy, built):
    """lab/peers_bench.py --draft-from: an eagle3 spec gets our eagle3 and draft_target paths and
    transformers' assisted generation with the draft_target spec's draft, on the same target."""
    from lab.peers import encode_prompts, measure, peer_paths

    dep = eagle_deploy("random")
    pair = built("draft")
    paths, settings = peer_paths(dep, pair.loaded)
    keys = [p.key for p in paths]
    assert keys[:4] == ["ours_target", "ours_eagle3", "ours_draft_target", "ours_ngram"]
    assert {"hf_target", "hf_assisted", "hf_prompt_lookup"} <= set(keys) and "assisted" in settings
    m = measure(paths, encode_prompts(dep, [("The quick brown fox", "chat")]), max_tokens=8)
    runs = m.runs[0]
    for key in ("ours_eagle3", "ours_draft_target", "ours_ngram", "hf_target", "hf_assisted"):
        assert runs[key].identical, (key, runs[key].first_difference)
    assert runs["ours_eagle3"].metrics.drafted > 0 and runs["ours_draft_target"].metrics.drafted > 0


def test_peer_paths_of_a_suffix_spec_run_ours_identical(built):
    from lab.peers import trtspec_paths

    dep = built(None, **{"speculative.method": "suffix", "speculative.max_draft_len": 8})
    paths = {p.key: p for p in trtspec_paths(dep)}
    assert list(paths) == ["ours_target", "ours_suffix", "ours_ngram"]
    ids = dep.encode(PROMPTS[0])
    target, suffix = paths["ours_target"].run(ids, 24), paths["ours_suffix"].run(ids, 24)
    assert suffix.output_ids == target.output_ids and suffix.metrics is not None


def test_vllm_suffix_config_against_the_inventory(tmp_path, tiny_ckpts):
    from vllm_fields import unknown_fields

    from lab.peers import vllm_suffix

    cfg = vllm_suffix(SuffixSpec(max_depth=32, spec_factor=2.0, min_token_prob=0.05, cache_responses=10))
    assert cfg == {
        "method": "suffix",
        "suffix_decoding_max_tree_depth": 32,
        "suffix_decoding_max_cached_requests": 10,
        "suffix_decoding_max_spec_factor": 2.0,
        "suffix_decoding_min_token_prob": 0.05,
    }
    assert unknown_fields(cfg | {"num_speculative_tokens": 8}) == []
    assert unknown_fields({"method": "suffix", "suffix_max_depth": 3}) == ["suffix_max_depth"]
    assert unknown_fields({"method": "sa"}) == ["method=sa"]
