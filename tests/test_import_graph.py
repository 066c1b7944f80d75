"""The import graph of the library and the lab: no import cycle anywhere, and the library never imports the lab.

The graph is read from the source with :mod:`ast`, not from ``sys.modules``, so an import inside a function counts
as much as one at the top of a module: both run, only at different times, and a cycle through a function-level
import is a cycle all the same (it just fails later, or only on some paths). Imports under
``if TYPE_CHECKING:`` are left out: they never run.

Edges. ``import kvpolicy.a.b`` and ``from kvpolicy.a import b`` (``b`` a submodule) give an edge to the module
``kvpolicy.a.b``; ``from kvpolicy.a import name`` (``name`` not a submodule) gives an edge to ``kvpolicy.a``.
Relative imports are resolved against the importing module's package. An edge goes to the *named* module only,
not to the ``__init__`` of the packages above it, although Python runs those first: a package's ``__init__``
re-exporting its parts (``kvpolicy/actions/__init__.py`` imports ``kvpolicy.actions.quantize``, which imports
``kvpolicy.actions.base``) would otherwise close a cycle through every package, and that cycle is harmless,
because the parent package is already in ``sys.modules`` (half initialised) when the child runs. A real cycle is
one between modules that name each other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvpolicy"
#: the evaluation harness, a distribution of its own (kvpolicy-lab): the library never imports it
LAB = ROOT / "lab" / "kvpolicy_lab"

# The library's command line: everything else in the library runs without it.
CLI_PACKAGES = ("kvpolicy.commands",)
CLI_MODULES = ("kvpolicy.cli", "kvpolicy.__main__")


@dataclass(frozen=True)
class Import:
    """One import statement's edge: ``source`` imports ``target`` at ``file:line``."""

    source: str
    target: str
    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.source} imports {self.target}"


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (``kvpolicy/a/__init__.py`` is ``kvpolicy.a``)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree`` at any depth (functions, classes, ``try``), except those under
    ``if TYPE_CHECKING:``, which never run (the ``else:`` branch of such an ``if`` does run, and is read)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _known(name: str, modules: Mapping[str, Path]) -> str | None:
    """``name`` if it is a module of the package, else its nearest ancestor that is (``kvpolicy.a.f`` written as
    ``import kvpolicy.a.f`` cannot happen, but ``kvpolicy.a`` always resolves), else None (outside the package)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: Mapping[str, Path], root: Path = ROOT) -> list[Import]:
    """The package-internal imports of one module, each mapped to the module it names (places relative to
    ``root``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    file = str(path.relative_to(root))
    is_package = path.name == "__init__.py"
    found = []
    for node in _import_nodes(tree):
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_known(alias.name, modules) for alias in node.names]
        else:
            base = _resolve_relative(module, is_package, node.level, node.module) if node.level else node.module
            if base is None:
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.append(submodule if submodule in modules else _known(base, modules))
        for target in targets:
            if target is not None and target != module:
                found.append(Import(module, target, file, node.lineno))
    return found


def import_graph(*packages: Path) -> tuple[dict[str, set[str]], list[Import]]:
    """The modules of ``packages`` (default: the library and the lab) with the modules each imports, and every
    import edge with its place."""
    modules = {name: path for package in packages or (PACKAGE, LAB) for name, path in module_files(package).items()}
    edges = [edge for module, path in modules.items() for edge in imports_of(module, path, modules)]
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for edge in edges:
        graph[edge.source].add(edge.target)
    return graph, edges


