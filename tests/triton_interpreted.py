"""Triton kernels run by Triton's CPU interpreter against float64 and the eager torch ops (Qwen3.5's, a packed
weight's dequantization, the decode and prefill attention, the small linear)
(`tests/test_triton_interpreted.py` runs this file in a process of its own: TRITON_INTERPRET must be set before a
kernel is defined). Each check raises AssertionError with what differs; ``python tests/triton_interpreted.py NAME``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's `tests` package

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from onecopy.models.attention import Step  # noqa: E402
from onecopy.models.qwen3_5 import Experts  # noqa: E402
from onecopy.models.qwen3_5_deltanet import GatedDeltaNet, chunk_terms, scan_chunks  # noqa: E402
from tests.qwen35_layers import random_deltanet, random_experts  # noqa: E402

# the tiny preset's DeltaNet heads (dk = dv = 16, 2 key / 4 value heads) and Qwen3.5-35B-A3B's (128, 4 of its 16 / 32)
HEADS = {"tiny": {}, "35b-a3b": dict(dim=256, linear_n_k_heads=2, linear_n_v_heads=4, linear_k_head_dim=128,
                                     linear_v_head_dim=128)}


def _layer(shape: str, dtype: torch.dtype) -> GatedDeltaNet:
    return random_deltanet(**HEADS[shape]).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, eager: torch.Tensor, what: str, mean: float = 1.5,
           most: float = 2.0) -> None:
    """``got`` as close to float64 ``want`` as the eager float32 ops are (``mean`` x their mean error, ``most`` x
    their largest: both are float32 rounding, summed in other orders)."""
    g, e = (got.double() - want).abs(), (eager.double() - want).abs()
    assert g.mean() <= mean * e.mean() + 1e-9 and g.max() <= most * e.max() + 1e-9, (
        what, float(g.mean()), float(e.mean()), float(g.max()), float(e.max()))


def deltanet_decode() -> None:
    """A decode step of five sessions (two at position 0: zero state) between the projections: output, conv window
    and recurrent state as the eager step's; each row's bits the same alone as beside the others."""
    from onecopy.kernels.deltanet import launch_deltanet_decode

    for shape in HEADS:
        m64, m32 = _layer(shape, torch.float64), _layer(shape, torch.float32)
        rows, pos = torch.tensor([6, 1, 3, 0, 5]), torch.tensor([9, 0, 4, 0, 2])
        conv = torch.randn(8, m32.conv_dim, m32.kernel)
        rec = torch.randn(8, m32.nv, m32.dk, m32.dv) * 0.5
        x = torch.randn(len(rows), 1, m32.in_proj.in_features)

        def eager(m, dtype):
            c, r = conv.to(dtype).clone(), rec.to(dtype).clone()
            with torch.no_grad():
                return m(x.to(dtype), Step(rows, pos, True), c, r, 1), c, r

        def kernel(lo, hi):
            c, r = conv.clone(), rec.clone()
            with torch.no_grad():
                proj = m32.in_proj(x[lo:hi])[:, 0]
                out = launch_deltanet_decode(proj, c, m32.conv1d.weight, r, m32.A_log, m32.dt_bias, m32.norm.weight,
                                             rows[lo:hi], pos[lo:hi], m32.nk, m32.norm.eps, wrap=False)
                return m32.out_proj(out[:, None]), c, r

        want, ref, got = eager(m64, torch.float64), eager(m32, torch.float32), kernel(0, 5)
        for i, what in enumerate(("output", "conv window", "recurrent state")):
            _close(got[i], want[i], ref[i], f"{shape} decode {what}")
        part = kernel(2, 5)
        assert torch.equal(part[0], got[0][2:]) and torch.equal(part[2][rows[2:]], got[2][rows[2:]]), shape


def deltanet_chunk_scan() -> None:
    """A prefill's chunk-to-chunk recurrence (the last chunk partly padding) as the torch loop's, output and state."""
    from onecopy.kernels.deltanet import launch_deltanet_chunk_scan

    for h, t, dk, dv, c in [(4, 70, 16, 16, 32), (2, 150, 128, 128, 64)]:
        g = torch.Generator().manual_seed(t)
        q, k = (F.normalize(torch.randn(h, t, dk, generator=g, dtype=torch.float64), dim=-1) for _ in range(2))
        v = torch.randn(h, t, dv, generator=g, dtype=torch.float64)
        decay = -torch.rand(h, t, generator=g, dtype=torch.float64) * 0.5
        beta = torch.rand(h, t, generator=g, dtype=torch.float64)
        state = torch.randn(h, dk, dv, generator=g, dtype=torch.float64) * 0.5
        n = (t + 2 * c - 1) // c
        want = scan_chunks(*chunk_terms(q, k, v, decay, beta, n, c), state)
        terms = chunk_terms(*(x.float() for x in (q, k, v, decay, beta)), n, c)
        ref = scan_chunks(*terms, state.float())
        got = launch_deltanet_chunk_scan(*terms, state.float(), wrap=False)
        assert got[0].shape == (h, n, c, dv) and got[0].is_contiguous()
        _close(got[0], want[0], ref[0], f"scan output {dk}")
        _close(got[1], want[1], ref[1], f"scan state {dk}")


def moe_routed() -> None:
    """A decode step's routed experts grouped by expert (runs of one to three 16-pair blocks) as the eager gathers
    are, to float64; the last row's bits the same alone as beside the others."""
    from onecopy.kernels.moe import launch_moe_routed

    for e, d, inter, topk in [(4, 64, 32, 2), (16, 64, 32, 4)]:
        ex = random_experts(e, d, inter)
        ref = Experts(e, d, inter).double()
        ref.load_state_dict({k: w.double() for k, w in ex.state_dict().items()})
        for n in (1, 3, 16, 40):
            x = torch.randn(n, d)
            idx = torch.stack([torch.randperm(e)[:topk] for _ in range(n)])
            top = torch.softmax(torch.randn(n, topk), -1)
            with torch.no_grad():
                got = launch_moe_routed(x, idx, top, ex.gate_up_proj, ex.down_proj, wrap=False)
                alone = launch_moe_routed(x[-1:], idx[-1:], top[-1:], ex.gate_up_proj, ex.down_proj, wrap=False)
                _close(got, ref.routed(x.double(), idx, top.double()), ex.routed(x, idx, top), f"moe {e} {n}")
            assert torch.equal(alone[0], got[-1]), (e, n)


