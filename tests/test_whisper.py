"""Whisper as an encoder-decoder bundle: transcripts equal transformers' model token for token."""

import wave

import numpy as np
import pytest
import torch

import onecopy
from onecopy.audio import AudioError, LogMel, load_audio, read_wav, resample
from onecopy.runtime import method as method_mod
from onecopy.transcribe import Transcriber, transcribe_file, transcribe_files

from .conftest import HostReads, run_cli

pytestmark = pytest.mark.slow


def _hf_transcribe(source, samples, sot, eos, suppress, suppress_begin, limit=100):
    """Greedy, timestamps-free decoding of transformers' WhisperForConditionalGeneration (same weights)."""
    import transformers

    from onecopy.models.ct2_whisper import hf_config_from_whisper

    cfg = transformers.WhisperConfig(**{k: v for k, v in hf_config_from_whisper(source.config).items() if k != "model_type"})
    model = transformers.WhisperForConditionalGeneration(cfg).eval()
    missing, unexpected = model.load_state_dict(source.hf_state_dict, strict=False)
    assert not unexpected and set(missing) <= {"proj_out.weight"}
    features = transformers.WhisperFeatureExtractor(feature_size=source.config.n_mels)(
        samples, sampling_rate=16000, return_tensors="pt").input_features
    ids = list(sot)
    with torch.no_grad():
        enc = model.model.encoder(features).last_hidden_state
        for step in range(limit):
            logits = model(encoder_outputs=(enc,), decoder_input_ids=torch.tensor([ids])).logits[0, -1]
            logits[list(suppress_begin if step == 0 else suppress)] = float("-inf")
            t = int(logits.argmax())
            if t == eos:
                break
            ids.append(t)
    return ids[len(sot):]


def test_transcript_matches_transformers_token_for_token(whisper_bundle, whisper_source, speech_wav):
    with onecopy.Engine.load(whisper_bundle) as engine:
        samples = load_audio(speech_wav)
        tr = Transcriber(engine).transcribe(samples)
        gen = engine.manifest.generation
        want = _hf_transcribe(whisper_source, samples, gen["sot_ids"], engine.eos_token_ids[0], gen["suppress_ids"],
                              set(gen["suppress_ids"]) | set(gen["suppress_ids_begin"]))
        assert tr.window_tokens == [want]
        words = tr.text.lower()
        for w in ("quick", "brown", "fox", "over", "lazy", "dog"):
            assert w in words, tr.text


def test_encoder_runs_once_per_window_and_its_output_stays_put(whisper_bundle, speech_wav, monkeypatch):
    """41 s of audio = two windows: two encoder calls, each writing its cross K/V into the window's
    pool row, which every decoder step reads in place; only the chosen ids reach the host."""
    samples = load_audio(speech_wav)
    silence = np.zeros(16000 * 34, dtype=np.float32)
    long = np.concatenate([samples, silence, samples])
    assert 30 < len(long) / 16000 < 60
    calls = []
    real = method_mod.Method.__call__
    monkeypatch.setattr(method_mod.Method, "__call__",
                        lambda self, *a: (calls.append((self.name, [x.data_ptr() for x in a])), real(self, *a))[1])
    with onecopy.Engine.load(whisper_bundle) as engine:
        t = Transcriber(engine)
        cross = [engine.runner.pool.tensors[f].data_ptr() for f in engine.method("encoder").spec.state]
        reads = HostReads(monkeypatch)
        tr = t.transcribe(long)
        monkeypatch.undo()
        steps = engine.scheduler.stats.decode_steps
    encoder_calls = [c for c in calls if c[0] == "encoder"]
    assert len(encoder_calls) == 2 and all(c[1][-len(cross):] == cross for c in encoder_calls)
    assert tr.text.lower().count("fox") == 2
    decoder_calls = [c for c in calls if c[0] == "decoder"]
    assert decoder_calls and all(c[1][-len(cross):] == cross for c in decoder_calls)  # the pool itself, no copy
    assert not any(ptr in cross for _, _, _, ptr in reads.reads)  # never read back to the host
    # Only chosen ids cross: one read per step that sampled, of the ids of the windows in that step.
    assert {(n, d) for n, _, d, _ in reads.reads} == {("tolist", torch.int64)}
    assert sum(k for _, k, _, _ in reads.reads) == sum(len(w) + 1 for w in tr.window_tokens)  # ids and eos
    assert len(reads.reads) <= steps < sum(len(w) + 4 for w in tr.window_tokens)  # both windows batched


