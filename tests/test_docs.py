"""Every code block of README.md and docs/ runs as it is printed.

A block is a fenced block of README.md or of a page under docs/. What happens to it:

* ```python: run in a process of its own on the CPU backend, in an empty temporary
  directory; it must exit 0 (the blocks assert what they show). When the block after
  it is a ```text block marked ``<!-- output -->``, its stdout must be that text.
  A python block whose first line starts with ``# sketch:`` (saying what it needs that
  the reader has: an engine, its caches) is only compiled.
* ```sh: when marked ``<!-- run -->``, every line is a ``kvxfer`` command, run in
  an empty temporary directory and expected to exit 0 (``<!-- exit: N -->``: the last
  one exits N); otherwise it must be marked ``<!-- not run: why -->`` or be README's
  ``<!-- test-command -->`` (what CI runs).
* ```text blocks are output or pictures, not code.

The blocks run through tests/docs_runner.py, which imports JAX and kvxfer once and
forks a process per block (no JAX backend is started before the fork), so each block
starts as a fresh process would, without paying for the imports again.

No block may name an absolute path (a reader's system is not ours to write: sketches
use a temporary directory too). Blocks that need several devices ask for them
themselves (``jax.config.update("jax_num_cpu_devices", N)`` before any array exists).

The pages are found beside tests/: in the checkout, or in the copy ``.ci/run`` makes
(it copies README.md and docs/ beside tests/).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LANGS = ("python", "sh", "text")
_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_MARKER = re.compile(r"<!--\s*((?:(?!-->).)*?)\s*-->\s*\Z", re.S)
# A string literal, or a shell word, that starts at the root of a file system.
_ABSOLUTE = re.compile(r"""(?:["'=\s]|^)(?:file://)?/(?:var|etc|usr|opt|home|root|tmp|srv|mnt|path)\b""",
                       re.M)
TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    code: str
    marker: str | None
    output: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[pathlib.Path]:
    docs = ROOT / "docs"
    assert docs.is_dir(), f"no docs/ beside tests/ in {ROOT} (.ci/run copies it there)"
    found = [ROOT / "README.md", *sorted(docs.rglob("*.md"))]
    assert found[0].is_file(), f"no README.md beside tests/ in {ROOT}"
    return found


def blocks_of(path: pathlib.Path) -> list[Block]:
    """The fenced blocks of one page, with the marker comment just before each."""
    text = path.read_text()
    page = path.relative_to(ROOT).as_posix()
    found: list[Block] = []
    for m in _FENCE.finditer(text):
        lang = m.group(1) or "text"
        assert lang in LANGS, (f"{page}:{text.count(chr(10), 0, m.start()) + 1}: a ```{lang}"
                               f" block; the docs tests know {LANGS}")
        before = _MARKER.search(text, 0, m.start())
        marker = before.group(1) if before else None
        found.append(Block(page, text.count("\n", 0, m.start()) + 1, lang, m.group(2),
                           marker, None))
    # A ```text block marked <!-- output --> is the stdout of the python block before it.
    merged: list[Block] = []
    for b in found:
        if b.lang == "text" and b.marker == "output":
            assert merged and merged[-1].lang == "python", f"{b.id}: output of no python block"
            merged[-1] = dataclasses.replace(merged[-1], output=b.code)
        else:
            merged.append(b)
    return merged


ALL = [b for p in pages() for b in blocks_of(p)]
CODE = [b for b in ALL if b.lang != "text"]


def _env() -> dict[str, str]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # The blocks import the kvxfer these tests test, wherever it comes from.
    import kvxfer
    src = str(pathlib.Path(kvxfer.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def _commands(block: Block) -> list[list[str]]:
    """The argv of each command of a <!-- run --> sh block (kvxfer commands only)."""
    argvs = []
    for line in block.code.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        argv = shlex.split(line, comments=True)
        assert argv[0] == "kvxfer" and not set(argv) & {"|", ">", ";", "&&", "||"}, (
            f"{block.id}: a run block holds kvxfer commands only: {line!r}")
        argvs.append(argv[1:])
    return argvs


def _jobs(block: Block, cwd: pathlib.Path) -> list[dict]:
    if block.lang == "python":
        return [{"id": block.id, "kind": "python", "code": block.code, "cwd": str(cwd)}]
    return [{"id": f"{block.id}#{n}", "kind": "cli", "argv": argv, "cwd": str(cwd)}
            for n, argv in enumerate(_commands(block))]


def _runs(block: Block) -> bool:
    if block.lang == "python":
        return not block.code.startswith("# sketch:")
    return block.lang == "sh" and (block.marker == "run"
                                   or re.fullmatch(r"exit: \d+", block.marker or "") is not None)


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> dict[str, dict]:
    """Runs the blocks the selected tests ask about, in one runner: id -> result."""
    wanted = {item.callspec.params["block"].id: item.callspec.params["block"]
              for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")
              and isinstance(item.callspec.params.get("block"), Block)}
    jobs = []
    for block in wanted.values():
        # A block naming a system path fails its own test and is never run: it would
        # write there.
        if _runs(block) and not _ABSOLUTE.search(block.code):
            jobs += _jobs(block, tmp_path_factory.mktemp("block"))
    if not jobs:
        return {}
    proc = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name(
        "docs_runner.py"))], input=json.dumps(jobs), capture_output=True, text=True,
        env=_env(), timeout=TIMEOUT_S * 4)
    assert proc.returncode == 0, f"the docs runner failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout)


