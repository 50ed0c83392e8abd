"""Quantized weights stay packed: GGUF types repacked, int8/int4 exports, the manifest, store and report.

On CPU a packed layer is read by the C++ kernel (`kernels.cpu`, its own tests: test_cpu_packed_kernel) or, where
it does not serve, dequantized in the graph, so a compiled method equals the eager model with the same packed
layers, and a GGUF one computes the float model of the dequantized GGUF up to float32 summation order (the
dequantization is gguf's bit for bit, `test_gguf_repack`). The CUDA kernels that read the packed tiles: tests/gpu.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import onecopy
from onecopy.errors import ExportError, ManifestError, UnknownWeightLayoutError
from onecopy.models.linear import PackedLinear
from onecopy.models.packed import PackedEmbedding, as_float_weights, dequantize, packed_bytes
from onecopy.models.quantize import pack_gguf, quantize_model, quantize_weight
from onecopy.models.source import resolve_source

from .bundle_cache import cached_bundle
from .conftest import TINY_MAX_SEQ_LEN, copy_bundle, eager_greedy, hf_greedy, run_cli
from .gguf_writer import write_tiny_gguf

PROMPT = [7, 3, 99, 250, 18, 42, 5, 300, 11]
PROJECTIONS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
# mode -> (layout, the group the fixture exports; fp8's group is always the row: K, 64 for w13)
MODES = {"int8": ("q8s", 64), "int4": ("q4a", 32), "fp8": ("f8r", 64)}
QWEIGHT_DTYPES = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}


@pytest.fixture(scope="module", params=list(MODES))
def quantized(request, tiny_source):
    mode = request.param
    layout, group = MODES[mode]
    out = cached_bundle("tiny-llama", max_seq_len=TINY_MAX_SEQ_LEN, quantize=mode, group_size=group)
    model = tiny_source.build(TINY_MAX_SEQ_LEN, torch.float32)
    quantize_model(model, mode, group)
    return mode, out, model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q.gguf")


@pytest.fixture(scope="module")
def gguf_bundle(tiny_gguf) -> Path:
    return cached_bundle(tiny_gguf, max_seq_len=TINY_MAX_SEQ_LEN)  # the default: packed, on CPU too


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("group", [16, 128])
def test_round_to_nearest_is_within_half_a_step_and_exact_on_the_grid(mode, group):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 256, generator=g)
    w[3, :group] = 0.25  # a constant group: scale 0, exact
    p = quantize_weight(w, mode, group)
    assert p.layout == MODES[mode][0] and p.qweight.dtype == (torch.int8 if mode == "int8" else torch.uint8)
    back = dequantize(p)
    step = p.scales.repeat_interleave(group, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(back[3, :group], w[3, :group])
    # every other group spans the whole code range: int8 reaches +-127, int4 both 0 and 15
    q = p.qweight.to(torch.int16)
    q = torch.stack((q & 15, q >> 4), -1).flatten(1) if mode == "int4" else q
    q = q.reshape(24, -1, group)[torch.arange(24) != 3]
    if mode == "int8":
        assert (q.abs().amax(-1) == 127).all()
    else:
        assert (q.amin(-1) == 0).all() and (q.amax(-1) == 15).all()
    assert p.nbytes == packed_bytes((24, 256), p.layout, group)


def test_fp8_is_within_half_an_e4m3_step_per_row_and_refuses_shapes_its_gemm_cannot_take():
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(0))
    p = quantize_weight(w, "fp8")
    assert (p.layout, p.group, p.qweight.dtype, tuple(p.scales.shape)) == ("f8r", 96, torch.float8_e4m3fn, (32, 1))
    assert torch.equal(p.qweight.float().abs().amax(-1), torch.full((32,), 448.0))  # each row spans the range
    # e4m3 keeps 3 mantissa bits: within half a step (2^-4 of the value), or of the smallest normal's step
    assert ((dequantize(p) - w).abs() <= (w.abs() * 2.0 ** -4).clamp_min(2.0 ** -10 * p.scales) + 1e-7).all()
    assert p.nbytes == packed_bytes((32, 96), "f8r", 96)
    with pytest.raises(ExportError, match=r"quantize='fp8' needs .* multiples of 16, this one is \[24, 40\]"):
        quantize_weight(torch.randn(24, 40), "fp8")


def test_quantize_options_are_checked_before_anything_is_built(tmp_path, tiny_source):
    with pytest.raises(ExportError, match=r"quantize='int3' is not supported; use int8 or int4 or fp8 \(--quantize\)"):
        onecopy.export(tiny_source, tmp_path / "a", quantize="int3", progress=False)
    with pytest.raises(ExportError, match=r"group size 48 is not supported; use one of 16, 32, 64, 128 \(--group-size\)"):
        onecopy.export(tiny_source, tmp_path / "b", quantize="int4", group_size=48, progress=False)
    with pytest.raises(ExportError, match="does not divide a weight's 64 inputs"):
        onecopy.export(tiny_source, tmp_path / "c", quantize="int8", group_size=128, progress=False)
    with pytest.raises(ExportError, match="group size 128 does not divide a weight's 64 inputs"):
        onecopy.export("tiny-qwen3.5-moe", tmp_path / "d", quantize="int4", group_size=128, progress=False)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_quantized_export_equals_the_eager_quantized_model(quantized):
    mode, bundle, model = quantized
    with onecopy.Engine.load(bundle) as engine:
        s = engine.open_session()
        with torch.no_grad():
            want = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
            torch.testing.assert_close(s.prefill(PROMPT), want, rtol=1e-4, atol=1e-4)
            for i, t in enumerate([17, 200, 3]):
                want = model(torch.tensor([[t]]), torch.tensor([len(PROMPT) + i]))
                torch.testing.assert_close(s.decode(torch.tensor([t])), want, rtol=1e-4, atol=1e-4)
        got = list(engine.open_session().generate_ids(PROMPT, onecopy.SamplingParams(max_new_tokens=20), stop_ids=[]))
        assert got == eager_greedy(model, PROMPT, 20)


def test_packed_layers_are_recorded_stored_packed_and_reported(quantized, tiny_source):
    mode, bundle, model = quantized
    layout, group = MODES[mode]
    m = json.loads((bundle / "manifest.json").read_text())
    assert set(m["packed"]) == {f"layers.{i}.{p}" for i in range(2) for p in PROJECTIONS} | {"output"}
    assert "tok_embeddings.weight" in m["weights"]  # gathered, not read whole: --quantize leaves it float
    assert m["packed"]["layers.1.feed_forward.w13"] == {"layout": layout, "group": group, "shape": [256, 64],
                                                        "source": f"{mode} rtn"}
    assert "layers.0.attention.wqkv.weight" not in m["weights"]
    assert m["weights"]["layers.0.attention.wqkv.qweight"]["dtype"] == str(QWEIGHT_DTYPES[mode]).removeprefix("torch.")
    floats = sum(p["shape"][0] * p["shape"][1] for p in m["packed"].values())
    with onecopy.Engine.load(bundle) as engine:
        with engine.open_session() as s:
            s.prefill([1, 2, 3])  # binds both methods
            s.decode(torch.tensor([4]))
        report = engine.memory_report()
        # the store holds each packed tensor once, at its packed size, and both methods read that one
        q = "layers.0.feed_forward.w2.qweight"
        stored = engine.weights.get(q)
        assert stored.dtype == QWEIGHT_DTYPES[mode]
        assert engine.method("prefill").bound[q] == engine.method("decode").bound[q] == stored.data_ptr()
        # what a float peer loads (onecopy bench): the packed layers' values as <layer>.weight
        peer = as_float_weights(engine.weights.as_map(m["weights"]), m["packed"], torch.float32)
        assert not any(f.endswith((".qweight", ".scales", ".mins")) for f in peer)
        assert torch.equal(peer["layers.1.feed_forward.w2.weight"], dequantize(model.layers[1].feed_forward.w2.weight))
    want = sum(packed_bytes(tuple(p["shape"]), p["layout"], p["group"]) for p in m["packed"].values())
    assert report.packed_weight_bytes == want and report.packed_as_float_bytes == 4 * floats
    assert report.packed_weight_bytes < (0.25 if mode == "int4" else 0.35) * report.packed_as_float_bytes
    assert "packed weights (as float)" in str(report)


def test_a_bundle_with_an_unknown_layout_is_refused_and_nothing_is_loaded(quantized, tmp_path, monkeypatch):
    from onecopy.runtime import weights as weights_mod

    loaded = []
    real_load = weights_mod.WeightStore.load
    monkeypatch.setattr(weights_mod.WeightStore, "load", lambda self, *a: (loaded.append(self), real_load(self, *a))[1])
    _, bundle, _ = quantized
    b = copy_bundle(bundle, tmp_path / "b")
    m = json.loads((b / "manifest.json").read_text())
    m["packed"]["layers.0.attention.wo"]["layout"] = "q3x"
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UnknownWeightLayoutError, match=r"layer 'layers.0.attention.wo' has weight layout 'q3x', "
                                                       r"which this onecopy cannot read \(it reads q8s, q4z, q4a, q8a, f8r, "
                                                       r"q4z_mma, q4a_mma, q8s_mma\)"):
        onecopy.Engine.load(b)
    m["packed"]["layers.0.attention.wo"].update(layout=MODES[quantized[0]][0], shape=[64, 128])
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="packed layer 'layers.0.attention.wo' does not match its weights"):
        onecopy.Engine.load(b)
    assert loaded == []  # no weight reached the device


def test_every_gguf_type_stays_packed_and_generates_like_the_dequantized_model(gguf_bundle, tiny_gguf):
    src = resolve_source(tiny_gguf)
    m = json.loads((gguf_bundle / "manifest.json").read_text())
    sources = {p["source"] for p in m["packed"].values()}
    assert sources == {"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"}
    assert {p["layout"] for p in m["packed"].values()} == {"q8s", "q4z", "q4a", "q8a"}
    assert m["packed"]["output"]["source"] == "Q6_K" and m["packed"]["tok_embeddings"]["layout"] == "q8s"
    # layer 0's q/k are Q4_K and v is Q6_K: one fused wqkv cannot hold both, so it stays float
    assert "layers.0.attention.wqkv" not in m["packed"] and "layers.0.attention.wqkv.weight" in m["weights"]
    # its methods call the CPU kernel by name: the runtime loads that library before the packages
    assert {k: v["native_ops"] for k, v in m["methods"].items()} == {k: ["onecopy_cpu"] for k in m["methods"]}
    float_model = src.build(TINY_MAX_SEQ_LEN, torch.float32)  # the dequantized GGUF
    packed_model = src.build(TINY_MAX_SEQ_LEN, torch.float32)
    assert pack_gguf(packed_model, src.packed)[1] == ["layers.0.attention.wqkv"]
    assert isinstance(packed_model.tok_embeddings, PackedEmbedding) and isinstance(packed_model.output, PackedLinear)
    with torch.no_grad():  # gguf's very floats, summed in the kernel's order (a few float32 ulps)
        ids = torch.tensor([PROMPT])
        got, ref = packed_model(ids, torch.arange(len(PROMPT))), float_model(ids, torch.arange(len(PROMPT)))
        assert torch.allclose(got, ref, rtol=0, atol=1e-4 * ref.abs().max().item()), (got - ref).abs().max()
    want = hf_greedy(src, PROMPT, 16)
    assert want == eager_greedy(float_model, PROMPT, 16)
    with onecopy.Engine.load(gguf_bundle) as engine:
        got = list(engine.open_session().generate_ids(PROMPT, onecopy.SamplingParams(max_new_tokens=16), stop_ids=[]))
    assert got == want


def test_requantizing_a_quantized_gguf_needs_dequantize(tmp_path, tiny_gguf):
    with pytest.raises(ExportError, match=r"tiny-q is already quantized \(Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0\) "
                                          r"and stays so; .* pass dequantize=True too \(--dequantize\)"):
        onecopy.export(tiny_gguf, tmp_path / "x", quantize="int4", dequantize=False, progress=False)


def test_cli_export_options_and_info(tmp_path, tiny_gguf, gguf_bundle, exports_via_cache):
    cli = run_cli  # the export below: its options reach the exporter, the bundle comes from the cache
    r = cli("export", "tiny-llama", "--out", str(tmp_path / "x"), "--quantize", "int4", "--group-size", "48")
    assert r.returncode == 2 and "--group-size: invalid choice: 48" in r.stderr
    r = cli("info", str(gguf_bundle))
    assert r.returncode == 0, r.stderr
    assert "packed        1 layers q4z g32 from Q4_0:" in r.stdout and "packed        2 layers q8s g16 from Q6_K:" in r.stdout
    assert "B/value; float32 would take" in r.stdout
    r = cli("export", str(tiny_gguf), "--out", str(tmp_path / "x"), "--dequantize", "--keep-quantized")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
    # --dequantize stores a GGUF's weights as floats (only the prefill method, to keep it quick); by default
    # they stay packed on CPU too (gguf_bundle: dequantize left at its default)
    r = cli("export", str(tiny_gguf), "--out", str(tmp_path / "f"), "--methods", "prefill", "--max-seq-len", "32",
            "--dequantize")
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "f" / "manifest.json").read_text())
    assert m["packed"] == {} and m["weights"]["output.weight"]["dtype"] == "float32"


def test_smollm2_q4_1_packed_computes_the_dequantized_gguf(smollm2_source):
    """The real Q4_1 file: packed layers (the CPU kernel) give the float model's logits up to float32 summation
    order and the same next token everywhere (the float model and its compiled bundle match transformers:
    test_correctness), at under a quarter of the float32 bytes."""
    float_model = smollm2_source.build(64, torch.float32)
    packed_model = smollm2_source.build(64, torch.float32)
    sources, kept_float = pack_gguf(packed_model, smollm2_source.packed)
    assert kept_float == [] and set(sources.values()) == {"Q4_1", "Q8_0"} and sources["tok_embeddings"] == "Q8_0"
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314, 5465, 47]])
    with torch.no_grad():
        got, ref = packed_model(ids, torch.arange(8)), float_model(ids, torch.arange(8))
    assert torch.allclose(got, ref, rtol=0, atol=1e-4 * ref.abs().max().item()), (got - ref).abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    held = sum(t.numel() * t.element_size() for t in packed_model.state_dict().values())
    floats = sum(t.numel() * t.element_size() for t in float_model.state_dict().values())
    assert held < 0.25 * floats, (held, floats)


def test_an_on_device_llama_is_quantized_as_built_and_the_exporter_leaves_it_so():
    """`random_weights.llama_on_device` with ``quantize`` (what `ModelSource.build` passes for the presets drawn
    on the device): the same packed tensors as the float draw quantized after, and `quantize_model` on it again
    (the exporter's step) changes nothing."""
    from onecopy.models.presets import PRESETS
    from onecopy.models.random_weights import llama_on_device

    cfg = PRESETS["tiny-llama"].config
    want = llama_on_device(cfg, TINY_MAX_SEQ_LEN, torch.float32, torch.device("cpu"), seed=5)
    quantize_model(want, "int8", 32)
    got = llama_on_device(cfg, TINY_MAX_SEQ_LEN, torch.float32, torch.device("cpu"), seed=5, quantize=("int8", 32))
    before = {n: t.clone() for n, t in got.state_dict().items()}
    quantize_model(got, "int8", 32)
    assert isinstance(got.layers[0].attention.wqkv, PackedLinear)
    assert got.state_dict().keys() == want.state_dict().keys() == before.keys()
    assert all(torch.equal(got.state_dict()[n], t) and torch.equal(before[n], t) for n, t in want.state_dict().items())
