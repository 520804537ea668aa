"""Test setup: several CPU devices, so sharded caches can be tested on one machine; a
real redis-server for the store tests."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)


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
