"""A MoE decode step's routed experts grouped by expert (`kernels.moe`) against float64 and the eager step."""

import pytest
import torch

from onecopy.models.qwen3_5 import Experts

from ..qwen35_layers import random_experts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("e,d,inter,k", [(16, 64, 32, 4), (256, 2048, 512, 8)])  # tiny; Qwen3.5-35B-A3B's experts
def test_routed_experts_kernel_matches_float64_and_the_eager_step(e, d, inter, k):
    """1-64 rows (experts shared between rows at the larger sizes; past 16 rows an expert's pairs span several
    16-pair blocks): the kernels' output as close to float64 as the eager step's (bf16 on the GPU: Inductor-like
    rounding points, within 1.25x its mean error and 2x its largest), the last row's bits the same alone as beside
    the others (fixed 16-row tiles), and its GPU-graph replay equal to the eager launch."""
    from onecopy.kernels.moe import launch_moe_routed

    ex = random_experts(e, d, inter).to("cuda", torch.bfloat16)
    ref_ex = Experts(e, d, inter).to("cuda", torch.float64)  # the same bf16 values, in float64
    with torch.no_grad():
        ref_ex.gate_up_proj.copy_(ex.gate_up_proj.double()), ref_ex.down_proj.copy_(ex.down_proj.double())
    for n in (1, 3, 16, 64):
        x = torch.randn(n, d, device="cuda").to(torch.bfloat16)
        idx = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(n)])
        top = torch.softmax(torch.randn(n, k, device="cuda"), -1).to(torch.bfloat16)
        with torch.no_grad():
            got = launch_moe_routed(x, idx, top, ex.gate_up_proj, ex.down_proj)
            eager = ex.routed(x, idx, top)
            ref = ref_ex.routed(x.double(), idx, top.double())
        ge, ee = (got.double() - ref).abs(), (eager.double() - ref).abs()
        assert ge.mean() <= 1.25 * ee.mean() and ge.max() <= 2 * ee.max(), (e, n, ge.mean(), ee.mean(), ge.max(), ee.max())
        with torch.no_grad():
            alone = launch_moe_routed(x[-1:], idx[-1:], top[-1:], ex.gate_up_proj, ex.down_proj)
        assert torch.equal(alone[0], got[-1]), (e, n)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            out = launch_moe_routed(x, idx, top, ex.gate_up_proj, ex.down_proj)
        graph.replay()
        assert torch.equal(out, got), (e, n)
