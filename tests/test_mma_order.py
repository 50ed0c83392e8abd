"""The native CUDA kernel's tile order of packed weights (`models.mma_order`, the ``_mma`` layouts), on CPU.

The kernel itself runs on a GPU (tests/gpu/test_native_linear_cuda.py); here: the order the export writes is
the one the kernel's header comment (kernels/native/packed_linear.cu) reads, read back by a reader written from
that comment alone; the traceable read-back is exact; a model rewritten in it computes what it computed; and
bad shapes get a clear error.
"""

from __future__ import annotations

import pytest
import torch

from onecopy.layouts import check_packed, mma_chunk
from onecopy.models.linear import PackedLinear
from onecopy.models.mma_order import orderable
from onecopy.models.packed import Packed, dequantize, stored_order, tile_ordered
from onecopy.models.quantize import order_tiles, quantize_model, quantize_weight
from onecopy.models.source import resolve_source

CASES = [("int4", "q4a", 128), ("int4", "q4a", 32), ("int4", "q4z", 64), ("int8", "q8s", 128), ("int8", "q8s", 32)]


def _weight(mode: str, layout: str, group: int, n: int = 48, k: int = 256) -> Packed:
    torch.manual_seed(n + k + group)
    p = quantize_weight(torch.randn(n, k), mode, group)
    return Packed("q4z", group, p.qweight, p.scales) if layout == "q4z" else p


def _value_at(p: Packed, row: int, k: int) -> int:
    """The stored-order weight's integer at (row, k)."""
    if p.layout in ("q4a", "q4z"):
        b = int(p.qweight[row, k // 2])
        return (b >> 4) if k % 2 else (b & 15)
    return int(p.qweight[row, k])


def _read_tiles(t: Packed, n: int, k: int) -> dict[tuple[int, int], int]:
    """(row, k) -> integer, read from the tile order exactly as the kernel's header comment states it:
    a tile of 16 rows and a chunk of CH values hold 32 lanes x 16 bytes, lane = 4 g + t, row = 16 f + 8 h + g,
    k = chunk + 16 j + 4 t + 2 p + e; 4-bit: byte 4 j + 2 e + p, nibble h; 8-bit: byte 4 (2 j + h) + 2 e + p."""
    ch = mma_chunk(t.layout)
    raw = t.qweight.reshape(-1)
    out = {}
    for f in range(n // 16):
        for c in range(k // ch):
            for lane in range(32):
                g, tt = lane // 4, lane % 4
                base = ((f * (k // ch) + c) * 32 + lane) * 16
                for j in range(ch // 16):
                    for h in range(2):
                        for p in range(2):
                            for e in range(2):
                                row, kk = 16 * f + 8 * h + g, c * ch + 16 * j + 4 * tt + 2 * p + e
                                if t.layout == "q8s_mma":
                                    out[row, kk] = int(raw[base + 4 * (2 * j + h) + 2 * e + p])
                                else:
                                    byte = int(raw[base + 4 * j + 2 * e + p])
                                    out[row, kk] = (byte >> 4) if h else (byte & 15)
    return out


@pytest.mark.parametrize("mode,layout,group", CASES)
def test_the_tile_order_is_the_one_the_kernel_reads(mode, layout, group):
    p = _weight(mode, layout, group, n=32, k=max(2 * mma_chunk(layout + "_mma"), group))
    t = tile_ordered(p)
    n, k = p.shape
    assert t.layout == layout + "_mma" and t.qweight.shape == p.qweight.shape and t.qweight.dtype == p.qweight.dtype
    got = _read_tiles(t, n, k)
    assert len(got) == n * k
    assert all(got[r, c] == _value_at(p, r, c) for r in range(n) for c in range(k))
    # scales (and mins): [tile][group][16 features]
    groups = k // group
    for f in range(n // 16):
        for q in range(groups):
            for i in range(16):
                assert t.scales.reshape(-1)[(f * groups + q) * 16 + i] == p.scales[16 * f + i, q]
                if p.mins is not None:
                    assert t.mins.reshape(-1)[(f * groups + q) * 16 + i] == p.mins[16 * f + i, q]


@pytest.mark.parametrize("mode,layout,group", CASES)
def test_reading_the_tile_order_back_is_exact(mode, layout, group):
    p = _weight(mode, layout, group)
    t = tile_ordered(p)
    check_packed(t.layout, t.group, t.shape, t.qweight, t.scales, t.mins)
    back = stored_order(t)
    assert back.layout == p.layout
    assert all(torch.equal(a, b) for a, b in zip(back.tensors(), p.tensors()))
    assert torch.equal(dequantize(t), dequantize(p))  # the traceable read the CPU graphs use
    assert not torch.equal(t.qweight, p.qweight)


def test_which_weights_have_a_tile_order_and_bad_shapes_are_refused():
    assert orderable("q4a", 128, (4096, 4096)) and orderable("q8s", 32, (48, 96))
    assert not orderable("q4a", 16, (4096, 4096))  # Q6_K's groups of 16: the Triton kernel keeps them
    assert not orderable("q4z", 32, (40, 256))  # rows not a multiple of 16
    assert not orderable("q4z", 32, (48, 96))  # K not a multiple of the 4-bit chunk (64)
    assert not orderable("q8a", 32, (48, 256)) and not orderable("f8r", 256, (48, 256))
    p = _weight("int4", "q4a", 32)
    t = tile_ordered(p)
    with pytest.raises(ValueError, match=r"the _mma layouts: groups \(32, 64, 128\), N a multiple of 16, K of 64"):
        check_packed(t.layout, t.group, (40, 256), t.qweight[:40], t.scales[:40], t.mins[:40])


def test_a_model_rewritten_in_the_tile_order_computes_the_same():
    """order_tiles rewrites every packed projection (not the embedding) in place; on CPU the graph reads the
    tile order back and dequantizes it (the stored order takes the C++ kernel: float32 summation order apart)."""
    src = resolve_source("tiny-llama")
    model = src.build(64, torch.float32)
    quantize_model(model, "int4", 32)
    tokens, pos = torch.tensor([[5, 77, 300, 12, 9]]), torch.arange(5)
    with torch.no_grad():
        want = model(tokens, pos)
    fresh = src.build(64, torch.float32)
    quantize_model(fresh, "int4", 32)
    done = order_tiles(fresh)
    layers = [name for name, m in fresh.named_modules() if isinstance(m, PackedLinear)]
    assert sorted(done) == sorted(layers) and len(done) == 4 * 2 + 1  # 4 projections x 2 layers + the LM head
    assert all(m.layout == "q4a_mma" for m in fresh.modules() if isinstance(m, PackedLinear))
    with torch.no_grad():
        got = fresh(tokens, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_unpacking_to_a_dtype_the_kernel_does_not_write_is_refused():
    """The native unpack writes bf16 or fp16 only; asked for another dtype it says so before touching a GPU."""
    from onecopy.kernels import native

    t = tile_ordered(_weight("int4", "q4a", 32))
    with pytest.raises(ValueError, match=r"unpack writes bfloat16 or float16, not torch.float32"):
        native.unpack(t.qweight, t.scales, t.mins, 2, 32, torch.float32)
