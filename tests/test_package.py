"""The package as installed: its public names, its shipped data, its docstrings."""

import ast
import importlib
import pathlib
import pkgutil

import pytest

import kvxfer

MODULES = sorted(m.name for m in pkgutil.walk_packages(kvxfer.__path__, "kvxfer.")
                 if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", ["kvxfer"] + MODULES)
def test_every_public_name_exists_and_is_listed(name):
    mod = importlib.import_module(name)
    assert hasattr(mod, "__all__"), f"{name} has no __all__"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{name}.__all__ lists missing names {missing}"
    assert len(set(mod.__all__)) == len(mod.__all__), f"{name}.__all__ repeats a name"


@pytest.mark.parametrize("name", ["kvxfer"] + MODULES)
def test_docstrings_cite_nothing_outside_the_project(name):
    doc = importlib.import_module(name).__doc__ or ""
    for outside in ("DESIGN.md", "SEEDS.md"):
        assert outside not in doc, f"{name}'s docstring cites {outside}"


def test_the_top_level_surface_is_curated():
    assert set(kvxfer.__all__) >= {"KVCacheManager", "PageRef", "Layout", "inspect",
                                   "LoadResult", "TransferError", "LayoutError",
                                   "BudgetError", "IntegrityError", "__version__"}
    public = {n for n in vars(kvxfer) if not n.startswith("_")}
    modules = {n for n in public if isinstance(getattr(kvxfer, n), type(kvxfer))}
    assert public - modules <= set(kvxfer.__all__)


def test_shipped_data_is_found_by_name():
    from kvxfer import catalog, config

    assert {"tiny", "llama3-8b", "gemma-mixed"} <= set(config.builtin_names())
    assert {"seeds", "tpu_kv_derived"} <= set(catalog.builtin_names())
    assert len(catalog.load("seeds").entries) == 6


ROOT = pathlib.Path(kvxfer.__file__).parent


def _module_files(root):
    """``(dotted name, room, path)`` of every module of the package at ``root``; a
    module's room is the subpackage (or top-level module) it belongs to."""
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(["kvxfer", *parts]), (parts[0] if parts else ""), path


def _imports(tree, name, is_package):
    """Every ``kvxfer....`` name a module imports: ``import a.b``, ``from a import b``
    (as ``a.b``) and relative imports resolved against the module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node.lineno, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                up = here[:len(here) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            yield node.lineno, [f"{base}.{a.name}" for a in node.names]


def cross_room_private_imports(root=ROOT):
    """``module:line: imported name`` for each import of a private module or name of
    another room (``kvxfer.manager._pages`` from ``kvxfer.cache``, say). Top-level
    private modules (``kvxfer._check``, ``kvxfer._counters``) are shared by every room."""
    found = []
    for name, room, path in _module_files(root):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for line, targets in _imports(tree, name, path.name == "__init__.py"):
            for target in targets:
                parts = target.split(".")
                if parts[0] != "kvxfer" or len(parts) < 3 or parts[1].startswith("_") \
                        or parts[1] == room:
                    continue
                if any(p.startswith("_") for p in parts[2:]):
                    found.append(f"{name}:{line}: {target}")
    return found


def test_no_room_imports_another_rooms_private_modules():
    assert cross_room_private_imports() == []


def test_the_walker_finds_cross_room_private_imports(tmp_path):
    files = {
        "testing/_store.py": "from kvxfer.manager._pages import first_span\n",
        "cache/_front.py": "from kvxfer._counters import Counters\n"
                           "from kvxfer.manager import Blocks\nfrom . import _host\n"
                           "from ..manager._pages import decode\nfrom .._check import check_int\n",
        "manager/_load.py": "import kvxfer.manager._pages\nfrom kvxfer.manager._agree import x\n",
        "bench/_cli.py": "def f():\n    from kvxfer.store import _open\n",
        "metrics.py": "from kvxfer.cache._front import HostCache\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert cross_room_private_imports(tmp_path) == [
        "kvxfer.bench._cli:2: kvxfer.store._open",
        "kvxfer.cache._front:4: kvxfer.manager._pages.decode",
        "kvxfer.metrics:1: kvxfer.cache._front.HostCache",
        "kvxfer.testing._store:1: kvxfer.manager._pages.first_span"]


def _spans(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, node.end_lineno - node.lineno + 1


def test_the_cache_package_keeps_small_rooms():
    files = sorted((ROOT / "cache").glob("*.py"))
    assert {p.name for p in files} >= {"__init__.py", "_front.py", "_host.py",
                                       "_store_tier.py"}
    big = [f"{p.name}:{node.lineno} {node.name} ({n} lines)" for p in files
           for node, n in _spans(p)
           if n > (300 if isinstance(node, ast.ClassDef) else 60)]
    assert big == [], "classes over 300 lines or functions over 60 in kvxfer/cache/"
