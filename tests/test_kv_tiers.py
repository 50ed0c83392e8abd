"""Tiers of the prefix cache: blocks the device evicts kept in host memory and on disk, loaded back instead of
prefilled (bit for bit the bytes the device held), across an engine restart, and files that do not check
are misses, never wrong bytes.

The tiny bundle is paged (16 positions per block, max_seq_len 64). Its engines here have 8 blocks, so a
few other prompts evict a prompt's cached blocks from the device.
"""

from __future__ import annotations

import pytest
import torch

import onecopy
from onecopy.runtime.kv_tiers import ROOT_DIGEST, TierIndex, prefix_digest
from onecopy.runtime.plan import DropFile, LoadBlock, SaveBlock, SaveFile, SpillSlot, StateOps
from onecopy.sampling import SamplingParams

from .conftest import wait_until

GREEDY = SamplingParams(max_new_tokens=6, temperature=0)
PROMPT = list(range(3, 43))  # 40 tokens: two full blocks and a partial one
NEXT = PROMPT + [50, 51, 52]  # the next turn: the two blocks are its cached prefix


def _key(ids: list[int], blocks: int) -> bytes:
    """The tiers' key of ``ids``' first ``blocks`` blocks of 16 (`prefix_digest` chained from the root)."""
    key = ROOT_DIGEST
    for i in range(blocks):
        key = prefix_digest(key, ids[16 * i:16 * (i + 1)])
    return key


def _state(session) -> dict[str, torch.Tensor]:
    return {k: v[:, :session.position].clone() for k, v in session.state.items()}


def _evict(engine) -> None:
    """Run other prompts until none of PROMPT's blocks is cached on the device any more."""
    kv = engine.scheduler.kv
    for i in range(8):
        engine.submit([200 + i] * 40, GREEDY).result()
        if not kv.lookup(PROMPT, touch=False):
            return
    raise AssertionError("the device cache kept PROMPT's blocks")


@pytest.fixture(scope="module")
def device_hit(tiny_bundle):
    """NEXT's tokens and state with its two blocks cached on the device (no tiers)."""
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2) as e:
        e.submit(PROMPT, GREEDY).result()
        r = e.submit(NEXT, GREEDY, keep_session=True)
        tokens = r.result()
        assert r.cached_tokens == 32
        state = _state(r.session)
        r.session.close()
    return tokens, state


def _settle(engine) -> None:
    """Wait for the idle engine's state operations (copies ahead of eviction, spills) to be carried out."""
    assert wait_until(lambda: not len(engine.scheduler.ops))
    with engine.loop.lock:  # taken and applied under the lock: held here, they are done
        pass


def _check_restored(engine, device_hit, tier: str) -> None:
    tiers = engine.scheduler.kv.tiers
    before = (tiers.stats.restored_host, tiers.stats.restored_disk)
    r = engine.submit(NEXT, GREEDY, keep_session=True)
    assert r.result() == device_hit[0]
    assert r.cached_tokens == 32  # both blocks loaded, not prefilled
    after = (tiers.stats.restored_host, tiers.stats.restored_disk)
    assert (after[0] - before[0], after[1] - before[1]) == ((2, 0) if tier == "host" else (0, 2))
    state = _state(r.session)
    for k, v in device_hit[1].items():
        assert torch.equal(state[k], v), k  # the bytes the device held, bit for bit
    r.session.close()


def test_evicted_blocks_come_back_from_host_memory(tiny_bundle, device_hit):
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_host_bytes=1 << 22) as e:
        e.submit(PROMPT, GREEDY).result()
        _evict(e)
        tiers = e.scheduler.kv.tiers
        assert tiers.stats.saved >= 2 and not tiers.disk
        _check_restored(e, device_hit, "host")
        # Loaded blocks are published again: the next prompt on them shares them on the device.
        again = e.submit(NEXT, GREEDY)
        assert again.result() == device_hit[0] and again.cached_tokens == 32
        _settle(e)  # the figures below read while the engine stays idle
        assert tiers.stats.restored_host == 2
        r = e.memory_report()
        assert r.kv_tier_restored == 2 and r.kv_tier_saved == tiers.stats.saved
        assert r.kv_host_tier_bytes >= tiers.host_slots * e.runner.blocks.block_bytes > 0
        assert "KV tiers: host / disk blocks" in str(r)
        from prometheus_client import generate_latest

        from onecopy.serve.metrics import ServerMetrics

        text = generate_latest(ServerMetrics(e, None).registry).decode()
        assert 'onecopy_kv_tier_restored_blocks_total{tier="host"} 2.0' in text
        assert f'onecopy_kv_tier_blocks{{tier="host"}} {float(len(tiers.host))}' in text
        assert f"onecopy_kv_tier_saved_blocks_total {float(tiers.stats.saved)}" in text


