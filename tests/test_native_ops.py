"""The CUDA C++ kernels' plumbing that runs without a GPU: which op libraries an exported program calls (the
manifest's ``native_ops``, what the runtime loads before a package), the native decode's split policy, and
that CPU bundles name none. The kernels themselves: tests/gpu/test_native_decode_cuda.py."""

from __future__ import annotations

import json

import pytest
import torch

from onecopy.export.exporter import op_libraries
from onecopy.kernels import native
from onecopy.kernels.tiles import NATIVE_MAX_SPLITS, native_decode_splits


@torch.library.custom_op("onecopy_testlib::scale", mutates_args=())
def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.library.custom_op("onecopy_testlib::bump", mutates_args=("pool",))
def _bump(x: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    pool.add_(1)
    return x + 1


_scale.register_fake(lambda x: torch.empty_like(x))
_bump.register_fake(lambda x, pool: torch.empty_like(x))


class _Calls(torch.nn.Module):
    def __init__(self, mutate: bool):
        super().__init__()
        self.mutate = mutate
        self.register_buffer("pool", torch.zeros(3))

    def forward(self, x):
        y = torch.ops.onecopy_testlib.bump(x, self.pool) if self.mutate else torch.ops.onecopy_testlib.scale(x)
        return y.relu()


@pytest.mark.parametrize("mutate", [False, True], ids=["plain", "writes-its-input"])
def test_op_libraries_finds_calls_also_inside_auto_functionalized(mutate):
    ep = torch.export.export(_Calls(mutate), (torch.randn(3),)).run_decompositions()
    assert op_libraries(ep, ("onecopy_testlib",)) == ["onecopy_testlib"]
    assert op_libraries(ep, ("onecopy_native",)) == []  # aten ops and other libraries are not listed


def test_cpu_bundles_name_no_native_ops(tiny_bundle):
    methods = json.loads((tiny_bundle / "manifest.json").read_text())["methods"]
    assert {k: m["native_ops"] for k, m in methods.items()} == {k: [] for k in methods}


def test_native_splits_of_the_batch_invariant_decode_ignore_the_batch():
    for positions in (2048, 4096, 16384, 1 << 20):
        got = {native_decode_splits(rows, 8, positions, 132, invariant=True) for rows in (1, 7, 64, 256)}
        assert len(got) == 1, got  # a row's splits depend on its length alone
        splits, block = got.pop()
        assert 1 <= splits <= NATIVE_MAX_SPLITS and block == 256


def test_native_splits_fill_the_gpu_when_rows_are_few_and_stay_within_the_merge():
    # 4 CTAs per SM on 132 SMs: one split per row from 66 rows of 8 KV heads, more below, at most the pool's
    splits = {rows: native_decode_splits(rows, 8, 4096, 132, invariant=False)[0] for rows in (1, 16, 33, 66, 256)}
    assert splits == {1: 64, 16: 4, 33: 2, 66: 1, 256: 1}
    assert native_decode_splits(1, 8, 1 << 20, 132, invariant=False)[0] == 66  # capped by the GPU, not the pool
    assert native_decode_splits(1, 1, 1 << 20, 1000, invariant=False)[0] == NATIVE_MAX_SPLITS


def test_native_kernels_are_not_offered_without_a_cuda_device():
    assert not native.supported(128, 4, torch.int8, "cpu")
    assert not native.loaded()
