"""Speech to text with an encoder-decoder (Whisper) bundle: greedy, timestamps-free, 30 s windows.

Per window the encoder runs once and its output (every decoder layer's cross-attention K/V)
stays on the device in a named session slot that each decoder step reads; per decoder step only
the chosen token id is copied to the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .audio import LogMel, load_audio, windows
from .bundle import parse_dtype
from .errors import InputError
from .runtime.engine import Engine
from .runtime.session import Slot


@dataclass
class Transcript:
    text: str
    window_tokens: list[list[int]] = field(default_factory=list)  # generated ids per 30 s window


class Transcriber:
    """Holds the feature extractor and suppression masks for one Whisper engine."""

    def __init__(self, engine: Engine) -> None:
        gen = engine.manifest.generation
        if "encoder" not in engine.methods or "decoder" not in engine.methods or "sot_ids" not in gen:
            raise InputError(f"bundle {engine.path} is not a speech model (needs encoder and decoder methods); "
                             "export one with `onecopy export whisper-tiny.en --out DIR`")
        self.engine = engine
        cfg = engine.manifest.config
        self.features = LogMel(cfg["n_mels"], engine.device)
        self.dtype = parse_dtype(engine.manifest.dtype)
        vocab, dev = cfg["vocab_size"], engine.device
        self.suppress = torch.zeros(vocab, dtype=torch.bool, device=dev)
        self.suppress[[i for i in gen.get("suppress_ids", []) if 0 <= i < vocab]] = True
        self.suppress_begin = self.suppress.clone()
        self.suppress_begin[[i for i in gen.get("suppress_ids_begin", []) if 0 <= i < vocab]] = True
        self.sot = list(gen["sot_ids"])
        self.eos = set(engine.eos_token_ids)

    def transcribe(self, samples: np.ndarray, max_new_tokens: int | None = None) -> Transcript:
        """Transcribe 16 kHz mono samples (any length: 30 s windows, texts joined)."""
        eng = self.engine
        limit = eng.max_seq_len - len(self.sot)
        if max_new_tokens is not None:
            limit = min(limit, max_new_tokens)
        texts, all_ids = [], []
        with eng.open_session() as s:
            for w in windows(samples):
                s.reset()
                s.run("encoder", self.features(w).to(self.dtype), keep_as="cross_kv")
                ids = self._decode_window(s, limit)
                all_ids.append(ids)
                texts.append(eng.tokenizer.decode(ids).strip())
        return Transcript(text=" ".join(t for t in texts if t), window_tokens=all_ids)

    def _decode_window(self, s, limit: int) -> list[int]:
        dev, kv = self.engine.device, Slot("cross_kv")
        logits = None
        for i, t in enumerate(self.sot):
            logits = s.run("decoder", torch.tensor([[t]], device=dev), torch.tensor([i], device=dev), kv)
        pos, ids = len(self.sot), []
        for step in range(limit):
            mask = self.suppress_begin if step == 0 else self.suppress
            token = logits.masked_fill(mask, float("-inf")).argmax(dim=-1)
            token_id = int(token.item())  # the one device-to-host copy per step
            if token_id in self.eos:
                break
            ids.append(token_id)
            if pos >= self.engine.max_seq_len:
                break
            logits = s.run("decoder", token.view(1, 1), torch.full((1,), pos, device=dev), kv)
            pos += 1
        return ids


def transcribe_file(engine: Engine, path: str | Path, max_new_tokens: int | None = None) -> Transcript:
    """Read a WAV file (resampled to 16 kHz) and transcribe it."""
    return Transcriber(engine).transcribe(load_audio(path), max_new_tokens)
