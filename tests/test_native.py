"""trtspec's own panel kernel (engines/torch/native.py): the same products as PyTorch's Linear,
and each row's result bit-identical however many rows run beside it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from trtspec.cache import cache_root
from trtspec.engines.torch import native


@pytest.fixture(autouse=True)
def _kernel():
    """The kernel, built (once a session) in the session's cache; skipped where it cannot be."""
    if native.panel_kernel() is None:
        pytest.skip("no C++ compiler: the panel kernel cannot be built")


@pytest.mark.parametrize(("out", "inp", "bias"), [(96, 64, False), (100, 37, True), (3, 5, True), (960, 576, False)])
def test_the_panel_kernel_computes_the_linear_and_each_row_alone_equals_it_in_any_batch(out, inp, bias):
    torch.manual_seed(out + inp)
    linear = nn.Linear(inp, out, bias=bias)
    panel = native.PanelLinear(linear)
    for rows in (1, 2, 3, 7, 12, 13, 25):  # one chunk, several, uneven ones, a ragged last panel
        x = torch.randn(rows, inp)
        got = panel(x)
        torch.testing.assert_close(got, linear(x).detach(), rtol=1e-5, atol=1e-5)
        for r in range(rows):
            assert torch.equal(panel(x[r : r + 1])[0], got[r])  # bit for bit, alone or beside others


def test_the_panel_linear_keeps_leading_dimensions_and_takes_no_rows():
    linear = nn.Linear(40, 70)
    panel = native.PanelLinear(linear)
    x = torch.randn(2, 3, 40)
    torch.testing.assert_close(panel(x), linear(x).detach(), rtol=1e-5, atol=1e-5)
    assert panel(torch.randn(0, 40)).shape == (0, 70)


def test_the_kernel_refuses_inputs_that_do_not_match_its_panels():
    panel = native.PanelLinear(nn.Linear(40, 70))
    with pytest.raises(RuntimeError, match="does not match the panels"):
        panel(torch.randn(2, 41))
    with pytest.raises(RuntimeError, match="float32"):
        panel(torch.randn(2, 40, dtype=torch.float64))


def test_without_a_compiler_the_kernel_is_unavailable_and_says_so_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(native, "SOURCE", tmp_path / "panels.cpp")  # a new build key: nothing cached
    (tmp_path / "panels.cpp").write_text(
        native.Path(native.__file__).with_name("csrc").joinpath("panels.cpp").read_text() + "\n// another build\n"
    )
    native.panel_kernel.cache_clear()
    try:
        assert native.panel_kernel() is None
        assert native.panel_kernel() is None
        err = capsys.readouterr().err
        assert err.count("the panel kernel is unavailable") == 1
    finally:
        native.panel_kernel.cache_clear()


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    native.panel_kernel.cache_clear()
    try:
        assert native.panel_kernel() is None
    finally:
        monkeypatch.delenv(native.DISABLE_ENV)
        native.panel_kernel.cache_clear()


@pytest.mark.parametrize("scheme", ["int8_wo", "int4_wo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_panels_compute_the_dequantized_linear_and_each_row_alone_equals_it(scheme, dtype):
    from trtspec.engines.torch.quant import WeightOnlyLinear, quantize

    torch.manual_seed(7)
    for out, inp in ((96, 64), (100, 96), (960, 576)):
        stored = quantize(torch.randn(out, inp) * 0.05, scheme).cast(dtype)
        bias = torch.randn(out).to(dtype)
        module = WeightOnlyLinear(stored, bias, dtype)
        panel = native.QuantPanelLinear(module)
        reference = stored.dequantize()  # [out, in] float32: the weights the codes stand for
        for rows in (1, 2, 4, 5, 9):  # one chunk of rows, several, uneven ones
            x = torch.randn(rows, inp).to(dtype)
            got = panel(x)
            assert got.dtype == dtype and got.shape == (rows, out)
            expected = x.float() @ reference.T + bias.float()
            torch.testing.assert_close(got.float(), expected, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)
            for r in range(rows):
                assert torch.equal(panel(x[r : r + 1])[0], got[r])


def _loads_in_a_new_process() -> subprocess.CompletedProcess:
    code = "from trtspec.engines.torch.native import panel_kernel; assert panel_kernel() is not None"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_a_build_killed_midway_stalls_no_later_load():
    """torch's build lock left behind by a killed build made every later load wait for ever
    (a served engine model never became ready); a library that does not import is built again."""
    folder = cache_root() / "native" / native.build_key()
    assert Path(native.panel_kernel().__file__).parent == folder  # built in the session's cache
    (folder / "lock").write_text("")  # as a build killed while holding it leaves it
    assert _loads_in_a_new_process().returncode == 0  # no wait on it (the built library is imported)
    library = folder / f"trtspec_panels_{native.build_key()}.so"
    torn = library.with_suffix(".torn")  # a new file: this process still maps the whole one
    torn.write_bytes(library.read_bytes()[:4096])  # as a build killed while linking leaves it
    torn.replace(library)
    done = _loads_in_a_new_process()
    assert done.returncode == 0, done.stderr
    assert library.stat().st_size > 4096 and not (folder / "lock").exists()  # built again, whole


def test_a_bfloat16_engines_int4_codes_run_in_k_pairs_where_the_cpu_has_avx512_bf16():
    from trtspec.engines.torch.quant import WeightOnlyLinear, quantize

    kernel = native.panel_kernel()
    if not kernel.has_q4_bf16():
        pytest.skip("this CPU has no AVX512-BF16: int4 runs on float32 activations")
    torch.manual_seed(3)
    stored = quantize(torch.randn(100, 96) * 0.05, "int4_wo").cast(torch.bfloat16)
    paired = native.QuantPanelLinear(WeightOnlyLinear(stored, None, torch.bfloat16))
    unpaired = native.QuantPanelLinear(WeightOnlyLinear(stored, None, torch.float32))
    assert paired.codes.shape[-1] == native.PAIRED and unpaired.codes.shape[-1] != native.PAIRED
    x = torch.randn(5, 96).to(torch.bfloat16)
    got = torch.ops.trtspec_native.linear_q4_bf16(x, paired.codes, paired.scales, paired.mins, None, 100)
    # the same exact products as the float32 path, summed in another order
    float_path = torch.ops.trtspec_native.linear_q4(x.float(), unpaired.codes, paired.scales, paired.mins, None, 100)
    torch.testing.assert_close(got, float_path, rtol=1e-5, atol=1e-6)
