"""Threads for the machine as it is now: fewer while another process holds a core.

llama.cpp's worker threads spin at every barrier of a step. When another busy process takes
one of their cores, the descheduled worker makes every barrier wait for a scheduler time
slice, and a step that costs 5 ms quiet costs 100 ms (measured on 2 cores beside one busy
process: 2.9 tok/s with 2 threads, 60 with 1). So a step many times slower than what this
machine's quiet steps cost, several steps in a row, is contention, not the model; and one
thread fewer than the cores left is faster than all of them.

:class:`ThreadPolicy` takes plain numbers: each step's measured seconds and what a quiet
machine's step of that shape costs at full threads (the engine's reference cost model,
which learns only from steps this policy calls quiet, so contention never becomes the
norm), and, where the operating system tells (Linux's ``/proc/loadavg``), whether the
machine is **crowded**: more tasks runnable than it has cores, so another process wants
one of this process's cores, while the others leave one free
(:func:`~llamax.engine.timing.threads.is_crowded`). It answers with the threads the next
step should use:

- **Not crowded** (the OS says so): a slow step is not another process (a cold cache,
  a page fault, a large batch the reference mispredicts), so nothing is judged and no
  probe runs: on a quiet machine the thread count never changes, and outputs stay what
  that count computes (a thread count changes llama.cpp's sums in some shapes).
- **Crowded**: a step counts as slow at :data:`CROWDED_SLOWDOWN` times its expected cost
  instead of :data:`SLOWDOWN` (the OS already says why it may be slow; beside one busy
  process on 2 cores a 2-thread step measured 2.9x its quiet cost, under the old bar).

- **Quiet** (full threads): :data:`NUM_SLOW_STEPS` steps in a row at least
  :data:`SLOWDOWN` times their expected cost mean contention: the threads are halved.
- **Contended** (fewer threads): a step at ``n`` of ``full`` threads is expected to cost at
  most ``full / n`` times the full-thread one (perfect scaling, the most a thread fewer can
  cost), and a run of steps slower than :data:`SLOWDOWN` times *that* halves them again.
- **Probes.** Whether the other process has gone cannot be seen with fewer threads (they
  fit beside it), so now and then one step runs at twice the threads (at most ``full``):
  within :data:`EXIT_SLOWDOWN` of its expected cost, or at most :data:`PROBE_WIN` times
  the cost (relative to expected) of the steps since the last probe, the higher count is
  kept (the machine may still be busy, without the collapse: then what is faster now
  wins, and until the next down-probe a step counts as slow only when it is slower than
  the lower count's steps were, over :data:`PROBE_WIN`); slower, the policy goes back
  down. A failed probe is as slow as a contended step, so probes are
  spaced by at least :data:`MIN_PROBE_GAP` steps *and* by enough seconds that failed
  probes take at most :data:`PROBE_SHARE` of the time: the hysteresis between the two
  thresholds and the spacing keep the count from flapping.
- **Down-probes.** A reference that learned on an already busy machine (a calibration
  timed beside a busy process, or contention from the first step) takes contention for the
  norm. So at full threads, after :data:`MIN_PROBE_GAP` steps and then every
  :data:`DOWN_PROBE_GAP`, one step runs at half the threads. Quiet, it costs at least what
  the full-thread step does (at most ``full / half`` times: on 2 cores, under 0.4% of the
  time). If it costs under :data:`DOWN_WIN` times the full-thread expectation, fewer threads
  are faster: the policy moves down, and :attr:`StepVerdict.reference_scale` tells the
  caller to rescale its reference to what the probe showed (with perfect scaling).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CROWDED_SLOWDOWN",
    "DOWN_PROBE_GAP",
    "DOWN_WIN",
    "EXIT_SLOWDOWN",
    "MIN_EXCESS_S",
    "MIN_PROBE_GAP",
    "NUM_SLOW_STEPS",
    "PROBE_SHARE",
    "PROBE_WIN",
    "SLOWDOWN",
    "StepVerdict",
    "ThreadPolicy",
]

SLOWDOWN = 3.0
"""A step at least this many times slower than expected is a slow step (where the OS does
not tell whether the machine is crowded)."""
CROWDED_SLOWDOWN = 1.5
"""The same on a machine the OS says is crowded."""
NUM_SLOW_STEPS = 3
"""Slow steps in a row that mean contention."""
EXIT_SLOWDOWN = 1.5
"""A probe at most this many times slower than expected means the cores are free again."""
MIN_PROBE_GAP = 16
"""Fewest steps between two probes."""
DOWN_PROBE_GAP = 256
"""Steps at full threads between two down-probes."""
DOWN_WIN = 0.5
"""A down-probe this much faster than the full-thread expectation means fewer threads win."""
PROBE_WIN = 0.8
"""A probe at most this fraction of the lower count's recent cost keeps the higher count."""
PROBE_SHARE = 0.05
"""The most of the time spent with fewer threads that failed probes may take."""
MIN_EXCESS_S = 0.001
"""A step must also be this many seconds over its expected cost to count as slow (a 50 us
step that took 200 us is noise, not contention)."""


@dataclass(frozen=True, slots=True)
class StepVerdict:
    """What :meth:`ThreadPolicy.observe` concluded from one step."""

    n_threads: int
    """Threads the next step should use."""
    is_quiet: bool
    """The step ran at full threads, not slow, on a machine not known to be crowded: a
    reference model may learn from it."""
    is_news: bool = False
    """This step started or ended contention (worth a log line)."""
    reference_scale: float = 1.0
    """Multiply the reference's costs by this: a down-probe showed they were learned on a
    busy machine."""


