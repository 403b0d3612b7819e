"""The distill feature store: captured features on disk, read per batch; checked on open."""

from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import load_file
from test_distill import eagle_spec, interrupted_distill, small_opts

import trtspec.distill.run as distill_mod
import trtspec.distill.trainer as trainer_mod
from trtspec.distill.data import collate
from trtspec.distill.run import distill
from trtspec.distill.sample import Sample
from trtspec.distill.store import CorruptStore, open_store, paths, write_store
from trtspec.spec import load_spec


def random_samples(n: int, width: int, dtype: torch.dtype) -> list[Sample]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        t = 5 + 3 * i
        tokens = torch.randint(0, 100, (t,), generator=gen)
        feats = torch.randn((t, width), generator=gen).to(dtype)
        top = torch.topk(torch.randn((t, 100), generator=gen), 4, dim=-1)
        out.append(
            Sample(
                tokens,
                2 + i,
                feats,
                torch.randint(0, 100, (t,), generator=gen),
                top_ids=top.indices,
                top_logits=top.values,
            )
        )
    return out


def store_key(work) -> str:
    (index,) = work.glob("data-*.safetensors")
    return index.name.removeprefix("data-").removesuffix(".safetensors")


def head_weights(folder):
    return load_file(str(folder / "model.safetensors"))


def same_head(a, b) -> bool:
    wa, wb = head_weights(a), head_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_store_round_trips(tmp_path, dtype):
    samples = random_samples(4, 6, dtype)
    written = write_store(tmp_path, "k1", {"why": "test"}, iter(samples))
    store = open_store(tmp_path, "k1")
    assert store is not None and store.dtype == dtype and (store.rows, store.width) == (5 + 8 + 11 + 14, 6)
    assert [s.row for s in store.samples] == [s.row for s in written.samples] == [0, 5, 13, 24]
    for s, d in zip(samples, store.samples):
        assert torch.equal(s.tokens, d.tokens) and torch.equal(s.labels, d.labels) and s.prompt_len == d.prompt_len
        assert torch.equal(s.top_ids, d.top_ids.long()) and torch.equal(s.top_logits, d.top_logits)  # soft labels
        assert d.features is None  # nothing of the features stays in memory
        rows = torch.empty_like(s.features)
        store.read_into(rows, d.row)
        assert torch.equal(rows, s.features)
    # the batch training sees: the same from disk as from memory, truncated at max_len
    for pick in ([0, 3, 1], [2]):
        mem = collate([samples[i] for i in pick], 9, soft=True)
        disk = collate([store.samples[i] for i in pick], 9, store, soft=True)
        for name in ("tokens", "features", "labels", "response", "top_ids", "top_logits"):
            assert torch.equal(getattr(mem, name), getattr(disk, name)), name


def test_training_from_disk_equals_training_from_memory(tmp_path, tiny_ckpts, monkeypatch):
    """The head trained on features read per batch from the store equals, bit for bit, the
    head trained on the same captures held in memory (the format-1 path)."""
    disk = distill(load_spec(eagle_spec(tmp_path / "a", tiny_ckpts["target"])), small_opts(tmp_path / "a"))

    def in_memory(work, key, inputs, samples):
        kept = list(samples)  # features stay on each sample: collate copies them from memory
        return types.SimpleNamespace(samples=kept, rows=sum(len(s.tokens) for s in kept), features=None)

    monkeypatch.setattr(distill_mod, "write_store", in_memory)
    monkeypatch.setattr(trainer_mod, "collate", lambda samples, max_len, store, soft=False: collate(samples, max_len, soft=soft))
    mem = distill(load_spec(eagle_spec(tmp_path / "b", tiny_ckpts["target"])), small_opts(tmp_path / "b"))
    assert not list((tmp_path / "b" / ".head.distill").glob("features-*"))  # really trained from memory
    assert same_head(tmp_path / "a" / "head", tmp_path / "b" / "head")
    assert disk.metrics == mem.metrics


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncate", "bytes, its manifest"),
        ("flip", "does not match its manifest's sha256"),
        ("delete", "is missing"),
        ("index", "is unreadable"),
    ],
)
def test_a_damaged_capture_is_detected_and_captured_again(tmp_path, tiny_ckpts, capsys, damage, message):
    spec = eagle_spec(tmp_path, tiny_ckpts["target"])
    distill(load_spec(spec), small_opts(tmp_path, max_steps=3))
    first = head_weights(tmp_path / "head")
    work = tmp_path / ".head.distill"
    key = store_key(work)
    index, feats = paths(work, key)
    data = feats.read_bytes()
    if damage == "truncate":
        feats.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        feats.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "delete":
        feats.unlink()
    else:
        index.write_bytes(index.read_bytes()[:40])
    with pytest.raises(CorruptStore, match=message):
        open_store(work, key)

    capsys.readouterr()
    distill(load_spec(spec), small_opts(tmp_path, max_steps=3, force=True))
    err = capsys.readouterr().err
    assert message in err and "; capturing again" in err
    assert open_store(work, key) is not None  # whole again
    again = head_weights(tmp_path / "head")
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_an_interrupted_capture_leaves_no_store(tmp_path, tiny_ckpts, monkeypatch):
    """Ctrl-C while the store is being written: no index, no features file, no partial file;
    the batches generated so far survive, and the rerun trains the head an uninterrupted run
    trains."""
    distill(load_spec(eagle_spec(tmp_path / "a", tiny_ckpts["target"])), small_opts(tmp_path / "a"))
    b = tmp_path / "b"
    loaded = load_spec(eagle_spec(b, tiny_ckpts["target"]))
    interrupted_distill(monkeypatch, loaded, b, at_batch=3)
    work = b / ".head.distill"
    assert len(list(work.glob("parts-*/responses/part-*"))) == 2  # the finished batches survive
    assert not list(work.glob("data-*")) and not list(work.glob("*features-*"))
    monkeypatch.undo()
    distill(loaded, small_opts(b))
    assert same_head(tmp_path / "a" / "head", b / "head")


