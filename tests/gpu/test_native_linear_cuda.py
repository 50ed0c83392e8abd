"""The native packed-projection kernels (kernels/native/packed_linear.cu) on CUDA: int4 / int8 weights in the
tile order the export writes, FP8 weights as stored, and bundles that use them (run on a GPU machine)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import onecopy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _weights(n: int, k: int) -> dict:
    """Tile-ordered weights of every layout and group the kernel takes, with their stored-order twins."""
    from onecopy.models.packed import Packed, tile_ordered
    from onecopy.models.quantize import quantize_weight

    w = torch.randn(n, k) / k ** 0.5
    out = {}
    for mode, g in (("int8", 128), ("int8", 32), ("int4", 128), ("int4", 32), ("int4", 64)):
        if k % g:
            continue
        p = quantize_weight(w, mode, g)
        out[f"{p.layout} g{g}"] = p
        if mode == "int4" and g != 64:  # q4z (GGUF Q4_0's layout): s * (q - 8)
            out[f"q4z g{g}"] = Packed("q4z", g, p.qweight, p.scales * 1.5)
    return {name: (tile_ordered(p).rebuild(tuple(t.cuda() for t in tile_ordered(p).tensors())),
                   p.rebuild(tuple(t.cuda() for t in p.tensors()))) for name, p in out.items()}


def _reference(x, exact, glu, residual, norm):
    xd = x.double()
    if norm is not None:
        g, _, eps = norm
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    ref = xd @ exact.double().t()
    if glu:
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    return ref if residual is None else ref + residual.double()


def _eager(x, exact, glu, residual, norm):
    """The eager bf16 model's ops on the same weight: RMSNorm (x * rstd, then the weight), F.linear, SwiGLU."""
    if norm is not None:
        g, parts, eps = norm
        x = (x.float() * torch.rsqrt(parts.sum(1, keepdim=True) / x.shape[1] + eps)).to(x.dtype) * g
    y = F.linear(x, exact.to(x.dtype))
    if glu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


def _fold_case(op: tuple, k: int, n_out: int, glu: bool, res: bool, norm: bool):
    """64 random rows with what the folds take (a residual, the norm's weight and x's partial sums of squares, each
    where asked), and ``call(lo, hi)``: the native packed op (operands ``op``: qweight, scales, mins, layout, group)
    on rows lo..hi with them."""
    from onecopy.kernels import native
    from onecopy.models.projections import sum_of_squares

    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(64, n_out, device="cuda", dtype=torch.bfloat16) if res else None
    g = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
    parts = torch.stack([sum_of_squares(c)[:, 0] for c in x.chunk(3, dim=1)], dim=1) if norm else None

    def call(lo, hi):
        nrm = (g, parts[lo:hi], 1e-5) if norm else None
        return native.packed_linear(x[lo:hi], *op, residual=None if r is None else r[lo:hi], glu=glu, norm=nrm)

    return x, r, g, parts, call


