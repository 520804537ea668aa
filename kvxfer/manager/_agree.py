"""Agreement between the processes of a job, round by round, without collectives.

Every load of a multi-process job ends with an agreement: the minimum over every
process of that load's verified prefix (``-1``: the load failed on that process),
and the union of the pages any process proved bad (so every rank frees them). A
``HostCache`` lookup agrees the same way on its hit length. Each round carries its
*subject*, a description of what it agrees on (the page keys in order, their count,
the slice classes): rounds whose subjects differ were two different requests paired
by mistake, and every rank raises ``AgreementError`` naming both sides instead of
agreeing on numbers that mean different things.
The agreement goes through the key-value store of JAX's distributed coordination
service (``jax.distributed``), not through a device collective, for two reasons:

* A device collective run on the manager's transfer thread can interleave with the
  engine's own multi-process programs differently on different ranks, and hang.
  Key-value requests are plain RPCs to the coordinator; they run no device program.
* A rank that never joins a collective (its ``load()`` raised in the call) pairs
  every later collective with the wrong load elsewhere. Here every load has a
  round number handed out in call order, whether the call succeeds or raises, so
  round ``r`` on one rank always meets round ``r`` on the others; a round that
  failed in the call still answers, with ``-1``. A rank that does not answer (it
  crashed, or its loads are out of step) is named in a ``TransferError`` after
  ``timeout`` seconds, never waited for forever.

Keys are ``kvxfer/agree/{agreement}/{round}/{rank}``, and the store stays bounded:
each rank posts its rounds in order, each only once it has finished every round
before it on this process (read every rank's key, or given up). So once a rank has
read every rank's key of round ``r``, every rank has finished every round before
``r``: no one will read a key of those rounds again, and the rank deletes its own
keys of them. At most two rounds of keys per rank are stored at any time.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from kvxfer._check import check_int
from kvxfer.engine import TransferError

__all__ = ["Agreement", "Agreed", "AgreementError", "describe_keys"]

log = logging.getLogger("kvxfer")

_KEY_PREFIX = "kvxfer/agree"
_SUBJECT_CHARS = 240  # of a subject's description posted (its hash is whole)
_ids = itertools.count()
_ids_lock = threading.Lock()


def _client() -> Any:
    """The coordination service client, or None when ``jax.distributed`` is not set up."""
    from jax._src import distributed
    return distributed.global_state.client


# The client raises jax.errors.JaxRuntimeError for every failure; the status code
# only shows as the start of its message ("DEADLINE_EXCEEDED: GetKeyValue() timed out").
def _is_not_found(e: Exception) -> bool:
    return str(e).startswith("NOT_FOUND")


def _is_deadline(e: Exception) -> bool:
    return str(e).startswith("DEADLINE_EXCEEDED")


class AgreementError(TransferError):
    """The processes of a job took part in one agreement round for different requests.

    Every rank whose round met a round of another subject raises it (so all of them
    do): the engine called ``load`` (or ``HostCache.lookup``) for different requests,
    or in a different order, on different ranks. The message names each side.

    Attributes:
      subjects: rank -> the description of what that rank's round was for.
    """

    def __init__(self, message: str, *, subjects: dict[int, str] | None = None):
        super().__init__(message)
        self.subjects = dict(subjects or {})


class Agreed(NamedTuple):
    """What the processes agreed on in one round.

    Attributes:
      value: the minimum of the values posted.
      bad: position -> the ranks that posted it as bad (union over every rank).
      flagged: whether any rank posted ``flag=True``.
    """

    value: int
    bad: dict[int, tuple[int, ...]]
    flagged: bool


def describe_keys(what: str, keys: Sequence[int], extra: str = "") -> str:
    """A round's subject: ``what`` and the count, the keys in order, and ``extra``.

    Example:
        >>> describe_keys("load", [11, 12], "classes [0]")
        'load of 2 pages (keys 0xb, 0xc; classes [0])'
    """
    shown = ", ".join(f"{k:#x}" for k in keys[:8]) + (", ..." if len(keys) > 8 else "")
    digest = ""
    if len(keys) > 8:  # the description is cut short: its hash tells requests apart
        h = hashlib.blake2b(b",".join(str(k).encode() for k in keys), digest_size=6)
        digest = f", hash {h.hexdigest()}"
    tail = f"; {extra}" if extra else ""
    return f"{what} of {len(keys)} pages (keys {shown}{digest}{tail})"


class Agreement:
    """Agrees with every process, round by round, on the minimum of a number.

    One per ``KVCacheManager`` and one per ``HostCache``. They are created in the
    same order on every process, so the n-th ``Agreement`` of each process has the
    same id everywhere and their keys meet. Each ``load()`` call takes a round with
    ``next_round()`` in call order (whether the call succeeds or raises) and answers
    it once with ``agree(round, value, subject=...)``, ``value=-1`` when the load
    failed on this process.

    In a single-process job ``agree`` returns ``value`` at once.

    Args:
      timeout: seconds ``agree`` waits for the other processes (and for this
        process's earlier rounds) before it raises ``TransferError``. The default,
        60 s, is shorter than ``jax.distributed``'s heartbeat timeout (100 s by
        default), so a rank stuck on a dead peer says so before JAX aborts it.

    Attributes:
      id: this agreement's number among those of its process (0, 1, ...); it names
        its keys, ``kvxfer/agree/{id}/{round}/{rank}``.
      timeout: as passed.

    Raises:
      TypeError, ValueError: ``timeout`` is not a finite number of seconds > 0.
      RuntimeError: several processes, but ``jax.distributed`` is not initialized.

    Example:
        >>> agreement = Agreement(timeout=5.0)
        >>> agreement.multiprocess
        False
        >>> first, second = agreement.next_round(), agreement.next_round()
        >>> (first, second)
        (0, 1)
        >>> agreement.agree(second, -1).value, agreement.agree(first, 3).value
        (-1, 3)
    """

    def __init__(self, *, timeout: float = 60.0) -> None:
        if isinstance(timeout, (bool, np.bool_)) or \
                not isinstance(timeout, (int, float, np.integer, np.floating)):
            raise TypeError(f"timeout={timeout!r} must be a number of seconds. Got "
                            f"{type(timeout).__name__}")
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be a finite number of seconds > 0")
        self.timeout = float(timeout)
        with _ids_lock:
            self.id = next(_ids)
        self._rank = jax.process_index()
        self._num_processes = jax.process_count()
        if self._num_processes > 1 and _client() is None:
            raise RuntimeError(
                f"a job of {self._num_processes} processes without jax.distributed: "
                "loads agree through its coordination service; call "
                "jax.distributed.initialize() first")
        self._cond = threading.Condition()
        self._issued = 0  # rounds [0, _issued) have been handed out
        self._done_below = 0  # every round below this has finished here
        self._claimed: set[int] = set()  # rounds >= _done_below whose agree was called
        self._finished: set[int] = set()  # rounds >= _done_below that finished
        self._posted: list[int] = []  # rounds whose own key may still be stored

    @property
    def multiprocess(self) -> bool:
        """Whether the job has several processes (``jax.process_count() > 1``)."""
        return self._num_processes > 1

    @property
    def rank(self) -> int:
        """This process's index (``jax.process_index()``)."""
        return self._rank

    def next_round(self) -> int:
        """Hands out the next round: call once per ``load()``, in call order.

        Returns:
          The round number (0, 1, 2, ...), the same for the same call on every process.
        """
        with self._cond:
            round_ = self._issued
            self._issued += 1
            return round_

    def agree(self, round: int, value: int, *, subject: str | None = None,
              bad: Collection[int] = (), flag: bool = False) -> Agreed:
        """The minimum of ``value`` over every process for ``round``, and what rides along.

        Call once per round, from any thread. Rounds are answered in order: this
        waits for this process's earlier rounds to finish first.

        Args:
          round: a round from ``next_round()`` not agreed before.
          value: an int >= 0, or ``-1`` for "the load failed on this process".
          subject: what the round agrees on (``describe_keys``); every rank must
            post the same one. None (a call that failed before it knew its request)
            meets any subject.
          bad: positions this process proved bad; the union comes back.
          flag: a yes/no any process may raise (``Agreed.flagged``).

        Returns:
          ``Agreed(value, bad, flagged)``: the minimum over every process (``value``
          itself in a single process), the bad positions by rank, the flag.

        Raises:
          TypeError, ValueError: ``round`` was not handed out or was agreed already;
            ``value`` is not an int >= -1.
          AgreementError: another rank's round had another subject.
          TransferError: a process did not answer within ``timeout`` seconds (named
            by rank), an earlier round of this process was never agreed, or the
            coordination service failed.

        Example:
            >>> agreement = Agreement()
            >>> agreement.agree(agreement.next_round(), 7, bad=[9]).value
            7
        """
        round = check_int(round, "round", minimum=0)
        value = check_int(value, "value", minimum=-1)
        bad = sorted({check_int(j, "bad position", minimum=0) for j in bad})
        with self._cond:
            if round >= self._issued:
                raise ValueError(f"round={round} was not handed out by next_round(); "
                                 f"rounds 0 to {self._issued - 1} were")
            if round < self._done_below or round in self._claimed:
                raise ValueError(f"round={round} was agreed already; each round is "
                                 "agreed once")
            self._claimed.add(round)
        post = {"value": value, "subject": subject, "bad": bad, "flag": bool(flag)}
        try:
            if not self.multiprocess:
                return _combine({self._rank: post})
            self._wait_for_earlier(round)
            posts = self._exchange(round, post)
        finally:
            self._finish(round)
        self._check_subjects(round, posts)
        return _combine(posts)

    def _check_subjects(self, round: int, posts: dict[int, dict[str, Any]]) -> None:
        subjects = {r: p["subject"] for r, p in posts.items() if p["subject"] is not None}
        if len(set(subjects.values())) > 1:
            sides = "; ".join(f"rank {r}: {s}" for r, s in sorted(subjects.items()))
            raise AgreementError(
                f"agreement {self.id} round {round}: the ranks took part for different "
                f"requests ({sides}); every rank must make the same calls in the same "
                "order", subjects=subjects)

    def _wait_for_earlier(self, round: int) -> None:
        # Posting round r only after every earlier round finished here is what makes
        # deleting old keys safe (module docstring). A round never agreed would stall
        # every later one: give up once no earlier round has finished for `timeout`.
        seen, deadline = None, 0.0
        with self._cond:
            while self._done_below < round:
                progress = self._done_below, len(self._finished)
                if progress != seen:
                    seen, deadline = progress, time.monotonic() + self.timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self._done_below, round)) - self._finished)
                    raise TransferError(
                        f"agreement {self.id} round {round}: round(s) {missing} before it "
                        f"were not agreed on this process (rank {self._rank}) within "
                        f"{self.timeout:g} s; every load must take part in the agreement, "
                        "in call order")
                self._cond.wait(left)

    def _exchange(self, round: int, post: dict[str, Any]) -> dict[int, dict[str, Any]]:
        client = _client()
        if client is None:
            raise TransferError(f"agreement {self.id} round {round}: jax.distributed was "
                                "shut down")
        deadline = time.monotonic() + self.timeout
        if post["subject"] is not None and len(post["subject"]) > _SUBJECT_CHARS:
            text = post["subject"]
            h = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
            post = dict(post, subject=f"{text[:_SUBJECT_CHARS]}... (hash {h})")
        try:
            client.key_value_set(self._key(round, self._rank), json.dumps(post))
        except jax.errors.JaxRuntimeError as e:
            raise TransferError(f"agreement {self.id} round {round}: could not post this "
                                f"rank's value to the coordination service: {e}") from e
        with self._cond:
            self._posted.append(round)
        posts, missing = {self._rank: post}, []
        for rank in range(self._num_processes):
            if rank == self._rank:
                continue
            text = self._read(client, round, rank, deadline)
            if text is None:
                missing.append(rank)
                continue
            posts[rank] = _parse(text, f"agreement {self.id} round {round}: rank {rank}")
        if missing:
            raise TransferError(
                f"agreement {self.id} round {round}: rank(s) {missing} did not answer "
                f"within {self.timeout:g} s (a process crashed, or its loads are out of "
                "step with this one's)")
        self._delete_before(client, round)
        return posts

    def _read(self, client: Any, round: int, rank: int, deadline: float) -> str | None:
        """Rank ``rank``'s value for ``round``, or None if it is not there by ``deadline``."""
        key = self._key(round, rank)
        left_ms = int((deadline - time.monotonic()) * 1000)
        try:
            if left_ms > 0:
                return client.blocking_key_value_get(key, left_ms)
            return client.key_value_try_get(key)  # time is up: only what is there now
        except jax.errors.JaxRuntimeError as e:
            if _is_deadline(e) or _is_not_found(e):
                return None
            raise TransferError(f"agreement {self.id} round {round}: reading rank "
                                f"{rank}'s value failed: {e}") from e

    def _delete_before(self, client: Any, round: int) -> None:
        # Every rank posted `round`, so every rank has finished all rounds before it.
        with self._cond:
            old = [r for r in self._posted if r < round]
            self._posted = [r for r in self._posted if r >= round]
        for r in old:
            try:
                client.key_value_delete(self._key(r, self._rank))
            except jax.errors.JaxRuntimeError:  # a key left behind costs bytes, not results
                pass

    def _finish(self, round: int) -> None:
        with self._cond:
            self._finished.add(round)
            while self._done_below in self._finished:
                self._finished.discard(self._done_below)
                self._claimed.discard(self._done_below)
                self._done_below += 1
            self._cond.notify_all()

    def meet(self, what: str) -> bool:
        """Waits until every process calls ``meet(what)`` on this agreement (``close``).

        A rank that finishes first then does not tear down the coordination service
        (rank 0 hosts it) while another rank still agrees on its last loads. Bounded
        by ``timeout``: a rank that never comes is logged, not waited for forever.

        Returns:
          Whether every process came (True at once in a single process).
        """
        if not self.multiprocess:
            return True
        client = _client()
        if client is None:
            return False
        try:
            client.wait_at_barrier(f"{_KEY_PREFIX}/{self.id}/{what}",
                                   int(self.timeout * 1000))
        except jax.errors.JaxRuntimeError as e:
            log.warning("agreement %d: not every rank reached %s within %g s: %s",
                        self.id, what, self.timeout, e)
            return False
        return True

    def _key(self, round: int, rank: int) -> str:
        return f"{_KEY_PREFIX}/{self.id}/{round}/{rank}"

    def __repr__(self) -> str:
        return (f"Agreement(id={self.id}, rank={self._rank} of {self._num_processes}, "
                f"rounds handed out={self._issued}, timeout={self.timeout:g} s)")


def _parse(text: str, where: str) -> dict[str, Any]:
    """A posted round, checked."""
    try:
        post = json.loads(text)
        ok = isinstance(post, dict) and isinstance(post.get("value"), int) and \
            isinstance(post.get("bad"), list) and \
            all(isinstance(j, int) and j >= 0 for j in post["bad"]) and \
            isinstance(post.get("subject"), (str, type(None))) and \
            isinstance(post.get("flag"), bool)
    except ValueError:
        ok = False
    if not ok:
        raise TransferError(f"{where} posted {text[:200]!r}, not a kvxfer agreement round "
                            "(another kvxfer version on that rank?)")
    return post


def _combine(posts: dict[int, dict[str, Any]]) -> Agreed:
    bad: dict[int, list[int]] = {}
    for rank, post in sorted(posts.items()):
        for j in post["bad"]:
            bad.setdefault(j, []).append(rank)
    return Agreed(min(p["value"] for p in posts.values()),
                  {j: tuple(r) for j, r in sorted(bad.items())},
                  any(p["flag"] for p in posts.values()))
