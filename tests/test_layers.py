"""One-way layering: the four layers of docs/architecture.md, core (``cpattn/core``) -> schedules -> model
(``cost``) -> tools (the rest), ranked finer here: the planner (``cpattn/planner``, a library the ``ultra``
schedule calls) beneath the schedules, and the lab (``cpattn/lab``: only the commands that run it import
it) above the other tools; and no module imports itself back through others (no import cycle). The
package's imports are read from its source, so an import inside a function counts too."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cpattn"
LAYERS = {"core": 1, "planner": 2, "schedules": 3, "model": 4, "tools": 5, "lab": 6}
#: tool modules that may import the lab: the commands that run it (and the command table)
LAB_USERS = ("cpattn.cli", "cpattn.cli.__main__", "cpattn.cli.calibrate", "cpattn.cli.reproduce")


def layer_of(module: str) -> int:
    """The layer of a ``cpattn`` module name (``cpattn.cost.estimate`` -> 4)."""
    parts = module.split(".")
    if len(parts) == 1:
        return LAYERS["tools"]  # the package root re-exports the front door
    top = parts[1]
    if top in ("core", "planner", "schedules", "lab"):
        return LAYERS[top]
    if top == "cost":
        return LAYERS["model"]
    if module in LAB_USERS:
        return LAYERS["lab"]
    return LAYERS["tools"]  # api, bench, verify, cli, launcher, models, integrations, ...


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").exists() or (PACKAGE.parent / rel / "__init__.py").exists()


def imports_of(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every ``cpattn`` module that ``path`` imports, anywhere in the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "cpattn"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "cpattn":
                continue
            for alias in node.names:  # ``from . import kernels`` imports the module cpattn.kernels
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if _is_module(sub) else target))
    return found


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module == "cpattn":
            continue  # the root re-exports every layer; nothing below imports it (checked below)
        for line, target in imports_of(path):
            if layer_of(target) > layer_of(module):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} (layer {layer_of(module)}) "
                           f"imports {target} (layer {layer_of(target)})")
    return bad


def test_no_module_imports_a_higher_layer():
    bad = upward_imports()
    assert not bad, "upward imports:\n" + "\n".join(bad)


def package_cycles() -> list[str]:
    """Pairs of sub-packages (``cost``, ``planner``, ...) that import each other, with one import each way."""
    edges: dict[tuple[str, str], str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        parts = module.split(".")
        if len(parts) < 3:
            continue  # a top-level module, not inside a sub-package
        for line, target in imports_of(path):
            other = target.split(".")
            if len(other) >= 2 and other[1] != parts[1] and (PACKAGE / other[1]).is_dir():
                edges.setdefault((parts[1], other[1]), f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    return [f"{a} <-> {b}: {edges[a, b]}; {edges[b, a]}" for (a, b) in sorted(edges) if a < b and (b, a) in edges]


def test_no_two_subpackages_import_each_other():
    cycles = package_cycles()
    assert not cycles, "import cycles between sub-packages:\n" + "\n".join(cycles)


#: ``(importer, imported)`` imports the module cycle check ignores: none
KNOWN_CYCLE_EDGES: frozenset = frozenset()


def import_graph(ignored: frozenset = KNOWN_CYCLE_EDGES) -> dict[str, dict[str, str]]:
    """``graph[a][b]``: where module ``a`` first imports module ``b`` (``path:line``). A module importing
    itself and the ``ignored`` edges are left out; ``from . import x`` in a package imports ``x`` only."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        edges = graph.setdefault(module, {})
        for line, target in imports_of(path):
            if target != module and (module, target) not in ignored:
                edges.setdefault(target, f"{path.relative_to(PACKAGE.parent)}:{line}")
    return graph


def strongly_connected(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            at = stack.index(v)
            found.append(sorted(stack[at:]))
            del stack[at:]

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_cycles() -> list[str]:
    """Every cycle of module imports: a strongly connected component of more than one module, with the
    imports inside it."""
    graph = import_graph()
    cycles = []
    for component in strongly_connected(graph):
        if len(component) > 1:
            inside = [f"  {a} -> {b} ({graph[a][b]})" for a in component for b in sorted(graph[a]) if b in component]
            cycles.append(" <-> ".join(component) + ":\n" + "\n".join(inside))
    return cycles


def test_no_module_import_cycles():
    cycles = import_cycles()
    assert not cycles, "import cycles between modules:\n" + "\n".join(cycles)


def test_the_cycle_check_finds_a_submodule_importing_its_package(tmp_path, monkeypatch):
    """A package that re-exports its submodules is no cycle, nor is a module importing itself; a submodule
    that imports its package back (even inside a function) is one, with every module on the way."""
    pkg = tmp_path / "cpattn"
    (pkg / "planner").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "planner" / "__init__.py").write_text("from . import build\nfrom .cache import get\n")
    (pkg / "planner" / "cache.py").write_text("from . import build\nimport cpattn.planner.cache\n")
    (pkg / "planner" / "build.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    assert import_cycles() == []
    (pkg / "planner" / "build.py").write_text("def plan():\n    from .. import planner\n")
    cycles = import_cycles()
    assert len(cycles) == 1 and cycles[0].startswith(
        "cpattn.planner <-> cpattn.planner.build <-> cpattn.planner.cache:"), cycles


def test_the_layer_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    """The reader finds relative, absolute and function-level imports, so it can fail."""
    pkg = tmp_path / "cpattn"
    (pkg / "schedules").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "api.py").write_text("")
    (pkg / "cost").mkdir()
    (pkg / "cost" / "__init__.py").write_text("")
    (pkg / "schedules" / "__init__.py").write_text("")
    (pkg / "schedules" / "bad.py").write_text("def f():\n    from ..cost import estimate\n    import cpattn.api\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    bad = upward_imports()
    assert len(bad) == 2 and all("cpattn.schedules.bad (layer 3)" in b for b in bad), bad


@pytest.mark.parametrize("module,layer", [("cpattn.core.comm", 1), ("cpattn.core.steps", 1),
                                          ("cpattn.planner.build", 2), ("cpattn.schedules.ring", 3),
                                          ("cpattn.cost.estimate", 4), ("cpattn.api", 5), ("cpattn.cli.plan", 5),
                                          ("cpattn.distributed", 5), ("cpattn", 5), ("cpattn.lab.machine_profile", 6),
                                          ("cpattn.cli.reproduce", 6)])
def test_layer_names(module, layer):
    assert layer_of(module) == layer


def test_core_modules_live_in_the_core_folder():
    """Every module of the core layer is in ``cpattn/core`` and the package root holds no core module."""
    root_modules = {p.stem for p in PACKAGE.glob("*.py")}
    core = {p.stem for p in (PACKAGE / "core").glob("*.py")} - {"__init__"}
    core |= {p.parent.name for p in (PACKAGE / "core").glob("*/__init__.py")}
    assert {"masks", "layout", "kernels", "comm", "steps", "executor", "merge"} <= core
    assert not root_modules & core, sorted(root_modules & core)


def test_public_short_paths_are_the_core_modules():
    """``cpattn.masks`` (and layout, kernels, merge) is the core module itself, not a second copy."""
    from cpattn.masks import causal

    import cpattn
    import cpattn.core.masks

    assert cpattn.masks is cpattn.core.masks and causal is cpattn.core.masks.causal


def test_import_cpattn_is_cheap():
    """No OR-Tools, matplotlib or rich until a command or the planner's solver needs them."""
    code = ("import sys, cpattn\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ortools', 'matplotlib', 'rich')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
