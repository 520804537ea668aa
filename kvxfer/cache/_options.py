"""``HostCache``'s construction arguments, checked before anything is built."""

from __future__ import annotations

import typing
from typing import Any

import numpy as np

from kvxfer.cache._arc import ARCPolicy
from kvxfer.cache._policy import CachePolicy, LRUPolicy, PolicyName
from kvxfer.cache._s3fifo import S3FIFOPolicy
from kvxfer.cache._store_tier import WriteThrough
from kvxfer.manager import KVCacheManager
from kvxfer.store import Sealer, Store

__all__ = ["check_namespace", "check_options", "check_write_through", "make_policy",
           "POLICIES"]

#: The policy each name builds.
POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy,
                                          "arc": ARCPolicy}
assert set(POLICIES) == set(typing.get_args(PolicyName))


def make_policy(policy: PolicyName | CachePolicy, capacity: int) -> CachePolicy:
    """The policy ``HostCache(policy=)`` names (or is given), bound to ``capacity``.

    Example:
        >>> make_policy("s3fifo", 8).name
        's3fifo'
        >>> make_policy("fifo", 8)
        Traceback (most recent call last):
        ...
        ValueError: Expected policy in ('lru', 's3fifo', 'arc') or a CachePolicy. Got 'fifo' of type str
    """
    if isinstance(policy, str) and policy in POLICIES:
        policy = POLICIES[policy]()
    elif not isinstance(policy, CachePolicy):
        raise ValueError(f"Expected policy in {typing.get_args(PolicyName)} or a "
                         f"CachePolicy. Got {policy!r} of type {type(policy).__name__}")
    policy.bind(capacity)
    return policy


def check_options(mgr: Any, store: Any, namespace: Any, write_through: Any,
                  auth_key: Any, encrypt: Any, allow_empty_namespace: Any = False,
                  write_back_on_close: Any = True) -> Sealer | None:
    """Refuses bad arguments, naming them; the sealer ``auth_key`` asks for, or None.

    Example:
        >>> check_options(None, None, "", False, None, False)
        Traceback (most recent call last):
        ...
        TypeError: mgr must be a KVCacheManager. Got NoneType
    """
    if not isinstance(mgr, KVCacheManager):
        raise TypeError(f"mgr must be a KVCacheManager. Got {type(mgr).__name__}")
    if store is not None and not isinstance(store, Store):
        raise TypeError(f"store must be a kvxfer.store.Store or None. Got "
                        f"{type(store).__name__}")
    if namespace is not None and not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str or None. Got {namespace!r} of type "
                        f"{type(namespace).__name__}")
    for name, flag in (("allow_empty_namespace", allow_empty_namespace),
                       ("write_back_on_close", write_back_on_close)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool. Got {flag!r} of type "
                            f"{type(flag).__name__}")
    check_namespace(namespace, store, allow_empty_namespace)
    namespace = namespace or ""
    try:
        namespace.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: no store could hold its keys
        raise ValueError(f"namespace={namespace!r} is not valid UTF-8 text: {e}") from None
    if check_write_through(write_through) != "never" and store is None:
        raise ValueError(f"write_through={write_through!r} needs a store")
    if encrypt and auth_key is None:
        raise ValueError("encrypt=True needs auth_key (the key material)")
    if auth_key is not None and store is None:
        raise ValueError("auth_key seals store blobs; it needs a store")
    if isinstance(auth_key, Sealer):  # a key with its previous ones (a rotation)
        if encrypt and not auth_key.encrypt:
            raise ValueError(f"encrypt=True, but auth_key={auth_key!r} does not encrypt: "
                             "build it with Sealer(key, encrypt=True, ...)")
        return auth_key
    return None if auth_key is None else Sealer(auth_key, encrypt=encrypt)


def check_namespace(namespace: str | None, store: Any, allow_empty: bool) -> None:
    """Refuses a missing or blank namespace over a store, unless ``allow_empty``.

    A store outlives the process, and its keys carry the KV geometry's fingerprint
    only: two models of one geometry (a fine-tune, another revision, another
    quantization of the weights) would serve each other's pages as verified hits.

    Example:
        >>> check_namespace(None, None, False)  # no store: nothing is shared
        >>> check_namespace("llama-3.1-8b@rev1:bf16:tok-v3", object(), False)
        >>> try:
        ...     check_namespace("", object(), False)
        ... except ValueError as e:
        ...     print(str(e)[:60])
        HostCache(namespace='') over a store: the store outlives thi
    """
    if store is None or allow_empty or (namespace is not None and namespace.strip()):
        return
    raise ValueError(
        f"HostCache(namespace={namespace!r}) over a store: the store outlives this "
        "process and its keys carry only the KV geometry's fingerprint, which another "
        "model of the same shapes shares (a fine-tune, another revision or "
        "quantization): its pages would come back as verified hits. Pass a namespace "
        "naming the model and revision, the weights' dtype and quantization, the "
        "tokenizer and anything else that changes the KV, or allow_empty_namespace=True "
        "to share pages with every model of this geometry on purpose")


def check_write_through(value: Any) -> WriteThrough:
    """``HostCache(write_through=)`` as one of its forms (``True`` and ``False``, the
    older spelling, are ``"always"`` and ``"never"``).

    Example:
        >>> check_write_through(True), check_write_through("never"), check_write_through(2)
        ('always', 'never', 2)
        >>> check_write_through(0)
        Traceback (most recent call last):
        ...
        ValueError: Expected write_through 'always', 'never' or a hit count >= 1. Got 0 of type int
    """
    if isinstance(value, bool):
        return "always" if value else "never"
    if isinstance(value, str) and value in ("always", "never"):
        return value
    if isinstance(value, (int, np.integer)) and value >= 1:
        return int(value)
    raise ValueError(f"Expected write_through 'always', 'never' or a hit count >= 1. Got "
                     f"{value!r} of type {type(value).__name__}")
