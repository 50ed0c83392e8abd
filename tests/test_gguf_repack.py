"""`gguf_repack`: every layout dequantizes bit for bit like `gguf.quants.dequantize`, on SmolLM2's real
blocks and on random valid blocks of the types the file lacks, in the bytes its docstring promises."""

from __future__ import annotations

from collections import defaultdict

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from onecopy.errors import InputError, ModelSourceError
from onecopy.models import gguf_repack as gr
from onecopy.models.source import embedded_default_gguf

REAL_BYTES_PER_TYPE = 4 << 20  # raw GGUF bytes checked per type: keeps the file's 96 MB to a few seconds
F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
BITS_PER_WEIGHT = {  # value bits + 32-bit scale (and min) per group
    Q.Q8_0: ("q8s", 8 + 32 / 32), Q.Q4_0: ("q4z", 4 + 32 / 32), Q.Q4_1: ("q4a", 4 + 64 / 32),
    Q.Q4_K: ("q4a", 4 + 64 / 32), Q.Q5_K: ("q8a", 8 + 64 / 32), Q.Q6_K: ("q8s", 8 + 32 / 16),
}


def assert_bit_equal(qtype: Q, raw: np.ndarray | bytes, shape: tuple[int, int]) -> gr.PackedWeight:
    """repack -> dequantize equals gguf's float32 bits (int32 views: -0.0 and +0.0 differ there)."""
    p = gr.repack(qtype, raw, shape)
    got = gr.dequantize(p)
    blocks = np.frombuffer(raw, np.uint8).reshape(shape[0], -1) if isinstance(raw, bytes) else raw
    want = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(blocks, qtype))).reshape(shape)
    assert got.dtype == torch.float32 and tuple(got.shape) == shape
    assert torch.isfinite(want).all()
    diff = (got.view(torch.int32) != want.view(torch.int32)).sum().item()
    assert diff == 0, f"{qtype.name}: {diff} of {got.numel()} values differ from gguf"
    return p


def finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random finite fp16 bit patterns (either sign; normals, subnormals and zeros), the first four
    chosen: +0, -0, the smallest subnormal, -max."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits = np.where((bits & 0x7C00) == 0x7C00, bits ^ 0x4000, bits)  # inf/NaN exponent -> a normal one
    bits[:4] = [0x0000, 0x8000, 0x0001, 0xFBFF][:n]
    return bits.view(np.float16)


def random_blocks(qtype: Q, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random bytes with every fp16 field a finite value: valid blocks of any content."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[:, off:off + 2] = finite_f16(rng, raw.shape[0]).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def smollm2() -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(str(embedded_default_gguf()))
    except ModelSourceError as e:
        pytest.skip(str(e))


def test_smollm2_real_blocks_dequantize_bit_for_bit(smollm2: gguf.GGUFReader) -> None:
    by_type = defaultdict(list)
    for t in smollm2.tensors:
        if t.tensor_type not in (Q.F32, Q.F16, Q.BF16):
            by_type[t.tensor_type].append(t)
    assert set(by_type) == {Q.Q4_1, Q.Q8_0}  # what this file holds; random_blocks covers the rest
    for qtype, tensors in by_type.items():
        block, _ = GGML_QUANT_SIZES[qtype]
        for t in tensors:  # evenly spaced rows of every tensor, REAL_BYTES_PER_TYPE in all
            n, k = reversed(t.shape.tolist())
            take = max(1, min(n, REAL_BYTES_PER_TYPE // len(tensors) // t.data.shape[1]))
            rows = np.linspace(0, n - 1, take).astype(np.int64)
            assert_bit_equal(qtype, t.data[rows], (take, k))


@pytest.mark.parametrize("qtype", gr.SUPPORTED, ids=lambda q: q.name)
def test_random_valid_blocks_dequantize_bit_for_bit(qtype: Q) -> None:
    block, _ = GGML_QUANT_SIZES[qtype]
    blocks_per_row = max(1, 1024 // block)
    raw = random_blocks(qtype, 16, blocks_per_row)
    assert_bit_equal(qtype, raw, (16, blocks_per_row * block))
    assert_bit_equal(qtype, raw.tobytes(), (16, blocks_per_row * block))  # bytes in, too


def _gguf_quantizes(qtype: Q) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), qtype)
        return True
    except NotImplementedError:
        return False


@pytest.mark.parametrize("qtype", [q for q in gr.SUPPORTED if _gguf_quantizes(q)], ids=lambda q: q.name)
def test_blocks_gguf_quantizes_dequantize_bit_for_bit(qtype: Q) -> None:
    w = np.random.default_rng(1).standard_normal((32, 512)).astype(np.float32)
    w[0] = 0.0  # Q4_0 then stores d = -0.0: the signs of zero must survive
    w[1] *= -1e-6
    assert_bit_equal(qtype, gguf.quants.quantize(w, qtype), w.shape)


@pytest.mark.parametrize("qtype", gr.SUPPORTED, ids=lambda q: q.name)
def test_packed_bytes_are_the_values_plus_fp32_scales(qtype: Q) -> None:
    layout, bits = BITS_PER_WEIGHT[qtype]
    block, _ = GGML_QUANT_SIZES[qtype]
    n, k = 8, 4 * max(block, 64)
    p = gr.repack(qtype, random_blocks(qtype, n, k // block), (n, k))
    assert p.layout == layout and p.qtype == qtype.name
    assert gr.packed_bytes(p) == n * k * bits / 8
    assert p.qweight.dtype == (torch.int8 if layout == "q8s" else torch.uint8)
    assert p.scales.dtype == torch.float32 and (p.mins is None) == (layout not in ("q4a", "q8a"))


def test_nibbles_are_k_even_low_k_odd_high() -> None:
    """The contract a kernel relies on: byte i of a row holds k = 2i (low nibble) and 2i + 1 (high)."""
    v = np.arange(32, dtype=np.uint8) % 16  # Q4_0 values of one block, k = 0..31
    qs = v[:16] | (v[16:] << 4)  # GGUF order: byte j holds k = j and k = j + 16
    raw = np.concatenate([np.float16(1.0).reshape(1).view(np.uint8), qs])
    p = gr.repack(Q.Q4_0, raw, (1, 32))
    assert p.qweight.tolist() == [[int(v[2 * i] | (v[2 * i + 1] << 4)) for i in range(16)]]
    assert gr.dequantize(p).tolist() == [[float(x) - 8 for x in v]]


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.IQ4_NL, Q.Q5_0, Q.F32, "Q3_K", 999])
def test_unsupported_type_is_an_input_error_naming_it(qtype: Q | str | int) -> None:
    with pytest.raises(InputError, match=str(getattr(qtype, "name", qtype))):
        gr.repack(qtype, np.zeros(256, np.uint8), (1, 256))


def test_wrong_size_or_shape_is_an_input_error() -> None:
    raw = random_blocks(Q.Q4_1, 2, 4)
    with pytest.raises(InputError, match="takes 160 bytes, got 80"):
        gr.repack(Q.Q4_1, raw[:1], (2, 128))
    with pytest.raises(InputError, match="multiple of 32"):
        gr.repack(Q.Q4_1, raw, (4, 80))
