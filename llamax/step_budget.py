"""Time-budgeted steps: size prefill chunks so running streams keep their pace.

A step's wall time is roughly ``c0 + c1·tokens + c2·attention``, where ``attention`` sums,
over the batch's tokens, the KV cells each one attends to. :class:`StepCostModel` learns
the three coefficients online from measured steps (recursive least squares with a
forgetting factor, so it follows a machine whose load changes). While sequences are
decoding, the scheduler gives prompts the largest chunks that add at most ``max_step_ms``
to the predicted time of the step's decode rows — Sarathi-Serve's idea: chunk size set by
the latency target, not by a token count. (Bounding the whole step instead would, with
many streams whose decode alone takes ``max_step_ms``, admit one short prompt a step.)
A prompt still advances by at least :data:`MIN_CHUNK` tokens a step,
so it is never starved. With nothing decoding, nobody waits for a token and the whole
``n_batch`` is used.

Nor is a long prompt slowed down much: its chunk is at least the smallest whose step is
predicted to cost at most :data:`FAIR_SLOWDOWN` times what its tokens cost when prefilled
alone (in ``n_batch`` chunks), see :meth:`StepCostModel.fair_chunk`. Each step costs the
decode rows and a fixed overhead on top of the chunk, so a chunk that is small next to them
makes the prefill many times slower than alone. That floor never stretches a step beyond
:data:`MAX_STRETCH` times ``max_step_ms`` on top of its decode rows.

Until the first steps are measured the model predicts from a prior (a two-core CPU and
SmolLM2-135M), so the very first steps are budgeted too. The fit's covariance is bounded:
with forgetting, many alike decode steps would otherwise inflate it in the directions
they do not excite, and the next prefill step would throw the coefficients far off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["FAIR_SLOWDOWN", "MAX_STRETCH", "MIN_CHUNK", "StepCostModel", "StepFeatures"]

MIN_CHUNK = 32
"""Fewest prompt tokens a prefilling sequence gets in a step that has decode rows."""
FAIR_SLOWDOWN = 1.25
"""A long prompt's chunk keeps its prefill at most this much slower than alone (predicted)."""
MAX_STRETCH = 2.0
"""The fair chunk may stretch a step to at most this many ``max_step_ms`` beyond its decode
rows."""

_SCALE = np.array([1.0, 1e-2, 1e-5])  # keeps the least-squares problem well conditioned
_PRIOR = np.array([0.004, 0.003, 5e-8]) / _SCALE  # 2-thread CPU: 4 ms + 3 ms/token + ...
_MIN_OBSERVATIONS = 4
_MAX_VARIANCE = 1.0  # bound on the covariance's eigenvalues: the prior's
_log = logging.getLogger("llamax.step_budget")


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """What a step's cost depends on."""

    num_tokens: int = 0
    """Tokens in the batch."""
    attention: int = 0
    """Sum over the batch's tokens of the KV cells each attends to."""

    def __add__(self, other: StepFeatures) -> StepFeatures:
        return StepFeatures(self.num_tokens + other.num_tokens, self.attention + other.attention)

    def vector(self) -> npt.NDArray[np.float64]:
        """``[1, tokens, attention]``, scaled."""
        vector: npt.NDArray[np.float64] = np.array([1.0, self.num_tokens, self.attention]) * _SCALE
        return vector


class StepCostModel:
    """Online fit of step seconds from :class:`StepFeatures`."""

    def __init__(self, *, forgetting: float = 0.95) -> None:
        self._theta = _PRIOR.copy()
        self._p = np.eye(3)  # prior uncertainty, in scaled units
        self._forgetting = forgetting
        self.num_observations = 0

    @property
    def is_ready(self) -> bool:
        """Whether enough steps were measured to trust predictions."""
        return self.num_observations >= _MIN_OBSERVATIONS

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """Update the fit with one measured step.

        Each equation is divided by the measured time, so the fit minimises *relative*
        errors: a 5 ms decode step counts as much as a 500 ms prefill step.
        """
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "step tokens=%d attention=%d predicted=%.4f measured=%.4f",
                features.num_tokens,
                features.attention,
                self.predict(features),
                seconds,
            )
        weight = 1.0 / max(seconds, 1e-4)
        x = features.vector() * weight
        px = self._p @ x
        gain = px / (self._forgetting + x @ px)
        self._theta = self._theta + gain * (seconds * weight - x @ self._theta)
        self._p = (self._p - np.outer(gain, px)) / self._forgetting
        if float(np.trace(self._p)) > _MAX_VARIANCE:
            # no wind-up in the directions recent steps did not excite
            values, vectors = np.linalg.eigh(self._p)
            self._p = (vectors * np.minimum(values, _MAX_VARIANCE)) @ vectors.T
        self.num_observations += 1

    def predict(self, features: StepFeatures) -> float:
        """Predicted seconds (coefficients clamped at zero, so a noisy fit stays sane)."""
        return float(features.vector() @ np.maximum(self._theta, 0.0))

    def largest_chunk(
        self,
        fixed: StepFeatures,
        attend: int,
        limit: int,
        budget_s: float,
        *,
        unified: bool,
        floor: int = MIN_CHUNK,
    ) -> int:
        """The most prompt tokens (at most ``limit``) a chunk attending to ``attend`` cells
        can add to a step already holding ``fixed`` while the predicted time stays within
        ``budget_s``; at least ``floor`` (or ``limit``).

        In a unified cache every token attends to the whole used span, so ``attend`` is
        that span (cells used plus the tokens already in the step) and it grows with the
        chunk for everybody; with streams the chunk's tokens attend to their own context.
        """
        lo, hi = min(limit, floor), limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            step = fixed + chunk_features(mid, attend, fixed, unified=unified)
            if self.predict(step) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def fair_chunk(
        self,
        fixed: StepFeatures,
        attend: int,
        limit: int,
        lone_tokens: int,
        *,
        unified: bool,
        slowdown: float = FAIR_SLOWDOWN,
    ) -> int:
        """The fewest prompt tokens (at most ``limit``) a chunk attending to ``attend``
        cells must have so that a step already holding ``fixed`` costs at most ``slowdown``
        times what those tokens cost prefilled alone in chunks of ``lone_tokens``
        (``limit`` when no chunk is that efficient)."""
        if limit <= 0:
            return 0
        theta = np.maximum(self._theta, 0.0)
        alone = chunk_features(lone_tokens, attend, StepFeatures(), unified=unified)
        per_token = float(alone.vector() @ theta) / max(lone_tokens, 1)
        k = np.arange(1, limit + 1, dtype=np.float64)
        attention = _chunk_attention(k, attend, fixed.num_tokens, unified=unified)
        features = np.stack(
            [np.ones_like(k), fixed.num_tokens + k, fixed.attention + attention], axis=1
        )
        step = (features * _SCALE) @ theta
        fits = np.flatnonzero(step <= slowdown * per_token * k)
        return int(fits[0]) + 1 if fits.size else limit


def chunk_features(num: int, attend: int, fixed: StepFeatures, *, unified: bool) -> StepFeatures:
    """Features ``num`` prompt tokens at context position ``attend`` add to a step."""
    return StepFeatures(num, _chunk_attention(num, attend, fixed.num_tokens, unified=unified))


_Num = TypeVar("_Num", int, npt.NDArray[np.float64])


def _chunk_attention(num: _Num, attend: int, fixed_tokens: int, *, unified: bool) -> _Num:
    if unified:  # everybody's span grows by ``num`` cells
        return num * (attend + num) + fixed_tokens * num
    return num * (attend + num // 2)
