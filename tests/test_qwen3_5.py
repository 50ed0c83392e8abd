"""Qwen3.5 (dense ``qwen3_5`` and MoE ``qwen3_5_moe``): the eager model against transformers, chunked
prefill, the HF loader, and exported bundles served by the Engine (compiled = eager, session isolation,
snapshots). Each bundle comes from the test bundle cache (exported once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import onecopy
from onecopy.models import qwen3_5
from onecopy.models.qwen3_5_config import FULL, LINEAR
from onecopy.models.qwen3_5_convert import hf_config_from_qwen3_5
from onecopy.models.source import ModelSource, preset_source, resolve_source

from .bundle_cache import cached_bundle
from .conftest import eager_greedy

VARIANTS = ["tiny-qwen3.5", "tiny-qwen3.5-moe"]
MAX_SEQ_LEN = 64
PROMPT = [5, 9, 33, 2, 71, 8, 100, 3, 250]
GREEDY = onecopy.SamplingParams(max_new_tokens=10)
ATOL = 1e-4


@pytest.fixture(scope="session", params=VARIANTS)
def q35_source(request) -> ModelSource:
    return preset_source(request.param)


def _bundle(src: ModelSource) -> Path:
    return cached_bundle(src.name, max_seq_len=MAX_SEQ_LEN)  # a preset: the name says it all


@pytest.fixture
def q35_engine(q35_source):
    """Deterministic engine, prompts prefilled 4 tokens per call (chunks interleave with decode steps)."""
    bundle = _bundle(q35_source)
    with onecopy.Engine.load(bundle, max_sessions=4, deterministic=True, prefill_chunk=4) as engine:
        yield engine


def _eager(src: ModelSource, chunk_size: int | None = None) -> qwen3_5.Qwen35:
    if chunk_size is not None:
        src.config.linear_chunk_size = chunk_size
    return src.build(MAX_SEQ_LEN, torch.float32)


# ----------------------------------------------------------------------------------------------- eager

def test_eager_matches_transformers(q35_source, tmp_path):
    """Weights saved as an HF checkpoint dir, read back by onecopy's loader and by transformers
    (eager attention, fp32): prefill logits and state, then 32 greedy decode steps."""
    import transformers

    q35_source.save_hf(tmp_path / "hf")
    src = resolve_source(tmp_path / "hf")
    assert src.family == q35_source.family == ("qwen3_5_moe" if "moe" in q35_source.name else "qwen3_5")
    loaded = src.config.to_dict()
    assert {**loaded, "linear_chunk_size": 0} == {**q35_source.config.to_dict(), "linear_chunk_size": 0}
    model = _eager(src, chunk_size=4)  # prefill of 9 tokens in 16 chunks of <= 4: the state passes between chunks
    assert model.prefill_chunks == 16
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager",
                                                            dtype=torch.float32).eval()
    assert type(ref).__name__ == ("Qwen3_5MoeForCausalLM" if src.config.moe else "Qwen3_5ForCausalLM")
    with torch.no_grad():
        out = ref(torch.tensor([PROMPT]), use_cache=True)
        logits = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
        torch.testing.assert_close(logits[0], out.logits[0, -1], atol=ATOL, rtol=0)
        # The state has transformers' cache layout: conv window [conv_dim, kernel], fp32 recurrent matrix, K/V.
        state = dict(zip(model.state_fqns(), model._eager_state))
        cache = out.past_key_values
        for i, kind in enumerate(src.config.layer_types):
            if kind == LINEAR:
                conv, rec = state[f"layers.{i}.linear_attn.conv_state"], state[f"layers.{i}.linear_attn.recurrent_state"]
                assert rec.dtype == torch.float32 and rec.shape == cache.get_recurrent_state(i).shape
                torch.testing.assert_close(conv, cache.get_conv_state(i), atol=1e-5, rtol=0)
                torch.testing.assert_close(rec, cache.get_recurrent_state(i), atol=1e-5, rtol=0)
            else:
                k, v = state[f"layers.{i}.self_attn.k_cache"], state[f"layers.{i}.self_attn.v_cache"]
                torch.testing.assert_close(k[:, :, :len(PROMPT)], cache.layers[i].keys, atol=1e-5, rtol=0)
                torch.testing.assert_close(v[:, :, :len(PROMPT)], cache.layers[i].values, atol=1e-5, rtol=0)
        ours, theirs, pos = [], [], len(PROMPT)
        ref_logits = out.logits[0, -1]
        for _ in range(32):
            ours.append(int(logits.argmax()))
            theirs.append(int(ref_logits.argmax()))
            assert ours[-1] == theirs[-1]
            out = ref(torch.tensor([[theirs[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            ref_logits = out.logits[0, -1]
            logits = model(torch.tensor([[ours[-1]]]), torch.tensor([pos]))
            pos += 1
            torch.testing.assert_close(logits[0], ref_logits, atol=ATOL, rtol=0)
    assert len(set(ours)) > 5  # a real sequence, not one token repeated


def test_chunked_prefill_equals_prefill_at_once(q35_source):
    """4 + 4 + 1 tokens into one row equal 9 at once into another: logits and every state row."""
    model = _eager(q35_source)
    specs = model.state_specs()
    pools = [torch.zeros(3, *shape, dtype=dtype) for shape, dtype in specs.values()]
    tokens, one, two = torch.tensor([PROMPT]), torch.tensor([1]), torch.tensor([2])
    with torch.no_grad():
        whole = model.prefill(tokens, torch.arange(9), one, *pools)
        for a, b in ((0, 4), (4, 8), (8, 9)):
            parts = model.prefill(tokens[:, a:b], torch.arange(a, b), two, *pools)
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=0)
    for fqn, pool in zip(specs, pools):
        torch.testing.assert_close(pool[2], pool[1], atol=1e-5, rtol=0, msg=fqn)
        assert pool[1].abs().sum() > 0 and pool[0].abs().sum() == 0, fqn  # row 0 never written
    # one batched decode step of rows 1 and 2 = each row's step alone
    with torch.no_grad():
        alone = [p.clone() for p in pools]
        a1 = model.decode(torch.tensor([[7]]), torch.tensor([9]), one, *alone)
        a2 = model.decode(torch.tensor([[11]]), torch.tensor([9]), two, *alone)
        both = model.decode(torch.tensor([[7], [11]]), torch.tensor([9, 9]), torch.tensor([1, 2]), *pools)
    torch.testing.assert_close(both, torch.cat([a1, a2]), atol=1e-5, rtol=0)
    for fqn, pool, ref in zip(specs, pools, alone):
        torch.testing.assert_close(pool, ref, atol=1e-5, rtol=0, msg=fqn)


@pytest.mark.parametrize("t", [1, 31, 32, 33, 100])
def test_transformers_chunking_equals_the_static_chunk_count(t):
    """The CUDA prefill's chunking (transformers': chunks of a fixed size, their count a run-time value; the
    recurrence between them one kernel there) and the CPU's (a static chunk count, chunks sized to the prompt) are the
    same rule: equal in float64 to rounding, output and final state, whether T fills its last chunk or not."""
    from onecopy.models.qwen3_5_deltanet import chunk_gated_delta_rule, chunk_terms, scan_chunks

    g = torch.Generator().manual_seed(t)
    h, dk, dv, c = 3, 16, 8, 32
    q, k = (torch.nn.functional.normalize(torch.randn(h, t, dk, generator=g, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(h, t, dv, generator=g, dtype=torch.float64)
    decay, beta = -torch.rand(h, t, generator=g, dtype=torch.float64), torch.rand(h, t, generator=g, dtype=torch.float64)
    state = torch.randn(h, dk, dv, generator=g, dtype=torch.float64)
    want_out, want_state = chunk_gated_delta_rule(q, k, v, decay, beta, state, 4)
    n = (t + 2 * c - 1) // c  # the CUDA path's count: the chunks T needs and a spare (zero tokens: no change)
    out, got_state = scan_chunks(*chunk_terms(q, k, v, decay, beta, n, c), state)
    assert out.shape == (h, n, c, dv)
    torch.testing.assert_close(out.reshape(h, -1, dv)[:, :t], want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_state, want_state, rtol=0, atol=1e-12)


def test_position_zero_starts_over(q35_source):
    """Prefill from position 0 ignores what the row holds (as the KV cache does by position)."""
    model = _eager(q35_source)
    with torch.no_grad():
        first = model(torch.tensor([PROMPT]), torch.arange(9))
        model(torch.tensor([[3, 4, 5]]), torch.arange(9, 12))
        again = model(torch.tensor([PROMPT]), torch.arange(9))
    torch.testing.assert_close(again, first, atol=1e-6, rtol=0)


def test_multimodal_sharded_checkpoint_loads(tmp_path):
    """A ``qwen3_5_moe`` checkpoint as Qwen ships them: text config nested, ``model.language_model.*``,
    vision tower and MTP head (skipped), experts stored one by one, sharded with an index."""
    from safetensors.torch import save_file

    src = preset_source("tiny-qwen3.5-moe")
    cfg = src.config
    text = hf_config_from_qwen3_5(cfg)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "architectures": [
        "Qwen3_5MoeForConditionalGeneration"], "text_config": text, "vision_config": {"depth": 1},
        "eos_token_id": 7}))
    (tmp_path / "tokenizer.json").write_text(src.tokenizer_json)
    sd = {}
    for k, v in src.hf_state_dict.items():
        k = k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k
        if k.endswith("experts.gate_up_proj"):
            gate, up = v.split(cfg.moe_intermediate_size, dim=1)
            for e in range(cfg.num_experts):
                sd[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e].clone()
                sd[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e].clone()
        elif k.endswith("experts.down_proj"):
            for e in range(cfg.num_experts):
                sd[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].clone()
        else:
            sd[k] = v
    sd["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    sd["mtp.fc.weight"] = torch.zeros(2, 2)
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, keys in shards.items():
        save_file({k: sd[k].contiguous() for k in keys}, str(tmp_path / f))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    loaded = resolve_source(tmp_path)
    assert loaded.family == "qwen3_5_moe" and loaded.eos_token_ids == [7]
    assert loaded.config.layer_types == cfg.layer_types and loaded.config.num_experts == cfg.num_experts
    want, got = src.state_dict(), loaded.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


# ----------------------------------------------------------------------------------------------- exported

def test_compiled_methods_equal_eager(q35_engine, q35_source):
    """Prefill (in chunks of 4, through the engine) and decode of the AOTI packages = the eager model."""
    model = _eager(q35_source)
    with torch.no_grad(), q35_engine.open_session() as s:
        got = s.prefill(PROMPT)
        want = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        pos = len(PROMPT)
        for _ in range(8):
            tok = int(want.argmax())
            assert int(got.argmax()) == tok
            got = s.decode(torch.tensor([tok])).clone()
            want = model(torch.tensor([[tok]]), torch.tensor([pos]))
            pos += 1
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        for fqn, eager in zip(model.state_fqns(), model._eager_state):
            assert s.state[fqn].dtype == eager.dtype
            torch.testing.assert_close(s.state[fqn], eager[0], atol=ATOL, rtol=0, msg=fqn)


REQUESTS = {
    "short": ([100, 3], GREEDY),
    "long": ([7, 7, 7, 250, 1, 19, 40, 41, 42, 43, 44], GREEDY),
    "sampled": (PROMPT, onecopy.SamplingParams(temperature=0.9, top_k=40, seed=7, max_new_tokens=12)),
}


def _run_alone(engine, prompt, params):
    with engine.open_session() as s:
        ids = s.submit(prompt, params, stop_ids=[]).result(timeout=300)
        return ids, {k: v.clone() for k, v in s.state.items()}


def test_concurrent_sessions_equal_solo_bit_for_bit(q35_engine):
    """Three sessions generating at once (prefill chunks interleaved with batched decode steps):
    each one's tokens and final state rows equal its run alone, bit for bit."""
    solo = {k: _run_alone(q35_engine, p, sp) for k, (p, sp) in REQUESTS.items()}
    sessions = {k: q35_engine.open_session() for k in REQUESTS}
    stats = q35_engine.scheduler.stats
    steps, rows = stats.decode_steps, stats.decode_rows
    with q35_engine.lock:  # admitted together: the three generate at once
        streams = {k: sessions[k].submit(p, sp, stop_ids=[]) for k, (p, sp) in REQUESTS.items()}
    try:
        for k, stream in streams.items():
            assert stream.result(timeout=300) == solo[k][0], k
            for fqn, t in sessions[k].state.items():
                assert torch.equal(t, solo[k][1][fqn]), (k, fqn)
    finally:
        for s in sessions.values():
            s.close()
    assert stats.decode_rows - rows > stats.decode_steps - steps  # decode steps were shared
    assert len({tuple(ids) for ids, _ in solo.values()}) == len(REQUESTS)


