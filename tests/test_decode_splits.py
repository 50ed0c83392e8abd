"""The decode attention's split policy (`kernels.tiles.decode_splits`), on CPU: every split of the table
below 128 rows of 8 KV heads (64 for an 8-bit cache), one per row from there, and, traced with a dynamic
batch, one exported program that picks per call (no guard specializes it to the batch it was traced with); the merge kernel's grid
(`merged_rows`) empty exactly when each row ran one split. The CUDA kernels that launch these splits, and
their batch-invariant variant: tests/gpu."""

import pytest
import torch

from onecopy.kernels.tiles import DECODE_PROGRAMS, DECODE_PROGRAMS_Q8, decode_splits, merged_rows, n_splits


@pytest.mark.parametrize("rows, want, want_q8", [(1, 16, 16), (16, 16, 16), (63, 16, 16), (64, 16, 1), (65, 16, 1),
                                                (127, 16, 1), (128, 1, 1), (256, 1, 1)])
def test_many_rows_run_one_split_each_and_few_rows_every_split(rows, want, want_q8):
    assert DECODE_PROGRAMS == 1024 and DECODE_PROGRAMS_Q8 == 512 and n_splits(4096) == 16
    assert decode_splits(rows, 8, n_splits(4096)) == want
    assert decode_splits(rows, 8, n_splits(4096), DECODE_PROGRAMS_Q8) == want_q8


def test_an_exported_decode_picks_its_splits_per_call():
    class Splits(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            splits = decode_splits(x.shape[0], 8, 16, DECODE_PROGRAMS_Q8)  # the split grid's third dimension
            return x.new_tensor([1, 0]) * splits + x.new_tensor([0, 1]) * merged_rows(x.shape[0], splits)

    batch = torch.export.Dim("batch", min=1, max=1024)
    ep = torch.export.export(Splits(), (torch.zeros(4, 3),), dynamic_shapes={"x": {0: batch}})
    for rows in (1, 7, 63, 64, 300, 1024):  # from 64 rows one split each and no merge launch (an empty grid)
        assert ep.module()(torch.zeros(rows, 3)).tolist() == ([1, 0] if rows >= 64 else [16, rows]), rows


@pytest.mark.parametrize("rows, splits, want", [(1, 16, 1), (63, 2, 63), (64, 1, 0), (300, 1, 0)])
def test_the_merge_runs_only_over_rows_of_several_splits(rows, splits, want):
    assert merged_rows(rows, splits) == want
