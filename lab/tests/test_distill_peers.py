"""lab/distill_peers.py on a tiny target: a distilled head's own data exported in speculators'
offline format (the same sequences, layers and draft vocabulary, the teacher's layer checked),
speculators' trainer run on it on the CPU (where its environment exists), and its head scored
in vLLM (where that environment exists too)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, write_spec
from safetensors.torch import load_file
from test_distill import PROMPTS
from test_vllm_head import vllm_tiny_target

from lab import distill_peers
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


def test_the_export_generates_at_the_batch_the_heads_data_was_generated_at(exported, tmp_path):
    """A head whose run chose its batch by measuring (gen_batch unset) is exported at the rows its
    manifest records, not after a new timing probe."""
    head = exported[1]
    manifest = json.loads((head / "trtspec-head.json").read_text())
    manifest["run"]["gen_batch"] = None
    manifest["data"].setdefault("rates", {})["rows"] = 7
    (tmp_path / "trtspec-head.json").write_text(json.dumps(manifest))
    assert distill_peers.distill_options(tmp_path).gen_batch == 7
    assert distill_peers.distill_options(head).gen_batch == 4  # given: kept


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
        [sys.executable, "-m", "lab.distill_peers", "spec.yaml", "--head", str(head)]
        + ["--out", str(tmp_path / "out"), "--speculators-head", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.startswith("Error: ") and "--speculators-head needs --reuse-export" in r.stderr


def test_a_folder_without_a_head_manifest_is_refused(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "lab.distill_peers", "spec.yaml", "--head", str(tmp_path / "nothing")]
        + ["--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.startswith("Error: ") and "trtspec-head.json" in r.stderr
    assert not (tmp_path / "out").exists()


# --- SpecForge: its offline rows from the same capture, its export converted to trtspec's layout ---


def test_the_export_writes_specforge_rows_of_the_same_capture(exported):
    """One .ckpt row per training sequence (sorted as SpecForge lists them): the same tokens and
    response mask, the head's layers concatenated in order (the speculators export's layers,
    bit for bit) and the last layer's output through the target's final norm."""
    from transformers import AutoModelForCausalLM

    spec, head, out, info = exported
    data = prepare(load_spec(spec), distill_peers.distill_options(head), work_folder(head))
    rows = sorted((out / distill_peers.SPECFORGE_ROWS).glob("*.ckpt"))
    assert [r.name for r in rows] == [f"data_{i:06d}.ckpt" for i in range(info["train_sequences"])]
    target = AutoModelForCausalLM.from_pretrained(info["verifier"], dtype=torch.float32)
    n_layers = len(info["aux_layer_ids"])
    for i, (s, path) in enumerate(zip(data.train, rows)):
        row = torch.load(path)
        t = len(s.tokens)
        assert set(row) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert torch.equal(row["input_ids"], s.tokens) and torch.equal(row["loss_mask"], s.response_mask().long())
        assert row["aux_hidden_state"].shape == (1, t, n_layers * 64) and row["aux_hidden_state"].dtype == torch.bfloat16
        hs = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))["hidden_states"]  # [T, layers + 1, 64]
        assert torch.equal(row["aux_hidden_state"][0], hs[:, :n_layers].reshape(t, -1))
        with torch.no_grad():
            normed = target.model.norm(hs[:, -1].float())
        assert row["hidden_state"].shape == (1, t, 64)
        assert torch.allclose(row["hidden_state"][0].float(), normed, atol=0.05, rtol=0.02)  # bfloat16 rounding
        assert not torch.allclose(row["hidden_state"][0].float(), hs[:, -1].float(), atol=0.05, rtol=0.02)  # not pre-norm
    mapping = torch.load(out / distill_peers.SPECFORGE_VOCAB)
    d2t = load_file(str(head / "model.safetensors"))["d2t"].long()
    assert torch.equal(mapping["d2t"], d2t) and mapping["t2d"].dtype == torch.bool
    assert int(mapping["t2d"].sum()) == len(d2t) and mapping["t2d"][torch.arange(len(d2t)) + d2t].all()
    draft = json.loads((out / distill_peers.SPECFORGE_DRAFT_CONFIG).read_text())
    assert (
        draft["eagle_aux_hidden_state_layer_ids"]
        == info["aux_layer_ids"]
        == draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    assert draft["draft_vocab_size"] == len(d2t) and draft["architectures"] == ["LlamaForCausalLMEagle3"]
    assert not any(k in draft for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output"))


def test_specforge_target_folder_has_the_index_its_loaders_need(exported):
    _, _, out, info = exported
    target = out / distill_peers.SPECFORGE_TARGET
    index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    with distill_peers_safe_open(distill_peers.Path(info["verifier"]) / "model.safetensors") as st:
        assert index == dict.fromkeys(st.keys(), "model.safetensors")
    assert (target / "config.json").resolve() == (distill_peers.Path(info["verifier"]) / "config.json").resolve()
    # the tiny target ties its LM head to the embeddings: SpecForge reads the embedding table
    tied = "lm_head.weight" not in index
    assert distill_peers.specforge_lm_head_key(target) == ("model.embed_tokens.weight" if tied else "lm_head.weight")


def distill_peers_safe_open(path):
    from safetensors import safe_open

    return safe_open(str(path), framework="pt")


def test_specforge_row_refuses_a_mask_or_state_of_another_length():
    tokens = torch.arange(5)
    with pytest.raises(ValueError, match="specforge_row"):
        distill_peers.specforge_row(tokens, torch.ones(4, dtype=torch.bool), torch.zeros(5, 3, 8), torch.zeros(5, 8))
    with pytest.raises(ValueError, match="specforge_row"):
        distill_peers.specforge_row(tokens, torch.ones(5, dtype=torch.bool), torch.zeros(5, 3, 8), torch.zeros(5, 4))


def test_the_cpu_loss_is_specforges_forward_kl():
    """specforge_cpu's loss: the mean over every batch x time position of -sum p log q, zero where
    the mask is 0 (what SpecForge's Triton kernel computes); with one-hot targets, the masked
    cross-entropy."""
    from lab import specforge_cpu

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]]).unsqueeze(-1)  # [B, T, 1]
    one_hot = torch.nn.functional.one_hot(labels, 11).float()
    got = specforge_cpu.LogSoftmaxLoss.apply(logits, one_hot, mask)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="none")
    want = (ce * mask.reshape(-1)).sum() / 10
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    got.backward()
    assert logits.grad[0, 2].abs().sum() == 0 and logits.grad[0, 0].abs().sum() > 0  # masked positions get no gradient


def _as_specforge(head, out, draft_config):
    """trtspec's head written as `specforge export --to sglang` writes one: the draft config's
    keys, the same tensor names, t2d beside d2t, bfloat16."""
    from safetensors.torch import save_file

    state = load_file(str(head / "model.safetensors"))
    cfg = json.loads(draft_config.read_text())
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[torch.arange(len(state["d2t"])) + state["d2t"]] = True
    out.mkdir()
    save_file(
        {**{k: v if k == "d2t" else v.to(torch.bfloat16) for k, v in state.items()}, "t2d": t2d}, str(out / "model.safetensors")
    )
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16", "transformers_version": "5.8.1"}))
    return out


def test_trtspec_scores_a_specforge_export_by_distills_own_report(exported, tmp_path):
    """The same weights in SpecForge's export layout, converted, give the head's own figures."""
    spec, head, out, _ = exported
    src = _as_specforge(head, tmp_path / "specforge", out / distill_peers.SPECFORGE_DRAFT_CONFIG)
    converted = distill_peers.specforge_to_trtspec(src, tmp_path / "back")
    assert "t2d" not in load_file(str(converted / "model.safetensors"))
    scored = distill_peers.score_trtspec(spec, head, {"specforge": converted})
    manifest = distill_peers.trtspec_figures(head)
    for key in ("k1_acceptance", "acceptance_length_k3", "per_position", "top1"):
        assert scored["specforge"][key] == manifest[key]
    assert not any(scored["specforge"]["norms"].values())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"eagle_aux_hidden_state_layer_ids": None, "eagle_config": None}, "names no eagle_aux_hidden_state_layer_ids"),
        ({"norm_output": False}, "norm_output false"),
        ({"architectures": ["Eagle3DraftModel"]}, "not a SpecForge EAGLE-3 export"),
        ({"num_hidden_layers": 2}, "2 draft layers"),
    ],
)
def test_a_specforge_export_trtspec_cannot_run_is_refused(exported, tmp_path, change, message):
    _, head, out, _ = exported
    src = _as_specforge(head, tmp_path / "specforge", out / distill_peers.SPECFORGE_DRAFT_CONFIG)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(SystemExit, match=message):
        distill_peers.specforge_to_trtspec(src, tmp_path / "back")


@pytest.fixture(scope="module")
def specforge_trained(exported):
    if not distill_peers.SPECFORGE_PY.is_file():
        pytest.skip(f"no SpecForge environment at {distill_peers.SPECFORGE_PY} (make specforge)")
    spec, head, out, info = exported
    args = distill_peers.parse_args([str(spec), "--head", str(head), "--out", str(out), "--specforge-epochs", "1"])
    return distill_peers.train_peers(args, out, info, out, ["specforge"])["specforge"]


def test_specforge_trains_on_the_export_and_trtspec_scores_its_head(specforge_trained, exported, tmp_path):
    """SpecForge's trainer on the CPU (lab/specforge_cpu.py), its own export, converted and
    scored on the same unseen chains as trtspec's head."""
    spec, head, _, info = exported
    src = distill_peers.Path(specforge_trained["head"])
    cfg = json.loads((src / "config.json").read_text())
    assert (
        cfg["draft_vocab_size"] == info["draft_vocab_size"] and cfg["eagle_aux_hidden_state_layer_ids"] == info["aux_layer_ids"]
    )
    weights = load_file(str(src / "model.safetensors"))
    assert torch.equal(weights["d2t"].long(), load_file(str(head / "model.safetensors"))["d2t"].long())
    assert specforge_trained["cpu_s"] > 0 and "num_epochs" in specforge_trained["hyperparameters"]
    converted = distill_peers.specforge_to_trtspec(src, tmp_path / "converted")
    scored = distill_peers.score_trtspec(spec, head, {"specforge": converted})
    assert scored["specforge"]["chains"] == scored["trtspec"]["chains"] > 0


@pytest.mark.vllm
def test_vllm_loads_specforges_export_and_drafts_with_it(specforge_trained, exported, tmp_path):
    """The folder `specforge export --to sglang` wrote, as vLLM's eagle3 method loads it (its
    config names the aux layers): it drafts on the unseen prompts and its counters add up."""
    if not VLLM_PY.is_file():
        pytest.skip(f"no vLLM environment at {VLLM_PY} (make vllm)")
    info = exported[3]
    head = distill_peers.Path(specforge_trained["head"])
    got = distill_peers.score_vllm(VLLM_PY, info["verifier"], head, info, 1, 16, tmp_path / "vllm.log")
    c = got["counters"]
    assert c["num_drafts"] > 0 and c["num_draft_tokens"] == c["num_drafts"]  # k=1: one draft a step
    assert got["acceptance"] == round(c["num_accepted_tokens"] / c["num_draft_tokens"], 3)


def test_speculators_trains_in_float32_where_asked_and_specforge_is_refused(exported, tmp_path, capsys):
    """`--peer-dtype float32` (a CPU without bf16 instructions): speculators through its own
    setting (--hidden-states-dtype float32: its autocast then computes nothing in bf16, as torch
    says in its log); SpecForge, whose offline rows are bf16, is refused by name."""
    spec, head, out, info = exported
    with pytest.raises(SystemExit) as refused:
        distill_peers.check_args(distill_peers.parse_args([str(spec), "--head", str(head), "--peer-dtype", "float32"]))
    assert refused.value.code == 2 and "SpecForge trains in bfloat16 only" in capsys.readouterr().err
    missing = _speculators_missing()
    if missing:
        pytest.skip(missing)
    data = tmp_path / "export"  # a copy: the head is written beside the data, away from the other tests' heads
    shutil.copytree(out, data, ignore=shutil.ignore_patterns("speculators-head", "specforge-head"))
    args = distill_peers.parse_args(
        [str(spec), "--head", str(head), "--out", str(data), "--epochs", "1", "--peer-dtype", "float32"]
    )
    trained = distill_peers.train_peers(args, data, info, tmp_path, ["speculators"])["speculators"]
    assert (distill_peers.Path(trained["head"]) / "model.safetensors").is_file()  # saved in bf16, its checkpoint format
    assert "float32" in trained["hyperparameters"]["hidden_states_dtype"]
    log = (tmp_path / "speculators-train.log").read_text()
    assert "hidden_states_dtype='float32'" in log and "Disabling autocast" in log  # torch: float32 compute, no bf16


def test_the_float32_muon_orthogonalizes_as_torchs_bf16_one_does():
    """speculators_cpu.py's float32 Newton-Schulz (a CPU without bf16) gives torch's Muon update,
    which it computes in bfloat16, to bfloat16's precision, tall and wide."""
    from torch.optim import _muon

    from lab import speculators_cpu

    coefficients = (3.4445, -4.7750, 2.0315)
    for shape in ((96, 64), (64, 96)):
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        ours = speculators_cpu._orthogonalize_float32(grad, coefficients, 5, 1e-7)
        theirs = _muon._zeropower_via_newtonschulz(grad, coefficients, 5, 1e-7)
        assert ours.dtype == torch.float32 and theirs.dtype == torch.bfloat16 and ours.shape == grad.shape
        torch.testing.assert_close(ours, theirs.float(), rtol=0.05, atol=0.02)
