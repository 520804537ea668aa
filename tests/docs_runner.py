"""Runs the docs' code blocks, each in a process of its own, sharing one start-up.

Used by tests/test_docs.py: ``python docs_runner.py < jobs.json > results.json``.
Each job is ``{"id", "kind": "python" | "cli", "code" | "argv", "cwd"}``. The
runner imports JAX, numpy and kvxfer once (no JAX backend is started: no device, no
compiled program, no thread of JAX's), then forks a child per job, so every block
starts as a fresh process would after its imports: it may still choose its devices
(``jax.config.update("jax_num_cpu_devices", N)``) and XLA flags. A child runs the
block (``kind="python"``: the code as ``__main__``; ``"cli"``: ``kvxfer.cli.main``
with the argv), with stdout and stderr in files and its temporary files in a directory
of its own (removed when it ends), and exits with the block's status.
Results: ``{id: {"status", "stdout", "stderr", "seconds"}}``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

TIMEOUT_S = 300


def _child(job: dict, out: str, err: str, tmp: str) -> None:
    os.chdir(job["cwd"])
    # The block's temporary files (a docs example's ``tempfile.mkdtemp()``, "a
    # directory of yours") go where the runner removes them once the block ends.
    tempfile.tempdir = os.environ["TMPDIR"] = tmp
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    status = 0
    try:
        if job["kind"] == "python":
            sys.argv = [job["id"]]
            exec(compile(job["code"], job["id"], "exec"), {"__name__": "__main__"})
        else:
            from kvxfer import cli

            status = cli.main(job["argv"])
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # the block's failure, reported as its status
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # threads a block left running end with it


def _run(job: dict) -> dict:
    out, err = (os.path.join(job["cwd"], f".docs-runner.{n}") for n in ("out", "err"))
    tmp = tempfile.mkdtemp(prefix="kvxfer-docs-block-")
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(job, out, err, tmp)
    while True:
        done, wstatus = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - start > TIMEOUT_S:
            os.kill(pid, signal.SIGKILL)
            _, wstatus = os.waitpid(pid, 0)
            break
        time.sleep(0.02)
    status = os.waitstatus_to_exitcode(wstatus)
    shutil.rmtree(tmp, ignore_errors=True)
    texts = []
    for path in (out, err):
        with open(path, errors="replace") as f:
            texts.append(f.read())
        os.remove(path)
    return {"status": status, "stdout": texts[0], "stderr": texts[1],
            "seconds": time.monotonic() - start}


def main() -> None:
    jobs = json.load(sys.stdin)
    # What the blocks import; none of it starts a JAX backend.
    import jax  # noqa: F401
    import jax.numpy  # noqa: F401
    import numpy  # noqa: F401

    import kvxfer  # noqa: F401
    import kvxfer.cache  # noqa: F401
    import kvxfer.cli  # noqa: F401
    import kvxfer.metrics  # noqa: F401
    import kvxfer.store  # noqa: F401
    import kvxfer.testing  # noqa: F401

    sys.stdout.flush()
    results = {job["id"]: _run(job) for job in jobs}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
