"""Where the torch backend runs (trtspec/device.py), on a CPU-only machine: names, refusals,
dtype rules, and engines that keep everything on their device.

No GPU is needed: the refusals are tested with the GPU count patched, and placement with the
"meta" device standing in for a GPU (a meta tensor meeting a CPU tensor in one op raises, as a
CUDA tensor would), so a forward that leaves any tensor on the CPU fails here. What only a GPU
can show (its kernels, its speed) is in tests/test_cuda.py (pytest -m cuda).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import write_spec
from typer.testing import CliRunner

from trtspec import device as dev
from trtspec.cli.app import app
from trtspec.cli.common import with_device
from trtspec.errors import RequestError, SpecError, TrtspecError
from trtspec.spec import load_spec

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_gpu(monkeypatch):
    """This process sees no GPU, whatever the machine has."""
    monkeypatch.setattr(dev, "_cuda_count", lambda: 0)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(dev, "_cuda_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


# ------------------------------------------------------------------ names and resolution


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:12", "auto", "CUDA:1"])
def test_device_names(name):
    assert dev.check_name(name) == name.lower()


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "mps", "", "cpu:0"])
def test_other_names_are_refused_naming_the_choices(name):
    with pytest.raises(ValueError, match="is not one of cpu, cuda, cuda:N or auto"):
        dev.check_name(name)


def test_default_and_cpu_resolve_to_the_cpu(no_gpu):
    assert dev.resolve(None) == dev.resolve("cpu") == torch.device("cpu")


def test_auto_is_the_cpu_without_a_gpu_and_the_gpu_with_one(no_gpu, monkeypatch):
    assert dev.resolve("auto") == torch.device("cpu")
    monkeypatch.setattr(dev, "_cuda_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert dev.resolve("auto") == torch.device("cuda", 0)


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_a_gpu_is_exit_2_naming_the_fix(no_gpu, name):
    with pytest.raises(TrtspecError) as e:
        dev.resolve(name)
    assert e.value.exit_code == 2
    msg = str(e.value)
    assert msg.startswith(f"device {name}: torch {torch.__version__}")
    assert "install a CUDA build of torch" in msg and "use device: cpu (--device cpu)" in msg


def test_cuda_index_beyond_the_gpus_names_the_range(two_gpus):
    assert dev.resolve("cuda:1") == torch.device("cuda", 1)
    assert dev.resolve("cuda") == torch.device("cuda", 0)
    with pytest.raises(TrtspecError, match=r"device cuda:2: this machine has 2 GPU\(s\), cuda:0 to cuda:1") as e:
        dev.resolve("cuda:2")
    assert e.value.exit_code == 2


# ------------------------------------------------------------------ dtype rules


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_dtype_runs_on_the_cpu_as_before(dtype):
    dev.check_dtype(torch.device("cpu"), dtype)  # float16 included: it ran on CPU before devices existed


@pytest.mark.parametrize("cap,dtype,ok", [((8, 0), "bfloat16", True), ((9, 0), "bfloat16", True), ((7, 5), "bfloat16", False),
                                          ((7, 5), "float16", True), ((7, 0), "float32", True)])  # fmt: skip
def test_bfloat16_needs_an_ampere_or_newer_gpu(monkeypatch, cap, dtype, ok):
    monkeypatch.setattr(dev, "_capability", lambda d: cap)
    if ok:
        dev.check_dtype(torch.device("cuda", 0), dtype, "target")
        return
    with pytest.raises(TrtspecError, match=r"target: bfloat16 needs a GPU of compute capability 8\.0 or newer; cuda:0 is 7\.5: set dtype: float16") as e:  # fmt: skip
        dev.check_dtype(torch.device("cuda", 0), dtype, "target")
    assert e.value.exit_code == 2


def test_the_cpu_kernel_choice_applies_on_the_cpu_only():
    assert dev.uses_cpu_kernels(torch.device("cpu"))
    assert not dev.uses_cpu_kernels(torch.device("cuda", 0))


# ------------------------------------------------------------------ the spec and --device


def test_spec_device_defaults_to_cpu_and_is_validated(tmp_path, tiny_ckpts):
    assert load_spec(write_spec(tmp_path / "a", tiny_ckpts)).spec.device == "cpu"
    assert load_spec(write_spec(tmp_path / "b", tiny_ckpts, device="cuda:1")).spec.device == "cuda:1"
    with pytest.raises(SpecError, match=r"spec.yaml: device: device 'gpu' is not one of cpu, cuda, cuda:N or auto"):
        load_spec(write_spec(tmp_path / "c", tiny_ckpts, device="gpu"))


def test_the_device_is_not_part_of_the_build(tmp_path, tiny_ckpts):
    """One engine folder loads on any device: changing the device rebuilds nothing."""
    cpu = load_spec(write_spec(tmp_path / "a", tiny_ckpts)).spec
    gpu = load_spec(write_spec(tmp_path / "b", tiny_ckpts, device="cuda")).spec
    assert cpu.build_hash("target") == gpu.build_hash("target") and cpu.build_hash("draft") == gpu.build_hash("draft")


def test_with_device_overrides_the_spec_and_refuses_bad_names(tmp_path, tiny_ckpts):
    loaded = load_spec(write_spec(tmp_path, tiny_ckpts, device="cuda"))
    assert with_device(loaded, None) is loaded
    assert with_device(loaded, "CPU").spec.device == "cpu" and loaded.spec.device == "cuda"
    with pytest.raises(RequestError, match="--device: device 'gpu' is not one of"):
        with_device(loaded, "gpu")


@pytest.mark.parametrize("command", ["build", "verify", "bench", "distill"])
def test_cuda_without_a_gpu_exits_2_on_every_command(tmp_path, tiny_ckpts, no_gpu, command):
    spec = write_spec(
        tmp_path, {"target": tiny_ckpts["target"], "head": tmp_path / "head"}, "head", **{"speculative.method": "eagle3"}
    )
    r = runner.invoke(app, [command, str(spec), "--device", "cuda"])
    assert r.exit_code == 2, r.output
    assert re.search(
        r"Error: device cuda: torch \S+ .*install a CUDA build of torch.*use device: cpu", " ".join(r.stderr.split())
    )
    assert not (tmp_path / "engines").exists()  # refused before building anything


def test_a_spec_asking_for_cuda_is_refused_the_same_way(tmp_path, tiny_ckpts, no_gpu):
    r = runner.invoke(app, ["build", str(write_spec(tmp_path, tiny_ckpts, device="cuda"))])
    assert r.exit_code == 2 and "install a CUDA build of torch" in r.stderr


def test_bad_device_name_on_the_command_line_is_exit_2(tmp_path, tiny_ckpts):
    r = runner.invoke(app, ["build", str(write_spec(tmp_path, tiny_ckpts)), "--device", "gpu", "--dry-run"])
    assert r.exit_code == 2 and "--device: device 'gpu' is not one of cpu, cuda, cuda:N or auto" in r.stderr


# ------------------------------------------------------------------ placement


def test_placement_is_decided_in_one_place():
    """Only trtspec/device.py asks torch about GPUs or names one: every other module takes the
    torch.device it decided (a second place would be a second set of rules)."""
    asks = re.compile(r"torch\.cuda\.(is_available|device_count|current_device|mem_get_info|get_device)|\.cuda\(|[\"']cuda[:\"']")
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in sorted((ROOT / "trtspec").rglob("*.py"))
        if p.name != "device.py" or p.parent.name != "trtspec"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if asks.search(line)
    ]
    assert offenders == []


def test_cpu_deployment_puts_every_engine_on_the_cpu(built):
    dep = built()
    assert dep.device == torch.device("cpu")
    for engine in dep.engines.values():
        assert engine.device == dep.device and engine.cache.k[0].device == dep.device and engine.cos.device == dep.device
        assert engine.kernels is not None and "does not apply" not in engine.kernels.reason  # the CPU kernel choice ran


def test_device_cpu_gives_todays_tokens_exactly(built, tmp_path):
    """--device cpu changes nothing: the same greedy tokens as the spec's default, both paths,
    and as transformers' own greedy generate on the checkpoint."""
    from transformers import AutoModelForCausalLM

    from trtspec.runtime import Deployment

    default = built()
    explicit = Deployment(with_device(default.loaded, "cpu"), default.loaded.output_dir())
    hf = AutoModelForCausalLM.from_pretrained(default.loaded.resolve(default.spec.target.path), dtype=torch.float32).eval()
    for prompt in default.loaded.verify_prompts()[:3]:
        ids = default.encode(prompt)
        outs = []
        for d in (default, explicit):
            for speculative in (False, True):
                d.forget_prefixes()
                (res,) = d.generate([d.request(ids, 24)], speculative=speculative)
                outs.append(res.output_ids)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert outs == [ref[0, len(ids) :].tolist()] * 4