def test_several_files_transcribe_as_concurrent_sessions(whisper_bundle, speech_wav, tmp_path):
    """Three files at once: each transcript equals the file's own, and decoder steps are shared."""
    with onecopy.Engine.load(whisper_bundle) as engine:
        alone = transcribe_file(engine, speech_wav)
        steps_alone = engine.scheduler.stats.decode_steps
        together = transcribe_files(engine, [speech_wav] * 3)
        steps_together = engine.scheduler.stats.decode_steps - steps_alone
        assert [t.window_tokens for t in together] == [alone.window_tokens] * 3
        assert steps_together < 1.5 * steps_alone  # one batched step serves all three
        assert engine.sessions_open == 0 and engine.capacity() == engine.max_sessions


def test_cli_transcribe(whisper_bundle, speech_wav):
    r = run_cli("transcribe", "--bundle", whisper_bundle, speech_wav)
    assert r.returncode == 0, r.stderr
    assert "lazy dog" in r.stdout.lower()
    r = run_cli("transcribe", "--bundle", whisper_bundle, speech_wav, speech_wav)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{speech_wav}: ") and "lazy dog" in line.lower() for line in lines)


def test_whisper_bundle_shares_weights_and_declares_the_decoder_cache(whisper_bundle):
    with onecopy.Engine.load(whisper_bundle) as engine:
        assert engine.methods == ["encoder", "decoder"]
        enc, dec = engine.method("encoder").spec, engine.method("decoder").spec
        cross = [f for f in engine.manifest.state if ".encoder_attn." in f]
        own = [f for f in engine.manifest.state if ".self_attn." in f]
        assert len(cross) == len(own) == 8
        assert (enc.role, enc.state, enc.writes) == ("encode", cross, sorted(cross))  # writes cross K/V only
        assert (dec.role, dec.state, dec.writes) == ("decode", own + cross, sorted(own))  # reads it, writes its cache
        r = engine.memory_report()
        assert r.duplicated_weight_bytes == 0 and r.resident_weight_bytes == r.unique_weight_bytes


def test_log_mel_equals_transformers(speech_wav):
    import transformers

    samples = load_audio(speech_wav)
    want = transformers.WhisperFeatureExtractor(feature_size=80)(samples, sampling_rate=16000,
                                                                 return_tensors="pt").input_features
    torch.testing.assert_close(LogMel(80, torch.device("cpu"))(samples), want, rtol=1e-4, atol=1e-4)


def test_resampling_keeps_a_tone():
    t = np.arange(22050 * 2) / 22050
    out = resample(np.sin(2 * np.pi * 440 * t).astype(np.float32), 22050)
    ref = np.sin(2 * np.pi * 440 * np.arange(len(out)) / 16000)
    assert len(out) == 32000 and np.abs(out[800:-800] - ref[800:-800]).max() < 1e-3


def _write_wav(path, rate, samples, width=2):
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes((np.asarray(samples) * 32767).astype("<i2").tobytes())


def test_bad_audio_gets_clear_errors(tmp_path, whisper_bundle):
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(AudioError, match="is empty"):
        load_audio(empty)
    text = tmp_path / "notes.wav"
    text.write_text("hello, not audio")
    with pytest.raises(AudioError, match="not a WAV file .*ffmpeg"):
        load_audio(text)
    slow = tmp_path / "slow.wav"
    _write_wav(slow, 1000, np.zeros(2000))
    with pytest.raises(AudioError, match="sample rate 1000 Hz is outside what onecopy resamples"):
        load_audio(slow)
    short = tmp_path / "short.wav"
    _write_wav(short, 16000, np.zeros(800))
    with pytest.raises(AudioError, match=r"0.050 s of audio; at least 0.1 s"):
        load_audio(short)
    with pytest.raises(AudioError, match="does not exist"):
        read_wav(tmp_path / "missing.wav")
    with onecopy.Engine.load(whisper_bundle) as engine:
        with pytest.raises(AudioError, match="is empty"):
            transcribe_file(engine, empty)
        assert engine.sessions_open == 0


def test_hf_whisper_checkpoint_dir_loads_the_same_model(whisper_source, tmp_path):
    """A transformers-format Whisper directory (config, safetensors, tokenizer, generation config)."""
    import json

    from onecopy.models.source import resolve_source

    whisper_source.save_hf(tmp_path)
    gen = whisper_source.generation
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"suppress_tokens": gen["suppress_ids"], "begin_suppress_tokens": gen["suppress_ids_begin"]}))
    src = resolve_source(tmp_path)
    assert src.family == "whisper" and src.config == whisper_source.config
    assert src.generation == gen and src.eos_token_ids == whisper_source.eos_token_ids
    assert set(src.hf_state_dict) == set(whisper_source.hf_state_dict)
    assert all(torch.equal(src.hf_state_dict[k], v) for k, v in whisper_source.hf_state_dict.items())