def test_a_cached_block_is_copied_to_a_free_host_slot_before_its_eviction(tiny_bundle, device_hit):
    """A block the cache keeps goes to a free host slot at once (beside the steps), so evicting it later, on
    another request's way to its first token, copies nothing; with no free slot nothing is copied ahead."""
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_host_bytes=1 << 22) as e:
        kv, tiers = e.scheduler.kv, e.scheduler.kv.tiers
        e.submit(PROMPT, GREEDY).result()
        blocks = kv.lookup(PROMPT, touch=False)
        keys = [kv.index.digest(b) for b in blocks]
        assert len(keys) == 2 and all(k in tiers.host for k in keys) and tiers.stats.saved == 2
        _settle(e)  # the copies are made while the engine is idle
        slots = [tiers.host[k] for k in keys]
        saves = []  # copies into those slots from now on
        apply = e.runner.blocks.tiers.apply
        e.runner.blocks.tiers.apply = lambda ops, t: saves.extend(
            op for op in ops if isinstance(op, SaveBlock) and op.slot in slots) or apply(ops, t)
        _evict(e)
        assert saves == []  # evicted without a copy: the host slots had them
        _check_restored(e, device_hit, "host")



def test_a_run_of_loads_stops_at_a_file_that_does_not_check_and_forgets_every_bad_file():
    k = [bytes([i]) * 16 for i in range(4)]
    bad = {k[1], k[3]}
    idx = TierIndex(host_slots=0, disk_blocks=4, on_disk=k,
                    read=lambda keys: [None if key in bad else b"file" for key in keys])
    assert [op.payload for op in idx.load(k, [5, 6, 7, 8])] == [b"file"]  # up to the first bad file
    assert list(idx.disk) == [k[2], k[0]] and idx.stats.load_failures == 2  # both bad files forgotten (deleted)
    assert TierIndex(host_slots=0, disk_blocks=1, on_disk=k[:1]).load(k[:1], [5]) == []  # no reader: a miss


def test_a_full_host_tier_takes_the_blocks_the_device_evicts_first_ahead_of_their_eviction():
    """With no free host slot a block the cache keeps is not copied at once; `copy_ahead` (the idle engine's)
    saves the oldest cached blocks (half a host tier's worth) that no tier holds, in place of the host tier's least
    recently used, and evicting them later copies nothing."""
    from onecopy.runtime.kv_manager import KVCacheManager, KVSpec

    ops = StateOps()
    tiers = TierIndex(host_slots=2)
    kv = KVCacheManager(KVSpec(blocks=4, width=4, block_size=4, prefix_cache=True), 1, 16, ops, tiers)
    tiers.save(90, b"x" * 16), tiers.save(91, b"y" * 16)  # the host tier full of blocks the device no longer has
    cached = []
    for t in range(3):  # three one-block prompts, cached in turn
        kv.prepare(0, 0, 4)
        kv.publish(0, [t] * 4)
        cached.append(kv.owned[0][0])
        kv.release(0)
    ops.take()
    assert len(tiers.host) == 2 and all(kv.index.digest(b) not in tiers for b in cached)  # no free slot: none kept
    kv.copy_ahead(8)
    oldest = kv.index.digest(cached[0])
    assert ops.take() == [SaveBlock(cached[0], 0)] and list(tiers.host) == [b"y" * 16, oldest]
    kv.copy_ahead(8)
    assert not len(ops)  # done: nothing copied twice
    kv.prepare(0, 0, 8)  # two blocks: one free, then the oldest cached one evicted
    assert cached[0] in kv.owned[0] and not any(isinstance(op, SaveBlock) for op in ops.take())


