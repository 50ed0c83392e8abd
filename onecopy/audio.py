"""Audio in: WAV reading, resampling to 16 kHz, and Whisper's log-mel features (no network, no librosa).

The features follow transformers' WhisperFeatureExtractor: 400-point STFT with a periodic Hann
window, hop 160, centered with reflection padding, power spectrum, Slaney mel filters,
log10 clamped to 8 below the maximum, then (x + 4) / 4. They are computed with torch on the
engine's device, so the encoder input never leaves it.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import torch

from .errors import OnecopyError

SAMPLE_RATE = 16000
N_FFT, HOP = 400, 160
CHUNK_SECONDS = 30
CHUNK_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS
MIN_SECONDS = 0.1
SUPPORTED_RATES = (4000, 384000)


class AudioError(OnecopyError):
    """The audio cannot be read or used (empty, not a WAV, unsupported format or rate, too short)."""


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Mono float32 samples in [-1, 1] and the sample rate of a RIFF/WAVE file (PCM 8/16/24/32, float32/64)."""
    path = Path(path)
    if not path.is_file():
        raise AudioError(f"{path} does not exist")
    return parse_wav(path.read_bytes(), str(path))


def parse_wav(data: bytes, path: str) -> tuple[np.ndarray, int]:
    """`read_wav` of bytes already read; ``path`` names them in errors (a file name, an upload)."""
    if not data:
        raise AudioError(f"{path} is empty; record or convert a WAV file with some audio in it")
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise AudioError(f"{path} is not a WAV file (no RIFF/WAVE header); convert it, e.g. "
                         f"`ffmpeg -i {Path(path).name} -ar 16000 -ac 1 out.wav`")
    fmt, fmt_body, pcm, off = None, b"", None, 12
    while off + 8 <= len(data):
        cid, size = data[off:off + 4], struct.unpack_from("<I", data, off + 4)[0]
        body = data[off + 8:off + 8 + size]
        if cid == b"fmt " and len(body) >= 16:
            fmt, fmt_body = struct.unpack_from("<HHIIHH", body, 0), body
        elif cid == b"data":
            pcm = body
        off += 8 + size + (size & 1)
    if fmt is None or pcm is None:
        raise AudioError(f"{path} lacks a fmt or data chunk; the WAV file is truncated or damaged")
    tag, channels, rate, _, block, bits = fmt
    if tag == 0xFFFE and len(fmt_body) >= 26:
        tag = struct.unpack_from("<H", fmt_body, 24)[0]  # WAVE_FORMAT_EXTENSIBLE: the real tag is in the sub-format
    if channels < 1 or block == 0:
        raise AudioError(f"{path} declares {channels} channels; the WAV header is damaged")
    frames = len(pcm) // block
    raw = pcm[:frames * block]
    if tag == 1 and bits == 8:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128) / 128
    elif tag == 1 and bits == 16:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768
    elif tag == 1 and bits == 24:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8).astype(np.float32) / 2**23
    elif tag == 1 and bits == 32:
        x = np.frombuffer(raw, "<i4").astype(np.float32) / 2**31
    elif tag == 3 and bits in (32, 64):
        x = np.frombuffer(raw, "<f4" if bits == 32 else "<f8").astype(np.float32)
    else:
        raise AudioError(f"{path}: WAV encoding (format {tag}, {bits} bits) is not supported; use PCM 16-bit")
    return x.reshape(-1, channels).mean(axis=1), rate


