"""KV tiers on CUDA (run on a GPU machine): blocks evicted to page-locked host slots and to files come back into
device blocks with the bytes the device held, across CUDA graphs, and the host slots are page-locked in place."""

from __future__ import annotations

import pytest
import torch

import onecopy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = onecopy.SamplingParams(max_new_tokens=8)
PROMPT = list(range(3, 3 + 72))  # 4 full blocks of 16 and a partial one
NEXT = PROMPT + [500, 501, 502]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return onecopy.export("tiny-llama", tmp_path_factory.mktemp("b") / "tiers", max_seq_len=128, device="cuda",
                          dtype="bfloat16", progress=False)


def _run_next(engine) -> tuple[list[int], int, dict[str, torch.Tensor]]:
    r = engine.submit(NEXT, GREEDY, keep_session=True, stop_ids=[])
    tokens = r.result()
    state = {k: v[:, :len(NEXT)].clone() for k, v in r.session.state.items()}
    r.session.close()
    return tokens, r.cached_tokens, state


def _evict(engine) -> None:
    for i in range(6):
        engine.submit([600 + i] * 72, GREEDY, stop_ids=[]).result()
        if not engine.scheduler.kv.lookup(PROMPT, touch=False):
            return
    raise AssertionError("PROMPT's blocks stayed on the device")


def test_host_and_disk_tiers_restore_the_device_bytes_on_cuda(bundle, tmp_path):
    options = dict(kv_blocks=12, max_sessions=2)
    with onecopy.Engine.load(bundle, "cuda", **options) as e:  # the reference: a device cache hit
        e.submit(PROMPT, GREEDY, stop_ids=[]).result()
        want = _run_next(e)
        block = e.runner.blocks.block_bytes
    assert want[1] == 64
    with onecopy.Engine.load(bundle, "cuda", kv_host_bytes=64 * block, kv_disk_dir=tmp_path, **options) as e:
        store = e.runner.blocks.tiers
        assert store._registered and store.host_bytes == 64 * block  # page-locked in place: no rounding
        e.submit(PROMPT, GREEDY, stop_ids=[]).result()
        _evict(e)
        got = _run_next(e)
        assert e.scheduler.kv.tiers.stats.restored_host == 4
    assert got[:2] == want[:2]
    for k, v in want[2].items():
        assert torch.equal(got[2][k], v), k
    with onecopy.Engine.load(bundle, "cuda", kv_host_bytes=64 * block, kv_disk_dir=tmp_path, **options) as e:
        got = _run_next(e)  # a restart: the blocks saved at close come from the files
        assert e.scheduler.kv.tiers.stats.restored_disk == 4
    assert got[:2] == want[:2]
    for k, v in want[2].items():
        assert torch.equal(got[2][k], v), k