def test_a_disk_tier_keeps_blocks_across_a_restart(tiny_bundle, device_hit, tmp_path):
    # One host slot: the host tier spills to disk as blocks keep coming.
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_disk_dir=tmp_path) as e:
        block_bytes = e.runner.blocks.block_bytes
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_host_bytes=block_bytes,
                             kv_disk_dir=tmp_path) as e:
        e.submit(PROMPT, GREEDY).result()
        _evict(e)
        tiers = e.scheduler.kv.tiers
        _settle(e)
        assert tiers.host_slots == 1 and tiers.stats.spilled >= 1
        files = sorted(tmp_path.glob("kv-*/*.kv"))
        assert len(files) == len(tiers.disk) >= 1
        assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    # Closing saved the host slot and the device's cached blocks too: nothing cached is lost to a restart.
    files = sorted(tmp_path.glob("kv-*/*.kv"))
    assert len(files) == len(tiers.disk) >= 1 + 1 + 8 - 2  # PROMPT's two, and what the device still cached
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_disk_dir=tmp_path) as e:  # restarted
        assert len(e.scheduler.kv.tiers.disk) == len(files)
        _check_restored(e, device_hit, "disk")


def test_an_engine_finds_blocks_another_engine_saved_to_the_shared_directory_after_it_started(tiny_bundle, device_hit,
                                                                                              tmp_path):
    """Two engines on one directory (replicas): blocks the other saved after this one listed the directory are
    found there when a prompt looks them up (a file of the block's key, its bytes checked at the load), loaded
    bit for bit; a key no tier holds is one look at the directory, a miss."""
    opts = {"kv_blocks": 8, "max_sessions": 2, "kv_disk_dir": tmp_path}
    with onecopy.Engine.load(tiny_bundle, **opts) as late:
        assert not late.scheduler.kv.tiers.disk
        with onecopy.Engine.load(tiny_bundle, **opts) as other:
            other.submit(PROMPT, GREEDY).result()  # its blocks saved when it closes
        _check_restored(late, device_hit, "disk")
        cold = late.submit([7] * 40, GREEDY)
        cold.result()
        assert cold.cached_tokens == 0


def test_a_restarted_engine_warms_its_host_tier_from_the_disk_tier(tiny_bundle, device_hit, tmp_path):
    """An engine starting on a directory of blocks reads the most recent into its free host slots in the background:
    a conversation resumed after the restart loads from host memory (no file read on its way), bit for bit; the
    host tier evicting a warmed block drops it without writing its file again."""
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_disk_dir=tmp_path) as e:
        block = e.runner.blocks.block_bytes
        e.submit(PROMPT, GREEDY).result()  # its blocks saved when the engine closes
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_disk_dir=tmp_path,
                             kv_host_bytes=4 * block) as e:
        tiers = e.scheduler.kv.tiers
        assert wait_until(lambda: tiers.stats.warmed == 2)
        from prometheus_client import generate_latest

        from onecopy.serve.metrics import ServerMetrics

        assert "onecopy_kv_tier_warmed_blocks_total 2.0" in generate_latest(ServerMetrics(e, None).registry).decode()
        files = {f: f.stat().st_mtime_ns for f in tmp_path.glob("kv-*/*.kv")}
        _check_restored(e, device_hit, "host")
        for i in range(4):  # the host tier's four slots taken by new blocks: the warmed ones dropped
            e.submit([300 + i] * 40, GREEDY).result()
        _settle(e)
        assert {f: f.stat().st_mtime_ns for f in files} == files  # no file written again
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_disk_dir=tmp_path,
                             kv_host_bytes=1 * block) as e:  # one slot: the most recent block only
        assert wait_until(lambda: e.scheduler.kv.tiers.stats.warmed == 1)
        assert list(e.scheduler.kv.tiers.host) == [list(e.scheduler.kv.tiers.disk)[-1]]


def test_a_file_that_does_not_check_is_a_miss_and_is_deleted(tiny_bundle, device_hit, tmp_path):
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_disk_dir=tmp_path) as e:
        e.submit(PROMPT, GREEDY).result()  # its blocks saved when the engine closes
    (path,) = tmp_path.glob(f"kv-*/{_key(PROMPT, 2).hex()}.kv")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the payload's last byte: the checksum no longer holds
    path.write_bytes(bytes(data))
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_disk_dir=tmp_path) as e:
        r = e.submit(NEXT, GREEDY)
        assert r.result() == device_hit[0]  # the second block prefilled again, not loaded as it was
        assert r.cached_tokens == 16
        stats = e.scheduler.kv.tiers.stats
        assert (stats.restored_disk, stats.load_failures) == (1, 1)
        assert not path.exists()
    # Another model's files live in another directory: never read.
    assert len(list(tmp_path.glob("kv-*"))) == 1


