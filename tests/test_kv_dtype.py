"""An 8-bit KV cache (``--kv-dtype int8|fp8``, `models.kv_quant`): what the bundle declares, what a write
stores, how close the logits stay to a full-precision cache, and every runtime feature on top of it
(batched decode, deterministic mode, snapshots, prefix blocks, memory report, `onecopy info`)."""

from __future__ import annotations

import pytest
import torch

import onecopy
from onecopy.bundle import read_manifest
from onecopy.errors import ExportError, InputError
from onecopy.models import kv_quant
from onecopy.models.source import preset_source
from onecopy.sampling import SamplingParams

from .bundle_cache import cached_bundle
from .conftest import TINY_MAX_SEQ_LEN, run_cli

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)
PROMPT = list(range(3, 43))  # 40 tokens: two full blocks of 16 and a partial one
CFG = preset_source("tiny-llama").config
D, HKV, BS = CFG.head_dim, CFG.n_kv_heads, 16


@pytest.fixture(scope="module", params=["int8", "fp8"])
def kv_bundle(request):
    return request.param, cached_bundle("tiny-llama", max_seq_len=TINY_MAX_SEQ_LEN, kv_dtype=request.param)


@pytest.fixture(scope="module")
def int8_bundle():
    return cached_bundle("tiny-llama", max_seq_len=TINY_MAX_SEQ_LEN, kv_dtype="int8")  # kv_bundle's int8: one export


def test_the_command_line_exports_an_8_bit_cache(tmp_path, exports_via_cache):
    """`onecopy export --kv-dtype int8`, as a user would (the export options reach the exporter; the bundle
    itself comes from the cache: the same options give the same bundle as int8_bundle's)."""
    out = tmp_path / "tiny-kv-int8-cli"
    r = run_cli("export", "tiny-llama", "--out", out, "--max-seq-len", TINY_MAX_SEQ_LEN, "--kv-dtype", "int8")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"wrote {out}\n"
    assert read_manifest(out).state["layers.0.attention.k_cache"].dtype == "int8"


def _run(engine, prompt, steps):
    """Logits of a prefill and ``steps`` greedy decodes in a fresh session, [steps + 1, vocab] fp32."""
    with engine.open_session() as s:
        out = [s.prefill(prompt).float().reshape(-1)]
        for _ in range(steps):
            out.append(s.decode(out[-1].argmax()[None]).float().reshape(-1))
    return torch.stack(out)


def test_the_bundle_declares_8_bit_pools_and_their_scales(kv_bundle):
    name, bundle = kv_bundle
    m = read_manifest(bundle)
    dtype = {"int8": "int8", "fp8": "float8_e4m3fn"}[name]
    for i in range(CFG.n_layers):
        for kv in "kv":
            values, scales = m.state[f"layers.{i}.attention.{kv}_cache"], m.state[f"layers.{i}.attention.{kv}_scale"]
            assert (values.dtype, values.shape, values.paged) == (dtype, [HKV, BS, D], True)
            assert (scales.dtype, scales.shape, scales.paged) == ("float32", [HKV, BS], True)
    assert m.kv_dtype_description() == f"{dtype} values, a float32 scale per position and head"
    assert m.kv_8bit  # what the bandwidth floor counts as 8-bit values and their scales (bench.decode.floor_bytes)
    r = run_cli("info", bundle)
    assert r.returncode == 0, r.stderr
    assert f"kv dtype      {dtype} values, a float32 scale per position and head" in r.stdout


def test_a_block_takes_the_8_bit_bytes_and_the_report_says_so(kv_bundle, tiny_bundle):
    name, bundle = kv_bundle
    with onecopy.Engine.load(bundle, max_sessions=2) as e, onecopy.Engine.load(tiny_bundle, max_sessions=2) as f:
        per_layer = 2 * HKV * BS * (D * 1 + 4)  # K and V: a byte per value, a float32 scale per position and head
        assert e.runner.blocks.block_bytes == CFG.n_layers * per_layer
        assert f.runner.blocks.block_bytes == CFG.n_layers * 2 * HKV * BS * D * 4  # the float32 cache
        assert e.manifest.kv_8bit and not f.manifest.kv_8bit
        r = e.memory_report()
        assert r.kv_block_bytes == e.runner.blocks.block_bytes and "float32 scale per position" in r.kv_dtype
        assert "kv dtype: " in str(r)


def test_a_write_stores_each_vector_in_8_bits_with_its_scale(kv_bundle, tiny_bundle):
    """Layer 0's K/V depend only on the tokens: the 8-bit cache holds exactly the float cache's vectors
    quantized (scale = max|x| / QMAX, values within half a step for int8, a relative 2**-4 for fp8)."""
    name, bundle = kv_bundle
    dtype = kv_quant.KV_DTYPES[name]
    with onecopy.Engine.load(bundle, max_sessions=2) as e, onecopy.Engine.load(tiny_bundle, max_sessions=2) as f:
        a, b = e.open_session(), f.open_session()
        a.prefill(PROMPT)
        b.prefill(PROMPT)
        n = len(PROMPT)
        for kv in "kv":
            x = b.state[f"layers.0.attention.{kv}_cache"][:, :n].float()  # [H, n, D]
            q = a.state[f"layers.0.attention.{kv}_cache"][:, :n]
            scale = a.state[f"layers.0.attention.{kv}_scale"][:, :n]
            assert q.dtype == dtype and scale.dtype == torch.float32
            torch.testing.assert_close(scale, x.abs().amax(-1) / kv_quant.QMAX[dtype], rtol=1e-5, atol=0)
            err = (kv_quant.dequantize(q, scale) - x).abs()
            bound = scale[..., None] * 0.5 if name == "int8" else x.abs() * 2 ** -4 + scale[..., None] * 2 ** -9
            assert (err <= bound * 1.001 + 1e-7).all(), (kv, (err - bound).max())
            assert q.float().abs().amax(-1).eq(kv_quant.QMAX[dtype]).all()  # each vector's largest value hits QMAX
        a.close()
        b.close()


