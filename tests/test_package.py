"""The package as installed: its public names, its shipped data, its docstrings."""

import importlib
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
