"""The CPU packed-weight kernel (`kernels.cpu.packed_linear`): every layout against a float64 reference, a row's
bits independent of the batch, the many-rows path equal to the float GEMM of the dequantized weight, and the
errors a bad operand gets. Built once per machine (the C++ source's hash names the build)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from onecopy.kernels import cpu
from onecopy.models.linear import matmul
from onecopy.models.packed import Packed, dequantize

K = 256


def _weight(layout: str, group: int, n: int = 40, k: int = K, seed: int = 0) -> Packed:
    g = torch.Generator().manual_seed(seed)
    if layout == "q8s":
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    else:
        q = torch.randint(0, 256, (n, k // (2 if layout.startswith("q4") else 1)), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    mins = -torch.rand(n, k // group, generator=g) * 0.1 if layout in ("q4a", "q8a") else None
    return Packed(layout, group, q, scales, mins)


def _run(x: torch.Tensor, w: Packed) -> torch.Tensor:
    return cpu.packed_linear(x, w.layout, w.group, w.qweight, w.scales, w.mins)


@pytest.mark.parametrize("layout", ["q8s", "q8a", "q4z", "q4a"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_every_layout_matches_float64_of_the_dequantized_weight(layout, group):
    w = _weight(layout, group)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    want = F.linear(x.double(), dequantize(w, torch.float64))
    got = _run(x, w)
    assert got.dtype == torch.float32 and got.shape == (5, 40)
    # float32 sums of 256 products: a few ulps of the largest partial sums
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (got.double() - want).abs().max()


@pytest.mark.parametrize("layout", ["q8s", "q4a"])
def test_a_rows_bits_do_not_depend_on_the_batch_or_its_place(layout):
    w = _weight(layout, 32)
    x = torch.randn(8, K, generator=torch.Generator().manual_seed(2))
    solo = torch.cat([_run(x[i:i + 1], w) for i in range(8)])
    assert torch.equal(_run(x, w), solo)
    assert torch.equal(_run(x.flip(0), w), solo.flip(0))


def test_many_rows_take_the_float_gemm_of_the_exact_dequantization():
    w = _weight("q4a", 32)
    x = torch.randn(80, K, generator=torch.Generator().manual_seed(3))  # past the fused path's 64 rows
    assert torch.equal(_run(x, w), x @ dequantize(w).t())


def test_matmul_reads_a_packed_weight_with_the_kernel_on_cpu(monkeypatch):
    w = _weight("q4z", 32)
    x = torch.randn(2, 3, K)
    calls = []
    real = cpu.packed_linear
    monkeypatch.setattr(cpu, "packed_linear", lambda *a: calls.append(a[1]) or real(*a))
    bias = torch.randn(40)
    y = matmul(x, w, bias)
    assert calls == ["q4z"] and y.shape == (2, 3, 40)
    assert torch.equal(y, (real(x.reshape(6, K), w.layout, w.group, *w.tensors()[:2], None) + bias).reshape(2, 3, 40))
    # what the kernel does not take keeps the dequantization in the graph: group 16 (Q6_K's), bfloat16 rows
    for other, xs in ((_weight("q8s", 16), x), (w, x.bfloat16())):
        assert torch.equal(matmul(xs, other), F.linear(xs, dequantize(other, xs.dtype)))
    assert calls == ["q4z"]


def test_bad_operands_get_an_error_that_names_them():
    w = _weight("q4a", 32)
    x = torch.randn(1, K)
    with pytest.raises(RuntimeError, match=r"x must be a float32 CPU matrix \[M, K\]"):
        _run(x.double(), w)
    with pytest.raises(RuntimeError, match=r"qweight must be contiguous \[N, K/2\] bytes"):
        _run(torch.randn(1, K + 32), w)
    with pytest.raises(RuntimeError, match="mins go with the affine layouts only"):
        cpu.packed_linear(x, "q4a", 32, w.qweight, w.scales, None)
    with pytest.raises(RuntimeError, match="packed_linear: unknown layout id 9"):
        torch.ops.onecopy_cpu.packed_linear(x, w.qweight, w.scales, w.mins, 9, 32)
    with pytest.raises(RuntimeError, match="group 16 must be a multiple of 32"):
        torch.ops.onecopy_cpu.packed_linear(x, w.qweight, w.scales.repeat(1, 2), w.mins.repeat(1, 2), 3, 16)


def test_the_avx2_and_plain_paths_agree_with_float64_too(tmp_path):
    """$ATEN_CPU_CAPABILITY holds the kernel to AVX2 or plain C++ as it holds ATen (CI's AVX2 rerun runs this
    file again under avx2): each path on every layout, in a fresh process."""
    script = tmp_path / "paths.py"
    script.write_text(
        "import sys, torch, torch.nn.functional as F\n"
        f"sys.path.insert(0, {str(Path(__file__).parent.parent)!r})\n"
        "from tests.test_cpu_packed_kernel import _weight, _run, K\n"
        "from onecopy.models.packed import dequantize\n"
        "for layout in ('q8s', 'q8a', 'q4z', 'q4a'):\n"
        "    w = _weight(layout, 64)\n"
        "    x = torch.randn(3, K, generator=torch.Generator().manual_seed(4))\n"
        "    want = F.linear(x.double(), dequantize(w, torch.float64))\n"
        "    got = _run(x, w).double()\n"
        "    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), layout\n"
        "    assert torch.equal(_run(x[1:2], w), _run(x, w)[1:2]), layout\n"
        "print('ok')\n")
    for cap in ("avx2", "default"):
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "ATEN_CPU_CAPABILITY": cap})
        assert r.returncode == 0 and r.stdout.strip() == "ok", (cap, r.stderr[-2000:])


def test_a_method_naming_the_cpu_kernels_is_refused_on_cuda():
    from types import SimpleNamespace

    from onecopy.errors import DeviceMismatchError
    from onecopy.runtime.method import _load_native_ops

    spec = SimpleNamespace(name="decode", native_ops=["onecopy_cpu"])
    with pytest.raises(DeviceMismatchError, match=r"method 'decode' calls the CPU kernels \(onecopy_cpu\); load the "
                                                  "bundle on the CPU it was exported for"):
        _load_native_ops(spec, torch.device("cuda"))
