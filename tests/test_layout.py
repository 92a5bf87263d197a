"""The layout of DEVELOPERS.md: one `specray` package; no bare component module is importable."""

import ast
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


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            names.append("." * node.level + (node.module or ""))
    return names


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
