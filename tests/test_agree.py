"""``Agreement``: one number per load agreed over every process, through the KV store."""

import pathlib

import numpy as np
import pytest

from kvxfer.manager._agree import Agreement
from test_multiprocess import run_pair

WORKER = pathlib.Path(__file__).with_name("agree_worker.py")


def test_single_process_returns_the_value_at_once():
    a = Agreement(timeout=1)
    assert not a.multiprocess
    rounds = [a.next_round() for _ in range(3)]
    assert rounds == [0, 1, 2]
    # Out of order is fine: there is no one to wait for.
    assert [a.agree(2, -1).value, a.agree(0, 0).value,
            a.agree(1, np.int64(7)).value] == [-1, 0, 7]


def test_each_agreement_has_its_own_id():
    a, b = Agreement(), Agreement()
    assert b.id == a.id + 1
    assert a.next_round() == b.next_round() == 0


@pytest.mark.parametrize("timeout, error, match", [
    (0, ValueError, "timeout=0 must be a finite number of seconds > 0"),
    (-1.0, ValueError, "timeout=-1.0"),
    (float("inf"), ValueError, "timeout=inf"),
    (None, TypeError, "timeout=None must be a number of seconds"),
    (True, TypeError, "timeout=True"),
    ("5", TypeError, "timeout='5'"),
])
def test_bad_timeouts_are_named(timeout, error, match):
    with pytest.raises(error, match=match):
        Agreement(timeout=timeout)


def test_bad_rounds_and_values_are_named():
    a = Agreement()
    with pytest.raises(ValueError, match=r"round=0 was not handed out by next_round\(\)"):
        a.agree(0, 1)
    r = a.next_round()
    with pytest.raises(ValueError, match=r"round=1 was not handed out.*rounds 0 to 0 were"):
        a.agree(1, 1)
    with pytest.raises(ValueError, match="round=-1 must be >= 0"):
        a.agree(-1, 1)
    with pytest.raises(TypeError, match="round='0' must be an int"):
        a.agree("0", 1)
    with pytest.raises(ValueError, match="value=-2 must be >= -1"):
        a.agree(r, -2)
    with pytest.raises(TypeError, match="value=0.5 must be an int"):
        a.agree(r, 0.5)
    with pytest.raises(TypeError, match="value=True must be an int, not a bool"):
        a.agree(r, True)
    assert a.agree(r, 4).value == 4  # the rejected calls did not use the round up
    with pytest.raises(ValueError, match="round=0 was agreed already"):
        a.agree(r, 4)


def test_two_processes_agree_round_by_round_and_clean_up():
    a, b = run_pair("rounds", worker=WORKER)
    assert a["processes"] == b["processes"] == 2 and a["multiprocess"]
    # The minimum of each round, whichever rank was slower; rank 1's -1 in round 2
    # reaches both and does not disturb the rounds after it.
    assert a["agreed"] == b["agreed"] == [4, 3, -1, 0, 9]
    assert a["old_gone"] == b["old_gone"] == [True] * 3
    assert a["own_previous_gone"] == b["own_previous_gone"] == [True] * 4
    # Rank 0 answered round 6 first on its main thread and round 5 late from another
    # thread: each still met rank 1's answer to the same round, in round order.
    assert a["order"] == [["r5", 6], ["r6", 1]]
    assert b["order"] == [["r5", 6], ["r6", 1]]
    agreement = a["ids"][0]
    assert a["left"] == b["left"] == [f"kvxfer/agree/{agreement}/6/0",
                                      f"kvxfer/agree/{agreement}/6/1"]
    assert a["ids"] == b["ids"]
    for out in (a, b):
        assert f"agreement {a['ids'][1]} round 1: round(s) [0] before it were not " \
               "agreed on this process" in out["unagreed_error"]
        assert 1.5 <= out["unagreed_s"] < 30  # it waited for the timeout, and no longer
        assert "the ranks took part for different requests (rank 0: load of 1 pages " \
               "(keys 0x0); rank 1: load of 1 pages (keys 0x1))" in out["mismatch"]["error"]
        assert out["mismatch"]["subjects"] == {"0": "load of 1 pages (keys 0x0)",
                                               "1": "load of 1 pages (keys 0x1)"}
        assert out["rides_along"] == [3, {"4": [0], "5": [1], "9": [0, 1]}, True]


def test_a_crashed_process_is_named_within_the_timeout():
    a, b = run_pair("crash", worker=WORKER, exit_codes=(0, 3))
    assert b is None and a["first"] == 3
    assert "agreement 0 round 1: rank(s) [1] did not answer within 5 s" in a["error"]
    assert 4.5 <= a["waited_s"] < 30  # it waited for the timeout, and no longer