def _on_meta(monkeypatch, folder: Path, slots: int = 2):
    """The engine in ``folder`` loaded onto the meta device (safetensors cannot load there, so
    its tensors are read on the CPU and moved, as load_file(device=...) does on a GPU)."""
    from safetensors.torch import load_file

    import trtspec.engines.torch.engine as engine_module

    monkeypatch.setattr(
        engine_module, "load_file", lambda path, device="cpu": {k: v.to(device) for k, v in load_file(path).items()}
    )
    return engine_module.TorchEngine.load(folder, slots=slots, device=torch.device("meta"))


def test_an_engine_on_another_device_runs_its_whole_forward_there(built, monkeypatch):
    """Weights, KV cache, features, RoPE tables and step inputs on the engine's device: a
    batched ragged forward (mask, slot gather, feature capture) runs to the very end, where
    the logits are copied to the CPU for the loop — the only copy (meta has no data to copy)."""
    from trtspec.engines.torch.engine import ForwardItem

    engine = _on_meta(monkeypatch, built().target.folder)
    assert engine.kernels.layout == "dense" and "does not apply" in engine.kernels.reason
    engine.capture_features((0, 1))
    tensors = [*engine.model.parameters(), *engine.cache.k, *engine.cache.v, engine.cos, engine.sin, engine.features]
    assert {t.device.type for t in tensors} == {"meta"}
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        engine.run([ForwardItem([1, 2, 3, 4, 5], 2), ForwardItem([6, 7], 1)])  # [b=2, q=5]: mask and gather
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        engine.run([ForwardItem([1, 2, 3, 4, 5, 8], 1)])  # one row decoding: no mask, a cache view


