"""Named per-session device slots and the host-read budget of LLM generation."""

import pytest
import torch

import onecopy
from onecopy import Slot

from .conftest import HostReads


def test_slot_round_trip_reset_and_close(tiny_engine):
    s = tiny_engine.open_session()
    out = s.run("prefill", torch.tensor([[1, 2, 3]]), torch.arange(3), keep_as="last_logits")
    assert s.slot("last_logits") is out and set(s.slots) == {"last_logits"}
    s.reset()
    with pytest.raises(onecopy.InputError, match=r"has no slot 'last_logits' \(slots: none\).*keep_as='last_logits'"):
        s.slot("last_logits")
    s.keep("tok", torch.tensor([[7]]))
    s.run("decode", Slot("tok"), torch.tensor([0]))  # a kept tensor used as an input, in place
    s.close()
    with pytest.raises(onecopy.SessionClosedError):
        s.slot("tok")


def test_slot_shape_and_dtype_are_checked_on_use(tiny_engine):
    s = tiny_engine.open_session()
    s.keep("tok", torch.tensor([[7, 8]]))
    with pytest.raises(onecopy.InputError, match=r"input 'tokens' has shape \[1, 2\], compiled for \[\{'min': 1, 'max': 1024\}, 1\]"):  # noqa: E501
        s.run("decode", Slot("tok"), torch.tensor([0]))
    s.keep("tok", torch.tensor([[7.0]]))
    with pytest.raises(onecopy.InputError, match="input 'tokens' must be int64, got float32"):
        s.run("decode", Slot("tok"), torch.tensor([0]))
    with pytest.raises(onecopy.InputError, match="has no slot 'nope'"):
        s.run("decode", Slot("nope"), torch.tensor([0]))
    with pytest.raises(onecopy.InputError, match="must hold a tensor on cpu"):
        s.keep("meta", torch.empty(1, device="meta"))


def test_llm_generation_reads_only_sampled_ids(tiny_engine, monkeypatch):
    for params in (onecopy.SamplingParams(max_new_tokens=12),
                   onecopy.SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, repetition_penalty=1.3,
                                          max_new_tokens=12)):
        with tiny_engine.open_session() as s:
            reads = HostReads(monkeypatch)
            out = list(s.generate_ids([4, 5, 6, 7], params, stop_ids=[]))
            monkeypatch.undo()
        assert len(out) == 12
        # one read per scheduler step: the step's sampled ids (a single session here), nothing else
        assert [(n, k, d) for n, k, d, _ in reads.reads] == [("tolist", 1, torch.int64)] * 12


def test_repetition_penalty_discourages_repeats(tiny_engine):
    with tiny_engine.open_session() as s:
        plain = list(s.generate_ids([9, 9, 9], onecopy.SamplingParams(max_new_tokens=24), stop_ids=[]))
    with tiny_engine.open_session() as s:
        penalized = list(s.generate_ids([9, 9, 9], onecopy.SamplingParams(max_new_tokens=24, repetition_penalty=50.0),
                                        stop_ids=[]))
    assert len(set(plain)) < len(plain)  # the tiny model loops without a penalty
    assert len(set(penalized)) == len(penalized) and 9 not in penalized
