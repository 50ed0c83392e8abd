"""Qwen3.5 on CUDA: captured decode graphs equal eager decode bit for bit, dense and MoE (H100/H200)."""

import pytest
import torch

import onecopy
from onecopy.models.source import preset_source

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT = [5, 9, 33, 2, 71, 8, 19]


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_graph_decode_equals_eager_bit_for_bit(preset, tmp_path):
    bundle = onecopy.export(preset_source(preset), tmp_path / preset, max_seq_len=128, device="cuda",
                            dtype="bfloat16", progress=False)
    runs = []
    for graphs in (False, True):
        with onecopy.Engine.load(bundle, "cuda", max_sessions=4, cuda_graphs=graphs) as engine:
            assert engine.graph_buckets == ([1, 2, 4] if graphs else []) and not engine.loop.overlap
            s = engine.open_session()
            logits = [s.prefill(PROMPT).clone()]
            for _ in range(32):
                logits.append(s.decode(logits[-1].argmax(-1)).clone())
            runs.append((logits, {k: v.clone() for k, v in s.state.items()}))
            # and batched: three sessions through the scheduler (padded to the 4-row graph)
            ids = [engine.submit(p, onecopy.SamplingParams(max_new_tokens=16), stop_ids=[]).result(timeout=120)
                   for p in (PROMPT, PROMPT[:3], [42] * 5)]
            runs[-1] += (ids,)
    (le, se, ie), (lg, sg, ig) = runs
    for i, (a, b) in enumerate(zip(le, lg)):
        assert torch.equal(a, b), f"{preset}: step {i} differs"
    for k in se:
        assert torch.equal(se[k], sg[k]), (preset, k)
    assert ie == ig
    # The deterministic engine's decode: logits and every state row bit for bit wherever the session sits.
    from ..invariance import assert_invariant

    with onecopy.Engine.load(bundle, "cuda", max_sessions=2, deterministic=True, cuda_graphs=False) as engine:
        assert engine.role_method("decode") == "decode_invariant"
        assert_invariant(engine)
