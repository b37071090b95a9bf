"""Time-budgeted steps: size prefill chunks so running streams keep their pace.

A step's wall time is roughly ``c0 + c1·tokens + c2·attention + c3·row_attention``, where
``attention`` sums, over the batch's tokens, the KV cells each one attends to, and
``row_attention`` is the part of it in micro-batches of fewer than :data:`TILE_ROWS` query
rows. ggml's CPU flash attention computes such a micro-batch one query row at a time and a
larger one in tiles; over a long context a row costs several times more the first way
(measured with SmolLM2 at 3,400 cells: 60 prompt tokens plus 4 decode rows, 64 rows, took
0.48 s; 56 plus 4 took 0.84 s). So the cost of a chunk is not monotonic in its size, and the
chunk search below tries every size rather than bisecting. On backends without the cliff
``c3`` is learned as about zero. The tiles themselves are padded: a tile costs a whole one
however few rows it holds, so ``attention`` is counted with the padded rows' share
(:attr:`StepFeatures.tile_waste`, from :func:`tile_waste_table`) where the backend reports
its ``attention_tiles``. :class:`StepCostModel` learns
the four coefficients online from measured steps (recursive least squares with a
forgetting factor, so it follows a machine whose load changes). While sequences are
decoding, the scheduler gives prompts the largest chunks that add at most ``max_step_ms``
to the predicted time of the step's decode rows — Sarathi-Serve's idea: chunk size set by
the latency target, not by a token count. (Bounding the whole step instead would, with
many streams whose decode alone takes ``max_step_ms``, admit one short prompt a step.)
A prompt still advances by at least :data:`MIN_CHUNK` tokens a step,
so it is never starved. With nothing decoding, nobody waits for a token and the whole
``n_batch`` is used; so too when the only one-token rows compute prompts' last tokens (a
memory cut at checkpoints computes that token alone, a step after the rest): no reply is
streaming yet, and budgeting them cut the other prompts beside them, which kept four alike
agent conversations on a hybrid model out of step for good (1.16x the wall, issue 59).

Nor is a long prompt slowed down much. Each step costs the decode rows and a fixed
overhead on top of the chunk, so a chunk that is small next to them makes the prefill many
times slower than alone. When the budget's chunk is smaller than the *fair* one, the
smallest whose step is predicted to cost at most :data:`FAIR_SLOWDOWN` times what its
tokens cost prefilled alone (in ``n_batch`` chunks, see :meth:`StepCostModel.fair_chunk`),
the chunk gets the most that keeps the step within :data:`MAX_STRETCH` times the larger of
``max_step_ms`` and the decode rows' time: per token, a larger chunk is cheaper, and the
prompt's time to first token matters too. It is predicted within that over
:data:`OVERRUN`, which leaves the machine its margin (only a chunk making progress 1.5x
faster may use it): filled to ``MAX_STRETCH`` budgets, stretched steps measured up to
1.10-1.24x their prediction and every worst gap passed 0.5 s at 250 ms (2-core EPYC, issue
59). Measured (SmolLM2, 2 threads, 4 streams, a 3,400-token prompt): stopping at the fair
chunk made the prefill 1.48x slower than alone; stretching to ``MAX_STRETCH`` budgets
*beyond* the decode rows (0.53 s steps) gave worst gaps up to 0.87 s. The scheduler judges
fairness where a prompt will end as well as where it is, so a prompt whose late chunks
will need the stretch has it from its first chunk, and it splits a prompt's last chunks
evenly when that is cheaper (:meth:`StepCostModel.last_chunks`).

Until the first steps are measured the model predicts from a prior (a two-core CPU and
SmolLM2-135M), so the very first steps are budgeted too. The fit's covariance is bounded:
with forgetting, many alike decode steps would otherwise inflate it in the directions
they do not excite, and the next prefill step would throw the coefficients far off. An
eigenvalue past the bound is cut to :data:`_SPAN` steps of forgetting below it, so a run
of decode steps decomposes the covariance once in five steps, not at every one. The fit
runs at every step, just after a decode has flushed the caches: it is written in Python
floats (numpy calls on four numbers cost more than the arithmetic there), 0.06 ms a step
where numpy took 0.16-0.20 (issue 59, ``step-overhead/``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "FAIR_SLOWDOWN",
    "MAX_STRETCH",
    "MIN_CHUNK",
    "MIN_PROGRESS",
    "OVERRUN",
    "PRIOR_COEFFICIENTS",
    "TILE_ROWS",
    "StepCostModel",
    "StepFeatures",
    "micro_batch",
    "step_with_chunk",
    "tile_waste_table",
]

MIN_CHUNK = 32
"""Fewest prompt tokens a prefilling sequence gets in a step that has decode rows (but a
prompt's last :data:`TILE_ROWS` tokens may go in smaller chunks that fit the budget; see
:meth:`StepCostModel.largest_chunk`)."""
MIN_PROGRESS = 8
"""Fewest prompt tokens of such a smaller chunk."""
OVERRUN = 1.1
"""How far over its budget a chunk making progress 1.5 times faster may be
predicted (see :meth:`StepCostModel.largest_chunk`)."""
_FASTER = 1.5
FAIR_SLOWDOWN = 1.25
"""A long prompt's chunk keeps its prefill at most this much slower than alone (predicted)."""
MAX_STRETCH = 2.0
"""A chunk below its fair size may stretch a step to at most this many times the larger of
``max_step_ms`` and the step's decode rows' time."""

