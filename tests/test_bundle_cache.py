"""The test bundle cache itself (`bundle_cache`): what its key holds, one export for concurrent askers, and a
damaged entry never handed out. A stand-in exporter writes tiny fake bundles: nothing is compiled here."""

import json
import os
import threading
import time
from pathlib import Path

import pytest

from . import bundle_cache as bc


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """The cache in tmp_path, its exporter a stand-in that records its calls and writes a two-file bundle."""
    calls = []

    def fake_export(source, out_dir, *, progress=True, workers=None, **options):  # (workers: where it compiles)
        calls.append((str(source), options))
        time.sleep(0.2)  # long enough for a second asker to arrive while it runs
        out = Path(out_dir)
        (out / "methods").mkdir(parents=True)
        (out / "manifest.json").write_text(json.dumps({"source": str(source), **options}))
        (out / "methods" / "decode.pt2").write_bytes(b"package")
        return out

    monkeypatch.setenv(bc.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.setattr(bc, "_EXPORT", fake_export)
    monkeypatch.setattr(bc, "_used", {})
    monkeypatch.setattr(bc, "_exports", [])
    return calls


def test_the_key_binds_options_to_the_exporters_defaults():
    key = bc.bundle_key("tiny-llama", max_seq_len=64)[0]
    assert key == bc.bundle_key("tiny-llama", max_seq_len=64, kv_block=16, dtype=None)[0]  # the defaults
    assert key != bc.bundle_key("tiny-llama", max_seq_len=32)[0]
    assert key != bc.bundle_key("tiny-llama", max_seq_len=64, kv_block=None)[0]
    assert key != bc.bundle_key("tiny-qwen3.5", max_seq_len=64)[0]
    options = bc.export_options(max_seq_len=64, methods=("decode",))
    assert options["methods"] == ["decode"] and "out_dir" not in options and "progress" not in options


def test_a_model_source_is_keyed_by_its_contents(tiny_source):
    from onecopy.models.source import preset_source

    assert bc.source_identity(tiny_source) == bc.source_identity(preset_source("tiny-llama"))
    other = preset_source("tiny-llama", seed=1)  # same name and config, other weights
    assert bc.source_identity(other)["content"] != bc.source_identity(tiny_source)["content"]


def test_a_file_source_is_keyed_by_its_name_and_bytes(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"one")
    first = bc.source_identity(f)
    f.write_bytes(b"two")
    assert bc.source_identity(f) != first and bc.source_identity(str(f))["name"] == "m.gguf"


@pytest.mark.parametrize("var,value", [("TORCHINDUCTOR_CPP_MARCH", "x86-64-v3"), ("CXX", "clang++")])
def test_the_code_environment_is_in_the_key(monkeypatch, var, value):
    monkeypatch.delenv(var, raising=False)
    before = bc.bundle_key("tiny-llama", max_seq_len=64)[0]
    monkeypatch.setenv(var, value)
    key, material = bc.bundle_key("tiny-llama", max_seq_len=64)
    assert key != before and material["environment"]["env"][var] == value


def test_the_isa_in_effect_is_in_the_key_and_library_kernel_choices_are_not(monkeypatch):
    """CI reruns the batch-invariance tests held to AVX2: where that moves the ISA Inductor generates code for
    (ATen's capability, read once per process), their bundles are their own; MKL's and oneDNN's kernel choices
    (made when a bundle runs) and the variables themselves (a cap at what the machine has is the same code) are
    not in the key."""
    import subprocess
    import sys

    import torch

    plain, material = bc.bundle_key("tiny-llama", max_seq_len=64)
    assert material["environment"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    for var, value in (("MKL_ENABLE_INSTRUCTIONS", "AVX2"), ("ONEDNN_MAX_CPU_ISA", "AVX2")):
        monkeypatch.setenv(var, value)
    assert bc.bundle_key("tiny-llama", max_seq_len=64)[0] == plain
    # Inductor reads $ATEN_CPU_CAPABILITY at each export (ATen only once): on a machine past AVX2 the cap moves the
    # code this process generates, so it moves the key; on an AVX2 machine it is the same code and the same key
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    capped, capped_material = bc.bundle_key("tiny-llama", max_seq_len=64)
    assert capped_material["environment"]["vec_isa"] == "avx2"
    assert (capped == plain) == (material["environment"]["vec_isa"] == "avx2")
    code = "import tests.bundle_cache as bc; print(bc.bundle_key('tiny-llama', max_seq_len=64)[0])"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    assert out.split()[-1] != plain  # no vector ISA in effect: other code, another bundle


def test_the_code_hash_covers_what_the_exporter_imports_and_not_the_runtime():
    modules = bc.exporter_modules()
    assert {"onecopy.export.exporter", "onecopy.bundle", "onecopy.models.llama", "onecopy.models.whisper",
            "onecopy.kernels.decode", "onecopy.models.kv_quant"} <= set(modules)
    assert any(m.endswith("toolchain") for m in modules)  # wherever it lives
    assert not any(m.startswith("onecopy.runtime") for m in modules) and "onecopy" not in modules
    assert len(bc.code_hash()) == 64


def test_concurrent_askers_get_one_export_and_the_same_bundle(fake_cache):
    got, errors = [], []

    def ask():
        try:
            got.append(bc.cached_bundle("tiny-llama", max_seq_len=64))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(got) == 4 and len(set(got)) == 1
    assert len(fake_cache) == 1  # one export; the others waited for it and took it
    assert json.loads((got[0] / "manifest.json").read_text())["max_seq_len"] == 64
    assert not list(got[0].parent.parent.glob(".tmp-*"))  # exported aside, renamed into place
    assert bc.cached_bundle("tiny-llama", max_seq_len=64, kv_block=16) == got[0] and len(fake_cache) == 1


def test_a_damaged_entry_is_exported_again_and_reported(fake_cache):
    bundle = bc.cached_bundle("tiny-llama", max_seq_len=64)
    assert bc.check_entries_used() == []
    (bundle / "methods" / "decode.pt2").unlink()  # what a test must never do to a cached bundle
    assert bc.check_entries_used() == [bundle.parent.name] and not bundle.exists()  # reported, removed
    again = bc.cached_bundle("tiny-llama", max_seq_len=64)
    assert again == bundle and (again / "methods" / "decode.pt2").read_bytes() == b"package" and len(fake_cache) == 2
    (again / "manifest.json").chmod(0o644)
    (again / "manifest.json").write_text("{}")  # changed in place: its fingerprint no longer matches
    assert bc.cached_bundle("tiny-llama", max_seq_len=64) == bundle and len(fake_cache) == 3


def test_an_export_that_fails_leaves_nothing(fake_cache, monkeypatch):
    def failing(source, out_dir, **_):
        Path(out_dir).mkdir(parents=True)
        raise RuntimeError("compiler crashed")

    monkeypatch.setattr(bc, "_EXPORT", failing)
    with pytest.raises(RuntimeError, match="compiler crashed"):
        bc.cached_bundle("tiny-llama", max_seq_len=64)
    root = bc.cache_root()
    assert [p.name for p in root.iterdir() if p.name != ".locks"] == []


def test_pruning_removes_the_least_recently_used_entries_past_the_size(fake_cache, monkeypatch):
    old = bc.cached_bundle("tiny-llama", max_seq_len=32).parent
    new = bc.cached_bundle("tiny-llama", max_seq_len=64).parent
    monkeypatch.setattr(bc, "_used", {})  # as if another run had used them
    day = time.time() - 86400
    os.utime(old, (day - 60, day - 60))
    os.utime(new, (day, day))
    assert bc.prune(max_bytes=1 << 30) == []  # within the size: nothing goes
    size = sum(f.lstat().st_size for f in new.rglob("*"))
    assert bc.prune(max_bytes=size) == [old.name] and new.exists() and not old.exists()


def test_off_exports_into_a_directory_of_this_process(fake_cache, monkeypatch, tmp_path):
    monkeypatch.setenv(bc.ENV_DIR, "off")
    monkeypatch.setattr(bc, "_session_dir", lambda: tmp_path / "session")
    assert bc.cache_root() is None
    bundle = bc.cached_bundle("tiny-llama", max_seq_len=64)
    assert bundle.is_relative_to(tmp_path / "session") and len(fake_cache) == 1