def dequantize() -> None:
    """A packed weight dequantized for a prefill's GEMM (int4 affine and int8 symmetric, groups of 32-128) is
    `models.packed.dequantize`'s, bit for bit, in float32 (the interpreter truncates to bfloat16 where the GPU rounds:
    the GPU test compares that)."""
    from onecopy.kernels.dequant import launch_dequantize
    from onecopy.layouts import LAYOUT_IDS
    from onecopy.models.packed import dequantize as reference
    from onecopy.models.quantize import quantize_weight

    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    for mode, group in (("int4", 32), ("int4", 128), ("int8", 64)):
        p = quantize_weight(w, mode, group)
        got = launch_dequantize(p.qweight, p.scales, p.mins, LAYOUT_IDS[p.layout], p.group, torch.float32)
        assert torch.equal(got, reference(p, torch.float32)), (mode, group)


def decode_attention() -> None:
    """The split-KV decode attention (split and merge kernels) over rows of a pool, grouped query heads, lengths 1 to
    the whole row: as the eager softmax attention, to float64 (the split softmax's exps in another order: 3x its
    largest error); the batch-invariant splits give a row the same bits alone as beside the others."""
    from onecopy.kernels.decode import launch_decode

    g = torch.Generator().manual_seed(0)
    pool, hkv, s, d, hq = 5, 2, 300, 64, 8
    k, v = (torch.randn(pool, hkv, s, d, generator=g) for _ in range(2))
    rows, lengths = torch.tensor([3, 0, 4]), torch.tensor([1, 130, 300])
    q = torch.randn(3, hq, d, generator=g)

    def eager(dtype):
        outs = []
        for b in range(3):
            kk, vv = (t[rows[b], :, :lengths[b]].to(dtype).repeat_interleave(hq // hkv, 0) for t in (k, v))
            scores = (q[b].to(dtype)[:, None, :] @ kk.transpose(-1, -2))[:, 0] * d ** -0.5
            outs.append((torch.softmax(scores, -1)[:, None, :] @ vv)[:, 0])
        return torch.stack(outs)

    want, ref = eager(torch.float64), eager(torch.float32)
    for invariant in (False, True):
        _close(launch_decode(q, None, k, v, rows, lengths, invariant=invariant), want, ref,
               f"decode attention invariant={invariant}", mean=2.0, most=3.0)
    alone = launch_decode(q[2:], None, k, v, rows[2:], lengths[2:], invariant=True)
    assert torch.equal(alone[0], launch_decode(q, None, k, v, rows, lengths, invariant=True)[2])


def small_linear() -> None:
    """The small-linear kernel (a decode step's few rows): float and packed (int4 affine, int8) weights, plain, with
    a residual added and as SwiGLU of a fused gate/up weight, as the eager float32 products are, to float64."""
    from onecopy.kernels.linear import launch_linear
    from onecopy.layouts import LAYOUT_IDS
    from onecopy.models.packed import dequantize as reference
    from onecopy.models.quantize import quantize_weight

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 256, generator=g), torch.randn(128, 256, generator=g) / 16
    residual = torch.randn(3, 128, generator=g)
    for mode in (None, "int4", "int8"):
        p = quantize_weight(w, mode, 64) if mode else None
        weight = reference(p) if p else w
        args = (p.qweight, (p.scales, p.mins, LAYOUT_IDS[p.layout], p.group)) if p else (w, None)
        for glu, res in ((False, None), (False, residual), (True, None)):
            def eager(dtype):
                y = x.to(dtype) @ weight.to(dtype).T
                if glu:
                    gate, up = y.split(64, -1)
                    return F.silu(gate) * up
                return y + res.to(dtype) if res is not None else y
            got = launch_linear(x, args[0], res, glu, (32, 64, 4, 1), packed=args[1])[0]
            _close(got, eager(torch.float64), eager(torch.float32), f"linear {mode} glu={glu} res={res is not None}")


def prefill_attention() -> None:
    """A prefill chunk's causal attention over its row of the pools (the chunk at positions 40..69 of a row whose
    earlier positions are cached; grouped query heads) as the eager softmax attention, to float64."""
    from onecopy.kernels.prefill import launch_prefill

    g = torch.Generator().manual_seed(0)
    pool, hkv, s, d, hq, start, t = 3, 2, 128, 64, 4, 40, 30
    k, v = (torch.randn(pool, hkv, s, d, generator=g) for _ in range(2))
    q = torch.randn(t, hq, d, generator=g)
    rows, positions = torch.tensor([1]), torch.arange(start, start + t)

    def eager(dtype):
        kk, vv = (x[1, :, :start + t].to(dtype).repeat_interleave(hq // hkv, 0) for x in (k, v))  # [Hq, L, D]
        scores = torch.einsum("thd,hld->htl", q.to(dtype), kk) * d ** -0.5
        causal = torch.arange(start + t)[None, :] <= positions[:, None]  # [T, L]
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
        return torch.einsum("htl,hld->thd", probs, vv)

    got = launch_prefill(q, k, v, rows, positions, (16, 16, 4, 1))
    _close(got, eager(torch.float64), eager(torch.float32), "prefill attention", mean=2.0, most=3.0)


FUNCTIONS = {"deltanet_decode": deltanet_decode, "deltanet_chunk_scan": deltanet_chunk_scan, "moe_routed": moe_routed,
             "dequantize": dequantize, "decode_attention": decode_attention, "small_linear": small_linear,
             "prefill_attention": prefill_attention}

if __name__ == "__main__":
    for name in sys.argv[1:] or FUNCTIONS:
        FUNCTIONS[name]()
        print(f"{name}: ok", flush=True)
