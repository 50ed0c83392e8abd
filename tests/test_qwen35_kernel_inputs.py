"""The Qwen3.5 kernels' launchers refuse operands that do not describe their layer, naming them, before any
Triton is imported or launched (so these run on the CPU, in CI)."""

import pytest
import torch

from .qwen35_layers import random_deltanet


def test_deltanet_decode_refuses_pools_of_another_layer():
    from onecopy.kernels.deltanet import launch_deltanet_decode

    m = random_deltanet().to(torch.bfloat16)
    proj = torch.randn(2, m.in_proj.out_features, dtype=torch.bfloat16)
    conv = torch.zeros(4, m.conv_dim + 16, m.kernel, dtype=torch.bfloat16)
    rec = torch.zeros(4, m.nv, m.dk, m.dv)
    with pytest.raises(ValueError, match="do not describe one layer of 2 key heads"):
        launch_deltanet_decode(proj, conv, m.conv1d.weight, rec, m.A_log, m.dt_bias, m.norm.weight,
                               torch.tensor([0, 1]), torch.tensor([0, 0]), m.nk, 1e-6)


def test_chunk_scan_refuses_tiles_it_cannot_take():
    from onecopy.kernels.deltanet import launch_deltanet_chunk_scan

    h, n, c, dk, dv = 2, 3, 24, 16, 16
    z = torch.zeros
    with pytest.raises(ValueError, match="must be powers of two of 16 or more"):
        launch_deltanet_chunk_scan(z(h, n, c, dv), z(h, n, c, dk), z(h, n, c, dk), z(h, n, c, dk), z(h, n, c, c),
                                   z(h, n), z(h, dk, dv))
    with pytest.raises(ValueError, match="do not describe one prefill's chunks"):
        launch_deltanet_chunk_scan(z(h, n, 32, dv), z(h, n, 32, dk), z(h, n, 32, dk), z(h, n, 32, dk), z(h, n, 32, 32),
                                   z(h, n + 1), z(h, dk, dv))


def test_routed_experts_kernel_refuses_mismatched_weights():
    from onecopy.kernels.moe import launch_moe_routed

    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    idx, top = torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not match"):
        launch_moe_routed(x, idx, top, torch.zeros(4, 64, 64, dtype=torch.bfloat16),
                          torch.zeros(4, 64, 16, dtype=torch.bfloat16))
