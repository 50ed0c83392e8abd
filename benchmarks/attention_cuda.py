"""Decode attention over the state pool, measured on CUDA: which implementation, and rows vs pages.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/attention_cuda.py --out benchmarks/results/attention_cuda_h200.json

One layer of the Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128, bf16), a pool of
max_seq_len 2048, each session's filled context drawn in [1024, 1280]. For B = 1, 16, 64 sessions:
- triton: onecopy's split-KV kernel (reads only the filled prefix of each row, in place);
- fused_torch: the CPU path's formulation (gather fused into mul+sum reductions) under torch.compile;
- gather_sdpa: k_pool[rows] materialised, then SDPA with a mask (what "no gather" avoids);
- paged_triton: the same kernel reading KV from 64-token pages through a block table (vLLM-style),
  to measure what one contiguous row per session costs or saves against paged blocks.
Bytes counted: the filled K and V of each session (what attention must read), q and the output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from onecopy import kernels  # noqa: E402
from onecopy.kernels.decode import _kernels as decode_kernels  # noqa: E402
from onecopy.models.attention import pooled_attention, pooled_attention_torch  # noqa: E402

PAGE = 64


@triton.jit
def _paged_split_kernel(Q, K, V, TABLE, LENS, PO, PML, stride_qb, stride_qh, stride_kb, stride_kh, stride_ks,
                        stride_tb, stride_pob, stride_poh, stride_pos, stride_pmb, stride_pmh, stride_pms,
                        G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
                     SCALE: tl.constexpr):
    b, kvh, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(LENS + b)
    start = sp * SPLIT
    end = tl.minimum(start + SPLIT, length)
    offs_g, offs_d = tl.arange(0, GP), tl.arange(0, D)
    gmask = offs_g < G
    heads = kvh * G + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for n in range(start, end, BLOCK):  # BLOCK == page size: one page per step
        page = tl.load(TABLE + b * stride_tb + n // BLOCK)
        offs = tl.arange(0, BLOCK)
        nmask = n + offs < end
        base = page * stride_kb + kvh * stride_kh + offs[:, None] * stride_ks + offs_d[None, :]
        k = tl.load(K + base, mask=nmask[:, None], other=0.0)
        s = tl.where(nmask[None, :], tl.dot(q, tl.trans(k)) * SCALE, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + base, mask=nmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    tl.store(PO + b * stride_pob + heads[:, None] * stride_poh + sp * stride_pos + offs_d[None, :], acc, mask=gmask[:, None])
    pml = PML + b * stride_pmb + heads * stride_pmh + sp * stride_pms
    tl.store(pml, m_i, mask=gmask)
    tl.store(pml + 1, l_i, mask=gmask)


PAGED_SPLIT = 256


def paged_attention(q, k_pages, v_pages, table, lengths, s):
    """KV in pages [NB, Hkv, PAGE, D]; table [B, S/PAGE] of page ids."""
    _, merge_kernel = decode_kernels()
    b, hq, d = q.shape
    hkv = k_pages.shape[1]
    g = hq // hkv
    split = min(PAGED_SPLIT, -(-s // PAGE) * PAGE)  # a fixed number of positions per program
    ns = -(-s // split)
    po = torch.empty((b, hq, ns, d), dtype=torch.float32, device=q.device)
    pml = torch.empty((b, hq, ns, 2), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _paged_split_kernel[(b, hkv, ns)](q, k_pages, v_pages, table, lengths, po, pml, q.stride(0), q.stride(1),
                                      k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), table.stride(0),
                                      po.stride(0), po.stride(1), po.stride(2), pml.stride(0), pml.stride(1), pml.stride(2),
                                      G=g, GP=max(16, 1 << (g - 1).bit_length()), D=d, BLOCK=PAGE, SPLIT=split, SCALE=d ** -0.5,
                                      num_warps=4, num_stages=2)
    merge_kernel[(b, hq)](po, pml, out, po.stride(0), po.stride(1), po.stride(2), pml.stride(0), pml.stride(1),
                          pml.stride(2), out.stride(0), out.stride(1), NS=ns, NSP=max(2, 1 << (ns - 1).bit_length()), D=d,
                          num_warps=4)
    return out


def gather_sdpa(q, k_pool, v_pool, rows, lengths):
    s = k_pool.shape[2]
    mask = (torch.arange(s, device=q.device)[None, :] < lengths[:, None])[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k_pool[rows], v_pool[rows], attn_mask=mask,
                                                            enable_gqa=True)[:, :, 0]


def bench(fn, rep: int = 300) -> float:
    """Median ms of a CUDA-graph replay of fn (launch gaps excluded, as in the engine's decode graphs)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=50, rep=rep, return_mode="median")


def copy_bandwidth() -> float:
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
    return 2 * x.numel() / (ms / 1000)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attention_cuda.json"))
    ap.add_argument("--max-seq-len", type=int, default=2048)
    a = ap.parse_args()
    torch.manual_seed(0)
    hq, hkv, d, s = 32, 8, 128, a.max_seq_len
    bw = copy_bandwidth()
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "shape": {"heads": hq, "kv_heads": hkv, "head_dim": d, "max_seq_len": s},
           "copy_bandwidth_TBps": round(bw / 1e12, 3), "runs": []}
    fused = torch.compile(pooled_attention_torch)
    for b in (1, 16, 64):
        p = b + 1
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        k_pool = torch.randn(p, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        v_pool = torch.randn_like(k_pool)
        rows = torch.randperm(p, device="cuda")[:b]
        lengths = torch.randint(1024, 1281, (b,), device="cuda")
        # The same cache, paged: row r's positions [j*PAGE, (j+1)*PAGE) live in page table[r, j] (shuffled pages).
        n_pages = s // PAGE
        perm = torch.randperm(p * n_pages, device="cuda")
        table_all = perm.view(p, n_pages)
        k_pages = torch.empty(p * n_pages, hkv, PAGE, d, device="cuda", dtype=torch.bfloat16)
        v_pages = torch.empty_like(k_pages)
        k_pages[table_all.flatten()] = k_pool.view(p, hkv, n_pages, PAGE, d).transpose(1, 2).reshape(-1, hkv, PAGE, d)
        v_pages[table_all.flatten()] = v_pool.view(p, hkv, n_pages, PAGE, d).transpose(1, 2).reshape(-1, hkv, PAGE, d)
        table = table_all[rows].contiguous()
        ref = pooled_attention(q.cpu().double(), k_pool.cpu().double(), v_pool.cpu().double(), rows.cpu(), lengths.cpu())
        needed = int(lengths.sum()) * hkv * d * 2 * 2 + 2 * q.numel() * 2
        variants = {
            "triton": lambda: kernels.decode_attention(q, k_pool, v_pool, rows, lengths),
            "paged_triton": lambda: paged_attention(q, k_pages, v_pages, table, lengths, s),
            "fused_torch": lambda: fused(q, k_pool, v_pool, rows, lengths),
            "gather_sdpa": lambda: gather_sdpa(q, k_pool, v_pool, rows, lengths),
        }
        for name, fn in variants.items():
            try:
                err = float((fn().cpu().double() - ref).norm() / ref.norm())
                ms = bench(fn)
                res["runs"].append({"batch": b, "variant": name, "ms": round(ms, 4), "rel_err_vs_fp64": err,
                                    "needed_bytes": needed, "share_of_copy_bw": round(needed / (ms / 1000) / bw, 3)})
            except Exception as e:  # keep the rest of the run
                res["runs"].append({"batch": b, "variant": name, "error": repr(e)[:300]})
            print(res["runs"][-1], flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"{'B':>3} {'variant':<14} {'ms':>8} {'bw share':>9} {'err':>9}")
    for r in res["runs"]:
        if "ms" in r:
            print(f"{r['batch']:>3} {r['variant']:<14} {r['ms']:>8.4f} {r['share_of_copy_bw']:>9.3f} "
                  f"{r['rel_err_vs_fp64']:>9.2e}")


if __name__ == "__main__":
    main()
