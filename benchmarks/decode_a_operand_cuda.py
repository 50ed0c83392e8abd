"""An alternative decode attention design, measured (not shipped): the KV tile as the dot's A operand.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/decode_a_operand_cuda.py benchmarks/results/decode_a_operand_h200.json

Scores as K q^T ([BLOCK positions, 16 query rows]: M = BLOCK, which on Hopper lets an 8-bit tile feed the
MMA from registers, converted there) instead of q K^T; the output as P^T V, or, with V pages stored
transposed [NB, H, D, BS], as V^T P^T (both MMA operands then K-contiguous in memory, as 8-bit ldmatrix
wants). Each variant and tile (BLOCK, warps, stages) is timed against the shipped `launch_decode_paged`
on `kv_attention_cuda.inputs` (CUDA-graph replays, median) and checked against its output.
H200, results/decode_a_operand_h200.json (shipped = 2127ea8; two 32-layer exports shared the machine, so
compare within a row): 8-bit caches 0.30-0.45 of the copy bandwidth against 0.34-0.55 shipped, V^T
0.07-0.26: slower. bf16 with BLOCK 64: 0.71-1.00 against 0.67-0.93 shipped (1.0-1.08x), a lead for the
bf16 kernel not yet taken (every bf16 decode's bits would change).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from onecopy.kernels.decode import _kernels, launch_decode_paged  # noqa: E402
from onecopy.kernels.tiles import SPLIT_MAX, decode_splits, n_splits  # noqa: E402


@triton.jit
def exp_kernel(Q, K, V, KS, VS, TABLE, LENS, PO, PML, stride_qb, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh,
               stride_vx, stride_sp, stride_sh, stride_t, stride_pob, stride_poh, stride_pos, stride_pmb, stride_pmh,
               stride_pms, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, BS: tl.constexpr,
               SCALE: tl.constexpr, VT: tl.constexpr, NSE, Q8: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    length = tl.load(LENS + b)
    split = tl.cdiv(tl.cdiv(length, NSE), BLOCK) * BLOCK
    start = sp * split
    end = tl.minimum(start + split, length)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    gmask = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=0.0)
    qT = tl.trans(q)  # [D, GP]
    k_base = K + kvh * stride_kh
    v_base = V + kvh * stride_vh
    tab = TABLE + b * stride_t
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    if VT:
        acc = tl.zeros([D, GP], tl.float32)
    else:
        acc = tl.zeros([GP, D], tl.float32)
    for n in range(start, end, BLOCK):
        offs_n = n + tl.arange(0, BLOCK)
        nmask = offs_n < end
        blk = tl.load(tab + offs_n // BS, mask=nmask, other=0)
        k = tl.load(k_base + (blk * stride_kp + (offs_n % BS) * stride_ks)[:, None] + offs_d[None, :],
                    mask=nmask[:, None], other=0.0)
        sT = tl.dot(k.to(Q.dtype.element_ty), qT) * SCALE  # [BLOCK, GP]
        if Q8:
            sT = sT * tl.load(KS + kvh * stride_sh + blk * stride_sp + offs_n % BS, mask=nmask, other=0.0)[:, None]
        sT = tl.where(nmask[:, None], sT, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sT, 0))
        alpha = tl.exp(m_i - m_new)
        pT = tl.exp(sT - m_new[None, :])
        l_i = l_i * alpha + tl.sum(pT, 0)
        if Q8:
            pT = pT * tl.load(VS + kvh * stride_sh + blk * stride_sp + offs_n % BS, mask=nmask, other=0.0)[:, None]
        if VT:  # V pages [NB, H, D, BS]: V^T tile [D, BLOCK]
            vT = tl.load(v_base + (blk * stride_vp + offs_n % BS)[None, :] + offs_d[:, None] * stride_vx,
                         mask=nmask[None, :], other=0.0)
            acc = acc * alpha[None, :] + tl.dot(vT.to(Q.dtype.element_ty), pT.to(Q.dtype.element_ty))
        else:
            v = tl.load(v_base + (blk * stride_vp + (offs_n % BS) * stride_vx)[:, None] + offs_d[None, :],
                        mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(tl.trans(pT.to(Q.dtype.element_ty)), v.to(Q.dtype.element_ty))
        m_i = m_new
    if VT:
        tl.store(PO + b * stride_pob + heads[None, :] * stride_poh + sp * stride_pos + offs_d[:, None], acc,
                 mask=gmask[None, :])
    else:
        tl.store(PO + b * stride_pob + heads[:, None] * stride_poh + sp * stride_pos + offs_d[None, :], acc,
                 mask=gmask[:, None])
    pml = PML + b * stride_pmb + heads * stride_pmh + sp * stride_pms
    tl.store(pml, m_i, mask=gmask)
    tl.store(pml + 1, l_i, mask=gmask)


def launch(q, k, v, table, lengths, scales, vt, block=128, warps=4, stages=2, nse=None):
    merge = _kernels()[1]
    b, hq, d = q.shape
    hkv, bs = k.shape[1], k.shape[2]
    s = table.shape[1] * bs
    ns = n_splits(s, SPLIT_MAX, block)
    nse = min(nse or decode_splits(b, hkv, ns), ns)
    po = torch.empty((b, hq, ns, d), dtype=torch.float32, device=q.device)
    pml = torch.empty((b, hq, ns, 2), dtype=torch.float32, device=q.device)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    ks, vs = scales if scales is not None else (q, q)
    exp_kernel[(b, hkv, nse)](q, k, v, ks, vs, table, lengths, po, pml, q.stride(0), k.stride(0), k.stride(1), k.stride(2),
                              v.stride(0), v.stride(1), v.stride(2), ks.stride(0) if scales else 0, ks.stride(1) if scales else 0,
                              table.stride(0), po.stride(0), po.stride(1), po.stride(2), pml.stride(0), pml.stride(1),
                              pml.stride(2), G=hq // hkv, GP=16, D=d, BLOCK=block, BS=bs, SCALE=d ** -0.5, VT=vt, NSE=nse,
                              Q8=scales is not None, num_warps=warps, num_stages=stages)
    merge[(b, hq)](po, pml, out, po.stride(0), po.stride(1), po.stride(2), pml.stride(0), pml.stride(1), pml.stride(2),
                   out.stride(0), out.stride(1), NS=ns, NSP=max(2, 1 << (ns - 1).bit_length()), D=d, NSE=nse, num_warps=4)
    return out


def main() -> None:
    from attention_cuda import bench, copy_bandwidth  # this folder
    from kv_attention_cuda import inputs, share
    bw = copy_bandwidth()
    print("copy bw", bw / 1e12)
    res = []
    for fmt in ("int8", "fp8", "bf16"):
        for batch, ctx in ((64, 1024), (256, 1024), (64, 4096), (256, 4096), (16, 4096)):
            made = inputs(batch, ctx, fmt)
            q, _, k, v, table, rows, lengths, scales = made["args"]
            vT = v.transpose(2, 3).contiguous()
            ref = launch_decode_paged(*made["args"])
            row = {"kv": fmt, "batch": batch, "context": ctx}
            row["shipped"] = bench(lambda args=made["args"]: launch_decode_paged(*args), 200)
            for name, vv, vt in (("kA", v, False), ("kA_vT", vT, True)):
                for blk, w, st in ((128, 4, 2), (64, 4, 2), (128, 8, 2), (128, 4, 3)):
                    tag = f"{name}_{blk}_{w}_{st}"
                    try:
                        got = launch(q, k, vv, table, lengths, scales, vt, blk, w, st)
                        err = float((got.float() - ref.float()).abs().max())
                        row[tag] = bench(lambda a=(q, k, vv, table, lengths, scales, vt, blk, w, st): launch(*a), 200)
                        row[tag + "_err"] = round(err, 4)
                    except Exception as e:
                        row[tag] = "error " + str(e).splitlines()[0][:120]
            row["shares"] = {key: share(made["needed"], ms, bw) for key, ms in row.items()
                             if isinstance(ms, float) and not key.endswith("_err")}
            print(json.dumps(row), flush=True)
            res.append(row)
            del made, vT
            torch.cuda.empty_cache()
    out = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "copy_bandwidth_TBps": round(bw / 1e12, 3),
           "runs": res}
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