def _gemv_batches(rows: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """Batches of the FP8 GEMV (up to `rows`, fp8_gemv_rows) and row ranges inside each whose bits must equal the
    batch's: a row's bits do not depend on the batch within one plan, one n-tile of rows a CTA (up to 8 rows) or
    two (9-16: 8 warps a CTA, where a weight of few tiles takes 16 warps for up to 8 rows, another order of sums)."""
    return [(8, [(3, 4), (0, 5), (2, 8)])] + ([(rows, [(7, rows), (1, rows), (0, rows - 1)])] if rows > 8 else [])


def _gemm_weight(plain):
    """The weight as the packed GEMM multiplies it: s and m rounded to bf16, then s q + m rounded once to bf16."""
    from onecopy.models.packed import Packed, dequantize

    def r(t):
        return None if t is None else t.to(torch.bfloat16).float()

    return dequantize(Packed(plain.layout, plain.group, plain.qweight, r(plain.scales), r(plain.mins))).to(torch.bfloat16)


def test_native_packed_linear_matches_float64_and_is_batch_invariant():
    """Every tile-ordered layout and group, 1 to 96 rows, with the folds (norm, SwiGLU, residual): the native
    op (its kernel up to 32 rows, the packed GEMM past that where it serves, else and past 64 rows the weight
    unpacked for cuBLAS between the norm and fold kernels) against float64 of the float32
    dequantization, no looser than the Triton packed kernel on the same weight in its stored order; its sums
    of squares per 16 outputs are the rows' own; with ``invariant`` (the kernel at any batch size) a row's
    bits never depend on the rows beside it."""
    from onecopy import kernels
    from onecopy.kernels import native
    from onecopy.layouts import MMA_LAYOUT_IDS
    from onecopy.models.packed import LAYOUT_IDS, dequantize, kernel_linear
    from onecopy.models.projections import sum_of_squares

    torch.manual_seed(0)
    for n, k, glu, res, norm in [(4096, 4096, False, True, True), (2 * 1024, 4096, True, False, True),
                                 (1024, 576, False, False, False), (512, 14336, False, True, False)]:
        for name, (p, plain) in _weights(n, k).items():
            exact = dequantize(plain)
            n_out = n // 2 if glu else n
            tiles = kernels.packed_linear_tiles(n_out, glu, LAYOUT_IDS[plain.layout])
            pk = (plain.scales, plain.mins, LAYOUT_IDS[plain.layout], plain.group)
            for m in (1, 5, 16, 40, 64, 96):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                r = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16) if res else None
                g = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
                parts = torch.stack([sum_of_squares(c)[:, 0] for c in x.chunk(3, dim=1)], dim=1) if norm else None
                nrm = (g, parts, 1e-5) if norm else None
                out, ss = kernel_linear(x, p, residual=r, glu=glu, norm=nrm)
                triton = kernels.launch_linear(x, plain.qweight, r, glu, tiles, nrm, 16, pk)[0].double()
                ref = _reference(x, exact, glu, r, nrm)
                err, err_triton = float((out.double() - ref).abs().max()), float((triton - ref).abs().max())
                scale = float(ref.abs().max())
                assert out.shape == (m, n_out) and out.dtype == torch.bfloat16 and ss.shape == (m, n_out // 16)
                # past the kernel's rows the op (the packed GEMM, or cuBLAS and the fold kernels) rounds as the
                # eager bf16 model does on the weight as the GEMM dequantizes it: no looser than that model
                err_eager = float((_eager(x, _gemm_weight(plain), glu, r, nrm).double() - ref).abs().max()) \
                    if m > native.KERNEL_MAX_ROWS else 0.0
                assert err <= max(1.5 * err_triton, 1.5 * err_eager, 8e-3 * scale), (name, n, k, m, err, err_triton,
                                                                                     err_eager, scale)  # ~1 bf16 ulp
                want_ss = out.float().reshape(m, n_out // 16, 16).pow(2).sum(-1)
                torch.testing.assert_close(ss, want_ss, rtol=1e-5, atol=1e-5)
            x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
            op = (p.qweight, p.scales, p.mins, MMA_LAYOUT_IDS[p.layout], p.group)
            whole = native.packed_linear(x, *op, glu=glu, invariant=True)  # the kernel at 64 rows too
            for lo, hi in ((37, 38), (0, 8), (30, 46), (5, 38)):
                part = native.packed_linear(x[lo:hi], *op, glu=glu, invariant=True)
                assert torch.equal(whole[0][lo:hi], part[0]) and torch.equal(whole[1][lo:hi], part[1]), (name, lo, hi)
                if 8 < hi - lo <= native.KERNEL_MAX_ROWS:  # the default op runs the invariant kernel's plan there
                    assert torch.equal(native.packed_linear(x[lo:hi], *op, glu=glu)[0], part[0]), (name, lo, hi)
            # up to 8 rows the default op may take 16-warp CTAs (a weight of few tiles): its own rows still agree
            # whatever the batch up to 8
            few = native.packed_linear(x[32:40], *op, glu=glu)[0]
            assert torch.equal(native.packed_linear(x[37:38], *op, glu=glu)[0], few[5:6]), name
            assert torch.equal(native.packed_linear(x[33:36], *op, glu=glu)[0], few[1:4]), name


def test_native_packed_linear_rows_stay_independent_with_folds_and_many_tiles_a_cta():
    """What the first test leaves out: a row's bits with the norm and residual folds (x staged and x's group sums
    computed in shared memory at few rows, read from L2 at many: the same bits), with more tiles than the
    persistent grid has CTAs (a CTA's second tile: the double-buffered reduction), 8-warp CTAs (weights of 528
    and more tiles; fewer take 16 warps) with and without SwiGLU, int8 with groups of 64 and an odd number of
    chunks (K = 544, int8 g32; K = 576, int4 g64); each against float64 as well."""
    from onecopy.kernels import native
    from onecopy.layouts import MMA_LAYOUT_IDS
    from onecopy.models.packed import dequantize, tile_ordered
    from onecopy.models.projections import sum_of_squares
    from onecopy.models.quantize import quantize_weight

    torch.manual_seed(1)
    cases = [("int4", 128, 4096, 4096, False, True, True), ("int4", 128, 2 * 2048, 4096, True, False, True),
             ("int8", 64, 4096, 4096, False, True, True), ("int4", 128, 16384, 1024, False, False, False),
             ("int8", 128, 16384, 1024, False, True, False), ("int4", 128, 2 * 9216, 1024, True, False, True),
             ("int8", 32, 512, 544, False, False, True),
             ("int4", 64, 512, 576, False, True, True)]
    for mode, group, n, k, glu, res, norm in cases:
        plain = quantize_weight(torch.randn(n, k) / k ** 0.5, mode, group)
        plain = plain.rebuild(tuple(t.cuda() for t in plain.tensors()))
        p = tile_ordered(plain)
        op = (p.qweight, p.scales, p.mins, MMA_LAYOUT_IDS[p.layout], p.group)
        n_out = n // 2 if glu else n
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(64, n_out, device="cuda", dtype=torch.bfloat16) if res else None
        g = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
        parts = torch.stack([sum_of_squares(c)[:, 0] for c in x.chunk(3, dim=1)], dim=1) if norm else None

        def call(lo, hi, invariant=True):
            nrm = (g, parts[lo:hi], 1e-5) if norm else None
            return native.packed_linear(x[lo:hi], *op, residual=None if r is None else r[lo:hi], glu=glu, norm=nrm,
                                        invariant=invariant)

        whole = call(0, 64)
        for lo, hi in ((37, 38), (0, 5), (3, 11), (30, 46), (5, 38)):
            part = call(lo, hi)
            assert torch.equal(whole[0][lo:hi], part[0]) and torch.equal(whole[1][lo:hi], part[1]), \
                (mode, group, n, k, lo, hi)
        exact, r5, n5 = dequantize(plain), None if r is None else r[:5], (g, parts[:5], 1e-5) if norm else None
        ref = _reference(x[:5], exact, glu, r5, n5)
        err = float((call(0, 5, invariant=False)[0].double() - ref).abs().max())
        err_eager = float((_eager(x[:5], exact, glu, r5, n5).double() - ref).abs().max())
        assert err <= max(1.5 * err_eager, 8e-3 * float(ref.abs().max())), (mode, group, n, k, err, err_eager)


def test_native_packed_gemm_matches_float64_for_many_rows_and_is_deterministic():
    """The packed GEMM (kernels/native/packed_gemm.cu) for 16 to 300 rows, every layout and group: within two bf16
    ulps of float64 on the weight as it dequantizes it (s and m in bf16, s q + m rounded once to bf16: Marlin's
    arithmetic), and within 6x of the eager bf16 product on the float32 dequantization; weights of enough
    256-feature blocks for the GEMM (17408 = 68 whole blocks; 17424 = 1089 tiles: its last block one tile, a warp's
    second tile and seven warps' tiles empty) and, on Hopper, weights of few blocks whose K a cluster of CTAs splits
    (4096 x 4096: 16 blocks, 4 splits of 8 stages; 6144 x 1024: 24 blocks, 4 splits of 2 stages; 4112 x 1024: a last
    block of one tile), which it takes (not cuBLAS's bits on the unpacked weight), and the paths it leaves to cuBLAS
    on the unpacked weight (few blocks before Hopper; K = 576, not a multiple of the 128-value stage; past 64 rows);
    the same bits on every call; on Hopper 33 to 512 rows of a weight of 128-multiple N and K go to the wgmma kernel
    (packed_wgmma's bits). The decode op without folds takes the GEMM past 8 rows where it serves, past 16
    where it splits K (its rows' sums of squares its own)."""
    from onecopy.kernels import native
    from onecopy.layouts import MMA_LAYOUT_IDS
    from onecopy.models.packed import dequantize

    torch.manual_seed(2)
    split = torch.cuda.get_device_capability() >= (9, 0)  # thread-block clusters
    wgmma = torch.cuda.get_device_capability() == (9, 0)  # 33 to 512 rows: packed_wgmma.cu
    served = (17408, 17424) + ((4096, 6144, 4112) if split else ())
    for n, k in ((17408, 1024), (17424, 1024), (4096, 4096), (6144, 1024), (4112, 1024), (512, 576)):
        for name, (p, plain) in _weights(n, k).items():
            op = (p.qweight, p.scales, p.mins, MMA_LAYOUT_IDS[p.layout], p.group)
            exact, as_read = dequantize(plain), _gemm_weight(plain)
            for m in (16, 17, 33, 64, 65, 130):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = native.packed_gemm(x, *op)
                assert out.shape == (m, n) and out.dtype == torch.bfloat16, (name, n, k, m)
                ref = x.double() @ exact.double().t()
                err = float((out.double() - ref).abs().max())
                err_eager = float((F.linear(x, exact.to(torch.bfloat16)).double() - ref).abs().max())
                assert err <= 6 * err_eager, (name, n, k, m, err, err_eager)
                unpacked = F.linear(x, native.unpack(*op, torch.bfloat16))
                if wgmma and 33 <= m <= 512 and n % 128 == 0 and k % 128 == 0:  # Hopper: the wgmma kernel
                    assert torch.equal(out, native.packed_wgmma(x, *op)), (name, n, k, m)
                    assert not torch.equal(out, unpacked), (name, n, k, m)
                elif n in served and m <= 64:  # the GEMM's own arithmetic, not cuBLAS's
                    ref_read = x.double() @ as_read.double().t()
                    err_read = float((out.double() - ref_read).abs().max())
                    assert err_read <= 8e-3 * float(ref_read.abs().max()), (name, n, k, m, err_read)
                    assert not torch.equal(out, unpacked), (name, n, k, m)
                else:
                    assert torch.equal(out, unpacked), (name, n, k, m)
                assert torch.equal(native.packed_gemm(x, *op), out), (name, n, k, m)
                if n in served and (16 if n < 17408 else 8) < m <= native.KERNEL_MAX_ROWS:  # split: GEMV to 16
                    y, ss = native.packed_linear(x, *op)
                    assert torch.equal(y, out), (name, m)
                    torch.testing.assert_close(ss, y.float().reshape(m, n // 16, 16).pow(2).sum(-1), rtol=1e-5,
                                               atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="wgmma: compute capability 9.0 (H100 / H200)")
def test_native_packed_wgmma_matches_float64_on_the_weight_as_it_dequantizes_it():
    """The warpgroup-MMA kernel (kernels/native/packed_wgmma.cu), every layout and group, 1 to 1024 rows (64-, 128-
    and 256-row blocks, a partial last block): within two bf16 ulps of float64 on the weight as it dequantizes it (s and m
    in bf16, s q + m rounded once to bf16, as the packed GEMM), and within 6x of the eager bf16 product on the
    float32 dequantization; the same bits on every call; shapes and block sizes it refuses are refused by name.
    What it checks first when it fails: an exactly representable case (power-of-two scales, x one-hot) names the
    (feature, k) read wrong."""
    from onecopy.kernels import native
    from onecopy.layouts import MMA_LAYOUT_IDS
    from onecopy.models.packed import dequantize

    torch.manual_seed(3)
    for n, k in ((256, 1024), (4096, 4096), (1024, 14336)):
        for name, (p, plain) in _weights(n, k).items():
            op = (p.qweight, p.scales, p.mins, MMA_LAYOUT_IDS[p.layout], p.group)
            exact, as_read = dequantize(plain), _gemm_weight(plain)
            if n == 256:  # x one-hot: output column j of row i is the weight's (j, i) as read (to an ulp: the
                # reference rounds s q + m twice, through float32)
                eye = torch.eye(128, k, device="cuda", dtype=torch.bfloat16)
                got = native.packed_wgmma(eye, *op).float()
                want = as_read[:, :128].t().float()
                bad = (~((got - want).abs() <= want.abs() * 2 ** -7)).nonzero()  # NaN counts as wrong
                assert bad.numel() == 0, (name, "first wrong (k, feature):", bad[:4].tolist())
            for m in ((1, 40, 64, 65, 200, 1024) if n == 256 else (64, 128, 300)):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = native.packed_wgmma(x, *op)
                assert out.shape == (m, n) and out.dtype == torch.bfloat16, (name, n, k, m)
                ref_read = x.double() @ as_read.double().t()
                err_read = float((out.double() - ref_read).abs().max())
                assert err_read <= 8e-3 * float(ref_read.abs().max()), (name, n, k, m, err_read)
                ref = x.double() @ exact.double().t()
                err = float((out.double() - ref).abs().max())
                err_eager = float((F.linear(x, exact.to(torch.bfloat16)).double() - ref).abs().max())
                assert err <= 6 * err_eager, (name, n, k, m, err, err_eager)
                assert torch.equal(native.packed_wgmma(x, *op), out), (name, n, k, m)
                if m in (200, 300):  # every block size the kernel has (its own pick by the blocks it makes)
                    for nb in (64, 128, 256):
                        other = native.packed_wgmma(x, *op, nb).double()
                        assert float((other - ref_read).abs().max()) <= 8e-3 * float(ref_read.abs().max()), (name, m, nb)
    p, _ = _weights(4112, 1024)["q4a g128"]
    with pytest.raises(RuntimeError, match="N a multiple of 128"):
        native.packed_wgmma(torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16), p.qweight, p.scales, p.mins,
                            MMA_LAYOUT_IDS[p.layout], p.group)
    p, _ = _weights(256, 1024)["q4a g128"]
    with pytest.raises(RuntimeError, match=r"block_rows must be 64, 128 or 256 \(0: the kernel picks\), got 32"):
        native.packed_wgmma(torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16), p.qweight, p.scales, p.mins,
                            MMA_LAYOUT_IDS[p.layout], p.group, 32)


def test_native_packed_linear_takes_the_gemm_with_its_folds_past_8_rows():
    """9 to 64 rows of a weight the packed GEMM serves (enough output blocks, the SwiGLU one's last block holding one
    gate tile of 8; on Hopper also few blocks, K split over a cluster): the decode op runs the GEMM with its folds
    (the RMSNorm before as one kernel, the eager x * rstd then the weight; SwiGLU or the residual add after; the
    rows' sums of squares), against float64 no looser than the eager bf16 model on the weight as the GEMM
    dequantizes it; a row's bits do not depend on the rows beside it from 9 to 32 rows (blocks of 16 and 32; from 17
    where K is split) and from 33 to 64 (on Hopper the wgmma kernel between the norm and fold kernels where it serves
    the weight: the same bits in a CUDA graph)."""
    from onecopy.kernels import native
    from onecopy.layouts import MMA_LAYOUT_IDS
    from onecopy.models.packed import dequantize, tile_ordered
    from onecopy.models.quantize import quantize_weight

    torch.manual_seed(3)
    split = torch.cuda.get_device_capability() >= (9, 0)
    wgmma = torch.cuda.get_device_capability() == (9, 0)
    for mode, group, n, k, glu, res, norm in [("int4", 128, 2 * 9232, 1024, True, False, True),  # 577 tiles: 73 blocks
                                               ("int8", 128, 17408, 1024, False, True, True),
                                               ("int4", 32, 17408, 1024, False, True, False)] + (
            # few blocks, K split over a cluster (Hopper): qkv's norm fold, o's residual with a last block of one
            # tile, a SwiGLU weight of 16 blocks
            [("int4", 128, 6144, 1024, False, False, True), ("int8", 64, 4112, 1024, False, True, False),
             ("int4", 64, 2 * 2048, 1024, True, False, True)]
            if split else []):
        plain = quantize_weight(torch.randn(n, k) / k ** 0.5, mode, group)
        plain = plain.rebuild(tuple(t.cuda() for t in plain.tensors()))
        p = tile_ordered(plain)
        op = (p.qweight, p.scales, p.mins, MMA_LAYOUT_IDS[p.layout], p.group)
        n_out = n // 2 if glu else n
        x, r, g, parts, call = _fold_case(op, k, n_out, glu, res, norm)

        # a row's bits from 9 to 32 rows (the GEMM) and from 33 to 64 (the GEMM, or on Hopper the wgmma kernel and
        # the fold kernels where it serves the weight) do not depend on the rows beside it
        for whole, spans in ((call(0, 32), ((0, 9), (0, 17), (10, 32))), (call(0, 64), ((5, 64), (24, 64)))):
            for lo, hi in spans:
                if n < 17408 and hi - lo <= 16:  # a split weight keeps the GEMV up to 16 rows
                    continue
                part = call(lo, hi)
                assert torch.equal(whole[0][lo:hi], part[0]) and torch.equal(whole[1][lo:hi], part[1]), (mode, lo, hi)
        if wgmma and n % 128 == 0:  # the wgmma path in a CUDA graph: the eager bits
            eager = call(0, 64)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = call(0, 64)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1]), (mode, group, n)
        exact, as_read = dequantize(plain), _gemm_weight(plain)
        for m in (9, 17, 32, 64):
            out, ss = call(0, m)
            rm, nm = None if r is None else r[:m], (g, parts[:m], 1e-5) if norm else None
            ref = _reference(x[:m], exact, glu, rm, nm)
            err = float((out.double() - ref).abs().max())
            err_eager = float((_eager(x[:m], as_read, glu, rm, nm).double() - ref).abs().max())
            assert err <= max(1.5 * err_eager, 8e-3 * float(ref.abs().max())), (mode, group, m, err, err_eager)
            torch.testing.assert_close(ss, out.float().reshape(m, n_out // 16, 16).pow(2).sum(-1), rtol=1e-5,
                                       atol=1e-5)
            if n < 17408 and res and not norm and m > 16:  # the split GEMM ran (the GEMV's bits differ): its
                # output and the residual added as the eager op does
                gemm = native.packed_gemm(x[:m], *op)
                assert torch.equal(out, (r[:m].float() + gemm.float()).to(torch.bfloat16)), (mode, group, m)


def test_native_packed_linear_refuses_misaligned_or_mismatched_scales():
    """The kernel copies weights, scales and mins 16 bytes at a time: a view that starts off a 16-byte boundary
    is refused with the fix named, as are mins that are not float32 and shaped as the scales."""
    from onecopy.kernels import native
    from onecopy.layouts import MMA_LAYOUT_IDS

    p, _ = _weights(512, 1024)["q4a g128"]
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    off = torch.empty(p.scales.numel() + 1, device="cuda")[1:].view_as(p.scales).copy_(p.scales)  # 4 bytes off
    with pytest.raises(RuntimeError, match=r"qweight, scales and mins must start at 16-byte aligned addresses .*"
                                           r"pass a copy \(\.clone\(\)\)"):
        native.packed_linear(x, p.qweight, off, p.mins, MMA_LAYOUT_IDS[p.layout], p.group)
    with pytest.raises(RuntimeError, match="mins must be float32 and contiguous, shaped as the scales"):
        native.packed_linear(x, p.qweight, p.scales, p.mins[:, :-1], MMA_LAYOUT_IDS[p.layout], p.group)


def test_native_unpack_equals_the_torch_dequantization():
    """The prefill's float copy of a tile-ordered weight (`kernels.native.unpack`) bit for bit
    `models.packed.dequantize` (s * q, + m: two roundings in fp32, then one to the dtype)."""
    from onecopy.kernels import native
    from onecopy.layouts import MMA_LAYOUT_IDS
    from onecopy.models.packed import dequantize

    torch.manual_seed(0)
    for name, (p, plain) in _weights(1024, 576).items():
        for dtype in (torch.bfloat16, torch.float16):
            got = native.unpack(p.qweight, p.scales, p.mins, MMA_LAYOUT_IDS[p.layout], p.group, dtype)
            assert torch.equal(got, dequantize(plain, dtype)), (name, dtype)
            assert torch.equal(got, dequantize(p, dtype)), (name, dtype)  # the traceable read of the tile order


def test_native_fp8_linear_matches_float64_and_past_its_rows_the_scaled_mm_path():
    """FP8 weights: up to fp8_gemv_rows (16 rows for weights of up to 8192 outputs, else 8) the packed GEMV (bf16
    rows against the exact bf16 of each e4m3 value, the feature's scale after the sums; 8- and 16-warp CTAs by the
    weight's tiles) against float64 of the same weight, a row's bits independent of the batch within a plan
    (`_gemv_batches`); past those rows the op quantizes the rows in one kernel and runs ``_scaled_mm``, bit for
    bit `quantize_rows` + ``_scaled_mm`` as the torch path does."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores: sm_89+")
    from onecopy.kernels import native
    from onecopy.models.packed import quantize_rows
    from onecopy.models.quantize import quantize_weight

    torch.manual_seed(0)
    for n, k in ((4096, 4096), (1024, 576), (6144, 14336)):
        w = quantize_weight(torch.randn(n, k) / k ** 0.5, "fp8", k)
        qw, sw = w.qweight.cuda(), w.scales.cuda()
        exact = qw.double() * sw.double()
        rows = native.fp8_gemv_rows(n)
        for m in sorted({1, 3, 5, 8, rows}):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
            got = native.fp8_linear(x, qw, sw)
            ref = x.double() @ exact.t()
            err, scale = float((got.double() - ref).abs().max()), float(ref.abs().max())
            assert got.dtype == torch.bfloat16 and err <= 8e-3 * scale, (n, k, m, err, scale)  # ~1 bf16 ulp
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        for size, slices in _gemv_batches(rows):
            whole = native.fp8_linear(x[:size], qw, sw)
            for lo, hi in slices:
                assert torch.equal(whole[lo:hi], native.fp8_linear(x[lo:hi], qw, sw)), (n, k, lo, hi)
        for m in (rows + 1, rows + 7, 40):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q, s = quantize_rows(x)
            want = torch._scaled_mm(q, qw.t(), scale_a=s, scale_b=sw.reshape(1, -1), out_dtype=x.dtype)
            assert torch.equal(native.fp8_linear(x, qw, sw), want), (n, k, m)


def test_native_fp8_identity_weight_shows_each_path_s_rows():
    """An identity weight shows the rows each path multiplies: the GEMV's are x itself (every e4m3 value, here 1,
    is exact in bf16 and so is the scale's 2^112 round trip), the GEMM's (past fp8_gemv_rows) e4m3(x / s) * s with
    s = max |x| * fl(1/448), bit for bit `quantize_rows` on CUDA (torch divides by a Python number with its
    reciprocal: before the quantization did the same, 9 of 40 such trials had values on the other e4m3
    neighbour, H200)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores: sm_89+")
    from onecopy.kernels import native
    from onecopy.models.packed import quantize_rows

    torch.manual_seed(0)
    for trial in range(10):
        k = 14336 if trial % 2 == 0 else 4096
        eye = torch.eye(k, device="cuda").to(torch.float8_e4m3fn)
        x = torch.randn(native.fp8_gemv_rows(k) + 4, k, device="cuda", dtype=torch.bfloat16) * 3
        assert torch.equal(native.fp8_linear(x[:3], eye, torch.ones(k, device="cuda")), x[:3]), trial
        q, s = quantize_rows(x)
        got = native.fp8_linear(x, eye, torch.ones(k, device="cuda"))
        assert torch.equal(got, (q.float() * s).to(torch.bfloat16)), trial


def test_native_fp8_glu_linear_makes_the_swiglu_rows_in_one_pass():
    """fp8_glu_linear(x [M, 2K], w) is fp8_linear(silu(gate) * up, w): up to fp8_gemv_rows the SwiGLU rows made in
    one kernel for the GEMV, past that made and quantized in one kernel for ``_scaled_mm``. An identity weight shows
    the rows: the eager products (silu, then the product, each rounded to bf16) up to those rows, those `quantize_rows`
    gives them past that, but for the rare product that the kernel's exp rounds to the other bf16 neighbour. A
    view whose rows are not 16-byte aligned takes ATen's ops: bit for bit the unfused op on the eager products."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores: sm_89+")
    from onecopy.kernels import native
    from onecopy.models.packed import quantize_rows
    from onecopy.models.quantize import quantize_weight

    torch.manual_seed(0)
    for k in (4096, 14336):
        eye = torch.eye(k, device="cuda").to(torch.float8_e4m3fn)
        ones = torch.ones(k, device="cuda")
        for m in (1, 3, 8, 9, 16, 17, 64):
            x = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16) * 3
            gate, up = x.split([k, k], dim=-1)
            rows = F.silu(gate) * up
            q, s = quantize_rows(rows)
            got = native.fp8_glu_linear(x, eye, ones)
            want = rows if m <= native.fp8_gemv_rows(k) else (q.float() * s).to(torch.bfloat16)
            assert got.shape == (m, k) and got.dtype == torch.bfloat16
            assert float((got != want).float().mean()) < 1e-3, (k, m)
            assert float((got.float() - want.float()).abs().max()) <= 0.125 * float(want.float().abs().max()), (k, m)
    w = quantize_weight(torch.randn(4096, 14336) / 14336 ** 0.5, "fp8", 14336)
    qw, sw = w.qweight.cuda(), w.scales.cuda()
    wide = torch.randn(40, 2 * 14336 + 8, device="cuda", dtype=torch.bfloat16)
    for m in (5, 40):
        x = wide[:m, 1:1 + 2 * 14336]  # rows 2 bytes past 16-byte alignment
        gate, up = x.split([14336, 14336], dim=-1)
        assert torch.equal(native.fp8_glu_linear(x, qw, sw), native.fp8_linear(F.silu(gate) * up, qw, sw)), m
        x = wide[:m, :2 * 14336].contiguous()
        gate, up = x.split([14336, 14336], dim=-1)
        got, want = native.fp8_glu_linear(x, qw, sw).double(), native.fp8_linear(F.silu(gate) * up, qw, sw).double()
        assert float((got - want).norm() / want.norm()) < 1e-2, m


def test_native_packed_linear_takes_fp8_weights_with_the_folds():
    """An f8r weight through the decode step's packed op (layouts.F8R_NATIVE_ID, group K) with the folds (the norm
    before, SwiGLU of a fused gate/up weight or the residual after, the rows' sums of squares): up to fp8_gemv_rows
    the GEMV against float64 (a row's bits independent of the batch within a plan), past them the norm kernel, the
    rows quantized for cuBLAS's FP8 GEMM and the fold kernel against float64 of the quantized rows; no
    batch-invariant form, and an int8 weight named f8r is refused."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores: sm_89+")
    from onecopy.kernels import native
    from onecopy.layouts import F8R_NATIVE_ID
    from onecopy.models.packed import quantize_rows
    from onecopy.models.quantize import quantize_weight

    torch.manual_seed(5)
    for n, k, glu, res, norm in [(4096, 4096, False, True, False), (2 * 2048, 4096, True, False, True),
                                 (6144, 4096, False, False, True), (4096, 14336, False, True, False)]:
        w = quantize_weight(torch.randn(n, k) / k ** 0.5, "fp8", k)
        qw, sw = w.qweight.cuda(), w.scales.cuda()
        exact = (qw.double() * sw.double()).float()
        n_out = n // 2 if glu else n
        x, r, g, parts, call = _fold_case((qw, sw, None, F8R_NATIVE_ID, k), k, n_out, glu, res, norm)

        for size, slices in _gemv_batches(native.fp8_gemv_rows(n)):
            whole = call(0, size)
            for lo, hi in slices:
                part = call(lo, hi)
                assert torch.equal(whole[0][lo:hi], part[0]) and torch.equal(whole[1][lo:hi], part[1]), (n, k, lo, hi)
        for m in (1, 5, 8, 9, 12, 16, 17, 64):
            out, ss = call(0, m)
            rm, nm = None if r is None else r[:m], (g, parts[:m], 1e-5) if norm else None
            if m <= native.fp8_gemv_rows(n):
                ref = _reference(x[:m], exact, glu, rm, nm)
            else:  # the rows the GEMM multiplies: the norm's (as the eager model makes them), quantized to e4m3
                xn = x[:m] if nm is None else (x[:m].float() * torch.rsqrt(parts[:m].sum(1, keepdim=True) / k + 1e-5)
                                               ).to(torch.bfloat16) * g
                q, s = quantize_rows(xn)
                ref = _reference((q.double() * s.double()), exact, glu, rm, None)
            err, scale = float((out.double() - ref).abs().max()), float(ref.abs().max())
            assert out.shape == (m, n_out) and err <= 8e-3 * scale, (n, k, m, err, scale)
            torch.testing.assert_close(ss, out.float().reshape(m, n_out // 16, 16).pow(2).sum(-1), rtol=1e-5,
                                       atol=1e-5)
        with pytest.raises(RuntimeError, match="batch-invariant"):
            native.packed_linear(x[:2], qw, sw, None, F8R_NATIVE_ID, k, glu=glu, invariant=True)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        native.packed_linear(x[:2], qw.view(torch.int8), sw, None, F8R_NATIVE_ID, k)


@pytest.fixture(scope="module")
def int4_native(tmp_path_factory):
    return onecopy.export("tiny-llama", tmp_path_factory.mktemp("b") / "int4", max_seq_len=128, device="cuda",
                          quantize="int4", group_size=32, progress=False)


def test_int4_bundle_holds_the_tile_order_and_decodes_batch_invariantly(int4_native):
    """A CUDA export writes its int4 projections in the native kernel's tile order (the manifest says q4a_mma
    and lists the native library), binds each packed tensor once for both methods, and its deterministic
    engine gives a session the same tokens batched as alone."""
    from onecopy.kernels import native

    prompt = [5, 77, 300, 12, 9, 401, 3]
    params = onecopy.SamplingParams(max_new_tokens=24)
    with onecopy.Engine.load(int4_native, "cuda", max_sessions=4, deterministic=True) as e:
        layouts = {p["layout"] for p in e.manifest.packed.values()}
        assert layouts == {"q4a_mma"}, layouts
        assert all(native.LIBRARY in m.native_ops for m in e.manifest.methods.values())
        q = "layers.0.feed_forward.w13.qweight"
        assert e.method("prefill").bound[q] == e.method(e.role_method("decode")).bound[q] == e.weights.get(q).data_ptr()
        alone = list(e.open_session().generate_ids(prompt, params, stop_ids=[]))
        streams = [e.submit(prompt if i == 0 else [i + 1, 2, 3], params, stop_ids=[]) for i in range(4)]
        assert [s.result(timeout=120) for s in streams][0] == alone
    with onecopy.Engine.load(int4_native, "cuda", max_sessions=4, cuda_graphs=False) as e:
        eager = list(e.open_session().generate_ids(prompt, params, stop_ids=[]))
    with onecopy.Engine.load(int4_native, "cuda", max_sessions=4, cuda_graphs=True) as e:
        graph = list(e.open_session().generate_ids(prompt, params, stop_ids=[]))
    assert graph == eager
