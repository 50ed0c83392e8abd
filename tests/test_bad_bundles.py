"""Each damaged bundle gets a typed error that names the problem and the fix, and nothing is loaded."""

import json
import struct

import pytest

import onecopy
from onecopy.runtime import method as method_mod

from .conftest import copy_bundle


def _manifest(b):
    return json.loads((b / "manifest.json").read_text())


def _write_manifest(b, m):
    (b / "manifest.json").write_text(json.dumps(m))


def missing_weights_file(b):
    (b / "weights.safetensors").unlink()


def missing_package(b):
    (b / "methods" / "decode.pt2").unlink()


def flipped_weight_byte(b):
    data = bytearray((b / "weights.safetensors").read_bytes())
    data[-7] ^= 0x01
    (b / "weights.safetensors").write_bytes(bytes(data))


def flipped_package_byte(b):
    data = bytearray((b / "methods" / "prefill.pt2").read_bytes())
    data[len(data) // 2] ^= 0x01
    (b / "methods" / "prefill.pt2").write_bytes(bytes(data))


def _rewrite_weights(b, edit):
    from safetensors.torch import load_file, save_file

    w = load_file(str(b / "weights.safetensors"))
    edit(w)
    save_file(w, str(b / "weights.safetensors"))


def missing_tensor(b):
    _rewrite_weights(b, lambda w: w.pop("norm.weight"))


def wrong_dtype(b):
    import torch

    _rewrite_weights(b, lambda w: w.__setitem__("norm.weight", w["norm.weight"].to(torch.float16)))


def wrong_shape(b):
    _rewrite_weights(b, lambda w: w.__setitem__("norm.weight", w["norm.weight"][:-1].clone()))


def unknown_format_version(b):
    m = _manifest(b)
    m["format_version"] = 99
    _write_manifest(b, m)


def paged_without_block_size(b):
    m = _manifest(b)
    m["kv_block_size"] = None  # the state says paged, the manifest no longer says how many positions a block holds
    _write_manifest(b, m)


def methods_disagree_on_paging(b):
    m = _manifest(b)
    m["methods"]["decode"]["paged"] = False  # would be called without the block table it was compiled to take
    _write_manifest(b, m)


def unknown_op_library(b):
    m = _manifest(b)
    m["methods"]["decode"]["native_ops"] = ["onecopy_future"]  # a newer onecopy's kernels: nothing to load them from
    _write_manifest(b, m)


def native_ops_on_cpu(b):
    m = _manifest(b)
    m["methods"]["decode"]["native_ops"] = ["onecopy_native"]  # CUDA C++ kernels named by a CPU bundle
    _write_manifest(b, m)


def truncated_manifest(b):
    text = (b / "manifest.json").read_text()
    (b / "manifest.json").write_text(text[: len(text) // 2])


def missing_field(b):
    m = _manifest(b)
    del m["methods"]
    _write_manifest(b, m)


def wrong_device_kind(b):
    m = _manifest(b)
    m["device_kind"] = "cuda"
    _write_manifest(b, m)


def other_torch_release(b):
    m = _manifest(b)
    m["build"]["torch"] = "2.9.1+cu128"
    _write_manifest(b, m)


def undeclared_constant(b):
    m = _manifest(b)
    m["methods"]["decode"]["constants"].append("layers.9.ghost.weight")
    _write_manifest(b, m)


def package_constants_disagree(b):
    """The manifest stops declaring a weight the package needs: caught after the package is opened."""
    m = _manifest(b)
    m["methods"]["decode"]["constants"].remove("norm.weight")
    _write_manifest(b, m)


def truncated_weights(b):
    data = (b / "weights.safetensors").read_bytes()
    (b / "weights.safetensors").write_bytes(data[: len(data) - 100])


def garbage_weights_header(b):
    data = bytearray((b / "weights.safetensors").read_bytes())
    data[0:8] = struct.pack("<Q", 2**40)
    (b / "weights.safetensors").write_bytes(bytes(data))


def package_path_escapes(b):
    m = _manifest(b)
    m["methods"]["decode"]["package"] = "../../outside/decode.pt2"
    _write_manifest(b, m)


def absolute_weights_path(b):
    m = _manifest(b)
    m["weights_file"] = "/etc/hosts"
    _write_manifest(b, m)


def tokenizer_path_escapes(b):
    m = _manifest(b)
    m["tokenizer"]["file"] = "../tokenizer.json"
    _write_manifest(b, m)


def package_symlink_leads_out(b):
    outside = b.parent / "outside.pt2"
    (b / "methods" / "prefill.pt2").rename(outside)
    (b / "methods" / "prefill.pt2").symlink_to(outside)


CASES = [
    (missing_weights_file, onecopy.BundleNotFoundError, r"weights.safetensors is missing; export"),
    (missing_package, onecopy.BundleNotFoundError, r"decode.pt2 is missing; export"),
    (flipped_weight_byte, onecopy.WeightsCorruptError, r"does not match its content hash .* export again"),
    (flipped_package_byte, onecopy.WeightsCorruptError, r"prefill.pt2 does not match its hash"),
    (missing_tensor, onecopy.WeightSpecError, r"'norm.weight' is listed in the manifest but missing"),
    (wrong_dtype, onecopy.WeightSpecError, r"'norm.weight' is F16\[64\] .* expects float32\[64\]"),
    (wrong_shape, onecopy.WeightSpecError, r"'norm.weight' is F32\[63\] .* expects float32\[64\]"),
    (unknown_format_version, onecopy.UnsupportedFormatVersionError, r"version 99 is not supported .* export the model again"),
    (truncated_manifest, onecopy.ManifestError, r"not valid JSON .* truncated"),
    (paged_without_block_size, onecopy.ManifestError, r"is paged but kv_block_size is None.*export the bundle again"),
    (methods_disagree_on_paging, onecopy.ManifestError, r"methods disagree with the state on whether the KV cache is paged"),
    (missing_field, onecopy.ManifestError, r"lacks or mangles a required field .*methods"),
    (unknown_op_library, onecopy.ManifestError,
     r"method 'decode' calls op libraries \['onecopy_future'\] that this onecopy does not have; export the bundle again"),
    (native_ops_on_cpu, onecopy.DeviceMismatchError,
     r"method 'decode' calls the native CUDA kernels \(onecopy_native\); load the bundle on the CUDA device"),
    (wrong_device_kind, onecopy.DeviceMismatchError, r"compiled for 'cuda' but you asked for 'cpu'.*--device cpu"),
    (other_torch_release, onecopy.TorchVersionMismatchError, r"compiled by torch 2.9.1\+cu128 but this is torch .* export the bundle again"),  # noqa: E501
    (undeclared_constant, onecopy.CoverageError, r"needs constants the bundle does not provide: \['layers.9.ghost.weight'\]"),
    (package_constants_disagree, onecopy.CoverageError, r"package needs constants \['norm.weight'\]"),
    (truncated_weights, onecopy.BundleError, r"(truncated|header).*export"),
    (garbage_weights_header, onecopy.WeightsCorruptError, r"unreadable safetensors header"),
    (package_path_escapes, onecopy.ManifestError,
     r"path '../../outside/decode.pt2' for the package of method 'decode' points outside the bundle directory"),
    (absolute_weights_path, onecopy.ManifestError, r"path '/etc/hosts' for the weights points outside the bundle"),
    (tokenizer_path_escapes, onecopy.ManifestError, r"path '../tokenizer.json' for the tokenizer points outside"),
    (package_symlink_leads_out, onecopy.ManifestError,
     r"'methods/prefill.pt2' for the package of method 'prefill' points outside .* export it again"),
]


@pytest.mark.parametrize("damage,error,message", CASES, ids=[c[0].__name__ for c in CASES])
def test_bad_bundle_is_refused_and_nothing_stays_loaded(tiny_bundle, tmp_path, monkeypatch, damage, error, message):
    bad = copy_bundle(tiny_bundle, tmp_path / "bad")
    damage(bad)
    opened, closed = [], []
    real_init, real_close = method_mod.Method.__init__, method_mod.Method.close
    monkeypatch.setattr(method_mod.Method, "__init__", lambda self, *a: (opened.append(self), real_init(self, *a))[1])
    monkeypatch.setattr(method_mod.Method, "close", lambda self: (closed.append(self), real_close(self))[1])
    loaded_weights = []
    from onecopy.runtime import weights as weights_mod

    real_load = weights_mod.WeightStore.load
    monkeypatch.setattr(weights_mod.WeightStore, "load", lambda self, *a: (loaded_weights.append(self), real_load(self, *a))[1])
    with pytest.raises(error, match=message):
        onecopy.Engine.load(bad)
    assert loaded_weights == []  # no weight reached the device
    assert all(m._compiled is None for m in opened)  # every package that was opened was released again


def test_missing_bundle_dir(tmp_path):
    with pytest.raises(onecopy.BundleNotFoundError, match="onecopy export SOURCE --out"):
        onecopy.Engine.load(tmp_path / "nope")


def test_missing_manifest(tmp_path):
    (tmp_path / "b").mkdir()
    with pytest.raises(onecopy.BundleNotFoundError, match="manifest.json is missing"):
        onecopy.Engine.load(tmp_path / "b")


def test_export_refuses_state_mismatch(tiny_source, tmp_path, monkeypatch):
    """If a method takes state the model does not declare, or the declared state is never written, no bundle is written."""
    from onecopy.models.llama import Transformer

    real = Transformer.state_fqns
    monkeypatch.setattr(Transformer, "state_fqns", lambda self: real(self)[:-1])
    with pytest.raises(onecopy.ExportError, match=r"takes state \['layers.1.attention.v_cache'\] beyond the declared state"):
        onecopy.export(tiny_source, tmp_path / "b", max_seq_len=16, methods=("decode",), progress=False)
    monkeypatch.setattr(Transformer, "state_fqns", lambda self: real(self) + ["layers.9.ghost"])
    with pytest.raises(onecopy.ExportError, match=r"never write the declared state \['layers.9.ghost'\]"):
        onecopy.export(tiny_source, tmp_path / "c", max_seq_len=16, progress=False)
    assert list(tmp_path.iterdir()) == []
