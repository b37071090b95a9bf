"""The fair share of sequence ids on plain keys (:mod:`llamax.engine.sched.fair_share`)."""

from __future__ import annotations

from llamax.engine.sched.fair_share import FairShare


def test_the_share_is_the_ids_over_the_requests_with_work() -> None:
    fair: FairShare[str] = FairShare(8)
    fair.count(["big"] * 8, ["a", "b", "a"])
    assert fair.share == 8 // 3 and fair.held == {"big": 8}
    assert fair.deprived == ["a", "b"]  # first come first, once each
    fair.count([], [])
    assert fair.share == 8 and fair.deprived == []
    fair.count(["x"] * 3, ["y"] * 20)
    assert fair.share == 4 and fair.deprived == ["y"]


def test_the_richest_above_its_share_gives_an_id_until_at_its_share() -> None:
    fair: FairShare[str] = FairShare(8)
    fair.count(["big"] * 6 + ["small"] * 2, ["new"])
    assert fair.share == 2
    taken = 0
    while (richest := fair.richest()) is not None:
        assert richest == "big"
        fair.add(richest, -1)
        taken += 1
    assert taken == 4 and fair.held == {"big": 2, "small": 2}


def test_a_request_at_its_share_goes_after_the_deprived() -> None:
    fair: FairShare[str] = FairShare(4)
    fair.count(["big"] * 4, ["big", "new"])
    assert fair.share == 2
    assert fair.is_over("big") and not fair.is_over("new")
    fair.count(["big"] * 4, ["big"])  # nobody else waits: no one is over
    assert not fair.is_over("big")


def test_forks_leave_an_id_for_each_other_deprived_request() -> None:
    fair: FairShare[str] = FairShare(8)
    fair.count(["n8"], ["n8", "a", "b"])
    assert fair.share == 2
    assert sorted(fair.others_deprived("n8")) == ["a", "b"]
    assert fair.num_forkable("n8", num_free_ids=7, num_others=2) == 5
    assert fair.num_forkable("n8", num_free_ids=7, num_others=0) == 7
    # never fewer than what the request lacks of its share
    assert fair.num_forkable("n8", num_free_ids=2, num_others=2) == 1
    fair.add("n8", 5)
    assert fair.num_forkable("n8", num_free_ids=2, num_others=2) == 0


def test_keys_equal_but_not_identical_are_one_request() -> None:
    """Issue 54 (9): fairness keys (``add_request(fair_key=...)``) are compared by value;
    a deprived key admitted since the count no longer takes ids from forks."""
    fair: FairShare[tuple[str, int]] = FairShare(4)
    batch, alone = ("batch", 1), ("alone", 2)
    fair.count([("batch", 1)] * 4, [("batch", 1)] * 196 + [("alone", 2)])
    assert fair.share == 2 and fair.held == {batch: 4}
    assert fair.deprived == [alone] and fair.richest() == batch
    assert fair.is_over(("batch", 1)) and not fair.is_over(("alone", 2))
    assert fair.others_deprived(("batch", 1)) == [alone]
    assert fair.num_forkable(batch, num_free_ids=1, num_others=1) == 0
    fair.admit(("alone", 2))
    assert fair.held[alone] == 1 and fair.others_deprived(batch) == []
