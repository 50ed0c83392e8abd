"""Block admission on the host: the KV cache manager's decisions and the state operations they queue,
with no bundle and no tensors (the engine-level behaviour is in test_prefix_cache.py)."""

import pytest

from onecopy.errors import SessionCapacityError
from onecopy.params import SamplingParams
from onecopy.runtime.kv_manager import KVCacheManager, KVSpec
from onecopy.runtime.plan import ClearTable, CopyBlock, SetTable, StateOps, ZeroBlocks
from onecopy.runtime.request import Request
from onecopy.runtime.rows import RowLease

BS = 4


def manager(blocks=12, rows=4, width=4, prefix_cache=True) -> tuple[KVCacheManager, StateOps]:
    ops = StateOps()
    return KVCacheManager(KVSpec(blocks, width, BS, prefix_cache), rows, width * BS, ops), ops


def fresh(row: int, prompt, max_new_tokens=1) -> Request:
    return Request(0, list(prompt), SamplingParams(max_new_tokens=max_new_tokens), frozenset(), lease=RowLease(row, 0))


def run(kv: KVCacheManager, req: Request, generated=()) -> None:
    """What the scheduler does around a request that prefills its prompt and ends with ``generated``."""
    assert kv.fits(req)
    kv.place(req)
    kv.prefilled(req)
    req.output, req.position, req.finish_reason = list(generated), req.start + len(req.prompt) + len(generated), "stop"
    kv.finished(req)


PROMPT = list(range(10, 19))  # 9 tokens: two full blocks and one position


def test_a_prompt_starts_on_the_published_blocks_of_an_earlier_one():
    kv, ops = manager()
    first = fresh(0, PROMPT)
    run(kv, first)
    held = list(kv.owned[0])
    assert ops.take() == [ZeroBlocks(tuple(held)), SetTable(0, 0, tuple(held))]  # 3 fresh blocks, zeroed
    second = fresh(1, PROMPT + [30, 31])
    kv.place(second)
    assert second.cached == 8 and kv.owned[1][:2] == held[:2]  # two full blocks shared
    assert [kv.refs[b] for b in held[:2]] == [2, 2]
    assert ops.take() == [SetTable(1, 0, tuple(held[:2])), ZeroBlocks((kv.owned[1][2],)), SetTable(1, 2, (kv.owned[1][2],))]


def test_a_row_about_to_write_a_shared_block_copies_it_first():
    kv, ops = manager()
    run(kv, fresh(0, PROMPT))
    ops.take()
    whole = fresh(1, PROMPT[:8])  # the whole prompt is cached: its last token is prefilled again, in block 1
    kv.place(whole)
    assert whole.cached == 7
    shared, mine = kv.owned[0][:2], kv.owned[1]
    assert mine[0] == shared[0] and mine[1] != shared[1] and kv.copies == 1
    assert ops.take() == [SetTable(1, 0, tuple(shared)), CopyBlock(shared[1], mine[1]), SetTable(1, 1, (mine[1],))]
    assert kv.refs[shared[1]] == 1 and kv.refs[mine[1]] == 1


def test_a_request_waits_for_a_prompt_being_prefilled_that_holds_more_of_it():
    kv, _ = manager()
    long = fresh(0, PROMPT, max_new_tokens=4)
    kv.place(long)  # admitted, not prefilled yet
    same = fresh(1, PROMPT + [40])
    assert not kv.fits(same)  # it would prefill blocks the first prompt is about to publish
    kv.prefilled(long)
    assert kv.fits(same)
    kv.place(same)
    assert same.cached == 8


def test_least_recently_used_unreferenced_blocks_are_evicted_and_referenced_ones_never():
    kv, _ = manager(blocks=6, rows=3)
    holder = fresh(0, [1] * 8, max_new_tokens=1)  # 2 blocks, kept referenced
    kv.place(holder)
    for i, token in enumerate((2, 3, 4)):  # each publishes 2 blocks and lets them go
        r = fresh(1, [token] * 8 + [0])
        run(kv, r)
        kv.release(1)
    assert kv.usage()["references"] == 2 and kv.usage()["cached"] + kv.usage()["free"] == 4
    assert kv.lookup([2] * 8, touch=False) == []  # the oldest was evicted for the newest
    assert len(kv.lookup([4] * 8, touch=False)) == 2
    assert all(kv.refs[b] == 1 for b in kv.owned[0])


def test_nothing_is_taken_when_the_blocks_are_not_there():
    kv, ops = manager(blocks=3, rows=2)
    with pytest.raises(SessionCapacityError, match=r"the KV cache is full: writing positions 0\.\.15 needs 4 more blocks"):
        kv.prepare(0, 0, 16)
    assert kv.owned[0] == [] and len(ops) == 0 and kv.free_list() == [0, 1, 2]
    with pytest.raises(SessionCapacityError, match=r"may write 16 positions \(4 KV blocks of 4\) and the whole KV cache"):
        kv.check_request(fresh(0, list(range(12)), max_new_tokens=5))


def test_every_block_is_free_or_cached_exactly_once_after_the_rows_let_go():
    kv, ops = manager()
    for row in range(3):
        run(kv, fresh(row, PROMPT + [row]), generated=[7, 8])
    for row in range(3):
        kv.release(row)
    assert all(isinstance(op, (SetTable, ZeroBlocks, CopyBlock, ClearTable)) for op in ops.take())
    use = kv.usage()
    assert use["references"] == 0 and use["shared"] == use["private"] == 0
    cached = [b for b in range(kv.blocks) if b in kv.index]
    assert sorted(kv.free_list() + cached) == list(range(kv.blocks))  # each block once


def test_a_prefix_computed_twice_goes_on_publishing_under_its_first_holder():
    from onecopy.runtime.prefix import PrefixIndex

    idx = PrefixIndex(BS, digests=True)
    a = list(range(8))
    idx.publish([0, 1], a)  # A: blocks 0 and 1
    b = a[:4] + [50, 51, 52, 53]  # B computed A's first block again (its block 2), then a block of its own
    idx.publish([2, 3], b)
    assert 2 not in idx and idx.lookup(b) == [0, 3]  # the duplicate stays private; B's next block is found
    alone = PrefixIndex(BS, digests=True)
    alone.publish([7, 8], b)
    assert idx.digest(3) == alone.digest(8)  # the key of the prefix, wherever its first block lives
    idx.remove(0)  # A's first block overwritten: what was published under it leaves too
    assert idx.lookup(b) == [] and 3 not in idx
