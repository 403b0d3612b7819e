"""bench/distill_peers.py on a tiny target: a distilled head's own data exported in speculators'
offline format (the same sequences, layers and draft vocabulary, the teacher's layer checked),
speculators' trainer run on it on the CPU (where its environment exists), and its head scored
in vLLM (where that environment exists too)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, write_spec
from safetensors.torch import load_file
from test_distill import PROMPTS
from test_vllm_head import vllm_tiny_target

import distill_peers
from trtspec.distill.data import collate
from trtspec.distill.run import DistillOptions, distill, prepare, work_folder
from trtspec.spec import load_spec

SPECULATORS_PY = distill_peers.SPECULATORS_PY
VLLM_PY = distill_peers.VLLM_PY


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A head distilled for the tiny target, and its data exported for speculators."""
    folder = tmp_path_factory.mktemp("peers")
    # 3 layers, so the heads read 3: vLLM 0.32 sized speculators' fc for 3 aux layers when its
    # head read the 2 of a 2-layer target (fc [64, 128] into [64, 192])
    target = vllm_tiny_target(folder / "target", layers=3)
    spec = write_spec(folder, {"target": target, "head": folder / "head"}, "head", **{"speculative.method": "eagle3"})
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    opts = DistillOptions(prompts=prompts, max_steps=4, eval_every=2, max_tokens=16, draft_vocab=150, batch_size=4, gen_batch=4)
    distill(load_spec(spec), opts)
    out = folder / "out"
    return spec, folder / "head", out, distill_peers.export(spec, folder / "head", out)


def test_the_export_is_the_heads_own_data_in_speculators_format(exported):
    spec, head, out, info = exported
    opts = distill_peers.distill_options(head)
    data = prepare(load_spec(spec), opts, work_folder(head))
    seqs = data.train + data.held
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert info["train_sequences"] == len(data.train) and info["held_out_sequences"] == len(data.held) == 1
    assert len(rows) == len(seqs) and len(list((out / "hidden_states").iterdir())) == len(seqs)
    manifest = json.loads((head / "trtspec-head.json").read_text())
    assert info["aux_layer_ids"] == [i + 1 for i in manifest["layer_ids"]]  # input-of-layer ids
    assert info["teacher_label_mismatch"].startswith("0/")
    for i, (s, row) in enumerate(zip(seqs, rows)):
        assert row["input_ids"] == s.tokens.tolist()
        assert row["loss_mask"] == s.response_mask().long().tolist()
        hs = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(hs["token_ids"], s.tokens)
        t = len(s.tokens)
        assert (
            hs["hidden_states"].shape == (t, len(manifest["layer_ids"]) + 1, 64) and hs["hidden_states"].dtype == torch.bfloat16
        )
        # the head's layers as distill captured them (bfloat16 rounding)
        stored = collate([s], t, data.store).features[0].view(t, len(manifest["layer_ids"]), 64)
        assert torch.allclose(hs["hidden_states"][:, :-1].float(), stored.float(), atol=0.02, rtol=0.01)
    d2t = load_file(str(head / "model.safetensors"))["d2t"]
    assert np.array_equal(np.load(out / "d2t.npy"), d2t.numpy())
    t2d = np.load(out / "t2d.npy")
    assert t2d.dtype == bool and t2d.sum() == len(d2t) and t2d[(d2t + torch.arange(len(d2t))).numpy()].all()


def _speculators_missing() -> str | None:
    return None if SPECULATORS_PY.is_file() else f"no speculators environment at {SPECULATORS_PY} (make speculators)"


@pytest.fixture(scope="module")
def trained(exported):
    missing = _speculators_missing()
    if missing:
        pytest.skip(missing)
    spec, head, out, info = exported
    run = distill_peers.train_speculators(SPECULATORS_PY, out, info, epochs=1, ttt_steps=3, log=out / "train.log")
    return run, info


