"""The thread policy on plain numbers (:mod:`llamax.engine.timing.contention`)."""

from __future__ import annotations

import pytest

from llamax.engine.timing.contention import (
    DOWN_PROBE_GAP,
    EXIT_SLOWDOWN,
    MIN_PROBE_GAP,
    NUM_SLOW_STEPS,
    PROBE_SHARE,
    PROBE_WIN,
    SLOWDOWN,
    ThreadPolicy,
)

STEP = 0.01  # what a quiet step costs at full threads


def test_quiet_steps_keep_full_threads_but_for_rare_down_probes() -> None:
    policy = ThreadPolicy(4)
    threads = []
    for _ in range(MIN_PROBE_GAP + 3 * DOWN_PROBE_GAP):
        threads.append(policy.n_threads)
        verdict = policy.observe(STEP, STEP * (2.0 if policy.n_threads == 2 else 1.3))
        assert not verdict.is_news and verdict.reference_scale == 1.0
        assert verdict.is_quiet == (threads[-1] == 4)
    assert [i for i, n in enumerate(threads) if n != 4] == [
        MIN_PROBE_GAP + k * (DOWN_PROBE_GAP + 1) for k in range(3)
    ]
    assert set(threads) == {2, 4}
    assert not policy.is_contended and policy.num_thread_changes == 6


def test_a_down_probe_finds_contention_the_reference_learned_as_the_norm() -> None:
    """Busy from the start: the reference says a step costs what a contended one does, and
    only a step at fewer threads shows it is 10x too much."""
    policy = ThreadPolicy(2)
    for _ in range(MIN_PROBE_GAP - 1):
        assert policy.observe(STEP * 20, STEP * 20).n_threads == 2
    assert policy.observe(STEP * 20, STEP * 20).n_threads == 1  # the down-probe
    verdict = policy.observe(STEP * 20, STEP * 1.8)
    assert verdict.n_threads == 1 and verdict.is_news and policy.is_contended
    assert verdict.reference_scale == pytest.approx(1.8 / 2 / 20)
    assert policy.observe(STEP * 20 * verdict.reference_scale, STEP * 1.8).n_threads == 1


def test_a_run_of_slow_steps_halves_the_threads() -> None:
    policy = ThreadPolicy(2)
    for _ in range(NUM_SLOW_STEPS - 1):
        verdict = policy.observe(STEP, STEP * 20)
        assert verdict.n_threads == 2 and not verdict.is_quiet
    verdict = policy.observe(STEP, STEP * 20)
    assert verdict.n_threads == 1 and verdict.is_news
    assert policy.is_contended and policy.num_thread_changes == 1


def test_isolated_spikes_are_not_contention() -> None:
    policy = ThreadPolicy(2)
    for i in range(200):
        policy.observe(STEP, STEP * (20 if i % NUM_SLOW_STEPS == 0 else 1))
    assert policy.n_threads == 2 and not policy.is_contended


def test_tiny_steps_need_a_real_excess_to_be_slow() -> None:
    policy = ThreadPolicy(2)
    for _ in range(50):
        policy.observe(50e-6, 200e-6)  # 4x, but 150 us: noise
    assert policy.n_threads == 2


def test_steps_at_fewer_threads_are_judged_against_perfect_scaling() -> None:
    """At 4 of 8 threads a quiet step may cost twice the full one: that is not contention;
    many times more is, and halves the threads again."""
    policy = ThreadPolicy(8)
    for _ in range(NUM_SLOW_STEPS):
        policy.observe(STEP, STEP * 20)
    assert policy.n_threads == 4
    for _ in range(MIN_PROBE_GAP - 1):
        assert policy.observe(STEP, STEP * 2).n_threads == 4
    policy = ThreadPolicy(8)
    for _ in range(NUM_SLOW_STEPS):
        policy.observe(STEP, STEP * 20)
    for _ in range(NUM_SLOW_STEPS):
        verdict = policy.observe(STEP, STEP * 2 * SLOWDOWN * 1.1)
    assert verdict.n_threads == 2 and not verdict.is_news  # news was the first drop only


def _contend(policy: ThreadPolicy) -> None:
    for _ in range(NUM_SLOW_STEPS):
        policy.observe(STEP, STEP * 20)


