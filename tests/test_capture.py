"""serve.capture: the served requests an EAGLE-3 head learns from, kept in distill's part
format (sampled by request id, opt-out, excluded tenants, bounded, torn parts never read)."""

from __future__ import annotations

import pytest
import torch
from conftest import write_spec
from test_eagle3 import random_head

from trtspec.errors import SpecError
from trtspec.spec import load_spec
from trtspec.speculative.capture import CaptureTag, bound, chosen, parts, read_capture, tenant_of

CAPTURE = {"dir": "captured", "max_gb": 1, "sample": 1.0}
PROMPTS = ["The capital of France is", "def add(a, b):", "SELECT name FROM users WHERE", "ls -la | grep"]


def _spec(tmp_path, tiny_ckpts, capture=CAPTURE, method="eagle3"):
    ck = dict(tiny_ckpts)
    draft = "draft"
    if method == "eagle3":
        ck["head"] = random_head(tiny_ckpts["target"], tmp_path / "head")
        draft = "head"
    return write_spec(tmp_path / "spec", ck, draft, **{"speculative.method": method, "serve.capture": capture})


@pytest.fixture(scope="module")
def deploy(tmp_path_factory, tiny_ckpts):
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment

    loaded = load_spec(_spec(tmp_path_factory.mktemp("capture"), tiny_ckpts, dict(CAPTURE, exclude_tenants=["acme"])))
    build(loaded, loaded.output_dir())
    return Deployment(loaded, loaded.output_dir())


def _serve(dep, tags, scopes=None, max_tokens=12):
    scopes = scopes or [""] * len(tags)
    reqs = [dep.request(dep.encode(p), max_tokens, 3, suffix_scope=s) for p, s in zip(PROMPTS, scopes)]
    results = dep.generate(reqs, tags=tags)
    dep.capture.flush()  # the parts are written by the writer's thread
    return reqs, results


def _clear(dep):
    for p in parts(dep.capture.folder):
        p.unlink()


# ------------------------------------------------------------------------------ the spec


def test_capture_is_off_unless_the_spec_sets_it(tmp_path, tiny_ckpts):
    loaded = load_spec(_spec(tmp_path, tiny_ckpts, capture=None))
    assert loaded.spec.serve.capture is None and loaded.capture_dir() is None


def test_capture_dir_is_relative_to_the_spec_file(tmp_path, tiny_ckpts):
    loaded = load_spec(_spec(tmp_path, tiny_ckpts))
    assert loaded.capture_dir() == (tmp_path / "spec" / "captured").resolve()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"sample": 0}, "serve.capture.sample"),
        ({"sample": 1.5}, "serve.capture.sample"),
        ({"max_gb": 0}, "serve.capture.max_gb"),
        ({"dir": " "}, "dir is empty"),
        ({"every": 3}, "every"),
    ],
)
def test_bad_capture_settings_are_refused_by_name(tmp_path, tiny_ckpts, changes, message):
    with pytest.raises(SpecError) as e:
        load_spec(_spec(tmp_path, tiny_ckpts, dict(CAPTURE, **changes)))
    assert message in str(e.value) and e.value.exit_code == 2


def test_capture_needs_the_features_of_method_eagle3(tmp_path, tiny_ckpts):
    with pytest.raises(SpecError) as e:
        load_spec(_spec(tmp_path, tiny_ckpts, method="draft_target"))
    assert "serve.capture keeps the features an EAGLE-3 head reads" in str(e.value)


# ------------------------------------------------------------------------------ which requests


def test_the_sample_is_decided_by_the_request_id_alone():
    ids = [f"req-{i}" for i in range(400)]
    half = [i for i in ids if chosen(i, 0.5)]
    assert half == [i for i in ids if chosen(i, 0.5)]  # the same ids, every time
    assert 150 < len(half) < 250  # about half
    assert all(chosen(i, 1.0) for i in ids)
    assert set(i for i in ids if chosen(i, 0.1)) <= set(half)  # a smaller share is a subset


def test_tenant_is_the_scope_before_its_first_slash():
    assert tenant_of("acme/alice") == "acme" and tenant_of("acme") == "acme" and tenant_of(None) == tenant_of("") == ""


def test_served_requests_are_kept_with_their_tokens_features_labels_and_tenant(deploy):
    _clear(deploy)
    reqs, results = _serve(deploy, [CaptureTag(f"r{i}") for i in range(4)], scopes=["bob/x", "", "bob", ""])
    got = {c.record["request_id"]: c for c in read_capture(deploy.capture.folder)}
    assert sorted(got) == ["r0", "r1", "r2", "r3"]
    for i, (req, res) in enumerate(zip(reqs, results)):
        c = got[f"r{i}"]
        tokens = req.prompt_ids + res.output_ids[:-1]
        assert c.sample.tokens.tolist() == tokens and c.sample.prompt_len == len(req.prompt_ids)
        # greedy: the target's label after each response position is the next token it answered
        assert c.sample.labels[len(req.prompt_ids) - 1 :].tolist() == res.output_ids
        assert c.sample.top_ids[:, 0].tolist() == c.sample.labels.tolist()
        assert c.sample.features.shape == (len(tokens), len(deploy.head.cfg.layer_ids) * deploy.target.config.hidden_size)
    assert (got["r0"].record["tenant"], got["r0"].record["scope"]) == ("bob", "bob/x")
    assert got["r1"].record["tenant"] == ""


