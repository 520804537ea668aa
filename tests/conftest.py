"""Test setup: several CPU devices, so sharded caches can be tested on one machine;
cheaper XLA:CPU code generation; a real redis-server for the store tests."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Most of the suite's time is XLA:CPU compiling small programs, much of that in LLVM.
# The tests check bytes and behaviour, never speed, so they compile with LLVM's
# optimisation level at 0: the same HLO (same layouts, aliasing, donation and
# fusions), cheaper machine code. (The older fusion emitters would save more, but they
# compute a bfloat16 ``x * 1`` through float32 and so change bits the default keeps:
# tests must run the code generation users run.) Set in the environment before JAX
# starts, so the processes the tests start (CLI, demo, multi-process) inherit it.
# KVXFER_TEST_XLA_DEFAULTS=1 keeps XLA's defaults.
CHEAP_CODEGEN = ("--xla_backend_optimization_level=0",)
if os.environ.get("KVXFER_TEST_XLA_DEFAULTS") != "1":
    _flags = os.environ.get("XLA_FLAGS", "").split()
    _names = {f.split("=")[0] for f in _flags}
    os.environ["XLA_FLAGS"] = " ".join(
        _flags + [f for f in CHEAP_CODEGEN if f.split("=")[0] not in _names])

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu(reason): relies on a fact of XLA:CPU (4 CPU "
                            "devices, the raw path's buffers, ...): skipped elsewhere")


def pytest_collection_modifyitems(config, items):
    """On another backend (a device check), tests marked ``cpu`` skip with their reason."""
    backend = jax.default_backend()
    if backend == "cpu":
        return
    for item in items:
        marker = item.get_closest_marker("cpu")
        if marker is not None:
            why = marker.args[0] if marker.args else "XLA:CPU only"
            item.add_marker(pytest.mark.skip(reason=f"on {backend}: {why}"))


@pytest.fixture(scope="session")
def redis_server():
    """The URL of a real redis-server started for the session (tests/redis_rig.py).

    Skips without redis-server on PATH or redis-py; fails instead when
    KVXFER_REQUIRE_REDIS=1 (CI).
    """
    import redis_rig

    redis_rig.require()
    with redis_rig.redis_server() as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster():
    """A real three-node Redis Cluster started for the session (``redis_rig.Cluster``:
    its ``spec``, and ``kill``/``restart`` of a node). A test that kills a node
    restarts it and waits for ``cluster_state:ok`` before it ends.

    Skips without redis-server, redis-cli or redis-py; fails instead when
    KVXFER_REQUIRE_REDIS=1 (CI).
    """
    import redis_rig

    redis_rig.require("redis-cli")
    with redis_rig.redis_cluster() as cluster:
        yield cluster