def test_a_probe_runs_full_threads_after_the_gap_and_returns_when_quiet() -> None:
    policy = ThreadPolicy(2)
    _contend(policy)
    for _ in range(MIN_PROBE_GAP - 1):
        assert policy.observe(STEP, STEP * 1.6).n_threads == 1
    assert policy.observe(STEP, STEP * 1.6).n_threads == 2  # the probe
    verdict = policy.observe(STEP, STEP * EXIT_SLOWDOWN)
    assert verdict.n_threads == 2 and verdict.is_news and verdict.is_quiet
    assert not policy.is_contended
    assert policy.num_thread_changes == 2  # down, and the probe's way up (kept)


def test_a_failed_probe_goes_back_down_and_spaces_the_next_by_its_cost() -> None:
    policy = ThreadPolicy(2)
    _contend(policy)
    for _ in range(MIN_PROBE_GAP):
        policy.observe(STEP, STEP * 1.6)
    assert policy.n_threads == 2
    probe_s = STEP * 20
    verdict = policy.observe(STEP, probe_s)
    assert verdict.n_threads == 1 and not verdict.is_quiet and policy.is_contended
    # the next probe waits until failed probes are at most PROBE_SHARE of the time
    num_steps = 0
    while policy.observe(STEP, STEP * 1.6).n_threads == 1:
        num_steps += 1
        assert num_steps < 10_000
    assert (num_steps + 1) * STEP * 1.6 * PROBE_SHARE >= probe_s
    assert num_steps * STEP * 1.6 * PROBE_SHARE < probe_s


def test_probes_take_at_most_their_share_of_a_long_contention() -> None:
    policy = ThreadPolicy(2)
    _contend(policy)
    total_s = probes_s = 0.0
    for _ in range(20_000):
        probing = policy.n_threads == 2
        seconds = STEP * (20 if probing else 1.6)
        total_s += seconds
        probes_s += seconds if probing else 0.0
        policy.observe(STEP, seconds)
    assert policy.is_contended
    assert probes_s <= 1.1 * PROBE_SHARE * total_s


def test_one_thread_is_never_lowered() -> None:
    policy = ThreadPolicy(1)
    for _ in range(50):
        assert policy.observe(STEP, STEP * 50).n_threads == 1
    assert not policy.is_contended


def test_full_must_be_positive() -> None:
    with pytest.raises(ValueError, match="full must be >= 1"):
        ThreadPolicy(0)


def test_a_probe_faster_than_the_lower_count_wins_on_a_still_busy_machine() -> None:
    """The other process is still there but the collapse is gone (it sleeps at barriers, or
    shares fairly): 2 threads at 2.5x their quiet cost beat 1 thread at 3.6x."""
    policy = ThreadPolicy(2)
    _contend(policy)
    for _ in range(MIN_PROBE_GAP):
        policy.observe(STEP, STEP * 3.6)
    assert policy.n_threads == 2  # the probe
    verdict = policy.observe(STEP, STEP * 2.5)
    assert verdict.n_threads == 2 and not policy.is_contended
    policy = ThreadPolicy(2)
    _contend(policy)
    for _ in range(MIN_PROBE_GAP):
        policy.observe(STEP, STEP * 3.6)
    assert policy.observe(STEP, STEP * 3.6 * PROBE_WIN * 1.1).n_threads == 1  # not enough


def test_after_a_busy_probe_wins_only_steps_slower_than_the_lower_count_go_back_down() -> None:
    policy = ThreadPolicy(2)
    _contend(policy)
    for _ in range(MIN_PROBE_GAP):
        policy.observe(STEP, STEP * 3.6)
    policy.observe(STEP, STEP * 2.5)  # the probe wins
    for _ in range(DOWN_PROBE_GAP - 1):  # 3.5x: slow by SLOWDOWN, but faster than 1 thread
        assert policy.observe(STEP, STEP * 3.5).n_threads == 2
    policy = ThreadPolicy(2)
    _contend(policy)
    for _ in range(MIN_PROBE_GAP):
        policy.observe(STEP, STEP * 3.6)
    policy.observe(STEP, STEP * 2.5)
    for _ in range(NUM_SLOW_STEPS):
        policy.observe(STEP, STEP * 20)  # the collapse is back
    assert policy.n_threads == 1 and policy.is_contended
