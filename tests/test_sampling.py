"""Batched on-device sampling: greedy, top-k, top-p, temperature, penalties, suppression, seeds per row."""

import pytest
import torch

import onecopy
from onecopy.sampling import BatchSampler, SamplingParams, counter_uniform

PROMPT = [10, 20, 30, 40]
CPU = torch.device("cpu")


def _logits(seed=0, vocab=1000, rows=1):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draw(params, logits, counters, first=None, prompts=None):
    """One batched draw: row i of ``logits`` sampled with ``params[i]`` at ``counters[i]``."""
    s = BatchSampler(len(params) + 1, logits.shape[-1], CPU)
    for row, p in enumerate(params):
        s.admit(row, p, (prompts or {}).get(row, []))
    plan = s.plan(list(range(len(params))), list(counters), list(first or [False] * len(params)))
    return s.sample(logits, plan)


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = _logits(0, rows=4)
    params = [SamplingParams(temperature=1.3, top_k=1, seed=s) for s in range(2)] + \
             [SamplingParams(temperature=1.0, top_p=1e-6, seed=s) for s in range(2)]
    for counter in range(5):
        assert _draw(params, logits, [counter] * 4).tolist() == logits.argmax(-1).tolist()


def test_top_k_only_draws_from_the_k_best():
    logits = _logits(2)
    best = set(torch.topk(logits, 5).indices[0].tolist())
    p = SamplingParams(temperature=5.0, top_k=5, seed=0)
    draws = {int(_draw([p], logits, [c])) for c in range(200)}
    assert draws <= best and len(draws) > 1


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    p = SamplingParams(temperature=1.0, seed=3)
    draws = torch.stack([_draw([p], logits, [c]) for c in range(4000)]).flatten()
    counts = torch.bincount(draws, minlength=3).float() / 4000
    torch.testing.assert_close(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.03, rtol=0)


def test_a_rows_draw_depends_only_on_its_own_logits_seed_and_counter():
    """Batch invariance of sampling: the same row alone, or among others at any batch index, draws the same."""
    vocab = 500
    mine = _logits(7, vocab) / 3  # flat enough that top-p keeps several tokens
    p = SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.3, seed=11)
    alone = [int(_draw([p], mine, [c], prompts={0: PROMPT})) for c in range(30)]
    others = [SamplingParams(), SamplingParams(temperature=2.0, seed=5), SamplingParams(temperature=0.5, top_p=0.5, seed=1)]
    for index in range(len(others) + 1):
        params = others[:index] + [p] + others[index:]
        logits = torch.cat([_logits(100 + i, vocab) for i in range(index)] + [mine] +
                           [_logits(200 + i, vocab) for i in range(len(others) - index)])
        got = [int(_draw(params, logits, [c] * len(params), prompts={index: PROMPT})[index]) for c in range(30)]
        assert got == alone, index
    assert len(set(alone)) > 3  # it really samples


def test_per_row_parameters_in_one_call():
    logits = _logits(3, rows=3)
    greedy = SamplingParams()
    hot = SamplingParams(temperature=1.0, seed=1)
    penalized = SamplingParams(repetition_penalty=1000.0)
    top = int(logits[2].argmax())
    got = _draw([greedy, hot, penalized], logits, [0, 0, 0], prompts={2: [top]})
    assert int(got[0]) == int(logits[0].argmax())
    assert int(got[2]) != top  # the prompt's token is pushed down for that row only
    assert int(got[1]) == int(_draw([hot], logits[1:2], [0]))


def test_suppressed_ids_are_never_drawn_and_begin_ids_only_at_first():
    logits = _logits(4)
    order = logits[0].argsort(descending=True).tolist()
    p = SamplingParams(suppress_ids=(order[0],), begin_suppress_ids=(order[1],))
    assert int(_draw([p], logits, [0], first=[True])) == order[2]
    assert int(_draw([p], logits, [0], first=[False])) == order[1]


def test_counter_uniform_is_uniform_and_keyed():
    u = counter_uniform(torch.full((20000,), 42), torch.arange(20000))
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    v = counter_uniform(torch.full((20000,), 43), torch.arange(20000))
    assert not torch.equal(u, v)
    assert torch.equal(u, counter_uniform(torch.full((20000,), 42), torch.arange(20000)))


def test_seeded_generation_is_reproducible(det_engine):
    """Same seed, same tokens, bit for bit: what a deterministic engine promises (a default engine's logits may
    differ in their last bits between runs, and a draw at temperature 1 can tip on them)."""
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234, max_new_tokens=16)
    a = list(det_engine.open_session().generate_ids(PROMPT, p, stop_ids=[]))
    b = list(det_engine.open_session().generate_ids(PROMPT, p, stop_ids=[]))
    c = list(det_engine.open_session().generate_ids(PROMPT, SamplingParams(temperature=1.0, top_k=50, top_p=0.9,
                                                                            seed=99, max_new_tokens=16), stop_ids=[]))
    assert a == b and a != c


def test_generation_stops_on_eos(tiny_engine):
    free = list(tiny_engine.open_session().generate_ids(PROMPT, SamplingParams(max_new_tokens=10), stop_ids=[]))
    stopped = list(tiny_engine.open_session().generate_ids(PROMPT, SamplingParams(max_new_tokens=10), stop_ids=[free[3]]))
    assert stopped == free[: free.index(free[3]) + 1]


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -1}, "temperature must be >= 0"),
    ({"top_k": -2}, "top_k must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"seed": -1}, r"seed must be in \[0, 2\*\*63\)"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(onecopy.InputError, match=match):
        SamplingParams(**kwargs)