def test_tier_index_keeps_keys_lru_first_and_spills_or_drops():
    reads: list[list[bytes]] = []
    idx = TierIndex(host_slots=2, disk_blocks=2, read=lambda keys: reads.append(list(keys)) or [b"file"] * len(keys))
    ops = StateOps()
    idx.attach(ops)
    k = [bytes([i]) * 16 for i in range(5)]
    assert idx.save(10, k[0]) == [SaveBlock(10, 0)] and idx.save(11, k[1]) == [SaveBlock(11, 1)]
    assert idx.save(12, k[0]) == []  # already kept: only touched
    assert idx.save(13, k[2]) == [SpillSlot(1, k[1]), SaveBlock(13, 1)]  # k[1] was least recent
    assert idx.save(14, k[3]) == [SpillSlot(0, k[0]), SaveBlock(14, 0)]
    assert idx.save(15, k[4]) == [DropFile(k[1]), SpillSlot(1, k[2]), SaveBlock(15, 1)]  # the disk is full too
    assert list(idx.disk) == [k[0], k[2]] and list(idx.host) == [k[3], k[4]]
    assert idx.load([k[3]], [7]) == [LoadBlock(0, 7)]
    assert idx.load([k[4], k[2]], [7, 8]) == [LoadBlock(1, 7)]  # k[2]'s file is written by operations not applied
    assert reads == []  # ... so it was not read
    ops.take()  # the batch that writes it is applied
    got = idx.load([k[2], k[0], k[1], k[3]], [8, 9, 10, 11])  # up to k[1]: dropped
    assert [op.payload for op in got] == [b"file", b"file"] and idx.stats.restored_disk == 2
    assert reads == [[k[2], k[0]]]  # the run's files, read together, and none past its end
    bare = TierIndex(host_slots=0, disk_blocks=1)  # a disk tier alone: nothing on eviction, everything at close
    assert bare.save(3, k[0]) == [] and bare.persist([(3, k[0])]) == [SaveFile(3, k[0])]
    assert TierIndex(host_slots=0).save(3, k[0]) == []  # no tier: nothing kept


def test_bad_tier_options_are_refused(tiny_bundle):
    with pytest.raises(onecopy.InputError, match="kv_host_bytes must be >= 0"):
        onecopy.Engine.load(tiny_bundle, kv_host_bytes=-1)
    with onecopy.Engine.load(tiny_bundle, prefix_cache=False, kv_host_bytes=1 << 20) as e:
        assert e.scheduler.kv.tiers is None
        assert "KV tiers" in e.prefix_cache_note


def test_serve_puts_the_disk_tier_under_the_state_dir_unless_told_otherwise(tmp_path):
    from onecopy.cli import build_parser, serve_engine_config

    parse = build_parser().parse_args
    c = serve_engine_config(parse(["serve", "--state-dir", str(tmp_path), "--kv-host-gib", "0.5"]))
    assert (c.kv_disk_dir, c.kv_host_bytes, c.kv_disk_bytes) == (str(tmp_path / "kv"), 2**29, 16 << 30)
    assert serve_engine_config(parse(["serve", "--state-dir", str(tmp_path), "--kv-disk-dir", "/x"])).kv_disk_dir == "/x"
    assert serve_engine_config(parse(["serve", "--state-dir", str(tmp_path), "--kv-disk-gib", "0"])).kv_disk_dir is None
    assert serve_engine_config(parse(["serve"])).kv_disk_dir is None


def test_interleaved_prompts_through_every_tier_hold_the_bytes_of_a_prefill(tiny_bundle, tmp_path):
    """Many prompts on a few shared histories, in a random order, through a cache of 8 blocks, a host tier of four
    slots and a disk tier of three blocks: saves, spills, drops and loads of every kind interleave. Each request's
    state is that of prefilling its prompt whole (within float roundings: a wrong block would be far off), and its
    tokens are the uncached engine's."""
    import random

    rng = random.Random(0)
    bases = [[rng.randrange(3, 400) for _ in range(40)] for _ in range(6)]
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, prefix_cache=False) as plain:
        block = plain.runner.blocks.block_bytes
        with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_host_bytes=4 * block,
                                 kv_disk_dir=tmp_path, kv_disk_bytes=4 * block) as tiered:  # 3 files
            for _ in range(60):
                prompt = rng.choice(bases)[:rng.choice((33, 40))] + [rng.randrange(3, 400) for _ in range(rng.randrange(4))]
                got = tiered.submit(prompt, GREEDY, keep_session=True)
                want = plain.submit(prompt, GREEDY, keep_session=True)
                assert got.result() == want.result()
                a, b = _state(got.session), _state(want.session)
                for k in a:
                    torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4, msg=k)
                got.session.close()
                want.session.close()
            s = tiered.scheduler.kv.tiers.stats
            assert s.restored_host and s.restored_disk and s.spilled and s.dropped, s


