"""One rank of the two-process ``Agreement`` tests (run by test_agree.py).

Usage: python agree_worker.py RANK PORT SCENARIO   (SCENARIO: rounds|crash)
Prints one JSON line with what this rank saw.
"""

import json
import os
import sys
import threading
import time

os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

rank, port, scenario = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=rank, initialization_timeout=60)

from jax._src import distributed  # noqa: E402

import kvxfer  # noqa: E402
from kvxfer.manager._agree import Agreement  # noqa: E402

client = distributed.global_state.client


def stored(key: str) -> bool:
    try:
        client.key_value_try_get(key)
    except Exception as e:  # NOT_FOUND
        assert "NOT_FOUND" in str(e), e
        return False
    return True


def keys_of(agreement: Agreement, round_: int) -> list[str]:
    return [f"kvxfer/agree/{agreement.id}/{round_}/{r}" for r in range(2)]


out: dict = {"rank": rank, "processes": jax.process_count()}
if scenario == "rounds":
    # Round 2: rank 1 failed its load. Sleeps make each rank the slow one in turn.
    values = {0: [5, 3, 7, 0, 9], 1: [4, 6, -1, 2, 9]}[rank]
    slow = {0: {3}, 1: {1, 4}}[rank]
    a = Agreement(timeout=20)
    out["multiprocess"] = a.multiprocess
    agreed, old_gone, own_previous_gone = [], [], []
    for i, v in enumerate(values):
        r = a.next_round()
        if i in slow:
            time.sleep(0.5)
        agreed.append(a.agree(r, v).value)
        if r >= 2:  # every rank has finished round r-2: all its keys are deleted
            old_gone.append(not any(stored(k) for k in keys_of(a, r - 2)))
        if r >= 1:  # this rank deletes its own key of round r-1 once round r is read
            own_previous_gone.append(not stored(keys_of(a, r - 1)[rank]))
    out.update(agreed=agreed, old_gone=old_gone, own_previous_gone=own_previous_gone)

    # The manager answers a load that raised on the caller's thread and the others on
    # its transfer thread: rank 0 answers round 5 late from a thread and round 6 at
    # once; round 6 still goes second and meets rank 1's round 6.
    r5, r6 = a.next_round(), a.next_round()
    order = []
    if rank == 0:
        def late():
            time.sleep(0.5)
            order.append(("r5", a.agree(r5, 8).value))
        t = threading.Thread(target=late)
        t.start()
        order.append(("r6", a.agree(r6, 1).value))
        t.join()
    else:
        order.append(("r5", a.agree(r5, 6).value))
        order.append(("r6", a.agree(r6, 2).value))
    out["order"] = order
    client.wait_at_barrier("agree-test-rounds", 30_000)
    out["left"] = sorted(k for k, _ in client.key_value_dir_get(f"kvxfer/agree/{a.id}/"))

    # A round handed out but never agreed stalls the next one: it fails, bounded.
    b = Agreement(timeout=2)
    out["ids"] = [a.id, b.id]
    b.next_round()
    start = time.monotonic()
    try:
        b.agree(b.next_round(), 0)
    except kvxfer.TransferError as e:
        out["unagreed_error"] = str(e)
    out["unagreed_s"] = time.monotonic() - start

    # Rounds of different requests never pair silently; a round without a subject
    # (a call that failed before it knew its request) meets any; bad positions and
    # flags come back from every rank.
    c = Agreement(timeout=20)
    try:
        c.agree(c.next_round(), 1, subject=f"load of 1 pages (keys {rank:#x})")
    except kvxfer.AgreementError as e:
        out["mismatch"] = {"error": str(e), "subjects": {str(k): v for k, v in
                                                          e.subjects.items()}}
    agreed = c.agree(c.next_round(), 3 + rank, subject="same" if rank else None,
                     bad=[rank + 4, 9], flag=rank == 1)
    out["rides_along"] = [agreed.value, {str(k): v for k, v in agreed.bad.items()},
                          agreed.flagged]
    print(json.dumps(out), flush=True)
    client.wait_at_barrier("agree-test-end", 30_000)
    jax.distributed.shutdown()
elif scenario == "crash":
    a = Agreement(timeout=5)
    out["first"] = a.agree(a.next_round(), 3 + rank).value
    if rank == 1:
        os._exit(3)  # dies before its next load, without a word
    start = time.monotonic()
    try:
        out["second"] = a.agree(a.next_round(), 4).value
    except kvxfer.TransferError as e:
        out["error"] = str(e)
    out["waited_s"] = time.monotonic() - start
    print(json.dumps(out), flush=True)
    # A clean shutdown would wait for the dead rank at the shutdown barrier.
    os._exit(0)
else:
    raise SystemExit(f"unknown scenario {scenario!r}")