def test_logits_equal_the_eager_reference_and_stay_close_to_a_full_precision_cache(kv_bundle, tiny_bundle):
    name, bundle = kv_bundle
    with onecopy.Engine.load(bundle, max_sessions=2) as e, onecopy.Engine.load(tiny_bundle, max_sessions=2) as f:
        got, full = _run(e, PROMPT, 16), _run(f, PROMPT, 16)
    model = preset_source("tiny-llama").build(TINY_MAX_SEQ_LEN, torch.float32, "cpu")
    model.kv_block, model.kv_dtype = BS, kv_quant.KV_DTYPES[name]
    with torch.no_grad():
        ref = [model(torch.tensor([PROMPT]), torch.arange(len(PROMPT))).float().reshape(-1)]
        for i in range(16):
            tok = got[i].argmax()  # the engine's tokens, so both see the same inputs
            ref.append(model(tok.view(1, 1), torch.tensor([len(PROMPT) + i])).float().reshape(-1))
    torch.testing.assert_close(got, torch.stack(ref), rtol=1e-4, atol=1e-4)
    err = (got - full).abs().amax().item()
    assert 0 < err < {"int8": 0.05, "fp8": 0.2}[name], err  # quantized (not 0), and close (logits reach ~4)
    assert torch.equal(got.argmax(-1), full.argmax(-1))


def test_deterministic_sessions_batched_equal_their_solo_runs(int8_bundle):
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=s) for s in (1, 2, 3)]
    prompts = [PROMPT, [7, 8, 9], list(range(100, 120))]
    with onecopy.Engine.load(int8_bundle, max_sessions=4, deterministic=True) as e:
        solo = [e.submit(p, sp, stop_ids=[]).result() for p, sp in zip(prompts, params)]
        stats = e.scheduler.stats
        steps, rows = stats.decode_steps, stats.decode_rows
        with e.lock:  # the loop admits all three together: decoded in one batch
            streams = [e.submit(p, sp, stop_ids=[]) for p, sp in zip(prompts, params)]
        assert [s.result() for s in streams] == solo
        assert stats.decode_rows - rows > stats.decode_steps - steps  # steps were shared: the runs were batched


def test_snapshots_round_trip_and_refuse_another_kv_dtype(int8_bundle, tiny_bundle, tmp_path):
    more = SamplingParams(max_new_tokens=6, temperature=0)
    with onecopy.Engine.load(int8_bundle, max_sessions=2) as e:
        with e.open_session() as s:
            s.prefill(PROMPT)
            s.save(tmp_path / "s.safetensors")
            snap = s.snapshot()
            want = list(s.generate_ids([50, 51], more, stop_ids=[]))
        assert snap.state["layers.0.attention.k_cache"].dtype == torch.int8
        assert snap.state["layers.0.attention.k_scale"].dtype == torch.float32
        with e.open_session(restore=tmp_path / "s.safetensors") as r:
            assert list(r.generate_ids([50, 51], more, stop_ids=[])) == want
    with onecopy.Engine.load(tiny_bundle, max_sessions=2) as f:
        with pytest.raises(InputError, match="another model or export"):
            f.open_session(restore=snap)


def test_a_cached_prefix_of_8_bit_blocks_gives_the_tokens_of_prefilling_it(int8_bundle):
    with onecopy.Engine.load(int8_bundle, max_sessions=4) as e, \
            onecopy.Engine.load(int8_bundle, max_sessions=4, prefix_cache=False) as plain:
        e.submit(PROMPT, GREEDY).result()
        second = PROMPT + [60, 61]
        cached = e.submit(second, GREEDY, stop_ids=[])
        assert cached.result() == plain.submit(second, GREEDY, stop_ids=[]).result()
        assert cached.cached_tokens == 32


def test_bad_kv_dtypes_are_refused_before_anything_is_written(tmp_path, tiny_source):
    with pytest.raises(ExportError, match=r"kv_dtype='int4': choose one of int8, fp8 .*\(--kv-dtype\)"):
        onecopy.export(tiny_source, tmp_path / "a", kv_dtype="int4", progress=False)
    with pytest.raises(ExportError, match="needs paged KV"):
        onecopy.export(tiny_source, tmp_path / "b", kv_dtype="int8", kv_block=None, progress=False)
    with pytest.raises(ExportError, match="built for the Llama family, not qwen3_5"):
        onecopy.export(preset_source("tiny-qwen3.5"), tmp_path / "c", kv_dtype="fp8", progress=False)
    assert not list(tmp_path.iterdir())
