"""The torch engine against transformers, and its prefix cache and ragged batching."""

from __future__ import annotations

import pytest
import torch

from trtspec.engines.torch.engine import ForwardItem, SlotPool, forward_groups


@pytest.fixture(scope="module")
def dep(built):
    return built("same")


@pytest.fixture(scope="module")
def hf_target(tiny_ckpts):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_ckpts["target"], dtype=torch.float32).eval()


def _seq(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 384, (n,), generator=g).tolist()


def test_logits_match_transformers(dep, hf_target):
    seq = _seq(40, 0)
    with torch.no_grad():
        ref = hf_target(torch.tensor([seq])).logits[0]  # [40, vocab]
    (ours,) = dep.target.run([ForwardItem(seq, 40)])
    # Same weights, same math, a different kernel order: float32 rounding only.
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_greedy_matches_transformers_generate(dep, hf_target):
    prompt = dep.encode("The quick brown fox", chat_template=False)
    (res,) = dep.generate([dep.request(prompt, 24)], speculative=False)
    with torch.no_grad():
        out = hf_target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert res.output_ids == out[0, len(prompt) :].tolist()


def test_prefix_cache_gives_same_logits_as_fresh(dep):
    eng = dep.target
    seq = _seq(30, 1)
    (fresh,) = eng.run([ForwardItem(seq, 5)])
    eng.run([ForwardItem(_seq(12, 2), 1)])  # something else in between
    eng.run([ForwardItem(seq[:20], 1)])  # cached prefix, then extend
    (extended,) = eng.run([ForwardItem(seq, 5)])
    torch.testing.assert_close(extended, fresh, rtol=1e-5, atol=1e-5)
    # A rejected branch: same prefix, different tail; the cache must forget the old tail.
    branch = seq[:25] + [7, 8, 9]
    (b1,) = eng.run([ForwardItem(branch, 3)])
    eng.forget_prefixes()  # recompute from scratch
    (b2,) = eng.run([ForwardItem(branch, 3)])
    torch.testing.assert_close(b1, b2, rtol=1e-5, atol=1e-5)


def test_ragged_batch_equals_one_by_one(dep):
    eng = dep.target
    seqs = [_seq(n, 10 + n) for n in (5, 17, 9, 30)]
    alone = [eng.run([ForwardItem(s, 3)])[0] for s in seqs]
    eng.forget_prefixes()
    batched = eng.run([ForwardItem(s, 3) for s in seqs])
    for a, b in zip(alone, batched):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def _partitions(n):
    """Every split of range(n) into consecutive runs."""
    if n == 0:
        yield []
        return
    for first in range(1, n + 1):
        for rest in _partitions(n - first):
            yield [first, *rest]