def test_speculators_trains_on_the_same_data_layers_and_draft_vocabulary(trained, exported):
    run, info = trained
    head = exported[1]
    cfg = json.loads((distill_peers.Path(run["head"]) / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["draft_vocab_size"] == info["draft_vocab_size"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == info["aux_layer_ids"]
    weights = load_file(str(distill_peers.Path(run["head"]) / "model.safetensors"))
    assert torch.equal(weights["d2t"].long(), load_file(str(head / "model.safetensors"))["d2t"].long())
    assert run["cpu_s"] > 0 and "epochs" in run["hyperparameters"]


@pytest.mark.vllm
def test_vllm_scores_the_peer_head_on_the_unseen_prompts(trained, exported, tmp_path):
    if not VLLM_PY.is_file():
        pytest.skip(f"no vLLM environment at {VLLM_PY} (make vllm)")
    run, info = trained
    got = distill_peers.score_vllm(VLLM_PY, info["verifier"], distill_peers.Path(run["head"]), info, 1, 16, tmp_path / "vllm.log")
    c = got["counters"]
    assert c["num_drafts"] > 0 and c["num_draft_tokens"] == c["num_drafts"]  # k=1: one draft a step
    assert got["acceptance"] == round(c["num_accepted_tokens"] / c["num_draft_tokens"], 3)


def _as_speculators(head, out):
    """trtspec's head written in speculators' checkpoint layout (its names, its nested layer
    config, the target's embeddings and t2d beside d2t), no norms: the same weights."""
    from safetensors.torch import save_file

    cfg = json.loads((head / "config.json").read_text())
    state = load_file(str(head / "model.safetensors"))
    layer = {k: cfg[k] for k in distill_peers.LAYER_KEYS if k in cfg}
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[torch.arange(len(state["d2t"])) + state["d2t"]] = True
    state = {("layers.0." + k[len("midlayer.") :] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    state |= {"t2d": t2d, "embed_tokens.weight": torch.zeros(cfg["vocab_size"], cfg["hidden_size"])}  # dropped again
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": cfg["draft_vocab_size"],
        "eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"],
        "transformer_layer_config": {**layer, "num_hidden_layers": 1, "sliding_window": 2048},
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_before_residual": False,
        "norm_output": False,
    }
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_trtspec_scores_a_converted_head_by_distills_own_report(exported, tmp_path):
    """The trtspec scoring path: the head distill wrote, scored again, gives its manifest's
    figures; the same weights in speculators' layout, converted back, give the same figures."""
    spec, head, _, _ = exported
    converted = distill_peers.speculators_to_trtspec(_as_speculators(head, tmp_path / "spec-layout"), tmp_path / "back")
    scored = distill_peers.score_trtspec(spec, head, {"speculators": converted})
    manifest = distill_peers.trtspec_figures(head)
    for key in ("k1_acceptance", "acceptance_length_k3", "per_position", "top1"):
        assert scored["trtspec"][key] == manifest[key] == scored["speculators"][key]
    assert any(manifest["top1"]) and scored["trtspec"]["chains"] > 0  # not all zeros: the comparison means something
    assert not any(scored["speculators"]["norms"].values())


def test_trtspec_scores_the_head_speculators_trained(trained, exported, tmp_path):
    """speculators' own checkpoint (its default norms) converts, passes the checkpoint check and
    is scored on the same unseen chains as trtspec's head."""
    run, _ = trained
    spec, head = exported[0], exported[1]
    src = distill_peers.Path(run["head"])
    converted = distill_peers.speculators_to_trtspec(src, tmp_path / "converted")
    scored = distill_peers.score_trtspec(spec, head, {"speculators": converted})
    flags = json.loads((src / "config.json").read_text())
    got = scored["speculators"]
    assert got["norms"] == {k: bool(flags.get(k, False)) for k in got["norms"]} and got["norms"]["norm_before_fc"]
    assert got["chains"] == scored["trtspec"]["chains"] > 0
    assert got["k1_acceptance"] == got["per_position"][0] and len(got["per_position"]) == len(scored["trtspec"]["per_position"])


def test_a_speculators_head_without_its_export_is_refused(exported, tmp_path):
    head = exported[1]
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "distill_peers.py"), "spec.yaml", "--head", str(head)]
        + ["--out", str(tmp_path / "out"), "--speculators-head", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.startswith("Error: ") and "--speculators-head needs --reuse-export" in r.stderr


def test_a_folder_without_a_head_manifest_is_refused(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "distill_peers.py"), "spec.yaml", "--head", str(tmp_path / "nothing")]
        + ["--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.startswith("Error: ") and "trtspec-head.json" in r.stderr
    assert not (tmp_path / "out").exists()