def test_a_new_capture_removes_the_superseded_one(tmp_path, tiny_ckpts, capsys):
    """Changing what shapes the data (here the response length) captures again and deletes
    the earlier capture instead of leaving its features behind."""
    spec = load_spec(eagle_spec(tmp_path, tiny_ckpts["target"]))
    distill(spec, small_opts(tmp_path, max_steps=2))
    work = tmp_path / ".head.distill"
    first = store_key(work)
    capsys.readouterr()
    distill(spec, small_opts(tmp_path, max_steps=2, max_tokens=10, force=True))
    assert "superseded file(s) of other data" in capsys.readouterr().err
    assert store_key(work) != first and not list(work.glob(f"*{first}*"))


def test_two_runs_never_share_a_work_folder(tmp_path, tiny_ckpts):
    """A second distill on a work folder in use is refused by name (exit 2); a lock left by a
    run that died is taken over."""
    import os
    import subprocess

    from trtspec.distill.run import work_lock
    from trtspec.errors import TrtspecError

    work = tmp_path / ".head.distill"
    with work_lock(work):
        with pytest.raises(TrtspecError, match="in use by another distill"):
            with work_lock(work):
                pass
    assert not (work / "lock").exists()
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid names no live process now
    (work / "lock").write_text(str(gone.pid))
    with work_lock(work):  # the dead run's lock is taken over
        assert (work / "lock").read_text() == str(os.getpid())


def test_a_fresh_lock_is_never_taken_over(tmp_path):
    """A run that has just taken the lock, before its pid is written (an empty lock file), or
    one whose pid was reused, still holds it: the kernel's lock decides, not the file's text."""
    import subprocess
    import sys

    from trtspec.distill.run import work_lock
    from trtspec.errors import TrtspecError

    work = tmp_path / ".head.distill"
    work.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); sys.stdin.read()", str(work / "lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TrtspecError, match="in use by another distill"):
            with work_lock(work):
                pass
    finally:
        holder.stdin.close()
        holder.wait(10)
    with work_lock(work):  # its run ended: the kernel released the lock
        pass


def test_held_out_agreement_is_the_same_in_one_batch_or_many(tmp_path, tiny_ckpts):
    """distill evaluates the held-out set a training batch at a time (memory bounded by one
    batch); the counts it sums equal those of one batch holding every sequence."""
    import json

    from trtspec.distill.ttt import agreement
    from trtspec.engines.eagle3_checkpoint import head_config_from_dict
    from trtspec.engines.torch.eagle3_head import Eagle3Head
    from trtspec.engines.torch.engine import TorchEngine

    distill(load_spec(eagle_spec(tmp_path, tiny_ckpts["target"])), small_opts(tmp_path, max_steps=3))
    work = tmp_path / ".head.distill"
    store = open_store(work, store_key(work))
    target = TorchEngine.load(tmp_path / "engines" / "target")
    cfg = head_config_from_dict(json.loads((tmp_path / "head" / "config.json").read_text()), target.config.num_layers)
    head = Eagle3Head.from_state_dict(cfg, head_weights(tmp_path / "head"))
    args = (target.model.model.embed_tokens, 3, target.cos, target.sin)
    s = store.samples
    whole = agreement(head, args[0], [collate(s, 512, store)], *args[1:])
    parts = agreement(head, args[0], (collate(s[i : i + 3], 512, store) for i in range(0, len(s), 3)), *args[1:])
    assert whole["chains"] > 0 and 0 < whole["top1"][0] < 1
    assert parts == whole


