"""The model side: families, their shared layers, checkpoint conversion, presets and model sources.

- models: `llama` (Llama/Qwen2/Qwen3/SmolLM), `qwen3_5` with `qwen3_5_deltanet` and `qwen3_5_config` (hybrid
  DeltaNet/attention, dense and MoE), `whisper`; `base` (what every family gives the exporter);
- shared layers: `layers` (RMSNorm, RoPE, SwiGLU MLP), `attention` (attention over the state pool),
  `projections` (the fused CUDA decode's projections), `invariant` (the batch-invariant decode);
  the CUDA kernels they call are the `onecopy.kernels` package;
- checkpoints: `hf_checkpoint` (Llama family, and what every text checkpoint shares), `gguf_file`,
  `qwen3_5_convert`, `ct2_whisper`;
- `families` (the registry of families), `presets` and `random_weights` (seeded random models),
  `source` (a preset, file or directory resolved into a `source.ModelSource`).
"""
