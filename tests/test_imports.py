"""The package's import graph: layers that point one way, no cycles, and every module imports first.

A cycle at module level works only in the order the package happens to import in today; the
first reorder (or a user importing a private module first) turns it into an ``ImportError`` on a
half-built module. The graph is read from the source (``ast``). The module-level graph leaves
out imports inside functions (they run later) and under ``if TYPE_CHECKING:`` (never run).

The layers are held on a second graph that counts every import, under ``TYPE_CHECKING`` and
inside functions too: a lazy import is still a dependency a reader has to follow. Lowest
first (:data:`LAYERS`)::

    core        dsclient's top-level private modules (_exceptions, _models, _observe, _urls,
                _records, _server_info, _streaming, ...): they import no package
    governor    -> core                     launcher  -> core only
    batch       -> governor, core           (the runner takes the client as protocols)
    client      -> batch, governor, core
    cli, ray, metrics -> the layers below
    dsclient    the package's facade (``__init__``) and ``__main__``: nothing imports them

A package imports only itself and the layers below its own: no two packages import each other.
Nor is there a cycle of modules on that graph, not even within one package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

import pytest

import dsclient

PACKAGE_DIR = Path(dsclient.__file__).parent

# No cycle is allowed; add nothing here.
ALLOWED_CYCLES: list[frozenset[str]] = []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _importable() -> list[str]:
    """Every module but the ``__main__`` ones (importing those runs the CLI)."""
    return [name for name in _modules() if not name.endswith("__main__")]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: not in functions, not TYPE_CHECKING."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With, ast.ClassDef)):  # class bodies run at import
                visit(node.body)

    visit(tree.body)
    return found


def _resolve(
    module: str,
    is_package: bool,
    node: ast.Import | ast.ImportFrom,
    modules: Collection[str] = (),
) -> set[str]:
    """The dsclient modules an import statement names (a package's own ``__init__`` included).

    ``from pkg import sub`` names ``pkg.sub`` only when ``sub`` is one of ``modules``: the
    package's ``__init__`` has run before any of its modules anyway, and a name that is a
    module is found even while the package is half-built. Without ``modules`` (or for a name
    that is not a module), ``pkg`` itself is named too.
    """
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name.split(".")[0] == "dsclient"}
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join([*base, node.module] if node.module else base)
    else:
        target = node.module or ""
    if target.split(".")[0] != "dsclient":
        return set()
    submodules = {f"{target}.{alias.name}" for alias in node.names}
    if modules and submodules <= set(modules):
        return submodules
    # `from .pkg import name` imports pkg, and pkg.name too when name is a submodule.
    return {target} | submodules


def _every_import(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement: in functions and under ``TYPE_CHECKING`` too."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def import_graph(*, every_import: bool = False) -> dict[str, set[str]]:
    """Module -> the dsclient modules it imports at module level (or anywhere, with
    ``every_import``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        found = _every_import(tree) if every_import else _module_level_imports(tree)
        for node in found:
            edges |= {t for t in _resolve(name, is_package, node, modules) if t in modules}
        edges.discard(name)
        graph[name] = edges
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's algorithm: the components of more than one module (the import cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[frozenset[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def test_no_import_cycles_between_modules() -> None:
    cycles = strongly_connected(import_graph())
    unexpected = [sorted(c) for c in cycles if c not in ALLOWED_CYCLES]
    assert unexpected == [], f"import cycles at module level: {unexpected}"


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(graph) == [frozenset({"a", "b", "c"})]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_relative_imports_and_skips_type_checking() -> None:
    graph = import_graph()
    assert "dsclient._exceptions" in graph["dsclient.client._retry"]
    assert "dsclient.client._retry" not in graph["dsclient._exceptions"]
    # _retry_after imports nothing from dsclient but the HTTP stack, which imports only its
    # own connections (_wire), a leaf.
    assert graph["dsclient._retry_after"] == {"dsclient._http"}
    assert graph["dsclient._http"] == {"dsclient._wire"}
    assert graph["dsclient._wire"] == set()


def _in(package: str, module: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_core(module: str) -> bool:
    """dsclient's core: its top-level private modules (``dsclient._exceptions``, ...), not
    ``__main__`` (the command line's entry point, at the top)."""
    parts = module.split(".")
    return (
        len(parts) == 2
        and parts[0] == "dsclient"
        and parts[1].startswith("_")
        and not parts[1].startswith("__")
    )


#: dsclient's layers, lowest first. A module imports its own package and the layers below its
#: package's, nothing else; a package in no layer fails the test (place it first).
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"core"}),
    frozenset({"governor", "launcher"}),
    frozenset({"batch"}),
    frozenset({"client"}),
    frozenset({"cli", "ray", "metrics"}),
    frozenset({"dsclient"}),
)