@pytest.fixture(scope="module")
def eagle_engines(tmp_path_factory, tiny_ckpts) -> Path:
    """A built eagle3 pair (the tiny target, a random head): its engines folder."""
    from transformers import AutoConfig

    from trtspec.distill.heads import new_head, save_head
    from trtspec.engines.build import build
    from trtspec.engines.eagle3_checkpoint import default_layer_ids

    root = tmp_path_factory.mktemp("device-eagle")
    hf = AutoConfig.from_pretrained(tiny_ckpts["target"])
    head, config = new_head(
        hf, tiny_ckpts["target"], default_layer_ids(hf.num_hidden_layers), list(range(7, 300, 2)), 0, anchor=False
    )
    save_head(root / "head", head, config)
    loaded = load_spec(
        write_spec(root, {"target": tiny_ckpts["target"], "head": root / "head"}, "head", **{"speculative.method": "eagle3"})
    )
    build(loaded, loaded.output_dir())
    return loaded.output_dir()


def test_a_head_on_another_device_drafts_there(eagle_engines, monkeypatch):
    """HeadEngine.load puts the head on its target's device; fuse and extend (states, tokens,
    positions, mask, slots) stay there."""
    from trtspec.engines.torch.eagle3_head import HeadEngine, HeadRow

    target = _on_meta(monkeypatch, eagle_engines / "target")
    head = HeadEngine.load(eagle_engines / "draft", target)
    assert head.device.type == "meta" and head.cache.k[0].device.type == "meta"
    assert {p.device.type for p in head.head.parameters()} == {"meta"}
    width = len(head.cfg.layer_ids) * target.config.hidden_size
    state = head.fuse(torch.zeros(3, width))  # features arriving from the CPU (Triton) are moved over
    outs = head.extend([HeadRow(0, 0, state, [4, 5, 6]), HeadRow(1, 2, torch.zeros(1, head.cfg.hidden_size), [7])])
    assert [o.shape for o in outs] == [(3, head.cfg.hidden_size), (1, head.cfg.hidden_size)]
    assert {o.device.type for o in outs} == {"meta"}


