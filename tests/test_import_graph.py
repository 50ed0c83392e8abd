"""The import graph of ``onecopy/``, read from the source with `ast` (nothing is imported): no cycles,
and the layering rules: the bundle format reads no model or kernel code, and neither the kernels nor
the runtime reach up into the exporter.

`import_graph` is the graph, for more rules. An edge is an explicit import of one module by another,
wherever it stands: at the top, inside a function, under ``if TYPE_CHECKING:``. ``from pkg import
name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``; relative imports are resolved.
Importing ``a.b.c`` also runs ``a/__init__.py`` and ``a/b/__init__.py``; those implicit imports of
parent packages are not edges (``onecopy/__init__.py`` imports the engine and the exporter, and every
module would otherwise reach them). A rule about a module's closure (`closure`) can also look at what
it imports from outside the package, e.g. that a module's closure never imports torch::

    graph = import_graph(external=True)
    assert not {name for m in closure(graph, "onecopy.runtime.scheduler") for name in graph[m]
                if under(name, "torch")}
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "onecopy"


def under(name: str, package: str) -> bool:
    """True when the dotted ``name`` is ``package`` or inside it."""
    return name == package or name.startswith(package + ".")


def modules(package_dir: Path = PACKAGE_DIR) -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, whether it is a package's ``__init__``)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph(package_dir: Path = PACKAGE_DIR, *, external: bool = False) -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports (see the module docstring).

    With ``external``, the imported names from outside the package are in the sets too, as written
    (``import torch.nn.functional`` gives ``torch.nn.functional``, ``from torch import nn`` gives
    ``torch``); the graph's keys are still the package's modules only.
    """
    mods = modules(package_dir)
    root = package_dir.name

    def resolve(name: str) -> str | None:  # the longest prefix of ``name`` that is a module of the package
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, (path, is_package) in mods.items():
        package = module if is_package else module.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if under(alias.name, root):
                        edges.add(resolve(alias.name))
                    elif external:
                        edges.add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    keep = len(parts) - (node.level - 1)
                    if keep < 1:
                        raise AssertionError(f"{path}:{node.lineno}: a relative import beyond the top of {root}")
                    target = ".".join(parts[:keep] + ([node.module] if node.module else []))
                else:
                    target = node.module
                if not under(target, root):
                    if external:
                        edges.add(target)
                    continue
                for alias in node.names:
                    edges.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in mods else resolve(target))
        edges.discard(None)
        graph[module] = edges
    return graph


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    """The package's modules that ``start`` imports, directly or not, and ``start`` itself."""
    seen, todo = {start}, [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep in graph and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components that are cycles (two modules or more, or one importing itself),
    each sorted, largest first (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found, key=lambda c: (-len(c), c))


def _describe(components: list[list[str]]) -> str:
    return "\n".join(f"  {len(c)} modules: {', '.join(c)}" for c in components)


# ------------------------------------------------------------------------------------------- the rules

def test_no_import_cycle_anywhere():
    found = cycles(import_graph())
    assert not found, "import cycles (strongly connected components):\n" + _describe(found)


def test_the_scheduler_and_kv_manager_are_host_only_and_below_the_engine():
    """Policy imports no torch, and nothing that runs on the device or holds sessions: its tests need no
    bundle, and the arrows point down (engine -> scheduler, never back)."""
    graph = import_graph(external=True)
    above = ("onecopy.runtime.engine", "onecopy.runtime.session", "onecopy.runtime.sessions", "onecopy.runtime.runner",
             "onecopy.runtime.loop", "onecopy.runtime.block_tensors")
    for start in ("onecopy.runtime.scheduler", "onecopy.runtime.kv_manager"):
        reach = closure(graph, start)
        assert not [m for m in reach if m in above], f"{start} reaches {sorted(m for m in reach if m in above)}"
        torch = sorted(m for m in reach for name in graph[m] if under(name, "torch"))
        assert not torch, f"{start}'s closure imports torch in {torch}"


def test_the_bundle_format_imports_no_model_or_kernel_code():
    graph = import_graph()
    reach = closure(graph, "onecopy.bundle")
    bad = sorted(m for m in reach if under(m, "onecopy.models") or under(m, "onecopy.kernels"))
    assert not bad, f"onecopy.bundle imports, directly or not, {bad} (its closure: {sorted(reach)})"


def test_kernels_and_runtime_do_not_import_the_exporter():
    graph = import_graph()
    lower = [m for m in graph if under(m, "onecopy.kernels") or under(m, "onecopy.runtime")]
    direct = {m: sorted(d for d in graph[m] if under(d, "onecopy.export")) for m in lower}
    assert not any(direct.values()), f"imports of onecopy.export: { {m: d for m, d in direct.items() if d} }"
    reached = {m: sorted(d for d in closure(graph, m) if under(d, "onecopy.export")) for m in lower}
    assert not any(reached.values()), f"onecopy.export reached: { {m: d for m, d in reached.items() if d} }"


def test_reading_a_bundle_loads_no_model_kernel_or_triton_module():
    """The same rule as imported: `onecopy.bundle` loaded in a fresh process under an empty ``onecopy``
    package (the real ``__init__`` imports the engine and the exporter, so ``import onecopy.bundle``
    always loads them)."""
    code = ("import sys, types; pkg = types.ModuleType('onecopy'); pkg.__path__ = [sys.argv[1]]; "
            "sys.modules['onecopy'] = pkg; import onecopy.bundle; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('onecopy', 'triton')))))")
    r = subprocess.run([sys.executable, "-c", code, str(PACKAGE_DIR)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    loaded = r.stdout.split()
    assert "onecopy.bundle" in loaded
    assert not [m for m in loaded if under(m, "onecopy.models") or under(m, "onecopy.kernels") or under(m, "triton")], loaded


# ---------------------------------------------------------------------------------- the graph itself

def test_the_graph_reads_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import f\n",
        "a.py": "import os\nimport pkg.sub.c\nfrom . import b, leaf\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.c import C\n",
        "leaf.py": "",
        "sub/__init__.py": "",
        "sub/c.py": "from torch import nn\ndef g():\n    from .. import a\n    from ..sub import d, thing\n",
        "sub/d.py": "from .c import *\nfrom pkg import b\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    g = import_graph(pkg)
    assert g == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.c", "pkg.b", "pkg.leaf"}, "pkg.b": {"pkg.sub.c"}, "pkg.leaf": set(),
                 "pkg.sub": set(), "pkg.sub.c": {"pkg.a", "pkg.sub.d", "pkg.sub"}, "pkg.sub.d": {"pkg.sub.c", "pkg.b"}}
    assert import_graph(pkg, external=True)["pkg.sub.c"] == {"pkg.a", "pkg.sub.d", "pkg.sub", "torch"}
    assert import_graph(pkg, external=True)["pkg.a"] == {"os", "pkg.sub.c", "pkg.b", "pkg.leaf"}
    assert cycles(g) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.sub.d"]]
    assert closure(g, "pkg.leaf") == {"pkg.leaf"} and closure(g, "pkg") == set(g)
    (pkg / "leaf.py").write_text("import pkg.leaf\n")
    assert cycles(import_graph(pkg))[-1] == ["pkg.leaf"]  # a module importing itself


def test_the_graph_sees_the_real_package():
    g = import_graph()
    assert {"onecopy", "onecopy.bundle", "onecopy.runtime.engine", "onecopy.kernels.native"} <= set(g)
    assert "onecopy.models.kv_quant" in g["onecopy.kernels.decode"]  # imported inside a function
    assert "onecopy.layouts" in g["onecopy.bundle"] and "onecopy.errors" in g["onecopy.bundle"]
