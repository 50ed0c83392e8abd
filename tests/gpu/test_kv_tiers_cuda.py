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
        engine.submit([400 + i] * 72, GREEDY, stop_ids=[]).result()
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


def test_interleaved_prompts_through_every_tier_on_cuda(bundle, tmp_path):
    """The CPU test's random interleaving on CUDA, where saves copy to the host on their own stream while loads
    and steps go on: every request's prompt state is a whole prefill's (bf16 roundings; a wrong or half-copied
    block would be far off), with saves, spills, drops and host and disk loads all happening."""
    import random

    rng = random.Random(0)
    one = onecopy.SamplingParams(max_new_tokens=1)
    bases = [[rng.randrange(3, 400) for _ in range(40)] for _ in range(6)]
    with onecopy.Engine.load(bundle, "cuda", kv_blocks=8, max_sessions=2, prefix_cache=False) as plain:
        block = plain.runner.blocks.block_bytes
        with onecopy.Engine.load(bundle, "cuda", kv_blocks=8, max_sessions=2, kv_host_bytes=4 * block,
                                 kv_disk_dir=tmp_path, kv_disk_bytes=4 * block) as tiered:
            for _ in range(80):
                prompt = rng.choice(bases)[:rng.choice((33, 40))] + [rng.randrange(3, 400) for _ in range(rng.randrange(4))]
                got = tiered.submit(prompt, one, keep_session=True, stop_ids=[])
                want = plain.submit(prompt, one, keep_session=True, stop_ids=[])
                got.result(), want.result()
                for k, v in want.session.state.items():
                    a, b = got.session.state[k][:, :len(prompt)].float(), v[:, :len(prompt)].float()
                    torch.testing.assert_close(a, b, rtol=0.05, atol=0.05, msg=k)
                got.session.close()
                want.session.close()
            s = tiered.scheduler.kv.tiers.stats
            assert s.restored_host and s.restored_disk and s.spilled and s.dropped, s


def test_a_slot_saved_on_the_copy_stream_is_spilled_with_its_new_bytes(bundle, tmp_path):
    """Saves copy to the host on their own stream: with the step's stream held up (so the copies are still to come),
    a save, a load from another just-saved slot (the step's stream waits for the copies) and a spill of the first
    slot (the host must wait too) write the block's bytes to the file, not the slot's old ones."""
    from onecopy.runtime.plan import LoadBlock, SaveBlock, SpillSlot

    with onecopy.Engine.load(bundle, "cuda", kv_blocks=12, max_sessions=2, kv_host_bytes=1 << 22,
                             kv_disk_dir=tmp_path) as e:
        store, blocks = e.runner.blocks.tiers, e.runner.blocks.tensors
        key = b"k" * 16
        with e.loop.lock:  # nothing else runs
            for i, t in enumerate(blocks.values()):
                t[0].copy_(torch.randn(t[0].shape, device="cuda").to(t.dtype))
                t[1].fill_(i + 1)
            want = store._gather(blocks, [0]).cpu()[0]
            torch.cuda.synchronize()
            torch.cuda._sleep(1 << 28)  # the step's stream spins: the saves' gathers, and so their copies, wait
            store.apply([SaveBlock(0, 0), SaveBlock(1, 1)], blocks)
            store.apply([LoadBlock(1, 2)], blocks)
            store.apply([SpillSlot(0, key)], blocks)
            got = store.read([key])[0]
            torch.cuda.synchronize()
            assert torch.equal(got.cpu(), want)
            assert torch.equal(store._gather(blocks, [2]).cpu(), store._gather(blocks, [1]).cpu())


def test_deterministic_turns_have_the_bits_of_their_whole_history_prefilled_from_every_tier_on_cuda(bundle, tmp_path):
    """tests/test_kv_tiers.py's deterministic case on CUDA (graphs, the copy stream, page-locked slots): the
    reply fills the fifth block (a decode step's bits: not published), the four prompt blocks found are cut
    back to 48 positions (a multiple of the prefill chunk, 24), and the turn's ids and KV equal the prefix
    cache off, bit for bit, from the device, the host tier and the disk tier."""
    sampled = onecopy.SamplingParams(max_new_tokens=9, temperature=0.9, seed=5)
    det = {"deterministic": True, "prefill_chunk": 24, "max_sessions": 2, "kv_blocks": 24}

    def turn(e, reply=None):
        if reply is None:
            reply = e.submit(PROMPT, sampled, stop_ids=[]).result()
        r = e.submit(PROMPT + reply + [500, 501, 502], sampled, keep_session=True, stop_ids=[])
        ids = r.result()
        state = {k: v[:, :r.session.position].clone() for k, v in r.session.state.items()}
        r.session.close()
        return reply, ids, state, r.cached_tokens

    with onecopy.Engine.load(bundle, "cuda", prefix_cache=False, **det) as e:
        reply, ids, state, cached = turn(e)
    assert cached == 0
    runs = {}
    with onecopy.Engine.load(bundle, "cuda", **det) as e:
        runs["device"] = turn(e)
    with onecopy.Engine.load(bundle, "cuda", kv_host_bytes=1 << 24, **det) as e:
        e.submit(PROMPT, sampled, stop_ids=[]).result()
        _evict(e)
        runs["host"] = turn(e, reply)
        assert e.scheduler.kv.tiers.stats.restored_host == 3
    with onecopy.Engine.load(bundle, "cuda", kv_disk_dir=tmp_path, **det) as e:
        e.submit(PROMPT, sampled, stop_ids=[]).result()
    with onecopy.Engine.load(bundle, "cuda", kv_disk_dir=tmp_path, **det) as e:
        runs["disk"] = turn(e, reply)
        assert e.scheduler.kv.tiers.stats.restored_disk == 3
    for tier, (r, got, st, cached) in runs.items():
        for k, v in state.items():
            assert torch.equal(st[k], v), (tier, k)
        assert (r, got, cached) == (reply, ids, 48), tier
