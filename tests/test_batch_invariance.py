"""Deterministic means batch-invariant: a session's logits, tokens and state never depend on its row,
the pool size, the batch size of a step or the sessions beside it (on any CPU: CI runs this file a
second time with the ISA forced down to AVX2)."""

import dataclasses

import pytest
import torch

import onecopy
from onecopy.runtime.engine import methods_to_load

from .invariance import assert_invariant

SAMPLED = onecopy.SamplingParams(temperature=0.8, top_k=50, seed=11, max_new_tokens=16)
NEIGHBOURS = [([5, 9, 33, 2], onecopy.SamplingParams(max_new_tokens=20)),
              ([300, 301], onecopy.SamplingParams(temperature=1.1, seed=3, max_new_tokens=20)),
              ([7, 7, 7, 250, 1, 19, 40, 41], onecopy.SamplingParams(max_new_tokens=20, repetition_penalty=1.3))]
PROMPT = [11, 22, 33, 44, 55, 66, 77]


def test_cpu_bundles_have_one_decode_which_deterministic_engines_run_one_row_per_call(tiny_bundle):
    manifest = onecopy.bundle.read_manifest(tiny_bundle)
    assert {n: m.batch_invariant for n, m in manifest.methods.items()} == {"prefill": False, "decode": False}
    for deterministic in (False, True):
        with onecopy.Engine.load(tiny_bundle, max_sessions=2, deterministic=deterministic) as engine:
            assert engine.methods == ["prefill", "decode"]
            assert engine.runner.step.one_row_per_call is deterministic


def test_deterministic_engines_prefer_a_batch_invariant_decode(tiny_bundle):
    """As on CUDA bundles: a deterministic engine loads the batch-invariant decode and runs it batched,
    a default engine the fast one."""
    manifest = onecopy.bundle.read_manifest(tiny_bundle)
    invariant = dataclasses.replace(manifest.methods["decode"], name="decode_invariant", batch_invariant=True)
    manifest.methods = {**manifest.methods, "decode_invariant": invariant}
    assert methods_to_load(manifest, deterministic=True) == ["prefill", "decode_invariant"]
    assert methods_to_load(manifest, deterministic=False) == ["prefill", "decode"]


def test_decode_step_is_batch_invariant(tiny_bundle):
    """Logits and the state row of one session, bit for bit: alone at row 0 of a 3-row pool vs row 5 of 8
    (batch index 5 of 8, 0 of 1, 1 of 2, 5 of 6), row 17 of 24 and row 5 of 70 among neighbours."""
    with onecopy.Engine.load(tiny_bundle, max_sessions=2, deterministic=True) as engine:
        assert_invariant(engine)


@pytest.mark.slow
def test_decode_step_is_batch_invariant_smollm2(smollm2_bundle):
    with onecopy.Engine.load(smollm2_bundle, max_sessions=2, deterministic=True) as engine:
        assert_invariant(engine, token=504, position=30)


def test_whisper_decoder_step_is_batch_invariant(whisper_bundle):
    with onecopy.Engine.load(whisper_bundle, max_sessions=2, deterministic=True) as engine:
        assert_invariant(engine, token=50257, position=3)


def _alone(bundle, pool_rows: int) -> tuple[list[int], dict[str, torch.Tensor]]:
    with onecopy.Engine.load(bundle, max_sessions=pool_rows, deterministic=True, prefill_chunk=3) as engine:
        with engine.open_session() as s:
            assert s.row == 0
            ids = s.submit(PROMPT, SAMPLED, stop_ids=[]).result(timeout=120)
            return ids, {k: v.clone() for k, v in s.state.items()}


@pytest.mark.parametrize("neighbours", [False, True], ids=["idle-neighbours", "generating-neighbours"])
def test_a_session_at_row_5_of_8_equals_itself_at_row_0_of_3(tiny_bundle, neighbours):
    """Through the scheduler: tokens and every byte of the state row, bit for bit, whether the five rows
    before it are idle or three of them generate in the same steps."""
    ids, state = _alone(tiny_bundle, 3)
    with onecopy.Engine.load(tiny_bundle, max_sessions=8, deterministic=True, prefill_chunk=3) as engine:
        others = [engine.open_session() for _ in range(5)]
        s = engine.open_session()
        assert s.row == 5
        streams = [o.submit(p, sp, stop_ids=[]) for o, (p, sp) in zip(others, NEIGHBOURS)] if neighbours else []
        got = s.submit(PROMPT, SAMPLED, stop_ids=[]).result(timeout=120)
        for st in streams:
            st.result(timeout=120)
        assert got == ids
        for k, v in s.state.items():
            assert torch.equal(v, state[k]), k
        if neighbours:
            assert engine.scheduler.stats.decode_rows > engine.scheduler.stats.decode_steps  # steps were shared