@pytest.mark.parametrize("seed", range(20))
def test_forward_groups_compute_the_fewest_tokens_with_each_row_once(seed):
    g = torch.Generator().manual_seed(seed)
    news = torch.randint(1, 300, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
    groups = forward_groups(news, 32)
    assert sorted(i for grp in groups for i in grp) == list(range(len(news)))
    assert all(grp == sorted(grp) for grp in groups)

    def cost(grps):
        return sum(len(grp) * max(news[i] for i in grp) + 32 for grp in grps)

    order = sorted(range(len(news)), key=lambda i: -news[i])  # any best split groups rows by length
    best = min(cost([order[sum(sizes[:j]) : sum(sizes[: j + 1])] for j in range(len(sizes))]) for sizes in _partitions(len(news)))
    assert cost(groups) == best


def test_forward_groups_keep_a_decode_step_whole_and_take_a_prefill_out_of_it():
    assert forward_groups([1] * 64) == [list(range(64))]  # nothing to save
    assert forward_groups([3, 3, 3, 3]) == [[0, 1, 2, 3]]
    assert forward_groups([1, 1, 300, 1]) == [[2], [0, 1, 3]]  # 4 x 300 padded -> 300 + 3
    assert forward_groups([10, 1, 1, 1]) == [[0, 1, 2, 3]]  # 27 padding tokens: less than a second forward
    assert forward_groups([20, 1, 1, 1]) == [[0], [1, 2, 3]]  # 57: more


def test_a_ragged_step_runs_as_forwards_of_similar_length_with_one_lm_head_call(dep, monkeypatch):
    """Rows padded to the longest cost what real tokens cost; the engine runs a step's rows in
    forwards of similar length (forward_groups) and reads the LM head once. Logits and captured
    features agree with one padded forward to float32 rounding (attention over a shorter span
    sums in another order), and the greedy tokens are the same."""
    eng = dep.target
    seqs = [_seq(n, 70 + n) for n in (6, 120, 4, 110)]
    items = [ForwardItem(s, 2) for s in seqs]
    eng.capture_features((0, 1))
    try:
        eng.forward_rows = 10**9  # one padded forward
        eng.forget_prefixes()
        whole = eng.run(items)
        whole_feats = [eng.features_of(s, 0, len(s)) for s in seqs]
        eng.forward_rows = 32
        eng.forget_prefixes()
        widths, heads = [], []
        body, head = eng.model.hidden_states, eng.model.logits
        monkeypatch.setattr(
            eng.model, "hidden_states", lambda step, *a: widths.append(tuple(step.tokens.shape)) or body(step, *a)
        )
        monkeypatch.setattr(eng.model, "logits", lambda h: heads.append(h.shape[0]) or head(h))
        before = eng.forwards
        split = eng.run(items)
        feats = [eng.features_of(s, 0, len(s)) for s in seqs]
    finally:
        eng.capture, eng.features, eng.forward_rows = (), None, 32
        eng.forget_prefixes()
    assert sorted(widths) == [(2, 6), (2, 120)]  # 252 tokens computed, not 480
    assert heads == [8] and eng.forwards == before + 1
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for a, b in zip(whole_feats, feats):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_batch_reads_the_lm_head_once_and_each_item_gets_its_own_rows(dep, monkeypatch):
    eng = dep.target
    seqs = [_seq(n, 10 + n) for n in (5, 17, 9)]
    wants = (1, 4, 2)
    alone = [eng.run([ForwardItem(s, k)])[0] for s, k in zip(seqs, wants)]
    eng.forget_prefixes()
    calls = []
    head = eng.model.logits
    monkeypatch.setattr(eng.model, "logits", lambda h: calls.append(h.shape[0]) or head(h))
    batched = eng.run([ForwardItem(s, k) for s, k in zip(seqs, wants)])
    assert calls == [sum(wants)]  # one LM-head call for the whole step
    for a, b, k in zip(alone, batched, wants):
        assert b.shape == (k, eng.vocab_size)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_more_sequences_than_slots_evicts_correctly(dep):
    eng = dep.target
    seqs = [_seq(10, 100 + i) for i in range(eng.max_batch_size + 3)]
    first = [eng.run([ForwardItem(s, 2)])[0] for s in seqs]
    again = [eng.run([ForwardItem(s, 2)])[0] for s in seqs]
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_slot_pool_continues_a_sequence_with_its_rejected_drafts_rolled_back():
    pool = SlotPool(3, rollback=1)
    pool.commit(0, [1, 2, 3])
    pool.commit(1, [1, 2, 3, 4, 5])
    # [1, 2, 3, 4, 9] keeps all of slot 1 but its last token (a rejected draft): slot 1 again.
    assert pool.assign([[1, 2, 3, 4, 9]]) == [(1, 4)]
    assert pool.assign([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]]) == [(1, 5), (0, 3)]


def test_slot_pool_never_gives_a_live_sequence_to_one_that_only_shares_its_header():
    header = [7, 7, 7, 7]  # e.g. a chat template's system prompt
    pool = SlotPool(3, rollback=2)
    live_a = header + [10, 11, 12, 13, 14, 15]
    pool.commit(0, live_a)
    pool.commit(1, [99])  # used later than slot 2: slot 2 is the least recently used
    (slot_b, reuse_b) = pool.assign([header + [20, 21]])[0]
    assert slot_b == 2 and reuse_b == 0  # not slot 0, although it shares 4 tokens with it
    pool.commit(slot_b, header + [20, 21])
    # A comes back with two rejected drafts replaced: it finds its own slot and K/V again.
    assert pool.assign([live_a[:-2] + [30, 31]]) == [(0, len(live_a) - 2)]
    # A new sequence takes the least recently used slot and still reuses what it shares.
    pool.commit(0, live_a)
    assert pool.assign([[99, 5]]) == [(1, 1)]