TILE_ROWS = 64
"""Query rows from which ggml's CPU flash attention uses its tiled kernel
(``GGML_FA_TILE_Q``); a micro-batch of fewer rows is computed row by row."""

Waste = npt.NDArray[np.float64]
"""``waste[n]``: the padded query rows, per row, the tiled kernel computes beside a
micro-batch of ``n`` rows (zero below :data:`TILE_ROWS`); see :func:`tile_waste_table`."""

_SCALES = (1.0, 1e-2, 1e-5, 1e-5)  # keeps the least-squares problem well conditioned
_SCALE = np.array(_SCALES)
PRIOR_COEFFICIENTS = (0.004, 0.003, 1e-6, 2e-6)
"""Seconds a step costs, fixed, per token, per attended cell and per cell attended row by
row, before anything was measured: a 2-thread CPU and SmolLM2-135M. A calibrated context
starts from its machine's own (:mod:`llamax.engine.timing.calibration`)."""
_PRIOR_SCALED = tuple(c / s for c, s in zip(PRIOR_COEFFICIENTS, _SCALES, strict=True))
_MIN_OBSERVATIONS = 4
_MAX_VARIANCE = 1.0  # bound on the covariance's eigenvalues: the prior's
_CALIBRATED_VARIANCE = 0.25  # a calibrated start is trusted more than the prior
_SPAN = 5  # steps of forgetting an eigenvalue cut at the bound takes to reach it again
_MIN_SPREAD, _OUTLIER_SPREADS = 0.05, 3.0
_log = logging.getLogger("llamax.engine.timing.step_budget")


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """What a step's cost depends on."""

    num_tokens: int = 0
    """Tokens in the batch."""
    attention: int = 0
    """Sum over the batch's tokens of the KV cells each attends to."""
    row_attention: int = 0
    """The part of ``attention`` in micro-batches of fewer than :data:`TILE_ROWS` rows."""
    tile_waste: int = 0
    """Attention the tiled kernel computes on top of ``attention``, for the unfilled rows
    of its tiles (see :func:`tile_waste_table`); costed as attention."""

    def __add__(self, other: StepFeatures) -> StepFeatures:
        return StepFeatures(
            self.num_tokens + other.num_tokens,
            self.attention + other.attention,
            self.row_attention + other.row_attention,
            self.tile_waste + other.tile_waste,
        )

    def vector(self, *, scaled: bool = True) -> npt.NDArray[np.float64]:
        """``[1, tokens, attention + tile_waste, row_attention]``, scaled (as the fit works)
        or not (to multiply with coefficients in seconds)."""
        vector: npt.NDArray[np.float64] = np.array(_values(self), dtype=np.float64)
        return vector * _SCALE if scaled else vector