def test_a_directory_over_budget_or_a_disk_that_refuses_deletes_never_stops_an_engine(tiny_bundle, tmp_path,
                                                                                       monkeypatch):
    """An engine started on a directory holding more blocks than its budget (another engine's, or a smaller
    --kv-disk-gib) deletes the oldest; a file system that refuses deletions is logged, never an engine failure."""
    from pathlib import Path

    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_disk_dir=tmp_path) as e:
        block = e.runner.blocks.block_bytes
        for i in range(4):
            e.submit([300 + i] * 40, GREEDY).result()
    assert len(list(tmp_path.glob("kv-*/*.kv"))) >= 4
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_disk_dir=tmp_path,
                             kv_disk_bytes=3 * block) as e:  # room for two files
        assert len(e.scheduler.kv.tiers.disk) == len(list(tmp_path.glob("kv-*/*.kv"))) == 2

    def refuse(self, missing_ok=False):
        raise PermissionError(f"read-only: {self}")

    monkeypatch.setattr(Path, "unlink", refuse)
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=2, kv_host_bytes=block, kv_disk_dir=tmp_path,
                             kv_disk_bytes=3 * block) as e:
        for i in range(6):  # host spills to disk, the disk drops its oldest: every deletion refused
            e.submit([310 + i] * 40, GREEDY).result()
        assert e.scheduler.kv.tiers.stats.dropped and not e.failed


def test_tiers_without_room_for_a_block_are_off_and_say_so(tiny_bundle, tmp_path):
    with onecopy.Engine.load(tiny_bundle, kv_host_bytes=100, kv_disk_dir=tmp_path, kv_disk_bytes=0) as e:
        assert e.scheduler.kv.tiers is None and "KV tiers off" in e.prefix_cache_note


def test_a_thousand_conversations_on_a_cache_that_holds_64_all_resume_after_a_restart(tiny_bundle, tmp_path):
    """1,000 conversations through a device cache with room for 64 of them, a host tier for 100 and a disk tier
    for all: after a restart every one resumes from its saved blocks (none prefilled again) with the tokens of a
    whole prefill (checked on a sample against an engine without a cache)."""
    import random

    rng = random.Random(1)
    three = SamplingParams(max_new_tokens=3, temperature=0)
    prompts = [[rng.randrange(3, 400) for _ in range(30)] for _ in range(1000)]
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8) as probe:
        block = probe.runner.blocks.block_bytes
    options = dict(kv_blocks=2 * 64 + 16, max_sessions=8, kv_host_bytes=200 * block, kv_disk_dir=tmp_path,
                   kv_disk_bytes=2100 * block)
    with onecopy.Engine.load(tiny_bundle, **options) as e:
        streams = [e.submit(p, three, stop_ids=[]) for p in prompts]
        histories = [p + s.result() for p, s in zip(prompts, streams)]  # 33 ids: two whole blocks each
        s = e.scheduler.kv.tiers.stats
        assert s.spilled and not s.dropped
    one = SamplingParams(max_new_tokens=1, temperature=0)
    turns = [h + [rng.randrange(3, 400)] for h in histories]
    with onecopy.Engine.load(tiny_bundle, **options) as e:
        assert len(e.scheduler.kv.tiers.disk) == 2000
        streams = [e.submit(t, one, stop_ids=[]) for t in turns]
        got = [s.result() for s in streams]
        assert [s.cached_tokens for s in streams] == [32] * 1000  # every conversation's blocks found
        s = e.scheduler.kv.tiers.stats  # from the files, or from the host slots warmed from them at start
        assert s.restored_disk + s.restored_host == 2000 and s.restored_host <= s.warmed and not s.load_failures
    sample = rng.sample(range(1000), 40)
    with onecopy.Engine.load(tiny_bundle, max_sessions=8, prefix_cache=False) as plain:
        want = [plain.submit(turns[i], one, stop_ids=[]) for i in sample]
        assert [w.result() for w in want] == [got[i] for i in sample]


