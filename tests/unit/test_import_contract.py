"""Dependencies point inward: the decision cores never import the adapters around them.

Each core is imported in a fresh interpreter (this test process has long since loaded everything) and
``sys.modules`` is read back. A second, static check walks every import statement in a core, including
the ones inside functions that a plain import would not run. The last test keeps the three adapter
packages (control, probe, sim) free of package-level import cycles.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

CORES = (
    "dsec.model",
    "dsec.breaker",
    "dsec.health",
    "dsec.quota",
    "dsec.policy",
    "dsec.scheduler",
    "dsec.snapshot",
    "dsec.heal",
    "dsec.alerts",
    "dsec.decide",
    "dsec.cost",
)

# Never, from any core, at any depth: these are the adapters and entry points that sit on top of the cores.
ADAPTERS = ("dsec.control", "dsec.probe", "dsec.sim", "dsec.cli", "dsec.launch")
THIRD_PARTY = ("fastapi", "uvicorn", "httpx", "torch")

# Third-party packages a core legitimately needs, with the reason.
ALLOWED: dict[str, frozenset[str]] = {
    # The webhook sink (dsec.alerts.sinks.WebhookSink) posts alerts; it is the alert router's one real sink.
    "dsec.alerts": frozenset({"httpx"}),
}


def _present(core: str) -> bool:
    return importlib.util.find_spec(core) is not None


def _forbidden(name: str, core: str) -> bool:
    if any(name == a or name.startswith(a + ".") for a in ADAPTERS):
        return True
    # dsec.cli_serve, dsec.cli_sim, ...: the CLI's modules are flat, not a package
    if name.startswith("dsec.cli_"):
        return True
    top = name.split(".")[0]
    return top in THIRD_PARTY and top not in ALLOWED.get(core, frozenset())


def _loaded_by(core: str) -> list[str]:
    code = f"import json, sys; import {core}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded: list[str] = json.loads(out.stdout)
    return loaded


@pytest.mark.parametrize("core", CORES)
def test_importing_a_core_loads_no_adapter(core: str) -> None:
    if not _present(core):
        pytest.skip(f"{core} does not exist yet")
    bad = [name for name in _loaded_by(core) if _forbidden(name, core)]
    assert bad == [], f"import {core} loaded {bad}"


def _imports(path: Path, package: str) -> Iterator[tuple[str, int]]:
    """Every module an import statement in ``path`` names, at module level or inside a function."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                yield ".".join([*base, *([node.module] if node.module else [])]), node.lineno
            elif node.module:
                yield node.module, node.lineno


def _modules_of(package: str) -> Iterator[tuple[Path, str]]:
    pkg_dir = SRC.joinpath(*package.split("."))
    paths = sorted(pkg_dir.rglob("*.py")) if pkg_dir.is_dir() else [pkg_dir.with_suffix(".py")]
    for path in paths:
        rel = path.relative_to(SRC).with_suffix("").parts
        # the package a relative import in this file is relative to
        yield path, ".".join(rel if path.name == "__init__.py" else rel[:-1])


@pytest.mark.parametrize("core", CORES)
def test_no_core_source_names_an_adapter_even_inside_a_function(core: str) -> None:
    if not _present(core):
        pytest.skip(f"{core} does not exist yet")
    bad = [
        f"{path.relative_to(SRC)}:{line} imports {name}"
        for path, package in _modules_of(core)
        for name, line in _imports(path, package)
        if name.startswith("dsec.") and _forbidden(name, core)
    ]
    assert bad == []


def _package_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    def owner(name: str) -> str | None:
        return next((p for p in packages if name == p or name.startswith(p + ".")), None)

    graph: dict[str, set[str]] = {p: set() for p in packages}
    for pkg in packages:
        for path, package in _modules_of(pkg):
            for name, _ in _imports(path, package):
                target = owner(name)
                if target is not None and target != pkg:
                    graph[pkg].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle in ``graph`` as a path that starts and ends on the same node, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            found = visit(nxt, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    return next((c for c in (visit(n, []) for n in sorted(graph)) if c), None)


def test_cycle_finder_finds_a_cycle() -> None:
    # the check below would pass vacuously if _cycle never found anything
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_control_probe_and_sim_have_no_package_level_import_cycle() -> None:
    # Function-level imports count: they defer the cycle to run time, they do not remove it.
    assert _cycle(_package_graph(("dsec.control", "dsec.probe", "dsec.sim"))) is None
