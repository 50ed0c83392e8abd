"""Compiled methods equal the eager model and transformers' reference."""

import pytest
import torch

import onecopy

from .conftest import TINY_MAX_SEQ_LEN, eager_greedy, hf_greedy

PROMPT = [7, 3, 99, 250, 18, 42, 5, 300, 11]


def test_prefill_and_decode_logits_equal_eager(tiny_engine, tiny_source):
    model = tiny_source.build(TINY_MAX_SEQ_LEN, torch.float32)
    s = tiny_engine.open_session()
    with torch.no_grad():
        want = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
        got = s.prefill(PROMPT)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for i, t in enumerate([17, 200, 3]):
            want = model(torch.tensor([[t]]), torch.tensor([len(PROMPT) + i]))
            got = s.decode(torch.tensor([t]))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_greedy_tokens_equal_transformers(tiny_engine, tiny_source):
    want = hf_greedy(tiny_source, PROMPT, 20)
    assert want == eager_greedy(tiny_source.build(TINY_MAX_SEQ_LEN, torch.float32), PROMPT, 20)
    got = list(tiny_engine.open_session().generate_ids(PROMPT, onecopy.SamplingParams(max_new_tokens=20), stop_ids=[]))
    assert got == want


def test_state_written_by_prefill_is_read_by_decode(tiny_engine):
    """A prompt split across prefill and decode continues exactly like the prompt prefilled whole."""
    params = onecopy.SamplingParams(max_new_tokens=10)
    whole = list(tiny_engine.open_session().generate_ids(PROMPT, params, stop_ids=[]))
    s = tiny_engine.open_session()
    s.prefill(PROMPT[:4])
    for t in PROMPT[4:-1]:
        s.decode(torch.tensor([t]))
    split = list(s.generate_ids(PROMPT[-1:], params, stop_ids=[]))  # the last token goes through decode
    assert split == whole


def test_chunked_prefill_equals_single_chunk(tiny_bundle):
    """The 9-token prompt in one prefill call, and in calls of 4 tokens (an engine loaded with prefill_chunk=4):
    the same tokens."""
    params = onecopy.SamplingParams(max_new_tokens=8)
    runs = {}
    for chunk in (None, 4):  # None: the default (512), the whole prompt at once
        with onecopy.Engine.load(tiny_bundle, prefill_chunk=chunk) as engine:
            stats = engine.scheduler.stats
            before = stats.prefill_chunks
            runs[chunk] = list(engine.open_session().generate_ids(PROMPT, params, stop_ids=[]))
            runs[chunk, "chunks"] = stats.prefill_chunks - before
    assert runs[None, "chunks"] == 1
    assert 2 <= runs[4, "chunks"] <= 3  # 4 + 4 + 1 (or 4 + 4, the last token through decode)
    assert runs[4] == runs[None]


def test_prompt_longer_than_max_seq_len_is_refused_before_any_method_runs(tiny_engine, monkeypatch):
    calls = []
    for name in tiny_engine.methods:
        m = tiny_engine.method(name)
        monkeypatch.setattr(m, "_run", lambda args, _f=m._run: calls.append(1) or _f(args))
    s = tiny_engine.open_session()
    with pytest.raises(onecopy.PromptTooLongError, match=r"65 tokens .* max_seq_len=64.*--max-seq-len"):
        list(s.generate_ids(list(range(TINY_MAX_SEQ_LEN + 1))))
    assert calls == [] and s.position == 0


def test_generation_stops_at_max_seq_len(tiny_engine):
    s = tiny_engine.open_session()
    out = list(s.generate_ids(list(range(60)), onecopy.SamplingParams(max_new_tokens=50), stop_ids=[]))
    assert len(out) == 5 and s.position == TINY_MAX_SEQ_LEN  # 60 prompt + 4 decoded, 5th sampled from the last


def test_bad_method_inputs_get_typed_errors(tiny_engine):
    s = tiny_engine.open_session()
    with pytest.raises(onecopy.InputError, match="must be int64"):
        s.run("decode", torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.long))
    with pytest.raises(onecopy.InputError, match=r"shape \[1, 2\], compiled for \[\{'min': 1, 'max': 1024\}, 1\]"):
        s.run("decode", torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    with pytest.raises(onecopy.InputError, match="takes 2 inputs"):
        s.run("decode", torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(onecopy.InputError, match="has no method 'encoder'"):
        s.run("encoder", torch.zeros(1))


@pytest.mark.slow
def test_smollm2_matches_transformers_and_answers_paris(smollm2_bundle, smollm2_source):
    with onecopy.Engine.load(smollm2_bundle) as engine, engine.open_session() as s:
        tok = engine.tokenizer
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
        got = list(s.generate_ids(ids, onecopy.SamplingParams(max_new_tokens=12)))
        assert tok.decode(got) == "The capital of France is Paris."
        assert got[-1] in engine.eos_token_ids
        want = hf_greedy(smollm2_source, ids, len(got))
        assert got == want
        r = engine.memory_report()
        assert r.duplicated_weight_bytes == 0 and r.resident_weight_bytes == r.unique_weight_bytes