def package_of(module: str) -> str:
    """The part of :data:`LAYERS` a module is in: ``"core"``, ``"governor"``, ..., or
    ``"dsclient"`` for the package's facade and ``__main__``."""
    if _is_core(module):
        return "core"
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "dsclient"
    return parts[1]


def layer_of(package: str) -> int:
    for rank, layer in enumerate(LAYERS):
        if package in layer:
            return rank
    raise AssertionError(f"{package!r} is in no layer: place it in LAYERS")


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = package_of(module)
        packages.setdefault(source, set()).update(package_of(t) for t in targets)
        packages[source].discard(source)
    return packages


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that does not point down a layer, as ``"module -> module"``."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if package_of(target) != package_of(module)
        and layer_of(package_of(target)) >= layer_of(package_of(module))
    )


def test_layers_point_down_counting_every_import() -> None:
    graph = import_graph(every_import=True)
    assert {package_of(m) for m in graph} == set().union(*LAYERS)
    assert layer_violations(graph) == []


def test_no_two_packages_import_each_other() -> None:
    # Implied by the layers; said apart because it is the rule a reader checks first.
    assert strongly_connected(package_graph(import_graph(every_import=True))) == []


def test_the_layers_are_those_of_the_design() -> None:
    # The order itself, so that a change to LAYERS is a change a reviewer sees.
    assert [sorted(layer) for layer in LAYERS] == [
        ["core"],
        ["governor", "launcher"],
        ["batch"],
        ["client"],
        ["cli", "metrics", "ray"],
        ["dsclient"],
    ]
    packages = package_graph(import_graph(every_import=True))
    assert packages["core"] == set()
    assert packages["launcher"] == {"core"}
    assert packages["governor"] == {"core"}
    assert packages["batch"] <= {"core", "governor"}
    assert "batch" in packages["client"] and "governor" in packages["client"]
    assert not any("dsclient" in targets for targets in packages.values())


def test_no_import_cycles_counting_every_import() -> None:
    # Not even within the client: Stream, the governed transport and the SDK planner take the
    # client's Caller and Planner (issue 26's second item), not AsyncClient, so no lazy cycle
    # is left anywhere.
    assert strongly_connected(import_graph(every_import=True)) == []


def test_the_layer_check_catches_an_import_up_or_across() -> None:
    graph = {
        "dsclient._exceptions": set(),
        "dsclient.governor._endpoint": {"dsclient._exceptions", "dsclient.client._discovery"},
        "dsclient.client._discovery": {"dsclient.governor._endpoint", "dsclient._exceptions"},
        "dsclient.launcher._server": {"dsclient.governor._endpoint"},
        "dsclient.batch._batch": {"dsclient.client._discovery"},
        "dsclient.cli.map": {"dsclient.client._discovery", "dsclient.launcher._server"},
        "dsclient.metrics": {"dsclient"},
        "dsclient.__main__": {"dsclient.cli.map"},
    }
    assert layer_violations(graph) == [
        "dsclient.batch._batch -> dsclient.client._discovery",
        "dsclient.governor._endpoint -> dsclient.client._discovery",
        "dsclient.launcher._server -> dsclient.governor._endpoint",
        "dsclient.metrics -> dsclient",
    ]
    assert strongly_connected(package_graph(graph)) == [frozenset({"client", "governor"})]


def test_the_graph_names_a_submodule_not_its_package() -> None:
    # `from .. import launcher` inside dsclient.cli.serve is a dependency on the launcher, not
    # on dsclient's facade; `from . import __version__` in dsclient.metrics is one on the facade.
    modules = {"dsclient", "dsclient.launcher", "dsclient.metrics"}
    submodule = ast.parse("from .. import launcher").body[0]
    name = ast.parse("from . import __version__").body[0]
    assert isinstance(submodule, ast.ImportFrom) and isinstance(name, ast.ImportFrom)
    assert _resolve("dsclient.cli.serve", False, submodule, modules) == {"dsclient.launcher"}
    assert _resolve("dsclient.metrics", False, name, modules) == {
        "dsclient",
        "dsclient.__version__",
    }