def test_engine_rejects_bad_input(dep):
    from trtspec.errors import RequestError

    eng = dep.target
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.run([ForwardItem([1, 2, 10_000], 1)])
    with pytest.raises(RequestError, match="exceeds the engine's max_batch_size"):
        eng.run([ForwardItem([1], 1)] * (eng.max_batch_size + 1))
    with pytest.raises(RequestError, match="exceeds max_seq_len"):
        eng.run([ForwardItem([1] * (eng.max_seq_len + 1), 1)])


def test_failed_forward_never_leaves_half_written_kv_reusable(dep, monkeypatch):
    eng = dep.target
    eng.forget_prefixes()
    prefix, tail = _seq(12, 7), _seq(6, 8)
    (clean,) = eng.run([ForwardItem(prefix + tail, 1)])  # reference logits, fresh cache
    eng.forget_prefixes()
    eng.run([ForwardItem(prefix + tail, 1)])  # the slot now holds prefix + tail
    real = eng.model.hidden_states

    def crash_after_writing(step, cos, sin, cache):
        real(step, cos, sin, cache)  # K/V of the tail are written ...
        raise RuntimeError("forward failed")  # ... but the call never completes

    monkeypatch.setattr(eng.model, "hidden_states", crash_after_writing)
    with pytest.raises(RuntimeError):
        eng.run([ForwardItem(prefix + _seq(6, 9), 1)])  # overwrites the tail's K/V, then fails
    monkeypatch.setattr(eng.model, "hidden_states", real)
    assert prefix in eng.pool.tokens  # the slot's record kept only the still-valid prefix
    (again,) = eng.run([ForwardItem(prefix + tail, 1)])
    torch.testing.assert_close(again, clean, rtol=1e-5, atol=1e-5)


