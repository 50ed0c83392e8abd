"""GGUF quantized tensors repacked, losslessly, into four row-major layouts a GPU kernel reads well.

A GGUF tensor of logical shape [N, K] (K the reduction axis, a multiple of the type's block size) is a run
of blocks whose byte layout differs per type. `repack` rewrites it into one of four layouts; `dequantize`
turns a layout into float32 with exactly the bits `gguf.quants.dequantize` gives. Every layout has
`qweight` (values, [N, K], or [N, K/2] bytes for 4-bit ones), `scales` float32 [N, K/group] and, the
affine ones, `mins` float32 [N, K/group]. For value q at [n, k], with s and m its group's (g = k // group):

    layout  qweight                  value            from (group; s; m)
    q8s     int8 [N, K]              s * q            Q8_0 (32; d), Q6_K (16; d * sc; q stored as q - 32)
    q4z     uint8 [N, K/2], nibbles  s * (q - 8)      Q4_0 (32; d)
    q4a     uint8 [N, K/2], nibbles  s * q + m        Q4_1 (32; d; m), Q4_K (32; d * sc; -(dmin * mn))
    q8a     uint8 [N, K]             s * q + m        Q5_K (32; d * sc; -(dmin * mn)), q in 0..31

Nibble order: byte i of a row holds k = 2i in its low nibble and k = 2i + 1 in its high one, whatever
the group size, so a kernel unpacks a [BN, BK/2] byte tile as `tl.join(b & 15, b >> 4).reshape(BN, BK)`.
(GGUF's own order, a block's low nibbles then its high ones, differs between Q4_0/Q4_1 and Q4_K.)

Why the bits match gguf (float32, IEEE round to nearest):
- the fp16 fields are converted by the numpy call gguf uses (exact: every fp16 is an fp32), and the
  K-quant factors d * sc and dmin * mn are the numpy fp32 products gguf computes, so each stored scale
  and min is the very number gguf uses;
- `dequantize` does gguf's operations, rewritten only by identities that hold bit for bit in IEEE:
  s * q == q * s, a - b == a + (-b) (subtraction is defined so, signed zeros included), and q - 8,
  q - 32 are exact small integers as in gguf;
- s * q is exact in every layout: at most 11 (fp16 significand) + 7 (|sc| <= 128) + 5 (|q| <= 32)
  = 23 significant bits, and no over- or underflow (|d| < 2^16; nonzero |d| >= 2^-24). So the one
  rounding is q4a/q8a's add of m: a kernel may use an FMA, or compute d * (sc * q), and get the same bits.
  Every result is 0 or at least 2^-24 in size (all terms are multiples of 2^-24), never an fp32
  subnormal, so flush-to-zero changes nothing either.
Q4_0 keeps its own layout: folding its zero point into a min, s * q + (-8 s), gives the same numbers but
+0.0 where gguf gives -0.0 (q = 8 with d < 0), and it would cost a min per group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .. import layouts
from ..errors import InputError
from . import packed as pk

Q = GGMLQuantizationType
LAYOUTS = tuple(layouts.LAYOUTS)
_NIBBLES = tuple(k for k, (per_byte, _) in layouts.LAYOUTS.items() if per_byte == 2)  # two values per byte
_AFFINE = tuple(k for k, (_, affine) in layouts.LAYOUTS.items() if affine)  # s * q + m


@dataclass
class PackedWeight:
    """One quantized weight in a kernel-friendly layout (see the module docstring); CPU tensors."""

    layout: str
    shape: tuple[int, ...]  # the logical float shape, [N, K] (leading dims, if any, are rows too)
    group: int  # values per scale along K
    qweight: torch.Tensor
    scales: torch.Tensor  # float32 [rows, K // group]
    mins: torch.Tensor | None = None  # float32 [rows, K // group], for q4a and q8a
    qtype: str = ""  # the GGUF type it came from, for messages

    def __post_init__(self) -> None:
        k, rows = self.shape[-1], math.prod(self.shape[:-1])
        q_cols = k // 2 if self.layout in _NIBBLES else k
        ok = (self.layout in LAYOUTS and k % self.group == 0 and tuple(self.qweight.shape) == (rows, q_cols)
              and tuple(self.scales.shape) == (rows, k // self.group)
              and (self.mins is not None) == (self.layout in _AFFINE)
              and (self.mins is None or self.mins.shape == self.scales.shape))
        if not ok:
            raise ValueError(f"inconsistent PackedWeight: layout {self.layout}, shape {self.shape}, group {self.group}, "
                             f"qweight {tuple(self.qweight.shape)}, scales {tuple(self.scales.shape)}")

    def packed(self) -> pk.Packed:
        """The weight as a model layer holds it (`models.packed`), rows flattened to [N, K]."""
        return pk.Packed(self.layout, self.group, self.qweight, self.scales, self.mins)


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] bytes -> [n, 1] float32, the conversion gguf does."""
    return b.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """GGUF nibble order: per run of `span` bytes, their low nibbles, then their high nibbles."""
    q = qs.reshape(qs.shape[0], -1, 1, span) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(qs.shape[0], -1)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K block head -> (d * sc, -(dmin * mn)), float32 [n, 8]; 6-bit sc/mn packed in 12 bytes."""
    lo, hi, mix = np.split(b[:, 4:16].reshape(-1, 3, 4), 3, axis=1)
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).reshape(-1, 8)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1).reshape(-1, 8)
    return _f16(b[:, 0:2]) * sc.astype(np.float32), -(_f16(b[:, 2:4]) * mn.astype(np.float32))


# Each takes [n_blocks, type_size] bytes and gives (layout, group, values [n_blocks, block] in logical
# order, scales [n_blocks, groups per block], mins or None): gguf's dequantize_blocks, stopped before the
# multiply.
Unpacked = tuple[str, int, np.ndarray, np.ndarray, np.ndarray | None]


def _q8_0(b: np.ndarray) -> Unpacked:
    return "q8s", 32, b[:, 2:].view(np.int8), _f16(b[:, :2]), None


def _q4_0(b: np.ndarray) -> Unpacked:
    return "q4z", 32, _nibbles(b[:, 2:], 16), _f16(b[:, :2]), None


def _q4_1(b: np.ndarray) -> Unpacked:
    return "q4a", 32, _nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q4_k(b: np.ndarray) -> Unpacked:
    return "q4a", 32, _nibbles(b[:, 16:], 32), *_k_scales(b)


def _q5_k(b: np.ndarray) -> Unpacked:
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit i: value 32i + j
    q = _nibbles(b[:, 48:], 32) | ((qh & np.uint8(1)).reshape(b.shape[0], -1) << np.uint8(4))
    return "q8a", 32, q, *_k_scales(b)


def _q6_k(b: np.ndarray) -> Unpacked:
    ql = _nibbles(b[:, :128], 64)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (ql | ((qh & np.uint8(3)).reshape(b.shape[0], -1) << np.uint8(4))).astype(np.int8) - np.int8(32)
    return "q8s", 16, q, _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32), None


_UNPACK: dict[GGMLQuantizationType, Callable[[np.ndarray], Unpacked]] = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}
SUPPORTED: tuple[GGMLQuantizationType, ...] = tuple(_UNPACK)


def _qtype(qtype: GGMLQuantizationType | int | str) -> GGMLQuantizationType:
    try:
        t = Q[qtype] if isinstance(qtype, str) else Q(qtype)
    except (KeyError, ValueError):
        raise InputError(f"{qtype!r} is not a GGUF tensor type; pass a gguf.GGMLQuantizationType") from None
    if t not in _UNPACK:
        names = ", ".join(s.name for s in SUPPORTED)
        raise InputError(f"GGUF type {t.name} cannot stay quantized (supported: {names}); load the model "
                         "dequantized (the default GGUF path) or requantize it to one of those, e.g. Q4_K_M or Q8_0")
    return t


def _torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.require(a, requirements=["C", "W"]))  # copies only views of the caller's bytes


def repack(qtype: GGMLQuantizationType | int | str, raw: np.ndarray | bytes, shape: tuple[int, ...]) -> PackedWeight:
    """Repack a GGUF tensor's bytes (GGUF block order) of logical float shape `shape` = [N, K]."""
    t = _qtype(qtype)
    block, type_size = GGML_QUANT_SIZES[t]
    shape = tuple(int(s) for s in shape)
    k, rows = shape[-1], math.prod(shape[:-1])
    if k % block:
        raise InputError(f"a {t.name} tensor's last dim must be a multiple of {block}; shape {list(shape)} is not")
    is_buffer = isinstance(raw, (bytes, bytearray, memoryview))
    data = np.frombuffer(raw, dtype=np.uint8) if is_buffer else np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    want = rows * (k // block) * type_size
    if data.size != want:
        raise InputError(f"a {t.name} tensor of shape {list(shape)} takes {want} bytes, got {data.size}; "
                         "pass the shape in torch order ([N, K], GGUF's ne reversed)")
    layout, group, q, scales, mins = _UNPACK[t](data.reshape(-1, type_size))
    q = q.reshape(rows, k)
    if layout in _NIBBLES:
        q = q[:, 0::2] | (q[:, 1::2] << np.uint8(4))
    scales = scales.reshape(rows, k // group)
    return PackedWeight(layout, shape, group, _torch(q), _torch(scales),
                        None if mins is None else _torch(mins.reshape(rows, k // group)), t.name)


def dequantize(p: PackedWeight) -> torch.Tensor:
    """The float32 weight, bit for bit what gguf.quants.dequantize gives for the bytes `p` came from
    (`models.packed.dequantize`, the very function the exported graphs run)."""
    return pk.dequantize(p.packed()).reshape(p.shape)


def packed_bytes(p: PackedWeight) -> int:
    """Bytes the layout takes on a device: values, scales and mins."""
    return p.packed().nbytes