def _definitions(name: str) -> list[str]:
    """The modules that define ``name`` at their top level (a function, class or assignment)."""
    found = []
    for module, path in _modules().items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                continue
            if name in names:
                found.append(module)
    return sorted(found)


@pytest.mark.parametrize(
    ("name", "home"),
    [
        ("Lane", "dsclient.governor._lanes"),
        ("choose_lane", "dsclient.governor._lanes"),
        ("default_long_threshold", "dsclient.governor._lanes"),
        ("nearest_rank", "dsclient._percentile"),
        ("_nearest_rank", None),
        ("ServerInfo", "dsclient._server_info"),
        ("read_body", "dsclient._streaming"),
        ("read_json", "dsclient._streaming"),
    ],
)
def test_each_shared_concept_is_defined_once(name: str, home: str | None) -> None:
    assert _definitions(name) == ([home] if home else [])


def test_the_launcher_imports_only_itself_and_the_core() -> None:
    # Counting lazy and TYPE_CHECKING imports: the launcher is the server side, and the client,
    # the governor, the batch runner and the command line all sit elsewhere.
    graph = import_graph(every_import=True)
    launcher = sorted(m for m in graph if _in("dsclient.launcher", m))
    assert "dsclient.launcher._server" in launcher
    outside = {
        module: sorted(
            t for t in graph[module] if not _in("dsclient.launcher", t) and not _is_core(t)
        )
        for module in launcher
    }
    assert {m: t for m, t in outside.items() if t} == {}
    # ... and the core it reaches imports no package at all, so nothing comes in through it.
    core = sorted({t for m in launcher for t in graph[m] if _is_core(t)})
    assert core, "the launcher uses the core (records, exceptions, HTTP)"
    assert {m: sorted(t for t in graph[m] if not _is_core(t)) for m in core} == {
        m: [] for m in core
    }


def test_no_import_cycles_in_the_launcher_counting_every_import() -> None:
    graph = import_graph(every_import=True)
    # The package's __init__ included: a module of it importing the package is a cycle too.
    launcher = {
        m: {t for t in edges if _in("dsclient.launcher", t)}
        for m, edges in graph.items()
        if _in("dsclient.launcher", m)
    }
    assert strongly_connected(launcher) == []


def test_the_full_graph_counts_lazy_and_type_checking_imports() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from . import a\n"
        "def f():\n    from . import b\n"
        "from . import c\n"
    )
    assert sorted(n.names[0].name for n in _every_import(tree)) == ["TYPE_CHECKING", "a", "b", "c"]
    assert [n.names[0].name for n in _module_level_imports(tree)][1:] == ["c"]


def test_exceptions_does_not_import_retry_even_lazily() -> None:
    # The old cycle went through a function-local import in _exceptions; none is left anywhere.
    tree = ast.parse((PACKAGE_DIR / "_exceptions.py").read_text(encoding="utf-8"))
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            named |= _resolve("dsclient._exceptions", False, node)
    assert not any(
        name.startswith("dsclient.client._retry.") or name == "dsclient.client._retry" for name in named
    )


# Each module imported first in a clean dsclient namespace, then the whole package in two orders:
# a cycle shows up as an ImportError (a name from a half-built module) in one of them.
_IMPORT_ALL = r"""
import importlib, sys, traceback
names = sys.argv[1:]
failures = []
def clean():
    for key in [k for k in sys.modules if k == "dsclient" or k.startswith("dsclient.")]:
        del sys.modules[key]
for first in names:
    clean()
    try:
        importlib.import_module(first)
    except Exception:
        failures.append(f"{first} first: {traceback.format_exc(limit=-3)}")
for order in (names, names[::-1]):
    clean()
    for name in order:
        try:
            importlib.import_module(name)
        except Exception:
            failures.append(f"{name} in order {order[0]}...: {traceback.format_exc(limit=-3)}")
print("\n".join(failures))
sys.exit(1 if failures else 0)
"""


def test_every_module_imports_first_and_in_any_order() -> None:
    names = _importable()
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, *names],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", ["dsclient.client._retry", "dsclient._exceptions"])
def test_retry_names_the_request_path_imports_stay(name: str) -> None:
    module = __import__(name, fromlist=["_"])
    if name == "dsclient.client._retry":
        for attr in ("retry_after_of", "compute_backoff", "is_retryable", "describe"):
            assert callable(getattr(module, attr))
        assert module.parse_retry_after("1000", None) == 1.0
    else:
        assert module.error_from_response  # builds errors with the parser, no import of _retry
