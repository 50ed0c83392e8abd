"""The compiler pick and the load-time check that keep AOTI packages from crashing the process."""

import os
import shutil
import subprocess
import zipfile

import pytest

from onecopy.errors import ToolchainError
from onecopy.toolchain import check_package_loadable, elf_needed, links_libstdcxx_dynamically, pick_cxx

SRC = '#include <regex>\nbool f(const char* s) { return std::regex_match(s, std::regex("a+")); }\n'


def _build(tmp_path, *flags):
    src, out = tmp_path / "t.cpp", tmp_path / f"t{len(flags)}.so"
    src.write_text(SRC)
    subprocess.run([pick_cxx(), "-shared", "-fPIC", *flags, str(src), "-o", str(out)], check=True)
    return out.read_bytes()


def test_picked_compiler_links_libstdcxx_dynamically(tmp_path):
    so = _build(tmp_path)
    assert "libstdc++.so.6" in elf_needed(so)
    assert links_libstdcxx_dynamically(so)


def test_static_libstdcxx_is_detected_and_refused(tmp_path, monkeypatch):
    so = _build(tmp_path, "-static-libstdc++")
    assert not any(n.startswith("libstdc++") for n in elf_needed(so))
    assert not links_libstdcxx_dynamically(so)
    pkg = tmp_path / "bad.pt2"
    with zipfile.ZipFile(pkg, "w") as z:
        z.writestr("bad/data/aotinductor/model/x.wrapper.so", so)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with pytest.raises(ToolchainError, match="libstdc\\+\\+ linked statically.*re-export the bundle"):
        check_package_loadable(pkg)


def test_exported_packages_pass_the_check(tiny_bundle):
    for pkg in (tiny_bundle / "methods").iterdir():
        check_package_loadable(pkg)


def test_elf_needed_rejects_non_elf():
    assert elf_needed(b"not an elf at all") is None


def test_the_build_environment_is_put_back(monkeypatch):
    from onecopy.toolchain import build_environment

    monkeypatch.setenv("CXX", "g++-before")
    monkeypatch.delenv("NVCC_CCBIN", raising=False)
    path = os.environ["PATH"]
    with build_environment(CXX="c++", NVCC_CCBIN="c++"):
        assert os.environ["CXX"] == os.environ["NVCC_CCBIN"] == "c++"
        assert os.environ["PATH"].endswith(path) and shutil.which("ninja")  # the builder finds ninja
    assert os.environ["CXX"] == "g++-before" and "NVCC_CCBIN" not in os.environ and os.environ["PATH"] == path
