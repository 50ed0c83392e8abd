"""Bad arguments to load, export, sampling, transcription and the CLI: each gets its own clear error."""

import pytest
import torch

import onecopy
from onecopy.sampling import SamplingParams
from onecopy.transcribe import Transcriber

from .conftest import run_cli


def test_engine_load_arguments(tiny_bundle):
    with pytest.raises(onecopy.InputError, match="cuda_graphs=True needs a CUDA device; load with device='cuda'"):
        onecopy.Engine.load(tiny_bundle, "cpu", cuda_graphs=True)
    with pytest.raises(onecopy.InputError, match="max_sessions must be >= 1, got 0"):
        onecopy.Engine.load(tiny_bundle, max_sessions=0)
    with pytest.raises(onecopy.InputError, match=r"new_token_ratio must be in \[0, 1\], got 1.5"):
        onecopy.Engine.load(tiny_bundle, new_token_ratio=1.5)
    r = run_cli("bench", "throughput", "--bundle", str(tiny_bundle), "--new-token-ratio", "-0.5", "--requests", "1")
    assert r.returncode == 2 and "new_token_ratio must be in [0, 1], got -0.5" in r.stderr
    if not torch.cuda.is_available():
        with pytest.raises(onecopy.InputError, match="no CUDA GPU is visible; load with device='cpu'"):
            onecopy.Engine.load(tiny_bundle, "cuda")


def test_export_arguments(tiny_source, tmp_path):
    with pytest.raises(onecopy.ExportError, match=r"cannot export methods \['encoder'\]: llama models have prefill, decode"):
        onecopy.export(tiny_source, tmp_path / "a", max_seq_len=16, methods=("encoder",), progress=False)
    with pytest.raises(onecopy.ExportError, match=r"cannot export methods \['prefill'\]"):
        onecopy.export(tiny_source, tmp_path / "b", max_seq_len=16, methods=("decode",), embed_weights=("prefill",),
                       progress=False)
    with pytest.raises(onecopy.ExportError, match=r"max_seq_len=0 is out of range for tiny-llama"):
        onecopy.export(tiny_source, tmp_path / "c", max_seq_len=0, progress=False)
    with pytest.raises(onecopy.ExportError, match="device 'tpu' is not supported; use 'cpu' or 'cuda'"):
        onecopy.export(tiny_source, tmp_path / "d", max_seq_len=16, device="tpu", progress=False)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_repetition_penalty_must_be_positive():
    with pytest.raises(onecopy.InputError, match="repetition_penalty must be > 0, got 0"):
        SamplingParams(repetition_penalty=0)


def test_transcribing_with_an_llm_bundle(tiny_engine):
    with pytest.raises(onecopy.InputError, match="is not a speech model .*onecopy export whisper-tiny.en"):
        Transcriber(tiny_engine)


def test_info_device_memory(tiny_bundle):
    ok = run_cli("info", tiny_bundle, "--device-memory", "80GiB")
    assert ok.returncode == 0 and "sessions fit in 80GiB" in ok.stdout and "4,096 MiB reserve" in ok.stdout
    bad = run_cli("info", tiny_bundle, "--device-memory", "lots")
    assert bad.returncode == 2 and "cannot read size 'lots'; write it like 80GiB" in bad.stderr


def test_a_chat_template_that_refuses_the_messages_is_an_input_error():
    """A template's raise_exception (roles out of the order it takes) is the caller's error, named, not a crash: the
    server answers it with a 400 on /v1/chat/completions and /v1/responses alike."""
    from tokenizers import Tokenizer as HFTokenizer, models

    from onecopy.tokenizer import Tokenizer

    tok = Tokenizer(HFTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).to_str(),
                    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
                    "{{ raise_exception('System message must be first') }}{% endif %}{{ m['content'] }}{% endfor %}")
    assert tok.apply_chat_template([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]) == "ab"
    with pytest.raises(onecopy.InputError, match="the model's chat template refuses these messages: System message "
                                                 "must be first"):
        tok.apply_chat_template([{"role": "user", "content": "b"}, {"role": "system", "content": "a"}])