def test_decode_method_is_batch_invariant(q35_engine):
    """KV, conv and recurrent state rows and logits of one session, bit for bit, wherever it sits in the batch."""
    from .invariance import assert_invariant

    assert_invariant(q35_engine)


def test_snapshot_restore_continues_identically(q35_engine, tmp_path):
    """A snapshot mid-conversation restored into a new session continues with the same tokens and state."""
    more = [42, 43, 44]
    with q35_engine.open_session() as s:
        first = s.submit(PROMPT, GREEDY, stop_ids=[]).result(timeout=300)
        snap = s.snapshot()
        s.save(tmp_path / "s.safetensors")
        cont = s.submit(more, GREEDY, stop_ids=[]).result(timeout=300)
        end_state = {k: v.clone() for k, v in s.state.items()}
    for restore in (snap, tmp_path / "s.safetensors"):
        with q35_engine.open_session(restore=restore) as r:
            assert r.position == snap.position == len(PROMPT) + len(first) - 1
            assert r.submit(more, GREEDY, stop_ids=[]).result(timeout=300) == cont
            for fqn, t in r.state.items():
                assert torch.equal(t, end_state[fqn]), fqn


def test_recurrent_state_never_runs_overlapped(q35_engine):
    """The step queued after a stop id would advance DeltaNet state for good: such bundles run each
    step to the end before the next (on CUDA too), and refuse to be switched to overlap."""
    assert q35_engine.recurrent_state and all(".linear_attn." in f for f in q35_engine.recurrent_state)
    assert q35_engine.loop.overlap is False
    with pytest.raises(onecopy.InputError, match="overlapped steps need state that a position can rewind"):
        q35_engine.loop.overlap = True
    with q35_engine.open_session() as s:  # stop, then continue: the state holds exactly the fed tokens
        free = s.submit([5, 9, 33], GREEDY, stop_ids=[]).result(timeout=300)
        s.reset()
        first = s.submit([5, 9, 33], GREEDY, stop_ids=[free[4]]).result(timeout=300)
        more = s.submit([free[4], 40], GREEDY, stop_ids=[]).result(timeout=300)
    with q35_engine.open_session() as s:
        assert s.submit([5, 9, 33] + first[:-1] + [free[4], 40], GREEDY, stop_ids=[]).result(timeout=300) == more