def resample(x: np.ndarray, rate: int, target: int = SAMPLE_RATE) -> np.ndarray:
    """Band-limited (windowed-sinc, Hann, 32 zero crossings) resampling to ``target`` Hz."""
    if rate == target:
        return x.astype(np.float32)
    if not SUPPORTED_RATES[0] <= rate <= SUPPORTED_RATES[1]:
        raise AudioError(f"sample rate {rate} Hz is outside what onecopy resamples ({SUPPORTED_RATES[0]}.."
                         f"{SUPPORTED_RATES[1]} Hz); convert it to {target} Hz first")
    g = math.gcd(rate, target)
    up, down = target // g, rate // g
    cutoff = min(1.0, target / rate)  # of the input Nyquist
    half = 32 / cutoff  # filter half-width in input samples
    src = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64))
    n_out = int(math.ceil(len(x) * up / down))
    out = torch.empty(n_out, dtype=torch.float64)
    for start in range(0, n_out, 65536):  # chunks keep the tap matrix small
        t = torch.arange(start, min(n_out, start + 65536), dtype=torch.float64) * down / up
        left = torch.floor(t - half).long()
        taps = left[:, None] + torch.arange(int(2 * half) + 2)[None, :]
        d = t[:, None] - taps
        w = cutoff * torch.special.sinc(cutoff * d) * torch.where(
            d.abs() < half, 0.5 + 0.5 * torch.cos(math.pi * d / half), torch.zeros_like(d))
        vals = src[taps.clamp(0, len(x) - 1)] * ((taps >= 0) & (taps < len(x)))
        out[start:start + len(t)] = (vals * w).sum(1)
    return out.float().numpy()


def load_audio(path: str | Path) -> np.ndarray:
    """16 kHz mono float32 samples of a WAV file, checked for length."""
    return audio_samples(*read_wav(path), str(path))


def load_audio_bytes(data: bytes, name: str) -> np.ndarray:
    """`load_audio` of WAV bytes (an upload); ``name`` names them in errors."""
    return audio_samples(*parse_wav(data, name), name)


def audio_samples(x: np.ndarray, rate: int, path: str) -> np.ndarray:
    """``x`` at ``rate`` resampled to 16 kHz, checked for length."""
    x = resample(x, rate)
    if len(x) < MIN_SECONDS * SAMPLE_RATE:
        raise AudioError(f"{path} holds {len(x) / SAMPLE_RATE:.3f} s of audio; at least {MIN_SECONDS} s is needed")
    return x


def mel_filters(n_mels: int, n_fft: int = N_FFT, sr: int = SAMPLE_RATE) -> np.ndarray:
    """Slaney-scale, Slaney-normalized triangular filters [n_fft // 2 + 1, n_mels] (as librosa/transformers)."""
    def hz_to_mel(f: np.ndarray) -> np.ndarray:
        f = np.asarray(f, dtype=np.float64)
        mel = f / (200.0 / 3)
        log = f >= 1000.0
        return np.where(log, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0), mel)

    def mel_to_hz(m: np.ndarray) -> np.ndarray:
        m = np.asarray(m, dtype=np.float64)
        return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), m * (200.0 / 3))

    fft_freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    pts = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sr / 2), n_mels + 2))
    diff = np.diff(pts)
    slopes = pts[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    fb = np.maximum(0, np.minimum(down, up))
    return (fb * (2.0 / (pts[2:n_mels + 2] - pts[:n_mels]))[None, :]).astype(np.float32)


class LogMel:
    """Whisper log-mel features of 30 s windows, on a given device."""

    def __init__(self, n_mels: int, device: torch.device) -> None:
        self.device = device
        self.window = torch.hann_window(N_FFT, periodic=True, device=device)
        self.filters = torch.from_numpy(mel_filters(n_mels)).to(device)

    def __call__(self, samples: np.ndarray | torch.Tensor) -> torch.Tensor:
        """[1, n_mels, 3000] float32 features of up to 30 s of 16 kHz audio (zero-padded)."""
        x = torch.as_tensor(samples, dtype=torch.float32).to(self.device)
        x = torch.nn.functional.pad(x[:CHUNK_SAMPLES], (0, max(0, CHUNK_SAMPLES - len(x))))
        spec = torch.stft(x, N_FFT, HOP, window=self.window, center=True, pad_mode="reflect", return_complex=True)
        power = spec.abs().pow(2)[:, :-1]  # [201, 3000]
        mel = self.filters.T @ power
        log = torch.clamp(mel, min=1e-10).log10()
        log = torch.maximum(log, log.max() - 8.0)
        return ((log + 4.0) / 4.0)[None]


def windows(samples: np.ndarray) -> list[np.ndarray]:
    """Consecutive 30 s windows (the last one shorter); audio longer than 30 s is transcribed window by window."""
    return [samples[i:i + CHUNK_SAMPLES] for i in range(0, len(samples), CHUNK_SAMPLES)
            if len(samples[i:i + CHUNK_SAMPLES]) >= MIN_SECONDS * SAMPLE_RATE or i == 0]
