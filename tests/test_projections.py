"""`projections.by_rows`: the batch-size switch the CUDA decode uses, checked inside a real CPU package."""

import torch
from torch import nn

from onecopy.export.exporter import EXTERNAL_WEIGHTS
from onecopy import kernels
from onecopy.models.projections import by_rows


class TwoPaths(nn.Module):
    """few rows: x @ w.T + 1; more: x @ w.T (so the output says which branch ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return by_rows(x.shape[0], lambda x, w: x @ w.t() + 1, lambda x, w: x @ w.t(),
                       (x, self.proj.weight))


def _compile(module: nn.Module, tmp_path):
    b = torch.export.Dim("batch", min=1, max=1024)
    ep = torch.export.export(module, (torch.randn(2, 8),), dynamic_shapes=({0: b},), strict=False)
    pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "m.pt2"),
                                                   inductor_configs=dict(EXTERNAL_WEIGHTS))
    return torch._inductor.aoti_load_package(pkg)


def test_by_rows_switches_on_the_host_per_batch_size_with_weights_bound_from_outside(tmp_path):
    compiled = _compile(TwoPaths(), tmp_path)
    assert compiled.get_constant_fqns() == ["proj.weight"]  # one weight, bound from outside: no copy per branch
    w = torch.randn(4, 8)
    compiled.load_constants({"proj.weight": w}, check_full_update=True, user_managed=True)
    few = kernels.SMALL_LINEAR_ROWS
    for n in (1, few, few + 1, 1024):
        x = torch.randn(n, 8)
        torch.testing.assert_close(compiled(x), x @ w.t() + (1 if n <= few else 0))


class TwoOutputs(nn.Module):
    """Like the Llama decode's "rest" segment: the few-rows branch also returns partial sums the other
    does not compute (an uninitialised placeholder of the same shape there)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def few(x, w):
            y = x @ w.t() + 1
            return y, y.pow(2).sum(-1, keepdim=True).expand(y.shape[0], 3).contiguous()

        def many(x, w):
            y = x @ w.t()
            return y, y.new_empty((y.shape[0], 3))

        return by_rows(x.shape[0], few, many, (x, self.proj.weight))


def test_by_rows_branches_may_return_tuples_with_a_placeholder_in_one(tmp_path):
    compiled = _compile(TwoOutputs(), tmp_path)
    w = torch.randn(4, 8)
    compiled.load_constants({"proj.weight": w}, check_full_update=True, user_managed=True)
    for n in (1, kernels.SMALL_LINEAR_ROWS, kernels.SMALL_LINEAR_ROWS + 1):
        x = torch.randn(n, 8)
        y, ss = compiled(x)
        few = n <= kernels.SMALL_LINEAR_ROWS
        torch.testing.assert_close(y, x @ w.t() + (1 if few else 0))
        assert ss.shape == (n, 3)
        if few:
            torch.testing.assert_close(ss[:, 0], y.pow(2).sum(-1))
