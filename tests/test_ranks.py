"""Two tensor-parallel ranks through HostCache: the same prefix, the same caches."""

import pathlib

from test_multiprocess import run_pair

WORKER = pathlib.Path(__file__).with_name("rank_worker.py")


def test_ranks_stay_identical_through_faults_and_close(tmp_path):
    a, b = run_pair(f"faults:{tmp_path}", worker=WORKER)
    for step in ("bitflip", "after", "zero_dma", "healed", "in_step_again"):
        assert {k: v for k, v in a[step].items() if k != "reasons"} == \
            {k: v for k, v in b[step].items() if k != "reasons"}, step
    # A bit flip on rank 1 only: both use 2 pages, both free page 3 and its store copy.
    assert a["bitflip"]["hit"] == 4 and a["bitflip"]["prefix"] == 2
    assert a["bitflip"]["freed"] == [2] and a["bitflip"]["exact"]
    assert "digest mismatch in layer 1" in b["bitflip"]["reasons"]["2"]
    assert a["bitflip"]["reasons"]["2"].startswith("proven bad on rank(s) [1]")
    assert a["after_bitflip"] == b["after_bitflip"] == {"host": [101, 102, 104],
                                                        "store": [101, 102, 104]}
    assert a["after"] == {"hit": 2, "prefix": 2, "freed": [], "reasons": {}, "exact": True}
    # A delivery fault on rank 1: a miss at page 2 on both, the page kept everywhere.
    assert a["zero_dma"]["hit"] == 4 and a["zero_dma"]["prefix"] == 2
    assert a["zero_dma"]["freed"] == [] and a["zero_dma"]["exact"]
    assert b["zero_dma"]["reasons"]["2"].startswith("transfer: digest mismatch in layer 0")
    assert a["after_zero_dma"] == b["after_zero_dma"] == {"host": [101, 102, 103, 104],
                                                          "store": [101, 102, 103, 104]}
    assert a["healed"]["prefix"] == 4 and a["healed"]["exact"]
    # Lookups of different requests in one turn fail on both ranks, by name; the
    # next turn pairs up again.
    for out in (a, b):
        assert out["out_of_step"]["lookup_error"] == "AgreementError"
        assert "rank 0: lookup of 4 pages (keys 0x65, 0x66, 0x67, 0x68)" in \
            out["out_of_step"]["error"]
        assert "rank 1: lookup of 3 pages (keys 0x65, 0x66, 0x3e7)" in \
            out["out_of_step"]["error"]
    assert a["in_step_again"]["prefix"] == 2
    assert a["stats"]["cache"] == {"bad_pages": 1, "transfer_faults": 0}
    assert b["stats"]["cache"] == {"bad_pages": 1, "transfer_faults": 1}
    assert a["stats"]["mgr"] == {"pages_freed": 1, "transfer_faults": 0}
    assert b["stats"]["mgr"] == {"pages_freed": 1, "transfer_faults": 1}
    # Rank 0 closed first and waited for rank 1 rather than leaving it stranded.
    assert a["close_s"] >= 1.5 and b["close_s"] < 10


def test_loads_of_different_requests_raise_on_both_ranks(tmp_path):
    a, b = run_pair(f"mismatch:{tmp_path}", worker=WORKER)
    for out in (a, b):
        assert "the ranks took part for different requests (rank 0: load of 4 pages " \
               "(keys 0x65, 0x66, 0x67, 0x68; classes [0]); rank 1: load of 2 pages " \
               "(keys 0x65, 0x66; classes [0]))" in out["error"]
        assert out["next"] == 4


def test_a_stuck_rank_costs_the_others_their_deadline_and_pins_nothing(tmp_path):
    # tpu-sync #888: one stuck peer starved the others for up to 48 minutes. Here a
    # rank that stops answering costs each collective call of the others the
    # manager's agreement_timeout (2 s), then they go on with the rank named.
    a, b = run_pair(f"stuck:{tmp_path}", worker=WORKER)
    assert "rank(s) [1] did not answer within 2 s" in a["lookup"]
    assert "rank(s) [1] did not answer within 2 s" in a["load"]
    assert 1.5 <= a["lookup_s"] < 6 and 1.5 <= a["load_s"] < 6
    assert a["pinned"] == 0 and a["free_pages"] == 4 and a["cached"] == 4
    assert a["close_s"] < 8  # the cache's and the manager's meeting: 2 s each at most
    assert b["close_s"] < 8