def test_training_runs_on_the_batch_device(built, monkeypatch):
    """The training-time-test loss and its backward keep every tensor on the batch's device
    (meta here): positions, masks, step weights."""
    from transformers import AutoConfig

    from trtspec.distill.heads import new_head
    from trtspec.distill.ttt import Batch, to_device, ttt_loss
    from trtspec.engines.eagle3_checkpoint import default_layer_ids

    dep = built()
    hf = AutoConfig.from_pretrained(dep.target.folder)
    head, _ = new_head(hf, dep.target.folder, default_layer_ids(hf.num_hidden_layers), list(range(7, 300, 2)), 0)
    head.to("meta")
    cfg = head.cfg
    b, t, width = 2, 6, len(cfg.layer_ids) * hf.hidden_size
    cpu = Batch(
        torch.randint(1, 50, (b, t)),
        torch.zeros(b, t, width),
        torch.randint(0, 50, (b, t)),
        torch.ones(b, t, dtype=torch.bool),
        torch.randint(0, 50, (b, t, 4)),
        torch.zeros(b, t, 4),
    )
    assert to_device(cpu, torch.device("cpu")) is cpu
    batch = to_device(cpu, torch.device("meta"))
    embed = torch.nn.Embedding(hf.vocab_size, hf.hidden_size, device="meta")
    cos, sin = dep.target.cos.to("meta"), dep.target.sin.to("meta")
    t2d = torch.arange(hf.vocab_size, device="meta") % cfg.draft_vocab_size
    # Soft labels select scored positions by a mask: meta has no values, so it assumes all are.
    monkeypatch.setattr(torch.fx.experimental._config, "meta_nonzero_assume_all_nonzero", True)
    for soft in (False, True):
        loss, _ = ttt_loss(head, embed, batch, 3, t2d, cos, sin, soft=soft, weights=[0.5, 0.3, 0.2])
        assert loss.device.type == "meta"
        loss.backward()


def test_generation_rows_from_free_gpu_memory(tmp_path, built):
    """On a GPU distill generates as many rows as fit (docs/codesign.md); a CPU measures its
    batch instead (tests/test_distill_recipe.py)."""
    from transformers import AutoConfig

    from trtspec.distill.run import GEN_BATCH_MAX, GPU_MEMORY_USE, generation_rows

    folder = built().target.folder
    hf = AutoConfig.from_pretrained(folder)
    c = hf
    head_dim = c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    per_row = (
        2 * c.num_hidden_layers * kv_heads * head_dim * 512 * 4
        + 3 * c.hidden_size * 512 * 4
        + c.num_attention_heads * 512 * 512 * 4
        + 512 * (2 * c.intermediate_size + 4 * c.hidden_size) * 4
    )
    weights = (folder / "model.safetensors").stat().st_size
    gpu = torch.device("cuda", 0)
    free = weights + int(10.5 * per_row / GPU_MEMORY_USE)
    assert generation_rows(gpu, folder, hf, 3, 512, free=free) == 10
    assert generation_rows(gpu, folder, hf, 3, 512, free=weights) == 1  # never fewer than one
    assert generation_rows(gpu, folder, hf, 3, 512, free=10**15) == GEN_BATCH_MAX


