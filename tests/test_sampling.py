"""On-device sampling: greedy, top-k, top-p, temperature, seeds."""

import pytest
import torch

import onecopy
from onecopy.sampling import Sampler, SamplingParams

PROMPT = [10, 20, 30, 40]


def _logits(seed=0, vocab=1000):
    return torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_top_k_1_equals_greedy():
    for seed in range(5):
        logits = _logits(seed)
        got = Sampler(SamplingParams(temperature=1.3, top_k=1, seed=seed), torch.device("cpu"))(logits)
        assert int(got) == int(logits.argmax())


def test_tiny_top_p_equals_greedy():
    logits = _logits(1)
    for seed in range(5):
        got = Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=seed), torch.device("cpu"))(logits)
        assert int(got) == int(logits.argmax())


def test_top_k_only_draws_from_the_k_best():
    logits = _logits(2)
    best = set(torch.topk(logits, 5).indices[0].tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=5, seed=0), torch.device("cpu"))
    draws = {int(s(logits)) for _ in range(200)}
    assert draws <= best and len(draws) > 1


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    s = Sampler(SamplingParams(temperature=1.0, seed=3), torch.device("cpu"))
    counts = torch.bincount(torch.stack([s(logits) for _ in range(4000)]).flatten(), minlength=3).float() / 4000
    torch.testing.assert_close(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.03, rtol=0)


def test_seeded_generation_is_reproducible(tiny_engine):
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234, max_new_tokens=16)
    a = list(tiny_engine.open_session().generate_ids(PROMPT, p, stop_ids=[]))
    b = list(tiny_engine.open_session().generate_ids(PROMPT, p, stop_ids=[]))
    c = list(tiny_engine.open_session().generate_ids(PROMPT, SamplingParams(temperature=1.0, top_k=50, top_p=0.9,
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
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(onecopy.InputError, match=match):
        SamplingParams(**kwargs)