def _failed(what: str, r: dict) -> str:
    return f"{what} exited {r['status']}\n{r['stdout'][-3000:]}\n{r['stderr'][-3000:]}"


def test_the_pages_hold_code():
    assert len([b for b in CODE if b.lang == "python"]) >= 10, [b.id for b in CODE]


@pytest.mark.parametrize("block", CODE, ids=lambda b: b.id)
def test_no_block_names_a_system_path(block):
    bad = _ABSOLUTE.search(block.code)
    assert bad is None, f"{block.id} names an absolute path: {bad.group(0)!r}"


@pytest.mark.parametrize("block", [b for b in CODE if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_runs(block, results):
    if not _runs(block):  # a sketch: it must at least be Python
        assert block.output is None, f"{block.id}: a sketch shows no output"
        compile(block.code, block.id, "exec")
        return
    assert block.id in results, f"{block.id} was not run: it names an absolute path"
    r = results[block.id]
    assert r["status"] == 0, _failed(block.id, r)
    if block.output is not None:
        assert r["stdout"].rstrip() == block.output.rstrip(), (
            f"{block.id} printed {r['stdout']!r}, the page shows {block.output!r}")


@pytest.mark.parametrize("block", [b for b in CODE if b.lang == "sh"], ids=lambda b: b.id)
def test_shell_block_runs_or_says_why_not(block, results):
    marker = block.marker or ""
    if not _runs(block):
        assert marker == "test-command" or re.fullmatch(r"not run: \S.*", marker), (
            f"{block.id}: mark a sh block <!-- run -->, <!-- exit: N --> or "
            f"<!-- not run: why -->")
        return
    want = re.fullmatch(r"exit: (\d+)", marker)
    argvs = _commands(block)
    for n, argv in enumerate(argvs):
        assert f"{block.id}#{n}" in results, f"{block.id} was not run: it names an absolute path"
        r = results[f"{block.id}#{n}"]
        expected = int(want.group(1)) if want and n == len(argvs) - 1 else 0
        assert r["status"] == expected, _failed(f"{block.id}: kvxfer {shlex.join(argv)}"
                                                f" (expected {expected})", r)


def test_cli_page_documents_every_option():
    """docs/cli.md has a section per command naming each of its options."""
    from kvxfer import cli

    text = (ROOT / "docs" / "cli.md").read_text()
    sections = dict(re.findall(r"^## kvxfer (\w+)\n(.*?)(?=^## |\Z)", text, re.S | re.M))
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    assert set(sections) == set(sub.choices), (sorted(sections), sorted(sub.choices))
    for name, command in sub.choices.items():
        options = {o for a in command._actions for o in a.option_strings
                   if o.startswith("--") and o != "--help"}
        missing = sorted(o for o in options if not re.search(re.escape(o) + r"\b", sections[name]))
        assert not missing, f"docs/cli.md, kvxfer {name}: options not described: {missing}"


def test_the_blocks_leave_no_temporary_directories(tmp_path):
    """A block's ``tempfile.mkdtemp()`` (the docs' "a directory of yours") is removed
    once the block ends, as is everything the runner made for it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = ("import os, tempfile\n"
            "d = tempfile.mkdtemp()\n"
            "open(os.path.join(d, 'x'), 'w').write('x')\n"
            "print(os.path.isdir(d))\n")
    jobs = [{"id": "mkdtemp", "kind": "python", "code": code, "cwd": str(tmp_path)}]
    proc = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name(
        "docs_runner.py"))], input=json.dumps(jobs), capture_output=True, text=True,
        env={**_env(), "TMPDIR": str(tmp)}, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["mkdtemp"]["stdout"] == "True\n"
    assert list(tmp.iterdir()) == []
