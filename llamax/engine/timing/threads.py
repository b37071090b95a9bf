"""The engine's thread count, following the machine (:mod:`llamax.engine.timing.contention`).

:class:`ThreadAdapter` judges each measured step against a reference cost model that
learns what steps cost at full threads on a quiet machine (from the calibration, if any,
then from the steps the policy calls quiet), so it never learns contention as the norm; it
sets the backend's threads for the next step and reports its own stats. Whether the
machine is crowded comes from the backend if it simulates a machine
(:class:`~llamax.backend.base.MachineLoad`, as the fake does), else from
:func:`runnable_tasks`.
"""

from __future__ import annotations

import logging

from ...backend.base import Backend, MachineLoad, Threaded
from ...stats import ThreadStats
from .calibration import Calibration
from .contention import ThreadPolicy
from .step_budget import StepCostModel, StepFeatures, Waste

__all__ = ["ThreadAdapter", "is_crowded", "runnable_tasks"]

_log = logging.getLogger("llamax")
_REFERENCE_WARMUP = 16  # quiet steps an uncalibrated reference learns before it judges
_LOADAVG = "/proc/loadavg"


def is_crowded(runnable: int, n_threads: int, cores: int) -> bool:
    """Whether fewer threads may help: more tasks runnable than ``cores`` (another process
    wants one of ours), but the others (``runnable`` less this process's ``n_threads``, all
    taken as runnable) leave at least one core. On a machine the others fill (measured on
    2 cores beside 2 busy processes: 125 tok/s at 2 threads, 81 at 1) each thread is a
    share of the machine, and fewer threads only get less of it."""
    return runnable > cores and runnable - n_threads < cores


def runnable_tasks() -> int | None:
    """Tasks runnable on this machine right now (Linux: ``/proc/loadavg``'s fourth field,
    ``running/total``; this process's own spinning workers included), or None where the
    OS does not tell."""
    try:
        with open(_LOADAVG, "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


class ThreadAdapter:
    """Threads for the machine as it is now, when ``adapt`` and the backend has more than
    one to lower.

    Args:
        backend: The backend whose threads change (if it is :class:`Threaded`).
        adapt: Whether to adapt at all (``adapt_threads``).
        waste: The step cost model's tile waste (the reference model counts it alike).
        calibration: This machine's measured step costs, which the reference starts from.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        adapt: bool,
        waste: Waste | None,
        calibration: Calibration | None,
    ) -> None:
        self._threaded = backend if isinstance(backend, Threaded) else None
        threaded = self._threaded
        adapts = adapt and threaded is not None and threaded.n_threads > 1
        self._policy = ThreadPolicy(threaded.n_threads) if adapts and threaded else None
        self._runnable = backend.runnable_tasks if isinstance(backend, MachineLoad) else None
        if self._runnable is None and runnable_tasks() is not None:
            self._runnable = runnable_tasks
        self._reference = StepCostModel(waste=waste)
        self._warmup = 0 if calibration is not None else _REFERENCE_WARMUP
        if calibration is not None:
            self._reference.start_from(calibration.coefficients)
        self._has_warned = False

    def stats(self) -> ThreadStats:
        """The thread count and the policy's counters now."""
        policy = self._policy
        return ThreadStats(
            self._threaded.n_threads if self._threaded is not None else 0,
            policy is not None and policy.is_contended,
            policy.num_thread_changes if policy is not None else 0,
        )

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """Judge one measured step for contention and set the next step's threads."""
        policy, backend = self._policy, self._threaded
        if policy is None or backend is None:
            return
        reference = self._reference
        if self._warmup:  # not yet known what a quiet step costs: learn, do not judge
            self._warmup -= 1
            reference.observe(features, seconds)
            return
        expected = reference.predict(features)
        runnable = self._runnable() if self._runnable is not None else None
        crowded = None if runnable is None else is_crowded(runnable, backend.n_threads, policy.full)
        verdict = policy.observe(expected, seconds, crowded)
        if verdict.is_quiet:
            reference.observe(features, seconds)
        if verdict.reference_scale != 1.0:  # it learned on a busy machine
            fixed, token, attention, rows = (
                c * verdict.reference_scale for c in reference.coefficients
            )
            reference.start_from((fixed, token, attention, rows))
        if verdict.is_news:
            level = logging.DEBUG if self._has_warned else logging.WARNING
            self._has_warned = True
            if policy.is_contended:
                _log.log(
                    level,
                    "steps run many times slower with %d threads than this machine's quiet "
                    "ones (another process holds a core?): computing with %d until it ends",
                    policy.full, verdict.n_threads,
                )  # fmt: skip
            else:
                _log.log(level, "the cores are free again: computing with %d threads", policy.full)
        if verdict.n_threads != backend.n_threads:
            backend.set_n_threads(verdict.n_threads)