def test_moe_decode_reads_only_the_routed_experts():
    """In the compiled MoE decode the expert weights are read only by fused kernels that take the routing
    indices (gathers inside the reductions: N x top_k experts' bytes a step); no GEMM runs over all of them.
    Prefill, many tokens at once, runs every expert densely (each expert's weights read once per chunk)."""
    import re
    import zipfile

    src = preset_source("tiny-qwen3.5-moe")
    bundle = _bundle(src)

    def wrapper(method):
        with zipfile.ZipFile(bundle / "methods" / f"{method}.pt2") as z:
            return next(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp"))

    def expert_uses(src_text):
        return [line for line in src_text.splitlines() if re.search(r"mlp_experts_(gate_up|down)_proj\.data_ptr|"
                                                                   r"mlp_experts_(gate_up|down)_proj,", line)]

    decode = expert_uses(wrapper("decode"))
    assert decode and not any("_mm" in line or "bmm" in line for line in decode)
    assert all("cpp_fused" in line and "index" in line for line in decode)
    assert any("mm" in line for line in expert_uses(wrapper("prefill")))


@pytest.fixture(scope="module")
def q35_int4():
    """The MoE preset exported with --quantize int4 (group 32), and the eager model with the same packed layers."""
    from onecopy.models.quantize import quantize_model

    src = preset_source("tiny-qwen3.5-moe")
    bundle = cached_bundle(src.name, max_seq_len=MAX_SEQ_LEN, quantize="int4", group_size=32)
    model = _eager(src)
    quantize_model(model, "int4", 32)
    return bundle, model


def test_quantized_moe_packs_the_experts_and_equals_the_eager_quantized_model(q35_int4):
    """--quantize int4 on the MoE family: every projection and each layer's routed-expert stacks are packed
    (the manifest records the stacks [E, N, K]; the routers and DeltaNet's input projection stay float), the
    store holds each packed tensor once
    for both methods, the memory report counts the experts' packed bytes, and the compiled prefill and decode
    (and greedy generation) equal the eager model with the same packed layers."""
    import zipfile

    from onecopy.models.packed import PackedExperts, as_float_weights, packed_bytes
    from onecopy.models.source import preset_source as _preset

    bundle, model = q35_int4
    cfg = _preset("tiny-qwen3.5-moe").config
    m = json.loads((bundle / "manifest.json").read_text())
    e, i, d = cfg.num_experts, cfg.moe_intermediate_size, cfg.dim
    assert m["packed"]["layers.1.mlp.experts.gate_up_proj"] == {"layout": "q4a", "group": 32, "shape": [e, 2 * i, d],
                                                                "source": "int4 rtn"}
    assert m["packed"]["layers.1.mlp.experts.down_proj"]["shape"] == [e, d, i]
    assert m["weights"]["layers.1.mlp.experts.gate_up_proj.qweight"]["shape"] == [e, 2 * i, d // 2]
    assert "layers.1.mlp.experts.gate_up_proj" not in m["weights"]  # no float copy beside the packed one
    assert {"layers.0.linear_attn.out_proj", "layers.1.self_attn.wqkv", "layers.1.mlp.shared_expert.w13",
            "lm_head"} <= set(m["packed"])
    for kept in ("layers.1.mlp.gate", "layers.0.linear_attn.in_proj"):  # the router; DeltaNet's beta / decay inputs
        assert f"{kept}.weight" in m["weights"] and kept not in m["packed"]
    with onecopy.Engine.load(bundle) as engine, torch.no_grad():
        assert not engine.runner.batched_prefill  # this family's prefill takes one session's chunk (recurrent state)
        s = engine.open_session()
        got, want = s.prefill(PROMPT), model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        for j, t in enumerate([17, 200, 3]):
            want = model(torch.tensor([[t]]), torch.tensor([len(PROMPT) + j]))
            torch.testing.assert_close(s.decode(torch.tensor([t])), want, atol=ATOL, rtol=0)
        q = "layers.1.mlp.experts.down_proj.qweight"
        stored = engine.weights.get(q)
        assert stored.dtype == torch.uint8 and list(stored.shape) == [e, d, i // 2]
        assert engine.method("prefill").bound[q] == engine.method("decode").bound[q] == stored.data_ptr()
        report = engine.memory_report()
        peer = as_float_weights(engine.weights.as_map(m["weights"]), m["packed"], torch.float32)
        layer = model.layers[1].mlp.experts.gate_up_proj
        assert isinstance(layer, PackedExperts)
        assert torch.equal(peer["layers.1.mlp.experts.gate_up_proj"], layer.rows(None, torch.float32))
        ids = list(engine.open_session().generate_ids(PROMPT, GREEDY, stop_ids=[]))
    assert report.packed_weight_bytes == sum(packed_bytes(tuple(p["shape"]), p["layout"], p["group"])
                                             for p in m["packed"].values())
    assert report.packed_weight_bytes < 0.25 * report.packed_as_float_bytes
    assert ids == eager_greedy(model, PROMPT, GREEDY.max_new_tokens)
    # the decode step still reads only the routed experts: the kernels that take their packed values gather
    # them by the routing indices; no GEMM reads the stacks
    import re

    with zipfile.ZipFile(bundle / "methods" / "decode.pt2") as z:
        wrapper = next(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp"))
    uses = [line for line in wrapper.splitlines()
            if re.search(r"mlp_experts_(gate_up|down)_proj_qweight(\.data_ptr|,)", line)]
    assert len(uses) >= 2 * cfg.n_layers and all("cpp_fused" in line and "index" in line for line in uses)
    assert not any("_mm" in line for line in uses)


def test_packed_expert_stacks_quantize_each_expert_as_a_matrix_and_refuse_mismatched_scales():
    """A stack [E, N, K] quantizes as each expert's [N, K] would (int8, int4, fp8), gathers dequantize the chosen
    experts exactly, and scales shaped for another stack are refused by name."""
    from onecopy.models.packed import PackedExperts, dequantize
    from onecopy.models.quantize import quantize_experts, quantize_weight

    torch.manual_seed(0)
    w = torch.randn(3, 32, 64)
    for mode in ("int8", "int4", "fp8"):
        stack = quantize_experts(w, mode, 32)
        for x in range(3):
            alone = quantize_weight(w[x], mode, 32)
            assert torch.equal(stack.qweight[x].view(torch.uint8), alone.qweight.view(torch.uint8)), mode
            assert torch.equal(stack.rows(None, torch.float32)[x], dequantize(alone)), mode
        idx = torch.tensor([[2, 0], [1, 1]])
        assert torch.equal(stack.rows(idx, torch.float32), stack.rows(None, torch.float32)[idx]), mode
    s = quantize_experts(w, "int4", 32)
    with pytest.raises(ValueError, match=r"needs qweight torch.uint8 \[3, 32, 32\] and float32 scales and mins "
                                         r"\[3, 32, 2\]; got qweight torch.uint8 \[3, 32, 32\], scales torch.float32 "
                                         r"\[3, 32, 4\]"):
        PackedExperts("q4a", 32, s.qweight, torch.zeros(3, 32, 4), torch.zeros(3, 32, 4))


def test_the_35b_a3b_preset_has_the_published_shape():
    """The whole Qwen3.5-35B-A3B shape as a preset: 40 layers, three DeltaNet layers then one attention layer,
    256 experts of width 512 with 8 a token and a shared expert; built without memory, ~35B weights of which
    ~3B are read for a token (the routed share of the experts); drawn on the export device, never on the host."""
    from onecopy.models.presets import PRESETS

    preset = PRESETS["qwen3.5-35b-a3b"]
    cfg = preset.config
    assert preset.on_device and cfg.family == "qwen3_5_moe" and cfg.n_layers == 40
    assert cfg.layer_types == [LINEAR, LINEAR, LINEAR, FULL] * 10
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (256, 8, 512)
    with torch.device("meta"):
        model = qwen3_5.Qwen35(cfg, 4096, torch.bfloat16)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    experts = sum(v for n, v in sizes.items() if ".experts." in n)
    total = sum(sizes.values())
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts - sizes["embed_tokens.weight"]
    assert 34e9 < total < 36.5e9 and 2.5e9 < active < 3.5e9, (total, active)
    assert preset_source("qwen3.5-35b-a3b").hf_state_dict == {}  # nothing drawn on the host


def test_the_35b_a3b_shape_quantized_to_int4_fits_an_80_gb_gpu_with_room():
    """--quantize int4 (group 128) of the whole shape, on meta: every projection and expert stack packed (the
    experts are 32B of the 35B values); the routers, DeltaNet's input projections, norms, convolutions and the
    embedding float: ~21 GB of device weights against ~70 GB in bf16, so an H100 keeps ~55 GB for sessions."""
    from onecopy.models.packed import PackedExperts
    from onecopy.models.presets import PRESETS
    from onecopy.models.quantize import packed_layers, quantize_model

    cfg = PRESETS["qwen3.5-35b-a3b"].config
    with torch.device("meta"):
        model = qwen3_5.Qwen35(cfg, 4096, torch.bfloat16)
    bf16 = sum(p.numel() * 2 for p in model.parameters())
    quantize_model(model, "int4", 128)
    layers = packed_layers(model)
    assert sum(isinstance(m, PackedExperts) for m in model.modules()) == 2 * cfg.n_layers
    assert len([n for n in layers if n.endswith("experts.gate_up_proj")]) == cfg.n_layers
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if t is not None)
    floats = {n for n, p in model.named_parameters() if p.numel() > 1e6}
    kept = {"embed_tokens.weight"} | {f"layers.{i}.linear_attn.in_proj.weight" for i in range(cfg.n_layers)
                                      if cfg.layer_types[i] == LINEAR}
    assert floats == kept, floats ^ kept  # the gathered embedding and DeltaNet's input projections (KEPT_FLOAT)
    assert 65e9 < bf16 < 73e9 and 18e9 < held < 23e9, (bf16, held)


def test_on_device_random_weights_are_seeded_and_give_sane_logits():
    """`random_weights.qwen3_5_on_device` (the large presets' path, here on a tiny MoE shape on CPU): the same
    seed gives the same tensors, another seed others; every expert tensor is scaled by its fan-in (the residual
    stream stays in range however many layers add to it); the logits are spread (no ties for greedy tests)."""
    from onecopy.models.presets import PRESETS
    from onecopy.models.random_weights import qwen3_5_on_device

    cfg = PRESETS["tiny-qwen3.5-moe"].config
    a = qwen3_5_on_device(cfg, 64, torch.float32, torch.device("cpu"), seed=3)
    b = qwen3_5_on_device(cfg, 64, torch.float32, torch.device("cpu"), seed=3)
    c = qwen3_5_on_device(cfg, 64, torch.float32, torch.device("cpu"), seed=4)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
        assert name == "rope_inv_freq" or not torch.equal(pa, pc), name
    for name, p in a.state_dict().items():
        if ".experts." in name:  # [E, out, in]: each output's sum over `in` has variance ~1
            assert 0.7 < float(p.float().pow(2).sum(-1).mean()) < 1.3, name
        if name.endswith("A_log"):
            assert 0.05 <= float(p.exp().min()) and float(p.exp().max()) <= 2.0, name
    with torch.no_grad():
        logits = a(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
    assert torch.isfinite(logits).all() and 0.3 < float(logits.std()) < 30, float(logits.std())
    # the source path the large presets take (no host weights, a seed): the family draws them on the device
    src = ModelSource(name="tiny-moe-on-device", config=cfg, hf_state_dict={}, tokenizer_json="{}",
                      eos_token_ids=[cfg.vocab_size - 1], family=cfg.family, random_seed=3)
    built = src.build(64, torch.float32, "cpu")
    assert built.state_dict().keys() == a.state_dict().keys()
    assert all(torch.equal(x, y) for x, y in zip(built.state_dict().values(), a.state_dict().values()))


def test_on_device_draw_goes_a_layer_at_a_time_and_quantizes_each_as_it_is_drawn():
    """The on-device draw materialises one layer at a time with the values `fill_random` gives over the whole
    model (each tensor's generator seeded by its index), and with ``quantize`` packs each layer as soon as it is
    drawn: bit for bit the model drawn whole and quantized after (so the 35B shape in int4 never holds its bf16
    whole); the exporter's quantization then leaves those packed layers as they are."""
    from onecopy.models.packed import PackedExperts
    from onecopy.models.presets import PRESETS
    from onecopy.models.quantize import quantize_model
    from onecopy.models.random_weights import fill_random, qwen3_5_draw, qwen3_5_on_device

    cfg = PRESETS["tiny-qwen3.5-moe"].config
    with torch.device("meta"):
        whole = qwen3_5.Qwen35(cfg, 64, torch.float32)
    whole = whole.to_empty(device="cpu")
    fill_random(whole, 3, qwen3_5_draw)
    drawn = qwen3_5_on_device(cfg, 64, torch.float32, torch.device("cpu"), seed=3)
    want = dict(whole.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in drawn.named_parameters())
    quantize_model(whole, "int4", 32)
    packed = qwen3_5_on_device(cfg, 64, torch.float32, torch.device("cpu"), seed=3, quantize=("int4", 32))
    assert isinstance(packed.layers[1].mlp.experts.gate_up_proj, PackedExperts)
    before = {n: t.clone() for n, t in packed.state_dict().items()}
    quantize_model(packed, "int4", 32)  # what the exporter does next: nothing left to quantize
    got = packed.state_dict()
    assert got.keys() == whole.state_dict().keys() == before.keys()
    assert all(torch.equal(got[n].view(torch.uint8) if got[n].dtype == torch.uint8 else got[n], t)
               for n, t in whole.state_dict().items() if n != "rope_inv_freq")
    assert all(torch.equal(got[n], before[n]) for n in got)
    assert torch.equal(packed.rope_inv_freq, qwen3_5.Qwen35(cfg, 64, torch.float32).rope_inv_freq)  # computed