def test_the_features_and_labels_kept_are_the_targets_own(deploy):
    """Kept from the served steps, against one teacher-forced forward over the same tokens.
    They differ by float32 rounding only: serving computed them in batched prefill, verify and
    decode steps (several rows, a few positions each), the forward in one row of every
    position, so the sums run in other orders. Features and logits agree within 1e-4; the ids
    exactly, at every rank whose logit is more than 1e-3 from its neighbours' (not tied)."""
    from trtspec.distill.data import capture

    _clear(deploy)
    reqs, results = _serve(deploy, [CaptureTag(f"f{i}") for i in range(4)])
    kept = {c.record["request_id"]: c.sample for c in read_capture(deploy.capture.folder)}
    for i, (req, res) in enumerate(zip(reqs, results)):
        got, p = kept[f"f{i}"], len(req.prompt_ids) - 1
        again = capture(deploy.target, req.prompt_ids, res.output_ids[:-1])
        torch.testing.assert_close(got.features, again.features, rtol=1e-4, atol=1e-4)
        # labelled where serving scored: after the prompt's last position and every response one
        assert (got.top_ids[:p] == -1).all() and (got.labels[:p] == -1).all() and (got.top_logits[:p] == 0).all()
        torch.testing.assert_close(got.top_logits[p:], again.top_logits[p:], rtol=1e-4, atol=1e-4)
        gaps = again.top_logits[p:].diff(dim=-1).abs()  # [n, k - 1]
        apart = torch.ones_like(again.top_ids[p:], dtype=torch.bool)
        apart[:, 1:] &= gaps > 1e-3
        apart[:, :-1] &= gaps > 1e-3
        assert torch.equal(got.top_ids[p:][apart], again.top_ids[p:][apart])


def test_distill_trains_and_scores_a_captured_part_where_a_fully_labelled_one_would(deploy):
    """Distill reads labels only after response positions' predecessors (ttt.step_targets,
    chain_in_response; agreement's walks end at the last one): exactly the positions serving
    scored. The captured part's unlabelled prompt positions change no target of any step."""
    from trtspec.distill.data import capture, collate
    from trtspec.distill.ttt import step_targets

    _clear(deploy)
    reqs, results = _serve(deploy, [CaptureTag(f"d{i}") for i in range(4)])
    kept = {c.record["request_id"]: c.sample for c in read_capture(deploy.capture.folder)}
    got = [kept[f"d{i}"] for i in range(4)]
    again = [capture(deploy.target, r.prompt_ids, res.output_ids[:-1]) for r, res in zip(reqs, results)]
    a, b = collate(got, 10**6, soft=True), collate(again, 10**6, soft=True)
    for ta, tb in zip(step_targets(a, 3), step_targets(b, 3)):
        assert torch.equal(ta, tb) and bool((ta >= 0).any())
        soft_next = torch.cat([a.top_ids[:, 1:, 0], torch.full_like(a.top_ids[:, :1, 0], -1)], dim=1)
        assert (soft_next[ta >= 0] >= 0).all()  # the soft labels a scored position reads are there too


def test_keeping_a_request_runs_no_forward(deploy, monkeypatch):
    _clear(deploy)
    reqs = [deploy.request(deploy.encode(p), 12, 3) for p in PROMPTS]
    tags = [CaptureTag(f"n{i}") for i in range(4)]
    with deploy.labelled(reqs, tags):  # the target keeps their labels, as generate(tags=...) has it
        results = deploy.generate(reqs)
    calls = []
    run = deploy.target._run_locked
    monkeypatch.setattr(deploy.target, "_run_locked", lambda items: calls.append(items) or run(items))
    before = deploy.target.forwards
    kept = deploy.keep(reqs, results, tags)
    deploy.capture.flush()
    assert all(kept) and len(parts(deploy.capture.folder)) == 4
    assert calls == [] and deploy.target.forwards == before


def test_a_request_the_engine_no_longer_holds_is_not_kept(deploy):
    _clear(deploy)
    reqs = [deploy.request(deploy.encode(p), 8, 3) for p in PROMPTS]
    tags = [CaptureTag(f"g{i}") for i in range(4)]
    with deploy.labelled(reqs, tags):
        results = deploy.generate(reqs)
    deploy.target.forget_prefixes()  # its slots hold nothing now: neither features nor labels
    assert deploy.keep(reqs, results, tags) == [None] * 4
    deploy.capture.flush()
    assert parts(deploy.capture.folder) == []


