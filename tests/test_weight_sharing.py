"""Weights once: every method reads the same storage, owned by one Engine's store."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import onecopy
from onecopy.bundle import sha256, tensor_bytes

from .conftest import copy_bundle


def test_every_weight_is_bound_from_the_store(tiny_engine):
    with tiny_engine.open_session() as s:
        s.prefill([1, 2, 3])  # the first run of each method binds it
        s.decode(torch.tensor([4]))
        store = tiny_engine.weights
        for name in tiny_engine.methods:
            m = tiny_engine.method(name)
            assert m.weight_fqns, name
            for fqn in m.weight_fqns:
                assert m.bound[fqn] == store.get(fqn).data_ptr(), (name, fqn)
        prefill, decode = tiny_engine.method("prefill"), tiny_engine.method("decode")
        assert {f: prefill.bound[f] for f in prefill.weight_fqns} == {f: decode.bound[f] for f in decode.weight_fqns}
        r = tiny_engine.memory_report()
        assert r.resident_weight_bytes == r.unique_weight_bytes == store.nbytes > 0
        assert r.duplicated_weight_bytes == 0
        assert r.unique_weight_bytes == sum(v.numel() * v.element_size() for v in
                                            load_file(str(tiny_engine.path / "weights.safetensors")).values())


def test_methods_read_the_store_tensor_itself(tiny_engine):
    """Changing a store tensor in place changes what both compiled methods compute."""
    s = tiny_engine.open_session()
    before_p = s.prefill([5, 6, 7]).clone()
    before_d = s.decode(torch.tensor([8])).clone()
    tiny_engine.weights.get("norm.weight").mul_(-1.0)
    s.reset()
    after_p = s.prefill([5, 6, 7])
    after_d = s.decode(torch.tensor([8]))
    torch.testing.assert_close(after_p, -before_p, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after_d, -before_d, rtol=1e-5, atol=1e-5)


def test_two_engines_never_share_weights(tiny_bundle, tiny_source, tmp_path):
    """Same packages, different weights: each engine computes with its own, keyed by content hash."""
    other = copy_bundle(tiny_bundle, tmp_path / "other")
    weights = load_file(str(other / "weights.safetensors"))
    weights["norm.weight"] = weights["norm.weight"] * 2.0
    save_file(weights, str(other / "weights.safetensors"))
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["weights"]["norm.weight"]["sha256"] = sha256(tensor_bytes(weights["norm.weight"]))
    (other / "manifest.json").write_text(json.dumps(manifest))

    with onecopy.Engine.load(tiny_bundle) as a, onecopy.Engine.load(other) as b:
        la, lb = a.open_session().prefill([1, 2, 3]), b.open_session().prefill([1, 2, 3])
        assert not torch.allclose(la, lb)
        assert a.weights.get("norm.weight").data_ptr() != b.weights.get("norm.weight").data_ptr()
        model = tiny_source.build(64, torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(la, model(torch.tensor([[1, 2, 3]]), torch.arange(3)), rtol=1e-4, atol=1e-4)
            model.norm.weight.mul_(2.0)
            torch.testing.assert_close(lb, model(torch.tensor([[1, 2, 3]]), torch.arange(3)), rtol=1e-4, atol=1e-4)


def test_close_frees_everything(tiny_bundle):
    engine = onecopy.Engine.load(tiny_bundle)
    s = engine.open_session()
    s.prefill([1, 2])
    held = engine.weights.tensors() + list(engine.runner.blocks.tensors.values()) + [engine.runner.blocks.table]
    assert all(t.untyped_storage().nbytes() > 0 for t in held)
    engine.close()
    # AOTI runners keep references to user-managed constants; the memory itself must still go.
    assert all(t.untyped_storage().nbytes() == 0 for t in held)
    assert len(engine.weights) == 0 and engine.methods == []
    with pytest.raises(onecopy.EngineClosedError, match="load the bundle again"):
        engine.open_session()
    with pytest.raises(onecopy.SessionClosedError, match="open a new one"):
        s.prefill([1, 2])
    engine.close()  # idempotent


def test_fallback_runs_and_reports_duplication(fallback_bundle, tiny_bundle, tiny_source):
    with pytest.warns(UserWarning, match="carry their own weights"):
        engine = onecopy.Engine.load(fallback_bundle)
    with engine:
        assert engine.method("decode").embeds_weights and not engine.method("prefill").embeds_weights
        r = engine.memory_report()
        decode_weights = sum(engine.manifest.weights[f].nbytes for f in engine.method("decode").weight_fqns)
        assert r.duplicated_weight_bytes == decode_weights > 0
        assert r.resident_weight_bytes == r.unique_weight_bytes + decode_weights
        assert any("fallback" in n for n in r.notes)
        # The fallback still computes the same tokens (state still bound per session).
        with onecopy.Engine.load(tiny_bundle) as ref:
            want = list(ref.open_session().generate_ids([3, 1, 4, 1, 5], onecopy.SamplingParams(max_new_tokens=12)))
        got = list(engine.open_session().generate_ids([3, 1, 4, 1, 5], onecopy.SamplingParams(max_new_tokens=12)))
        assert got == want