def _greedy(engine, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy ids and each step's logits, one decode step at a time through run()."""
    engine.forget_prefixes()
    seq, logits = list(prompt), []
    for _ in range(n):
        (out,) = engine.run([ForwardItem(seq, 1)])  # [1, vocab]
        logits.append(out[0])
        seq.append(int(out[0].argmax()))
    return seq[len(prompt) :], logits


def test_fused_projections_decode_as_the_checkpoint_layout(dep, monkeypatch):
    """load() fuses q/k/v and gate/up into one matmul each; the model with the checkpoint's
    separate projections (what the EAGLE-3 head keeps) gives the same greedy ids."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from trtspec.engines.torch.engine import TorchEngine
    from trtspec.engines.torch.model import DecoderConfig, DecoderLM

    monkeypatch.setenv("TRTSPEC_ONEDNN", "0")  # both dense: only the fusion differs
    fused = TorchEngine.load(dep.target.folder, slots=1)
    layer = fused.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")
    hf = AutoConfig.from_pretrained(dep.target.folder)
    separate = DecoderLM.from_state_dict(DecoderConfig.from_hf(hf), load_file(str(dep.target.folder / "model.safetensors")))
    plain = TorchEngine(dep.target.folder, fused.manifest, separate, hf, 1)
    prompt = _seq(9, 42)
    ids_fused, logits_fused = _greedy(fused, prompt, 16)
    ids_plain, logits_plain = _greedy(plain, prompt, 16)
    assert ids_fused == ids_plain
    for a, b in zip(logits_fused, logits_plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_batched_decode_in_consecutive_slots_gathers_no_kv(dep):
    """Rows in consecutive slots (a fresh batch takes slots 0..b-1 in order and keeps them)
    attend to a view of the cache; each layer writes every row's new K/V in one scatter
    instead of one copy per row. Same logits as each row alone."""
    from torch.profiler import profile

    eng = dep.target
    seqs = [_seq(n, 50 + n) for n in (7, 12, 9)]
    eng.forget_prefixes()
    eng.run([ForwardItem(s, 1) for s in seqs])
    assert [slot for slot, _ in eng.pool.assign(seqs)] == [0, 1, 2]
    longer = [s + [5] for s in seqs]
    with profile() as prof:
        batched = eng.run([ForwardItem(s, 1) for s in longer])
    counts = {e.key: e.count for e in prof.key_averages()}
    layers = eng.config.num_layers
    assert counts.get("aten::index_select", 0) <= 1  # the embedding lookup, no K/V gather
    assert counts.get("aten::index_put_", 0) == 2 * layers  # K and V, all rows at once
    for s, b in zip(longer, batched):
        eng.forget_prefixes()
        (alone,) = eng.run([ForwardItem(s, 1)])
        torch.testing.assert_close(b, alone, rtol=1e-5, atol=1e-5)


def test_rows_with_finished_slots_between_them_attend_over_a_view_as_if_gathered(dep, monkeypatch):
    """A batch whose middle sequence finished (slots 0 and 2 of 0..2 go on) attends over a view
    of slots 0..2 with its queries placed in it, not a gather of each row's K/V per layer; the
    logits are the gather's (RANGE_ROWS 0 forces it) up to float rounding (SDPA splits its work
    by the batch it is given), as each row's are alone."""
    from torch.profiler import profile

    from trtspec.engines.torch import model

    eng = dep.target
    seqs = [_seq(n, 60 + n) for n in (7, 12, 9)]

    def step(prof: bool):
        eng.forget_prefixes()
        eng.run([ForwardItem(s, 1) for s in seqs])
        live = [seqs[0] + [5, 6], seqs[2] + [7, 8]]  # slot 1's sequence finished
        if not prof:
            return eng.run([ForwardItem(s, 2) for s in live]), {}
        with profile() as p:
            out = eng.run([ForwardItem(s, 2) for s in live])
        return out, {e.key: e.count for e in p.key_averages()}

    ranged, counts = step(prof=True)
    assert eng.last_slots == [0, 2]
    assert counts.get("aten::index_select", 0) <= 1  # the embedding lookup, no K/V gather
    monkeypatch.setattr(model, "RANGE_ROWS", 0)
    gathered, _ = step(prof=False)
    for a, b in zip(ranged, gathered):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_prefill_shared_computes_a_shared_prefix_and_a_repeated_prompt_once(dep):
    """Slot i ends up holding prompts[i] with the K/V and features each prompt's own prefill
    gives; the header all share is computed once, a prompt held twice once; a batch of those
    prompts then takes slots 0..n-1 in order and computes one position each."""
    from trtspec.engines.torch.engine import TorchEngine

    eng = TorchEngine.load(dep.target.folder, slots=5)
    eng.capture_features((0, 1))
    header = _seq(6, 70)
    a, b, c = header + [1, *_seq(4, 71)], header + [2, *_seq(7, 72)], header + [3, *_seq(2, 73)]
    prompts = [a, b, a, c, a]
    computed = []
    forward = eng._forward

    def counting(items, assigned, starts):
        computed.append(sum(len(it.tokens) - s for it, s in zip(items, starts)))
        return forward(items, assigned, starts)

    eng._forward = counting
    eng.prefill_shared(prompts)
    assert sum(computed) == len(header) + sum(len(p) - len(header) for p in (a, b, c))
    assert [len(t) for t in eng.pool.tokens] == [len(p) for p in prompts]
    shared_feats = [eng.features_of(p, 0, len(p)) for p in prompts]
    computed.clear()
    shared = eng.run([ForwardItem(p, 1) for p in prompts])
    assert [slot for slot, _ in eng.pool.assign(prompts)] == [0, 1, 2, 3, 4]
    assert computed == [len(prompts)]  # the last position of each: its logits
    for p, logits, feats in zip(prompts, shared, shared_feats):
        eng.forget_prefixes()
        (alone,) = eng.run([ForwardItem(p, 1)])
        torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(feats, eng.features_of(p, 0, len(p)), rtol=1e-4, atol=1e-4)  # other shapes: rounding
    # No shared prefix at all: each distinct prompt still lands in its own slot.
    eng.prefill_shared([b[::-1], a[::-1], b[::-1]])
    assert eng.pool.tokens[:3] == [b[::-1], a[::-1], b[::-1]]