def test_opted_out_and_excluded_tenants_are_never_kept(deploy):
    _clear(deploy)
    tags = [CaptureTag("a", allowed=False), CaptureTag("b"), CaptureTag("c"), CaptureTag("d", allowed=False)]
    _serve(deploy, tags, scopes=["", "acme", "acme/alice", "bob"])
    assert read_capture(deploy.capture.folder) == []


def test_only_requests_capture_may_keep_are_labelled_while_served(deploy):
    """The target labels the rows of the requests serve.capture may keep, and no other: an
    opted-out one, an excluded tenant's and one served without tags hold no label after the
    steps that served them; the kept one holds its own."""
    _clear(deploy)
    tags = [CaptureTag("k0"), CaptureTag("k1", allowed=False), CaptureTag("k2")]
    reqs, results = _serve(deploy, tags, scopes=["", "", "acme/alice"])
    untagged = deploy.request(deploy.encode(PROMPTS[3]), 8, 3)
    (alone,) = deploy.generate([untagged])
    served = [*zip(reqs, results), (untagged, alone)]
    labelled = []
    for r, res in served:
        tokens = r.prompt_ids + res.output_ids[:-1]
        ids, _ = deploy.target.labels_of(tokens, len(r.prompt_ids) - 1, len(tokens))  # what keeping one reads
        labelled.append("all" if bool((ids >= 0).all()) else "none" if bool((ids == -1).all()) else "some")
    assert labelled == ["all", "none", "none", "none"]
    assert [c.record["request_id"] for c in read_capture(deploy.capture.folder)] == ["k0"]
    assert deploy.target.labels.prompts == {}  # nothing is wanted once generate returned


def test_requests_without_tags_are_never_kept(deploy):
    _clear(deploy)
    reqs = [deploy.request(deploy.encode(p), 8, 3) for p in PROMPTS]
    deploy.generate(reqs)
    assert parts(deploy.capture.folder) == []


# ------------------------------------------------------------------------------ on disk


def test_the_folder_stays_under_max_gb_dropping_the_oldest(deploy):
    _clear(deploy)
    _serve(deploy, [CaptureTag(f"o{i}") for i in range(4)])
    found = parts(deploy.capture.folder)
    sizes = [p.stat().st_size for p in found]
    removed = bound(deploy.capture.folder, sum(sizes[2:]))
    assert removed == found[:2] and parts(deploy.capture.folder) == found[2:]
    assert sum(p.stat().st_size for p in parts(deploy.capture.folder)) <= sum(sizes[2:])


def test_a_writer_bounds_the_folder_itself(deploy, monkeypatch):
    _clear(deploy)
    _serve(deploy, [CaptureTag(f"w{i}") for i in range(4)])
    one = max(p.stat().st_size for p in parts(deploy.capture.folder))
    monkeypatch.setattr(deploy.capture, "max_bytes", int(one * 1.5))
    _serve(deploy, [CaptureTag(f"v{i}") for i in range(4)])
    left = parts(deploy.capture.folder)
    assert sum(p.stat().st_size for p in left) <= int(one * 1.5)
    assert [c.record["request_id"] for c in read_capture(deploy.capture.folder)] == ["v3"]  # the newest


@pytest.mark.parametrize("damage", ["truncate", "flip", "temp"])
def test_a_torn_or_altered_part_is_never_read(deploy, damage):
    _clear(deploy)
    _serve(deploy, [CaptureTag(f"t{i}") for i in range(2)] + [CaptureTag("x", allowed=False)] * 2)
    first, second = parts(deploy.capture.folder)
    raw = bytearray(first.read_bytes())
    if damage == "truncate":
        first.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        raw[-5] ^= 0xFF  # inside the tensor data, past the header
        first.write_bytes(bytes(raw))
    else:  # a writer killed before its rename leaves only its temp name
        first.rename(first.with_name(f".{first.name}.tmp123"))
    assert [c.path for c in read_capture(deploy.capture.folder)] == [second]


def test_a_request_whose_tenant_is_unknown_is_never_kept_while_tenants_are_excluded():
    from trtspec.spec import CaptureSpec
    from trtspec.speculative.capture import wanted

    open_to_all = CaptureSpec(dir="d", max_gb=1, sample=1.0)
    excluding = CaptureSpec(dir="d", max_gb=1, sample=1.0, exclude_tenants=["acme"])
    assert wanted(open_to_all, "r", None) and wanted(excluding, "r", "bob/x")
    assert not wanted(excluding, "r", None)  # no scope (suffix cache off): its tenant could be acme
    assert not wanted(excluding, "r", "acme/x") and not wanted(open_to_all, "r", "", allowed=False)