# ------------------------------------------------------------------ lab/gpu_check.py, its CPU-safe parts


@pytest.fixture(scope="module")
def gpu_check():
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "lab" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_gpu_check_without_a_gpu_is_exit_2(gpu_check, no_gpu, capsys):
    assert gpu_check.main(["--no-tests"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: gpu-check needs a CUDA GPU: device cuda: torch ")
    assert "install a CUDA build of torch" in err


def test_gpu_check_refuses_bad_acceptance(gpu_check):
    assert gpu_check.parse_acceptance("0.7") == [0.7] * 7
    assert gpu_check.parse_acceptance("0.8,0.6") == [0.8, 0.6]
    for bad in ("1.5", "x", ""):
        with pytest.raises(ValueError, match="--acceptance takes rates in"):
            gpu_check.parse_acceptance(bad)


def test_gpu_check_measures_a_tiny_shape_on_the_cpu(gpu_check):
    """The whole measurement path on a tiny random Llama (random_pair: weights made in the
    engine dtype on the device, no files), its table, JSON and projection."""
    report = gpu_check.run_shapes(["tiny"], torch.device("cpu"), torch.bfloat16, acceptance=[0.8, 0.6, 0.5], repeats=1)
    s = report["shapes"]["tiny"]
    assert report["machine"]["torch"] == torch.__version__ and report["machine"]["gpu"] == "none (CPU)"
    assert report["dtype"] == "bfloat16" and s["parameters"] > 0
    assert sorted(s["verify"]) == [str(k) for k in range(1, 8)] and sorted(s["tokens_per_s"], key=int) == ["1", "8", "32"]
    for k, ratio in s["verify"].items():  # the ratios are the measured milliseconds divided
        assert ratio == pytest.approx(s["verify_ms"][k] / s["decode_ms"], rel=0.01, abs=0.002)
    assert s["head"] == pytest.approx(s["head_ms"] / s["decode_ms"], rel=0.01, abs=0.0002)
    json.loads(json.dumps(report))  # what --json writes
    lines = gpu_check.table(report)
    assert lines[0] == f"trtspec gpu-check: cpu, torch {torch.__version__}, CUDA none"
    assert lines[1].split()[:4] == ["shape", "params", "decode", "ms"] and lines[2].split()[0] == "tiny"
    assert any(line.startswith("tiny PROJECTION (not measured): acceptance 0.80/0.60/0.50") for line in lines)
    assert "projection" in s["projection"]["label"] and len(s["projection"]["bound"]) == 3


def test_gpu_check_projection_arithmetic(gpu_check):
    costs = {"verify": {str(k): 1.0 + 0.05 * k for k in range(1, 8)}, "head": 0.04}
    p = gpu_check.projection(costs, [0.8, 0.5, 0.5])
    # tokens per forward over (verify(k) + k c), k = 1..3
    expected = [1.8 / (1.05 + 0.04), (1.8 + 0.4) / (1.10 + 0.08), (2.2 + 0.2) / (1.15 + 0.12)]
    assert list(p["bound"].values()) == [round(x, 3) for x in expected]
    # k=3's bound beats k=2's by 1.4%: the recommendation keeps the shorter k (recommend_k's 2% rule)
    assert p["best_k"] == 2 and p["speedup"] == round(expected[1], 3)
    assert gpu_check.projection(costs, [0.8, 0.5, 0.7])["best_k"] == 3  # a third draft that pays clearly
    assert gpu_check.goals({"verify": {"1": 1.02, "7": 1.12}, "head": 0.04}) == {
        "verify_le_1.1_decode_steps": {"value": 1.12, "met": False},
        "head_le_0.05_target_step": {"value": 0.04, "met": True},
    }
