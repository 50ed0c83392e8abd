"""Speech to text with an encoder-decoder (Whisper) bundle: greedy, timestamps-free, 30 s windows.

Every window of every file is one request to the engine's scheduler: at admission the encoder
runs once and writes the window's cross-attention K/V into the request's row of the state pool,
where every decoder step reads it on the device; the decoder steps of all windows in flight run
as one batch. Only the chosen token ids reach the host, one copy per step for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .audio import LogMel, load_audio, windows
from .bundle import parse_dtype
from .errors import InputError
from .runtime.engine import Engine
from .runtime.stream import TokenStream
from .params import SamplingParams


@dataclass
class Transcript:
    text: str
    window_tokens: list[list[int]] = field(default_factory=list)  # generated ids per 30 s window


class Transcriber:
    """Holds the feature extractor and the decoding rules (prompt, suppressed ids) for one Whisper engine."""

    def __init__(self, engine: Engine) -> None:
        gen = engine.manifest.generation
        if not {"encode", "decode"} <= {engine.method(n).role for n in engine.methods} or "sot_ids" not in gen:
            raise InputError(f"bundle {engine.path} is not a speech model (needs encoder and decoder methods); "
                             "export one with `onecopy export whisper-tiny.en --out DIR`")
        self.engine = engine
        cfg = engine.manifest.config
        self.features = LogMel(cfg["n_mels"], engine.device)
        self.dtype = parse_dtype(engine.manifest.dtype)
        self.sot = list(gen["sot_ids"])
        self.suppress = tuple(gen.get("suppress_ids", []))
        self.begin_suppress = tuple(gen.get("suppress_ids_begin", []))

    def _submit(self, mel: torch.Tensor, max_new_tokens: int | None) -> TokenStream:
        limit = self.engine.max_seq_len - len(self.sot) + 1  # the last position still yields one token
        if max_new_tokens is not None:
            limit = min(limit, max_new_tokens + 1)  # + the eos that ends a window
        params = SamplingParams(max_new_tokens=limit, suppress_ids=self.suppress, begin_suppress_ids=self.begin_suppress)
        return self.engine.submit(self.sot, params, encode_inputs=(mel,))

    def _collect(self, stream: TokenStream, max_new_tokens: int | None) -> list[int]:
        ids = stream.result()
        if stream.finish_reason == "stop":
            ids = ids[:-1]  # the eos
        return ids if max_new_tokens is None else ids[:max_new_tokens]

    def transcribe_many(self, recordings: Sequence[np.ndarray], max_new_tokens: int | None = None) -> list[Transcript]:
        """Transcribe several 16 kHz mono recordings at once: all their windows run as concurrent requests."""
        # Features of every window first, so the requests reach the scheduler together and batch from the start.
        mels = [[self.features(w).to(self.dtype) for w in windows(samples)] for samples in recordings]
        streams = [[self._submit(m, max_new_tokens) for m in file_mels] for file_mels in mels]
        out = []
        for file_streams in streams:
            ids = [self._collect(s, max_new_tokens) for s in file_streams]
            texts = [self.engine.tokenizer.decode(w).strip() for w in ids]
            out.append(Transcript(text=" ".join(t for t in texts if t), window_tokens=ids))
        return out

    def transcribe(self, samples: np.ndarray, max_new_tokens: int | None = None) -> Transcript:
        """Transcribe 16 kHz mono samples (any length: 30 s windows, texts joined)."""
        return self.transcribe_many([samples], max_new_tokens)[0]


def transcribe_file(engine: Engine, path: str | Path, max_new_tokens: int | None = None) -> Transcript:
    """Read a WAV file (resampled to 16 kHz) and transcribe it."""
    return transcribe_files(engine, [path], max_new_tokens)[0]


def transcribe_files(engine: Engine, paths: Sequence[str | Path], max_new_tokens: int | None = None) -> list[Transcript]:
    """Read WAV files and transcribe them as concurrent sessions (decoder steps batched across files)."""
    recordings = [load_audio(p) for p in paths]  # every file is read (and checked) before any work starts
    return Transcriber(engine).transcribe_many(recordings, max_new_tokens)