@dataclass(slots=True)
class ThreadPolicy:
    """Chooses each step's thread count from measured against expected step seconds.

    Args:
        full: the threads a quiet machine uses (the most this policy ever asks for).
    """

    full: int
    n_threads: int = 0
    """Threads the next step uses."""
    num_thread_changes: int = 0
    """Times the thread count changed (probes included)."""
    num_slow: int = 0
    """Slow steps in a row at the current count."""
    _stable: int = 0  # the count a probe returns to when it fails
    _is_probe: bool = False  # the next observed step is a probe
    _num_since_probe: int = 0
    _seconds_since_probe: float = 0.0
    _ratio_since_probe: float = 0.0  # sum of measured / expected (full threads) since then
    _bar: float = 0.0  # a higher slowdown bar after a probe won on a busy machine (0: none)
    _last_probe_s: float = 0.0  # what the latest failed probe cost
    _is_down_probe: bool = False
    _num_until_down_probe: int = MIN_PROBE_GAP

    def __post_init__(self) -> None:
        if self.full < 1:
            raise ValueError(f"full must be >= 1, got {self.full}")
        self.n_threads = self.n_threads or self.full
        self._stable = self.n_threads

    @property
    def is_contended(self) -> bool:
        """Whether the policy has moved below full threads (a probe step included)."""
        return self._stable < self.full

    def observe(
        self, expected_s: float, measured_s: float, crowded: bool | None = None
    ) -> StepVerdict:
        """Judge one step run at :attr:`n_threads` that a quiet machine would run in
        ``expected_s`` at full threads, ``crowded`` as the OS told right after it (None:
        it does not tell); return the threads for the next one."""
        n = self.n_threads
        allowed = expected_s * self.full / n  # the most fewer threads may cost, quiet
        if self._is_probe:
            return self._end_probe(expected_s, measured_s, allowed)
        if self._is_down_probe:
            return self._end_down_probe(expected_s, measured_s)
        bar = max(self._bar, CROWDED_SLOWDOWN if crowded else SLOWDOWN)
        is_slow = (
            crowded is not False
            and measured_s >= bar * allowed
            and measured_s - allowed >= MIN_EXCESS_S
        )
        self.num_slow = self.num_slow + 1 if is_slow else 0
        quiet = n == self.full and not is_slow and not crowded
        if self.num_slow >= NUM_SLOW_STEPS and n > 1:
            was_contended = self.is_contended
            self._move(max(1, n // 2))
            self._stable = self.n_threads
            self._reset_probe_clock(0.0)
            return StepVerdict(self.n_threads, quiet, is_news=not was_contended)
        if self.is_contended:
            self._num_since_probe += 1
            self._seconds_since_probe += measured_s
            self._ratio_since_probe += measured_s / max(expected_s, 1e-9)
            if self._is_probe_due():
                self._is_probe = True
                self._move(min(self.full, 2 * n))
        elif n > 1 and crowded is not False:  # a quiet machine is never probed
            self._num_until_down_probe -= 1
            if self._num_until_down_probe <= 0:
                self._bar = 0.0  # what the lower count costs may have changed
                self._is_down_probe = True
                self._move(n // 2)
        return StepVerdict(self.n_threads, quiet)

    def _end_down_probe(self, expected_s: float, measured_s: float) -> StepVerdict:
        self._is_down_probe = False
        self._num_until_down_probe = DOWN_PROBE_GAP
        if measured_s < DOWN_WIN * expected_s:  # fewer threads won: the reference is busy
            self._stable = self.n_threads
            self._reset_probe_clock(0.0)
            scale = measured_s * self.n_threads / self.full / expected_s
            return StepVerdict(self.n_threads, False, is_news=True, reference_scale=scale)
        self._move(self.full)
        return StepVerdict(self.n_threads, False)

    def _is_probe_due(self) -> bool:
        return (
            self._num_since_probe >= MIN_PROBE_GAP
            and self._seconds_since_probe * PROBE_SHARE >= self._last_probe_s
        )

    def _end_probe(self, expected_s: float, measured_s: float, allowed: float) -> StepVerdict:
        self._is_probe = False
        lower = self._ratio_since_probe / max(self._num_since_probe, 1)  # the lower count's
        is_faster = measured_s / max(expected_s, 1e-9) <= PROBE_WIN * lower
        if (
            is_faster
            or measured_s <= EXIT_SLOWDOWN * allowed
            or measured_s - allowed < MIN_EXCESS_S
        ):
            self._stable = self.n_threads  # the cores are free: keep the higher count
            # the lower count cost ``lower``: going back down is worth it only when slower
            self._bar = lower / PROBE_WIN if is_faster else 0.0
            self._reset_probe_clock(0.0)
            self._num_until_down_probe = DOWN_PROBE_GAP
            is_full = self.n_threads == self.full
            return StepVerdict(self.n_threads, is_full, is_news=is_full)
        self._move(self._stable)
        self._reset_probe_clock(measured_s)
        return StepVerdict(self.n_threads, False)

    def _reset_probe_clock(self, probe_s: float) -> None:
        self.num_slow = 0
        self._num_since_probe = 0
        self._seconds_since_probe = 0.0
        self._ratio_since_probe = 0.0
        self._last_probe_s = probe_s

    def _move(self, n_threads: int) -> None:
        if n_threads != self.n_threads:
            self.n_threads = n_threads
            self.num_thread_changes += 1
