"""The layout of DEVELOPERS.md: one `specray` package; no bare component module is importable."""

import ast
import functools
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPONENTS = ["core", "scheduler", "workers", "drafters", "cluster"]


@pytest.mark.parametrize("name", COMPONENTS + ["models", "specray_core"])
def test_bare_component_not_importable(name):
    assert importlib.util.find_spec(name) is None, f"a bare `{name}` module is importable: {importlib.util.find_spec(name)}"


def test_bare_names_not_importable_from_repo_root():
    """Even run from the repository root (PYTHONSAFEPATH keeps the cwd off sys.path)."""
    code = "import importlib.util,sys; sys.exit(any(importlib.util.find_spec(n) for n in %r))" % COMPONENTS
    env = {"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin"}
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env).returncode == 0


@pytest.mark.parametrize("mod", ["specray", "specray.scheduler", "specray.workers", "specray.drafters",
                                 "specray.cluster", "specray.models"])
def test_packages_map_to_folders(mod):
    spec = importlib.util.find_spec(mod)
    folder = {"specray": "core", "specray.models": "core/models"}.get(mod, mod.split(".")[-1])
    assert Path(spec.origin).resolve().parent == (ROOT / folder).resolve()


@functools.lru_cache(maxsize=None)
def _scan(path: Path) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The modules ``path`` imports (relative ones with their dots) and the lines of its strings naming
    specray.cluster: each file is parsed once per session, for all the tests below."""
    names, cluster_strings = [], []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            names.append("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "specray.cluster" in node.value:
            cluster_strings.append(node.lineno)
    return tuple(names), tuple(cluster_strings)


def _imports(path: Path) -> tuple[str, ...]:
    return _scan(path)[0]


def _py_files(*folders):
    for folder in folders:
        yield from (ROOT / folder).rglob("*.py")


def test_only_absolute_specray_imports():
    bad = [(str(p.relative_to(ROOT)), n) for p in _py_files(*COMPONENTS, "tests") for n in _imports(p)
           if n.startswith(".") or n.split(".")[0] in COMPONENTS]
    assert not bad, f"relative or bare component imports: {bad}"


def test_scheduler_is_torch_free():
    bad = [(str(p.relative_to(ROOT)), n) for p in _py_files("scheduler") for n in _imports(p)
           if n.split(".")[0] in ("torch", "ray", "numpy")]
    assert not bad
    code = "import sys, specray.scheduler.scheduler, specray.scheduler.draft_policy, specray.contract; " \
           "sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_ray_only_in_cluster():
    bad = [(str(p.relative_to(ROOT)), n) for p in _py_files("core", "scheduler", "workers", "drafters")
           for n in _imports(p) if n.split(".")[0] == "ray"]
    assert not bad


# ---- layering: imports point down, never up, and never in a circle ----------------------------------------
_FOLDER_PACKAGE = {"core": "specray", "scheduler": "specray.scheduler", "workers": "specray.workers",
                   "drafters": "specray.drafters", "cluster": "specray.cluster"}
# floor of each module (longest prefix wins): a module imports its own package or lower floors, never a higher
# floor nor a sibling on its own floor (the scheduler, the workers and the drafters know nothing of each other)
FLOORS = {
    "specray": 0,  # the plain-data floor: config, contract, sampling_params, outputs, errors, kv_blocks, ...
    "specray.parallel": 0,
    "specray.models": 1,
    "specray.sampling": 1,
    "specray.verification": 2,
    "specray.tree_verification": 3,  # trees of drafts, built on the chain verifier
    "specray.scheduler": 4,
    "specray.workers": 4,
    "specray.drafters": 4,
    "specray.engine": 5,
    "specray.llm": 6,
    "specray.training": 6,  # train-draft: generates its data with LLM, trains heads of specray.models
    "specray.cluster": 7,
}


def _module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [p for p in rest if p != "__init__"]
    return ".".join([_FOLDER_PACKAGE[folder]] + parts)


def _floor_key(module: str) -> str:
    return max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)


def _points_down(mod: str, dep: str) -> bool:
    mine, theirs = _floor_key(mod), _floor_key(dep)
    return mine == theirs or FLOORS[theirs] < FLOORS[mine]


def _import_graph() -> dict[str, set[str]]:
    """Every specray module -> the specray modules it imports (anywhere in the file, lazy imports included;
    ``from specray import X`` of the lazy root package counts as the root)."""
    graph = {}
    for path in _py_files(*_FOLDER_PACKAGE):
        graph[_module_name(path)] = {n for n in _imports(path) if n.split(".")[0] == "specray"}
    return graph


def test_imports_point_down():
    graph = _import_graph()
    up = [(mod, dep) for mod, deps in graph.items() for dep in deps if dep != "specray" and not _points_down(mod, dep)]
    assert not up, f"imports pointing up a floor or sideways (see FLOORS): {sorted(up)}"


def test_no_import_cycle():
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(mod: str, path: list[str]) -> list[str] | None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                return path + [mod, dep]
            if dep in graph and not state.get(dep):
                cycle = visit(dep, path + [mod])
                if cycle:
                    return cycle
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if not state.get(mod):
            cycle = visit(mod, [])
            assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_core_never_names_the_cluster_package():
    """cluster registers its executor, remote drafter and engine client (entry points in pyproject.toml): the
    core finds them through specray.engine.plugins, never by a module path in a string."""
    bad = [(str(path.relative_to(ROOT)), line) for path in _py_files("core", "scheduler", "workers", "drafters")
           for line in _scan(path)[1]]
    assert not bad, f"strings naming specray.cluster below it: {bad}"


def test_cluster_backends_are_registered():
    from specray.engine import plugins

    for kind in plugins.GROUPS:
        assert "ray" in plugins.names(kind), kind
