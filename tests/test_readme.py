"""The README's examples run as they are printed."""

import pathlib
import re

import jax


def _block(marker: str) -> str:
    readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text()  # .ci/run copies README.md beside tests/
    m = re.search(re.escape(marker) + r"\s*```python\n(.*?)```", text, re.S)
    assert m, f"README.md has no python block after {marker}"
    return m.group(1)


def test_engine_example_runs(capsys):
    assert len(jax.devices()) >= 4
    exec(compile(_block("<!-- engine-example -->"), "README.md:engine-example", "exec"), {})
    out = capsys.readouterr().out
    assert "stored in slots [7, 8]" in out


def test_cache_events_example_runs(capsys):
    exec(compile(_block("<!-- cache-events-example -->"), "README.md:cache-events-example",
                 "exec"), {})
    out = capsys.readouterr().out
    assert out.strip() == "[(11, ['store']), (12, ['host', 'store']), (13, ['host', 'store'])]"