def _values(features: StepFeatures) -> tuple[float, float, float, float]:
    """``[1, tokens, attention + tile_waste, row_attention]`` as Python floats: what the
    fit works on, and (as an array) :meth:`StepFeatures.vector`."""
    return (
        1.0,
        float(features.num_tokens),
        float(features.attention + features.tile_waste),
        float(features.row_attention),
    )


def _diagonal(value: float) -> list[list[float]]:
    """A 4x4 diagonal matrix of ``value``, as lists."""
    return [[value if i == j else 0.0 for j in range(4)] for i in range(4)]


class StepCostModel:
    """Online fit of step seconds from :class:`StepFeatures`.

    The fit is robust to spikes (a step 1.3-1.6x slower than its neighbours, seen on busy
    machines): once it is ready, a step slower than predicted counts at most three times
    the errors' running mean size, so one slow step moves the coefficients no more than a
    typical one would, while a machine that really became slower still moves them, step
    after step. From the prior that mean starts large (the first steps are far off and
    are learned from in full); from a calibration (:meth:`start_from`), small.
    """

    def __init__(self, *, forgetting: float = 0.95, waste: Waste | None = None) -> None:
        # The fit's state is in Python floats: :meth:`observe` runs at every step, right
        # after a decode has flushed the caches, where numpy calls on four numbers cost more
        # than the arithmetic (issue 59: 0.2 ms a step of 8-9 ms on SmolLM2 with numpy).
        self._theta = list(_PRIOR_SCALED)
        self._theta_clamped: npt.NDArray[np.float64] | None = None  # for the chunk searches
        self.waste = waste
        """The tiled kernel's waste by micro-batch rows (:func:`tile_waste_table`), or None."""
        self._p = _diagonal(_MAX_VARIANCE)  # prior uncertainty, in scaled units
        self._largest = _MAX_VARIANCE  # at least the covariance's largest eigenvalue
        self._forgetting = forgetting
        # an eigenvalue past the bound is cut to this, so that the next few steps cannot
        # pass the bound and need no eigendecomposition (one in _SPAN steps when decoding)
        self._cut_to = _MAX_VARIANCE * forgetting**_SPAN
        self._spread = 1.0  # running mean of |relative error|: from the prior, no clipping yet
        self.num_observations = 0
        self.num_clipped = 0
        """Steps whose error was clipped as outliers."""

    def start_from(self, coefficients: tuple[float, float, float, float]) -> None:
        """Start from measured coefficients (seconds: fixed, per token, per attended cell,
        per cell attended row by row) instead of the prior, and trust them more."""
        self._theta = [float(c) / s for c, s in zip(coefficients, _SCALES, strict=True)]
        self._theta_clamped = None
        self._p = _diagonal(_CALIBRATED_VARIANCE)
        self._largest = _CALIBRATED_VARIANCE
        self._spread = 0.1
        self.num_observations = max(self.num_observations, _MIN_OBSERVATIONS)

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """The current coefficients in seconds (fixed, per token, per attended cell, per
        cell attended row by row), clamped at zero as predictions use them."""
        t, s = self._theta, _SCALES
        return (
            max(t[0], 0.0) * s[0],
            max(t[1], 0.0) * s[1],
            max(t[2], 0.0) * s[2],
            max(t[3], 0.0) * s[3],
        )

    @property
    def is_ready(self) -> bool:
        """Whether enough steps were measured to trust predictions."""
        return self.num_observations >= _MIN_OBSERVATIONS

    @property
    def largest_variance(self) -> float:
        """The covariance's largest eigenvalue (scaled units), computed now; it never
        exceeds the prior's (no wind-up)."""
        return float(np.linalg.eigvalsh(np.array(self._p))[-1])

    def observe(self, features: StepFeatures, seconds: float) -> None:
        """Update the fit with one measured step.

        Each equation is divided by the measured time, so the fit minimises *relative*
        errors: a 5 ms decode step counts as much as a 500 ms prefill step.
        """
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "step tokens=%d attention=%d row_attention=%d tile_waste=%d "
                "predicted=%.4f measured=%.4f",
                features.num_tokens,
                features.attention,
                features.row_attention,
                features.tile_waste,
                self.predict(features),
                seconds,
            )
        weight = 1.0 / max(seconds, 1e-4)
        x = [v * s * weight for v, s in zip(_values(features), _SCALES, strict=True)]
        theta, p, forgetting = self._theta, self._p, self._forgetting
        # relative: (measured - predicted) / measured
        error = seconds * weight - sum(xi * ti for xi, ti in zip(x, theta, strict=True))
        if self.is_ready:  # a spike is a slow step: only errors that way are clipped
            bound = max(_MIN_SPREAD, _OUTLIER_SPREADS * self._spread)
            if error > bound:
                self.num_clipped += 1
                error = bound
            self._spread += 0.05 * (min(abs(error), bound) - self._spread)
        px = [sum(pij * xj for pij, xj in zip(row, x, strict=True)) for row in p]
        denominator = forgetting + sum(xi * pxi for xi, pxi in zip(x, px, strict=True))
        self._theta = [ti + pxi / denominator * error for ti, pxi in zip(theta, px, strict=True)]
        self._theta_clamped = None
        # pxi * pxj is pxj * pxi to the bit: the covariance stays exactly symmetric
        p = [
            [(pij - pxi * pxj / denominator) / forgetting for pij, pxj in zip(row, px, strict=True)]
            for row, pxi in zip(p, px, strict=True)
        ]
        # The update removes a positive semi-definite term before dividing by the
        # forgetting factor, so the largest eigenvalue grows at most that much a step.
        self._largest /= forgetting
        if self._largest > _MAX_VARIANCE:
            # no wind-up in the directions recent steps did not excite
            values, vectors = np.linalg.eigh(np.array(p))
            if values[-1] > _MAX_VARIANCE:
                values = np.minimum(values, self._cut_to)
                p = ((vectors * values) @ vectors.T).tolist()
            self._largest = float(values[-1])
        self._p = p
        self.num_observations += 1

    def predict(self, features: StepFeatures) -> float:
        """Predicted seconds (coefficients clamped at zero, so a noisy fit stays sane)."""
        return sum(v * c for v, c in zip(_values(features), self.coefficients, strict=True))

    def _clamped(self) -> npt.NDArray[np.float64]:
        """The coefficients in scaled units, clamped at zero, as an array (cached)."""
        if self._theta_clamped is None:
            self._theta_clamped = np.maximum(np.array(self._theta), 0.0)
        return self._theta_clamped

    def largest_chunk(
        self,
        fixed: StepFeatures,
        attend: int,
        limit: int,
        budget_s: float,
        *,
        unified: bool,
        floor: int = MIN_CHUNK,
        overrun: bool = True,
    ) -> int:
        """The most prompt tokens (at most ``limit``) a chunk attending to ``attend`` cells
        can add to a step already holding ``fixed`` while the predicted time stays within
        ``budget_s``, or (with ``overrun``) a chunk that makes progress at least 1.5x
        faster and is predicted within 1.1x the budget. When fewer than ``floor`` (or
        ``limit``) tokens fit: the cheapest step with at least ``floor``, so the prompt
        always advances (with ``overrun``, a chunk making progress 1.5x faster predicted
        within 1.1x of that step instead); or, for a tail of at most :data:`TILE_ROWS`
        tokens (computed row by row whatever its size), the chunk that fits if it has
        :data:`MIN_PROGRESS`.

        In a unified cache every token attends to the whole used span, so ``attend`` is
        that span (cells used plus the tokens already in the step) and it grows with the
        chunk for everybody; with streams the chunk's tokens attend to their own context.
        Every size is tried: crossing :data:`TILE_ROWS` can make a larger chunk cheaper.
        """
        if limit <= 0:
            return 0
        k, step = self._chunk_costs(fixed, attend, limit, unified=unified)
        fits = np.flatnonzero(step <= budget_s)
        best = int(fits[-1]) if fits.size else -1  # an index into k
        # Past the tiled kernel's threshold a chunk can make progress several times faster
        # than the largest that fits (over a long context, 60 tokens beside 4 decode rows
        # are computed in tiles, 20 row by row): such a chunk may overrun the budget a bit.
        if overrun:
            with np.errstate(divide="ignore", invalid="ignore"):
                rate = k / np.maximum(step, 1e-12)
            near = np.flatnonzero(step <= OVERRUN * budget_s)
            if near.size:
                fastest = int(near[np.argmax(rate[near])])
                if best < 0 or rate[fastest] >= _FASTER * rate[best]:
                    best = fastest
        floor = min(limit, floor)
        if best >= 0 and k[best] >= floor:
            return int(k[best])
        if floor == 0:
            return 0
        if best >= 0 and limit <= TILE_ROWS and k[best] >= MIN_PROGRESS:
            return int(k[best])  # a prompt's row-by-row tail: smaller steps that fit
        # Nothing of ``floor`` tokens fits: the cheapest step with at least that many (not
        # always the floor itself: a tiled chunk can cost less), the larger of equals; or,
        # as above, a chunk making progress 1.5x faster predicted within 1.1x of it (at the
        # end of a long prompt 32 tokens row by row cost nearly what 60 tiled cost).
        sizes, rest = k[floor - 1 :], step[floor - 1 :]
        cheapest = int(np.flatnonzero(rest <= rest.min() * (1 + 1e-9))[-1])
        if overrun:
            near = np.flatnonzero(rest <= OVERRUN * rest[cheapest])
            rate = sizes[near] / np.maximum(rest[near], 1e-12)
            fastest = int(near[np.argmax(rate)])
            if rate.max() >= _FASTER * sizes[cheapest] / max(rest[cheapest], 1e-12):
                return int(sizes[fastest])
        return int(sizes[cheapest])

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
        alone = step_with_chunk(
            StepFeatures(), lone_tokens, attend, unified=unified, waste=self.waste
        )
        per_token = self.predict(alone) / max(lone_tokens, 1)
        k, step = self._chunk_costs(fixed, attend, limit, unified=unified)
        fits = np.flatnonzero(step <= slowdown * per_token * k)
        return int(k[fits[0]]) if fits.size else limit

    def last_chunks(
        self,
        fixed: StepFeatures,
        attend: int,
        take: int,
        pending: int,
        budget_s: float,
        *,
        unified: bool,
    ) -> int:
        """This step's chunk of a prompt that ends within a few steps of ``take`` tokens.

        Taking ``take`` now can leave a last chunk so small that it is computed row by row
        (under :data:`TILE_ROWS` rows), which over a long context costs more than a tiled
        chunk twice its size. So when the prompt ends within 3 steps, those steps are
        priced both ways, largest chunk first or ``pending`` split evenly, and the cheaper
        plan's first chunk is returned; neither adds a step, and the even chunk must fit
        ``budget_s``.
        """
        steps = -(-pending // max(take, 1))
        if take >= pending or steps > 3:
            return take
        even = -(-pending // steps)
        if even == take or self._plan_s(fixed, attend, [even], unified) > budget_s:
            return take

        def plan_s(first: int) -> float:  # ``first``, then the rest evenly
            sizes = [first]
            for left in range(steps - 1, 0, -1):
                sizes.append(-(-(pending - sum(sizes)) // left))
            return self._plan_s(fixed, attend, sizes, unified)

        return even if plan_s(even) < plan_s(take) else take

    def _plan_s(self, fixed: StepFeatures, attend: int, chunks: list[int], unified: bool) -> float:
        """Predicted seconds of consecutive steps, each holding ``fixed`` and one chunk."""
        total = 0.0
        for chunk in chunks:
            features = step_with_chunk(fixed, chunk, attend, unified=unified, waste=self.waste)
            total += self.predict(features)
            attend += chunk + (fixed.num_tokens if unified else 0)
        return total

    def _chunk_costs(
        self, fixed: StepFeatures, attend: int, limit: int, *, unified: bool
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Chunk sizes 1..``limit`` and the predicted seconds of the step with each."""
        k = np.arange(1, limit + 1, dtype=np.float64)
        tokens, attention, rows, wasted = _with_chunk(
            fixed, k, attend, unified=unified, waste=self.waste
        )
        features = np.stack([np.ones_like(k), tokens, attention + wasted, rows], axis=1)
        step: npt.NDArray[np.float64] = (features * _SCALE) @ self._clamped()
        return k, step


def step_with_chunk(
    fixed: StepFeatures, num: int, attend: int, *, unified: bool, waste: Waste | None = None
) -> StepFeatures:
    """A step holding ``fixed``, plus ``num`` prompt tokens at context position ``attend``."""
    tokens, attention, rows, wasted = _with_chunk(fixed, num, attend, unified=unified, waste=waste)
    return StepFeatures(int(tokens), int(attention), int(rows), int(wasted))


def micro_batch(num_tokens: int, attention: int, *, waste: Waste | None = None) -> StepFeatures:
    """Features of one micro-batch: a unified cache's whole step, or one sequence's rows in
    a streams cache (each stream's rows are attended to apart)."""
    if num_tokens < TILE_ROWS:
        return StepFeatures(num_tokens, attention, attention)
    return StepFeatures(num_tokens, attention, 0, int(attention * _extras(waste, num_tokens)))


def tile_waste_table(max_rows: int, n_head: int, n_threads: int) -> Waste:
    """The tiled flash attention's padding overhead, by micro-batch rows ``0..max_rows``.

    ggml's CPU ``flash_attn_ext`` spreads the ``rows x n_head`` query rows of a micro-batch
    over ``4 x n_threads`` work chunks of equal size. Each chunk is cut into tiles of
    :data:`TILE_ROWS` rows that stop at a chunk's end and at a head's end, and every tile
    costs a whole one. So, with SmolLM2's 9 heads on 2 threads, 64 rows take 16 tiles (9
    would do), 84 rows 21 and 128 rows 24: a row of an 84-row micro-batch costs 1.8x what a
    row of a 512-row one does (72 tiles, all full). Measured at 3,400 cells with 4 decode
    rows beside a chunk: 124 prompt tokens 6.2 ms a token, 60 tokens 7.5, 508 tokens 5.6.
    """
    table = np.zeros(max_rows + 1)
    chunks = 4 * n_threads if n_threads > 1 else 1
    for rows in range(TILE_ROWS, max_rows + 1):
        total = rows * n_head
        size = -(-total // chunks)
        size = -(-total // max(-(-total // size), n_threads))
        tiles, start = 0, 0
        while start < total:
            end = min(start + size, total)
            index = start  # over head-major query rows: head = index // rows
            while index < end:  # tiles stop at the chunk's end and at the head's end
                index += min(TILE_ROWS, end - index, rows - index % rows)
                tiles += 1
            start = end
        table[rows] = tiles * TILE_ROWS / total - 1.0
    return table


_Num = TypeVar("_Num", int, npt.NDArray[np.float64])


def _with_chunk(
    fixed: StepFeatures, num: _Num, attend: int, *, unified: bool, waste: Waste | None
) -> tuple[_Num, _Num, _Num, _Num]:
    """(tokens, attention, row_attention, tile_waste) of ``fixed`` plus a ``num``-token
    chunk."""
    tokens = num + fixed.num_tokens
    if unified:  # everybody's span grows by ``num`` cells, and the rows share micro-batches
        attention = num * (attend + num) + fixed.num_tokens * num + fixed.attention
        rows = attention * (tokens < TILE_ROWS)
        return tokens, attention, rows, attention * _extras(waste, tokens)
    own = num * (attend + num // 2)
    return (
        tokens,
        own + fixed.attention,
        own * (num < TILE_ROWS) + fixed.row_attention,
        own * _extras(waste, num) + fixed.tile_waste,
    )


def _extras(waste: Waste | None, rows: _Num) -> _Num:
    """``waste`` at ``rows`` (an int or an array of row counts; zero without a table)."""
    if waste is None:
        return rows * 0
    if isinstance(rows, np.ndarray):
        extras: _Num = waste[np.minimum(rows, len(waste) - 1).astype(np.intp)]
        return extras
    return float(waste[min(rows, len(waste) - 1)])  # type: ignore[return-value]
