"""The package as installed: its public names, its shipped data, its docstrings."""

import ast
import importlib
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

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


def _requirements():
    """The package's requirement strings: pyproject.toml's beside tests/ (a checkout),
    else the installed distribution's (CI runs a copy of tests/ without it)."""
    pyproject = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
    if pyproject.exists():
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib
        return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    import importlib.metadata

    return importlib.metadata.requires("kvxfer")


def test_the_stated_jax_floor_is_the_one_the_code_checks():
    from kvxfer._requires import JAX_FLOOR

    floors = {}
    for req in _requirements():
        m = re.match(r"(jax|jaxlib)\s*>=\s*([0-9][^,;\s]*)\s*(?:;|$)", req)
        if m:
            floors[m.group(1)] = m.group(2)
    assert floors == {"jax": JAX_FLOOR, "jaxlib": JAX_FLOOR}
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f"jax and jaxlib {JAX_FLOOR} or newer" in readme


def test_an_older_jax_is_refused_naming_the_floor():
    from kvxfer._requires import JAX_FLOOR, JaxVersionError, jax_refusal, require_jax

    require_jax()  # the jax the tests run on
    assert issubclass(JaxVersionError, ImportError)
    assert jax_refusal({"jax": JAX_FLOOR, "jaxlib": "0.11.0.dev20260101"}) is None
    why = jax_refusal({"jax": "0.10.1", "jaxlib": "0.10.1"})
    assert f"jax and jaxlib {JAX_FLOOR} or newer" in why
    assert "this environment has jax 0.10.1, jaxlib 0.10.1" in why
    assert jax_refusal({"jax": JAX_FLOOR, "jaxlib": "0.9.2"}) is not None
    # Pre-releases and development releases of the floor come before it (PEP 440).
    for before in (f"{JAX_FLOOR}rc1", f"{JAX_FLOOR}b2", f"{JAX_FLOOR}.dev20260101",
                   f"{JAX_FLOOR}a1"):
        why = jax_refusal({"jax": before, "jaxlib": JAX_FLOOR})
        assert why is not None and f"has jax {before}, jaxlib {JAX_FLOOR}" in why, before
    for after in (f"{JAX_FLOOR}.post1", f"{JAX_FLOOR}+cuda12", f"{JAX_FLOOR}.0", "1.0rc1"):
        assert jax_refusal({"jax": after, "jaxlib": JAX_FLOOR}) is None, after
    with pytest.raises(ValueError, match="'nightly' \\(str\\) does not start"):
        jax_refusal({"jax": "nightly"})


def test_the_engine_refuses_to_import_under_an_older_jax():
    """``import kvxfer`` needs no JAX; what runs transfers fails on import, with the
    versions it needs, where the installed jax is older than the floor, and the command
    line says so on one line (exit 2)."""
    from kvxfer._requires import JAX_FLOOR

    code = ("import sys, jax, jaxlib\n"
            "jax.__version__ = jaxlib.__version__ = '0.10.1'\n"
            "import kvxfer\n"
            "from kvxfer import cli\n"
            "from kvxfer._requires import JaxVersionError\n"
            "for get in (lambda: kvxfer.KVCacheManager, lambda: __import__('kvxfer.cache')):\n"
            "    try:\n"
            "        get()\n"
            "    except JaxVersionError as e:\n"
            "        print(e)\n"
            "sys.exit(cli.main(['demo', '--quiet']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all("this environment has jax 0.10.1, jaxlib 0.10.1" in line
                                   for line in lines), (out.stdout, out.stderr)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"kvxfer demo: error: kvxfer needs jax and jaxlib {JAX_FLOOR} or newer"), out.stderr