def strongly_connected(graph: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
    """The strongly connected components of ``graph`` with more than one node, or one node importing itself:
    the import cycles. Tarjan's algorithm, iterative (the package is deeper than nothing but recursion is not
    needed)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph.get(root, ())))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    components.append(frozenset(component))
    return components


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def is_lab(module: str) -> bool:
    return _within(module, "kvpolicy_lab")


def is_cli(module: str) -> bool:
    return module in CLI_MODULES or any(_within(module, package) for package in CLI_PACKAGES)


def _describe(component: frozenset[str], edges: Iterable[Import]) -> str:
    inside = sorted({str(edge) for edge in edges if edge.source in component and edge.target in component})
    return "cycle between " + ", ".join(sorted(component)) + ":\n    " + "\n    ".join(inside)


# -- the cycle finder itself ----------------------------------------------------------------------------------


def test_cycle_finder_finds_cycles_and_only_cycles():
    graph = {
        "a": {"b"},
        "b": {"c"},
        "c": {"a", "d"},  # a -> b -> c -> a
        "d": {"e"},
        "e": set(),  # a chain out of the cycle is no cycle
        "f": {"f"},  # a module importing itself
        "g": {"h", "i"},
        "h": {"i"},
        "i": set(),  # a diamond is no cycle
        "j": {"k"},
        "k": {"j", "a"},  # a second cycle, pointing into the first
    }
    found = set(strongly_connected(graph))
    assert found == {frozenset("abc"), frozenset("f"), frozenset("jk")}
    assert strongly_connected({"x": {"y"}, "y": set()}) == []


def test_cycle_finder_handles_a_long_chain_without_recursion():
    n = 5000
    graph = {str(i): {str(i + 1)} for i in range(n)} | {str(n): {"0"}}
    assert strongly_connected(graph) == [frozenset(map(str, range(n + 1)))]


def test_edges_are_read_from_functions_and_relative_imports_but_not_type_checking(tmp_path):
    package = tmp_path / "kvpolicy"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from kvpolicy import c\n"
        "else:\n"
        "    import kvpolicy.d\n"
        "def f():\n"
        "    from .sub import b\n"
        "    from kvpolicy.sub.b import thing\n"
    )
    (package / "c.py").write_text("")
    (package / "d.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import b\nfrom .. import a\nfrom ..a import f\n")
    (package / "sub" / "b.py").write_text("import os\nfrom kvpolicy.sub import helper\n")
    modules = module_files(package)
    assert set(modules) == {"kvpolicy", "kvpolicy.a", "kvpolicy.c", "kvpolicy.d", "kvpolicy.sub", "kvpolicy.sub.b"}
    edges = {
        module: {edge.target for edge in imports_of(module, path, modules, tmp_path)}
        for module, path in modules.items()
    }
    assert edges["kvpolicy.a"] == {"kvpolicy.d", "kvpolicy.sub.b"}
    assert edges["kvpolicy.sub"] == {"kvpolicy.sub.b", "kvpolicy.a"}
    assert edges["kvpolicy.sub.b"] == {"kvpolicy.sub"}


# -- the package ----------------------------------------------------------------------------------------------


def test_the_graph_sees_both_packages():
    graph, edges = import_graph()
    assert {"kvpolicy.cache", "kvpolicy_lab.eval.cells", "kvpolicy.actions.quantize"} <= set(graph)
    # a function-level import is an edge (the CLI imports its parser lazily)
    assert any(edge.source == "kvpolicy.cli" and edge.target.startswith("kvpolicy.commands") for edge in edges)
    # the lab's edges into the library are seen
    assert any(is_lab(edge.source) and edge.target == "kvpolicy.cache" for edge in edges)


def test_no_import_cycle_in_the_package():
    graph, edges = import_graph()
    cycles = strongly_connected(graph)
    assert not cycles, "import cycles (function-level imports included):\n" + "\n".join(
        _describe(component, edges) for component in cycles
    )


def test_the_library_never_imports_the_lab():
    _, edges = import_graph()
    offending = [edge for edge in edges if not is_lab(edge.source) and is_lab(edge.target)]
    assert not offending, "the library imports the lab:\n    " + "\n    ".join(sorted(set(map(str, offending))))


def test_the_library_never_loads_the_lab_when_it_runs():
    """At run time too: every public name, the cache at work, the evaluation names that moved and the command line
    (its plugins not loaded) leave ``kvpolicy_lab`` out of ``sys.modules``."""
    import subprocess
    import sys

    code = (
        "import sys, torch, kvpolicy\n"
        "for name in kvpolicy.__all__: getattr(kvpolicy, name)\n"
        "assert not hasattr(kvpolicy, 'compare') and not hasattr(kvpolicy, 'estimate')\n"
        "from kvpolicy.cli import build_parser; build_parser()\n"
        "cache = kvpolicy.CompressedCache(policy='log', window=4, bits=2, group_size=16)\n"
        "cache.update(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64), 0)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kvpolicy_lab'))\n"
    )
    env = {**__import__("os").environ, "KVPOLICY_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("KVPOLICY_PLUGINS", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_names_that_moved_to_the_lab_say_where_they_are():
    import kvpolicy

    for name in ("compare", "estimate"):
        assert name not in kvpolicy.__all__ and name not in dir(kvpolicy)
        assert not hasattr(kvpolicy, name)
        with pytest.raises(AttributeError) as info:
            getattr(kvpolicy, name)
        assert str(info.value) == (
            f"kvpolicy.{name} moved to the kvpolicy-lab package: from kvpolicy_lab import {name}, after pip install "
            "kvpolicy-lab (from a clone of kvpolicy: pip install ./lab)"
        )
    with pytest.raises(AttributeError, match=r"^module 'kvpolicy' has no attribute 'no_such_name'$"):
        kvpolicy.no_such_name  # noqa: B018


def test_the_library_runs_without_its_command_line():
    _, edges = import_graph(PACKAGE)
    offending = [edge for edge in edges if not is_cli(edge.source) and is_cli(edge.target)]
    assert not offending, "the library imports its command line:\n    " + "\n    ".join(
        sorted(set(map(str, offending)))
    )


def test_membership():
    assert is_lab("kvpolicy_lab") and is_lab("kvpolicy_lab.eval.cells") and is_lab("kvpolicy_lab.commands.tune")
    assert not is_lab("kvpolicy.cache") and not is_lab("kvpolicy_labs") and not is_lab("kvpolicy")
    assert is_cli("kvpolicy.cli") and is_cli("kvpolicy.__main__") and is_cli("kvpolicy.commands.presets")
    assert not is_cli("kvpolicy.cache") and not is_cli("kvpolicy.commandsx") and not is_cli("kvpolicy")


# -- the layer package imports nothing above it ------------------------------------------------------------------

#: the modules above one layer's engine: the spec and its builders, the cache and its files, the presets
ABOVE_THE_LAYER = (
    "kvpolicy.spec", "kvpolicy.cache", "kvpolicy.cache_io", "kvpolicy.presets", "kvpolicy.preset_source",
    "kvpolicy.model_presets",
)  # fmt: skip


def upward(graph: Mapping[str, Iterable[str]], package: str, above: Iterable[str]) -> dict[str, list[str]]:
    """For each module of ``package`` that reaches a module of ``above`` through imports (directly or through
    other modules), one import chain from it to that module."""
    above = set(above)
    found = {}
    for start in sorted(module for module in graph if _within(module, package)):
        came_from: dict[str, str | None] = {start: None}
        queue = [start]
        while queue:
            node = queue.pop(0)
            if node in above:
                chain = [node]
                while came_from[chain[-1]] is not None:
                    chain.append(came_from[chain[-1]])
                found[start] = chain[::-1]
                break
            for child in sorted(graph.get(node, ())):
                if child not in came_from:
                    came_from[child] = node
                    queue.append(child)
    return found


def test_the_upward_finder_follows_chains():
    graph = {"p.a": {"q"}, "p.b": {"r"}, "q": {"top"}, "r": set(), "top": set()}
    assert upward(graph, "p", ["top"]) == {"p.a": ["p.a", "q", "top"]}
    assert upward(graph, "p", ["nothing"]) == {}


def test_the_layer_package_imports_nothing_above_it():
    graph, _ = import_graph(PACKAGE)
    assert {"kvpolicy.layer.engine", "kvpolicy.layer.held", "kvpolicy.layer.composition"} <= set(graph)
    chains = upward(graph, "kvpolicy.layer", ABOVE_THE_LAYER)
    assert not chains, "the layer package imports upward:\n    " + "\n    ".join(
        " -> ".join(chain) for chain in chains.values()
    )