def test_rows_that_share_their_first_tokens_each_keep_their_own_labels(built):
    """Two rows of a generation batch hold the same tokens for a while (a prompt's greedy and
    sampled responses), then part: each row's recorded labels and top-k logits are its own, as
    a teacher-forced capture of its sequence gives them."""
    from trtspec.distill.data import LabelRecorder, capture
    from trtspec.engines.torch.engine import ForwardItem, TorchEngine

    eng = TorchEngine.load(built("same").target.folder, slots=4)
    eng.capture_features((0, 1))
    rec = LabelRecorder(eng)
    prompt = [5, 17, 42, 99, 7]
    eng.prefill_shared([prompt, prompt])
    rec.run([ForwardItem(prompt, 1), ForwardItem(prompt, 1)])  # the loop's steps, as generate makes them
    rec.run([ForwardItem(prompt + [11], 1), ForwardItem(prompt + [11], 1)])
    rec.run([ForwardItem(prompt + [11, 12], 1), ForwardItem(prompt + [11, 13], 1)])
    outputs = ([11, 12, 3], [11, 13, 3])
    got = [rec.sample(prompt, out) for out in outputs]
    p = len(prompt) - 1  # the first position with logits: the last prompt token's
    for out, g in zip(outputs, got):
        ref = capture(eng, prompt, out)  # every position; the generated sample ends before its last token
        n = len(g.labels)
        assert torch.equal(g.labels[p:], ref.labels[p:n])
        assert torch.equal(g.top_ids[p:], ref.top_ids[p:n])
        torch.testing.assert_close(g.top_logits[p:], ref.top_logits[p:n], rtol=1e-4, atol=1e-4)


def test_a_prompts_responses_share_a_batch_and_come_back_in_request_order(built, tmp_path):
    """distill's requests come as every prompt's greedy response, then the sampled ones:
    generated() batches the requests of one prompt together (its prefill computed once) and
    still yields one sample per request in request order, each what that request generates
    alone; samples whose batch has left memory are read back from its part, and a second call
    reads every batch from the parts instead of generating it."""
    from trtspec.distill.data import batch_order, generated
    from trtspec.engines.torch.engine import TorchEngine
    from trtspec.speculative.loop import GenerationRequest
    from trtspec.speculative.sampling import SamplingParams

    eng = TorchEngine.load(built("same").target.folder, slots=4)
    eng.capture_features((0, 1))
    prompts = [[5, 17, 42, 99, 7], [5, 17, 8], [5, 17, 42, 3, 3, 61]]
    reqs = [GenerationRequest(p, 6) for p in prompts] + [
        GenerationRequest(p, 6, sampling=SamplingParams(temperature=0.8, seed=7 + i)) for i, p in enumerate(prompts)
    ]
    assert batch_order(reqs, 4) == [[0, 3, 1, 4], [2, 5]]
    prefills, real = [], eng.prefill_shared
    eng.prefill_shared = lambda ps: (prefills.append(ps), real(ps))[1]
    got = list(generated(eng, reqs, tmp_path / "parts"))
    assert prefills == [[prompts[0], prompts[0], prompts[1], prompts[1]], [prompts[2], prompts[2]]]
    assert len(list((tmp_path / "parts").glob("part-*.safetensors"))) == 2
    for r, s in zip(reqs, got):
        (alone,) = generated(eng, [r])
        assert s.prompt_len == len(r.prompt_ids) and torch.equal(s.tokens, alone.tokens)
        assert torch.equal(s.labels, alone.labels)
        # another batch's prefill rounds the features differently in the last bits, never the tokens
        torch.testing.assert_close(s.features, alone.features, rtol=1e-4, atol=1e-4)
    prefills.clear()
    again = list(generated(eng, reqs, tmp_path / "parts"))  # every batch found: nothing generated
    assert not prefills
    assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.features, b.features) for a, b in zip(got, again))
    kept = list(generated(eng, reqs))  # no parts: finished batches held in memory until their turn
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(got, kept))


def test_a_part_removed_before_its_samples_are_read_back_is_a_named_failure(built, tmp_path, monkeypatch):
    """A batch written to disk and gone when its samples' turn comes (another process cleaned
    the work folder): a RuntimeFailure that names the file and the fix, not a wrong sample."""
    import trtspec.distill.data as data
    from trtspec.engines.torch.engine import TorchEngine
    from trtspec.errors import RuntimeFailure
    from trtspec.speculative.loop import GenerationRequest
    from trtspec.speculative.sampling import SamplingParams

    eng = TorchEngine.load(built("same").target.folder, slots=4)
    eng.capture_features((0, 1))
    prompts = [[5, 17, 42, 99, 7], [5, 17, 8], [5, 17, 42, 3, 3, 61]]
    reqs = [GenerationRequest(p, 4) for p in prompts] + [
        GenerationRequest(p, 4, sampling=SamplingParams(temperature=0.8, seed=i)) for i, p in enumerate(prompts)
    ]
    written, real = [], data.write_part

    def write_then_lose_the_first(path, samples):
        real(path, samples)
        written.append(path)
        if len(written) == 2:  # the sampled responses of batch 0 are read back after this one
            written[0].unlink()

    monkeypatch.setattr(data, "write_part", write_then_lose_the_first)
    with pytest.raises(RuntimeFailure, match="part-00000-.*removed or damaged.*run distill again"):
        list(data.generated(eng, reqs, tmp_path / "parts"))
