"""README.md is a landing page that tells the truth: its links lead somewhere, its test
command tests the installed package from any directory, and it stays short.

Its code blocks run in tests/test_docs.py, with those of docs/.
"""

import importlib.metadata
import json
import os
import pathlib
import re
import shlex
import sys

import pytest

import kvxfer

ROOT = pathlib.Path(__file__).resolve().parents[1]  # .ci/run copies README.md beside tests/
README = ROOT / "README.md"


def _test_command() -> str:
    m = re.search(r"<!-- test-command -->\s*```sh\n(.*?)\n```", README.read_text(), re.S)
    assert m, "README.md has no sh block after <!-- test-command -->"
    return m.group(1).strip()


def test_readme_fits_on_a_few_screens():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move detail to docs/"
    assert max(len(line) for line in lines) <= 400, "a README line (a table cell?) runs long"


def test_readme_links_lead_to_files():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if "://" not in t]
    assert local, "README.md links to no page of docs/"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_the_test_command_reports_skips_and_slow_tests():
    argv = shlex.split(_test_command())
    # `python -m pytest` puts the current directory first on sys.path: from the
    # repository root that imports the source tree, not the installed package.
    assert argv[0] == "pytest", f"run the pytest script, not {argv[0]!r}: {argv}"
    assert "-ra" in argv and "--durations=15" in argv, argv
    assert "-p" in argv and argv[argv.index("-p") + 1] == "no:cacheprovider", argv


def _installed_copy() -> tuple[str, pathlib.Path | None]:
    """How kvxfer is installed, and where its package directory is: ("wheel", dir),
    ("editable", source dir) or ("none", None). The current directory is not searched:
    a source tree there (with a stale egg-info) is not an installation."""
    cwd = os.getcwd()
    path = [p for p in sys.path if p not in ("", cwd)]
    dist = next(iter(importlib.metadata.distributions(name="kvxfer", path=path)), None)
    if dist is None:
        return "none", None
    direct = dist.read_text("direct_url.json")
    info = json.loads(direct) if direct else {}
    if info.get("dir_info", {}).get("editable"):
        url = info.get("url", "")
        return "editable", pathlib.Path(url.removeprefix("file://")) / "kvxfer"
    return "wheel", pathlib.Path(dist.locate_file("kvxfer")).resolve()


def test_tests_import_the_installed_package():
    """The tests import the installed kvxfer, not a source tree that happens to be on
    sys.path (the current directory, under `python -m pytest`)."""
    imported = pathlib.Path(kvxfer.__file__).resolve().parent
    chosen = [pathlib.Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]
    if imported.parent in chosen and os.environ.get("KVXFER_REQUIRE_INSTALLED") != "1":
        pytest.skip(f"PYTHONPATH chooses the kvxfer under test ({imported})")
    kind, where = _installed_copy()
    if kind == "none":
        if os.environ.get("KVXFER_REQUIRE_INSTALLED") == "1":
            pytest.fail(f"KVXFER_REQUIRE_INSTALLED=1 but kvxfer is not installed "
                        f"(imported from {imported})")
        pytest.skip(f"kvxfer is not installed (imported from {imported})")
    assert imported == where.resolve(), (
        f"the tests imported kvxfer from {imported}, but the installed package ({kind}) "
        f"is {where}: run `pytest`, not `python -m pytest`, from the repository root")