def test_deterministic_turns_have_the_bits_of_their_whole_history_prefilled_from_every_tier(tiny_bundle, tmp_path):
    """A deterministic engine caches the blocks a prefill wrote (prompts', not the reply a decode step wrote: here
    it fills the third block) and ends a hit at a multiple of its prefill chunk (12 here: the two blocks found
    give 24 positions), so the rest is cut where a whole prefill cuts it (on this bundle cuts at 32 and 44
    give other bits than at 36 and 48): a turn on a history gets the ids and KV bits of the whole history
    prefilled (prefix cache off), whether its blocks come from the device, the host tier or the disk tier."""
    history = PROMPT
    sampled = SamplingParams(max_new_tokens=9, temperature=0.9, seed=11)  # sampled: the logits' bits matter
    det = {"deterministic": True, "prefill_chunk": 12, "max_sessions": 2, "kv_blocks": 8}

    def turn(e, reply=None):
        if reply is None:
            reply = e.submit(history, sampled).result()
        r = e.submit(history + reply + [50, 51, 52], sampled, keep_session=True)
        out = (reply, r.result(), _state(r.session), r.cached_tokens)
        r.session.close()
        return out

    with onecopy.Engine.load(tiny_bundle, prefix_cache=False, **det) as e:
        reply, ids, state, cached = turn(e)
        assert cached == 0 and not e.memory_report().prefix_cache
    runs = {}
    with onecopy.Engine.load(tiny_bundle, **det) as e:
        assert e.memory_report().prefix_cache
        runs["device"] = turn(e)
    with onecopy.Engine.load(tiny_bundle, kv_host_bytes=1 << 22, **det) as e:
        e.submit(history, sampled).result()
        _evict(e)
        runs["host"] = turn(e, reply)
        assert e.scheduler.kv.tiers.stats.restored_host == 2
    with onecopy.Engine.load(tiny_bundle, kv_disk_dir=tmp_path, **det) as e:
        e.submit(history, sampled).result()  # its blocks saved when the engine closes
    assert len(list(tmp_path.glob("kv-*-det12-cpu/*.kv"))) == 2  # the prompt's two whole blocks; its own directory
    with onecopy.Engine.load(tiny_bundle, kv_disk_dir=tmp_path, **det) as e:
        runs["disk"] = turn(e, reply)
        assert e.scheduler.kv.tiers.stats.restored_disk == 2
    for tier, (r, got, st, cached) in runs.items():
        for k, v in state.items():
            assert torch.equal(st[k], v), (tier, k)
        assert (r, got, cached) == (reply, ids, 24), tier  # two blocks found, cut back to a multiple of 12


@pytest.mark.parametrize("lost", [[0, 1], [1]])
def test_a_deterministic_restore_cut_short_is_cut_back_to_a_chunk_and_keeps_the_bits(tiny_bundle, tmp_path, lost):
    """Files gone after the engine listed them: the restore loads fewer blocks than the lookup found, and the
    prefix the row starts on is cut back again to a multiple of the prefill chunk (none loaded: 0; the first
    block alone: 12 of its 16 positions, the rest copied on write and prefilled): a miss, never a failure, and
    the turn keeps the bits of the whole prompt prefilled."""
    sampled = SamplingParams(max_new_tokens=4, temperature=0.9, seed=3)
    det = {"deterministic": True, "prefill_chunk": 12, "max_sessions": 2, "kv_blocks": 8}
    with onecopy.Engine.load(tiny_bundle, prefix_cache=False, **det) as e:
        r = e.submit(NEXT, sampled, keep_session=True)
        ids, state = r.result(), _state(r.session)
        r.session.close()
    with onecopy.Engine.load(tiny_bundle, kv_disk_dir=tmp_path, **det) as e:
        e.submit(PROMPT, sampled).result()
    with onecopy.Engine.load(tiny_bundle, kv_disk_dir=tmp_path, **det) as e:
        for i in lost:  # the files of PROMPT's blocks, by key: block 0's, block 1's
            (next(tmp_path.glob("kv-*-det12-cpu")) / (_key(PROMPT, i + 1).hex() + ".kv")).unlink()
        r = e.submit(NEXT, sampled, keep_session=True)
        assert r.result() == ids and r.cached_tokens == (0 if lost == [0, 1] else 12)
        for k, v in _state(r.session).items():
            assert torch.equal(v, state[k]), k
        r.session.close()
        assert e.submit(PROMPT, sampled).result()  # the engine serves on

