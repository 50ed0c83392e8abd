"""Pick a C++ compiler whose AOTI packages load safely into this process, and check packages at load.

Measured on the GPU image (docs/architecture.md, "Facts measured"): its $CXX (/opt/gcc/bin/g++) links libstdc++ statically into
the package's .so, which then segfaults in std::regex next to the process's own libstdc++. A .so
that links libstdc++.so.6 dynamically shares the process's copy and loads fine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import subprocess
import tempfile
import zipfile
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

from .errors import ExportError, ToolchainError

_PROBE_SRC = '#include <regex>\n#include <string>\nbool probe(const std::string& s) { return std::regex_match(s, std::regex("a+")); }\n'  # noqa: E501


def elf_needed(data: bytes) -> list[str] | None:
    """DT_NEEDED entries of an ELF64 little-endian shared object, or None if it is not one."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for sh in sections:
        if sh[1] != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[sh[6]]  # sh_link points at .dynstr
        needed = []
        for off in range(sh[4], sh[4] + sh[5], 16):
            tag, val = struct.unpack_from("<qQ", data, off)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                start = strtab[4] + val
                needed.append(data[start:data.index(b"\0", start)].decode())
        return needed
    return []


def links_libstdcxx_dynamically(so_bytes: bytes) -> bool:
    """True unless the object carries its own (static) libstdc++, which clashes with the process's."""
    needed = elf_needed(so_bytes)
    if needed is None or any(n.startswith("libstdc++") for n in needed):
        return True
    # No libstdc++ dependency: fine only if it has no C++ runtime code of its own.
    return b"_ZNSt6locale" not in so_bytes


def _compiler_ok(cxx: str) -> bool:
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d, "probe.cpp"), Path(d, "probe.so")
        src.write_text(_PROBE_SRC)
        r = subprocess.run([cxx, "-shared", "-fPIC", "-O0", str(src), "-o", str(out)], capture_output=True)
        return r.returncode == 0 and links_libstdcxx_dynamically(out.read_bytes())


@lru_cache(maxsize=None)
def pick_cxx() -> str:
    """The first of $CXX, g++, c++, /usr/bin/g++ that builds .so files linked to the shared libstdc++."""
    candidates = [os.environ.get("CXX"), "g++", "c++", "/usr/bin/g++", "/usr/bin/c++"]
    tried = []
    for c in candidates:
        if not c or c in tried:
            continue
        tried.append(c)
        if shutil.which(c) and _compiler_ok(c):
            return shutil.which(c) or c
    raise ExportError(f"no C++ compiler among {tried} builds shared objects that link libstdc++ dynamically; "
                      "install g++ (apt-get install g++) or set CXX to one that does")


def check_package_loadable(package: Path) -> None:
    """Refuse (instead of segfaulting) a package whose .so carries its own libstdc++."""
    if "libstdc++" in os.environ.get("LD_PRELOAD", ""):
        return  # the process-wide libstdc++ takes precedence; measured to load fine
    with zipfile.ZipFile(package) as z:
        for name in z.namelist():
            if name.endswith(".so") and not links_libstdcxx_dynamically(z.read(name)):
                raise ToolchainError(
                    f"{package.name} was compiled with libstdc++ linked statically ({name}); loading it would crash "
                    "this process. Fix: re-export the bundle with `onecopy export` (it picks a compiler that links "
                    "libstdc++ dynamically), or start Python with LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6")


@contextlib.contextmanager
def build_environment(**values: str) -> Iterator[None]:
    """What torch's extension builder (the native CUDA and the CPU kernels) needs in the environment: ``values``
    set, and the pip `ninja` package's binary on PATH (found even when the environment's bin is not); all of it
    put back afterwards."""
    saved = {k: os.environ.get(k) for k in (*values, "PATH")}
    os.environ.update(values)
    try:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
