"""The named workspace pool (CPU; the same code serves CUDA graph static buffers)."""

import torch

from onecopy.runtime.workspace import Workspace


def test_same_key_returns_the_same_storage():
    ws = Workspace()
    a = ws.get("x", (4, 8), torch.float32)
    b = ws.get("x", (4, 8), torch.float32)
    c = ws.get("x", (2, 3), torch.float32)  # smaller request: a view of the same buffer
    assert a.data_ptr() == b.data_ptr() == c.data_ptr()
    assert c.shape == (2, 3) and len(ws) == 1


def test_zeroing_on_reuse():
    ws = Workspace(zero_on_reuse=True)
    ws.get("x", (16,), torch.float32).fill_(7)
    assert torch.equal(ws.get("x", (16,), torch.float32), torch.zeros(16))
    plain = Workspace()
    plain.get("x", (16,), torch.float32).fill_(7)
    assert torch.equal(plain.get("x", (16,), torch.float32), torch.full((16,), 7.0))
    assert torch.equal(plain.get("x", (16,), torch.float32, zero=True), torch.zeros(16))


def test_growth_replaces_the_buffer_never_a_list():
    ws = Workspace()
    small = ws.get("x", (10,), torch.float32)
    big = ws.get("x", (1000,), torch.float32)
    assert len(ws) == 1 and ws.replacements == 1 and ws.nbytes == 4000
    assert big.data_ptr() != small.data_ptr()
    again = ws.get("x", (500,), torch.float32)
    assert again.data_ptr() == big.data_ptr() and ws.replacements == 1


def test_dtype_and_device_never_mixed():
    ws = Workspace()
    f = ws.get("x", (8,), torch.float32)
    i = ws.get("x", (8,), torch.int64)
    m = ws.get("x", (8,), torch.float32, "meta")
    assert f.dtype == torch.float32 and i.dtype == torch.int64 and m.device.type == "meta"
    assert f.data_ptr() != i.data_ptr()
    assert len(ws) == 3
    ws.clear()
    assert len(ws) == 0 and ws.nbytes == 0
