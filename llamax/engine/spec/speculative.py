"""Speculative decoding inside the continuous batch: drafters and their per-sequence state.

A decoding sequence may carry draft tokens in its batch entry: the step feeds its pending
token followed by ``k`` guesses and asks for logits at every one of those positions, in the
same ``llama_decode`` as every other sequence. After the decode the scheduler samples the
rows in order with the sequence's own sampler chain (logits processors, grammar, penalties,
logprobs, seed: all as without speculation) and keeps going while the sampled token equals
the draft. The first mismatch, or the row after the last draft, yields one more token that
is always right. Rejected cells are removed with ``seq_rm``.

Why this is lossless: each row is sampled from exactly the distribution the sequence would
have sampled from without speculation, given the tokens before it, which are all accepted
(so equal to what it would have produced). With a deterministic draft ``d`` (one-hot
``q``), the standard speculative rule "accept ``d`` with probability ``min(1, p(d)/q(d)) =
p(d)``, else sample from ``norm(max(0, p - q))``" is the same as "sample ``t ~ p``; accept
if ``t == d``, else emit ``t``": both accept with probability ``p(d)`` and, on rejection,
draw from ``p`` restricted to tokens other than ``d``. The sampler consumes one random draw
per emitted token, as without speculation, so a seeded request is reproduced too.

Only the *drafter* is pluggable, and it lives below the engine, in :mod:`llamax.drafting`
(:class:`~llamax.drafting.PromptLookup` matches the sequence's last n-gram against its own
prompt and output; a small draft model can implement :class:`~llamax.drafting.Drafter`
later). Verification, acceptance and rollback stay the scheduler's; this module keeps
each sequence's acceptance record (:class:`DraftState`), the context's
(:class:`SharedAcceptance`) and what a step with drafts costs (:class:`DecodeCost`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ...drafting import Drafter, DraftMethod

__all__ = ["DecodeCost", "DraftState", "SharedAcceptance", "new_draft_state"]


class SharedAcceptance:
    """A context's acceptance record over every sequence, by regime: what a new sequence
    expects before it has a record of its own. Decays slowly (0.98 per observation), so it
    follows the context's workload (copy-heavy or free text)."""

    __slots__ = ("loss_acceptance", "loss_rows", "pause", "successes", "trials")

    def __init__(self) -> None:
        # [not copying, copying]: a prior acceptance rate of 0.3 and 0.8
        self.successes, self.trials = [1.5, 4.0], [5.0, 5.0]
        self.pause = 0
        """Steps a new sequence waits before drafting: the guard's last verdict
        (:meth:`DraftState.audit`), 0 after drafts that paid."""
        self.loss_acceptance = 1.0
        """The acceptance rate (of a draft token, given the ones before it) of the sequence
        whose drafts lost last. A new sequence ends the pause it inherits early only on a
        run of right first guesses that rate would make unlikely (:func:`_hits_to_retry`):
        its text then copies more than the loser's did."""
        self.loss_rows = 0
        """The decode rows of the step whose verdict set :attr:`pause`: a new sequence
        serves the pause only in steps of about as many rows (:meth:`DraftState.tick`)."""

    def rate(self, hot: bool) -> float:
        """The context's acceptance rate in one regime."""
        return self.successes[hot] / self.trials[hot]

    def learn(self, hot: bool, successes: int, trials: int) -> None:
        """Add one observation of a sequence in regime ``hot``."""
        self.successes[hot] = 0.98 * self.successes[hot] + successes
        self.trials[hot] = 0.98 * self.trials[hot] + trials


_PSEUDO_TRIALS = 3.0
"""How many trials the context's rate counts for in a sequence's own estimate."""
_AUDITED_STEPS = 3
"""Verified steps the guard weighs together, each time, before it judges them."""
_FIRST_PAUSE, _LONGEST_PAUSE = 8, 1024
"""Steps without drafting after the guard stops it the first time, and at most."""
_INHERITED_PAUSE = 32
"""The most steps a new sequence waits, at first, because another sequence's drafts lost:
then it drafts and is judged on its own first few verified steps (see
:meth:`DraftState.audit`)."""
_RETRY_CHANCE = 0.01
"""How likely a run of right first guesses that ends an inherited pause may be at the
acceptance rate of the drafts that lost (see :func:`_hits_to_retry`)."""


def _similar_rows(rows: int, loss_rows: int) -> bool:
    """Whether a step of ``rows`` decode rows is like the one of ``loss_rows`` whose drafts
    lost: within a factor of two. What a draft token costs against what it saves depends on
    the step's rows (with one row a step's fixed cost dominates; with 16 on a CPU each row
    costs its share), so a verdict at 16 rows says little about a step of 1 or 4."""
    return max(rows, loss_rows) <= 2 * max(1, min(rows, loss_rows))


def _hits_to_retry(loss_acceptance: float) -> int:
    """Consecutive right first guesses (checked for free while paused) that end a pause a
    new sequence inherited, when the drafts that lost were accepted at ``loss_acceptance``:
    a run that rate gives with chance :data:`_RETRY_CHANCE` at most (4 at least; 13 for
    0.7, 6 for 0.4; never for 0.99 and above)."""
    if loss_acceptance >= 0.99:
        return 10**9
    rate = min(max(loss_acceptance, 0.05), 0.99)
    return max(4, math.ceil(math.log(_RETRY_CHANCE) / math.log(rate)))


class DraftState:
    """One sequence's drafter and its acceptance record.

    ``acceptance`` estimates the probability that a draft token is accepted given the ones
    before it (a geometric model), from decayed counts of verified drafts. Copying comes in
    runs, so the counts are kept apart for two regimes: after a draft that was accepted
    whole ("hot": the output is copying) and otherwise ("cold"). A sequence's own counts
    are blended with the context's (:class:`SharedAcceptance`, worth three trials), so a
    new sequence starts from what the context's workload has shown. The scheduler prices
    each draft token with the current regime's rate (see :meth:`expected_gain`) against the
    compute the token adds to the step, so the draft length adapts per sequence and per
    step, and a sequence whose drafts do not pay stops drafting. While it does not draft,
    the drafter's first proposed token is still checked against the token that actually
    follows (for free), so a sequence whose text turns repetitive starts drafting again.
    """

    __slots__ = (
        "_audits",
        "_backoff",
        "_cost_s",
        "_gain_s",
        "_hot",
        "_inherited",
        "_inherited_rows",
        "_judged",
        "_paused",
        "_retry_after",
        "_shadow",
        "_shared",
        "_streak",
        "_successes",
        "_trials",
        "drafter",
        "last_accepted",
        "num_accepted",
        "num_drafted",
        "num_pauses",
    )

    def __init__(self, drafter: Drafter, shared: SharedAcceptance | None = None) -> None:
        self.drafter = drafter
        self._shared = shared if shared is not None else SharedAcceptance()
        self._successes, self._trials = [0.0, 0.0], [0.0, 0.0]  # [cold, hot], own
        self._hot = False
        self._shadow: tuple[int, int] | None = None  # (position, first proposed token)
        self.num_drafted = 0
        self.num_accepted = 0
        self.last_accepted = 0
        """Draft tokens accepted at the last verification."""
        # the realized-gain guard (:meth:`audit`), starting where the context's stands: a
        # short wait after a loss elsewhere, then a verdict on a few steps of its own, whose
        # loss would pause it as long as the context's last one
        self._gain_s = self._cost_s = 0.0
        self._audits = 0
        self._paused = min(self._shared.pause, _INHERITED_PAUSE)  # steps left without drafting
        self._backoff = max(self._shared.pause, _FIRST_PAUSE)
        self._judged = False  # its first verdict weighs _AUDITED_STEPS steps
        # a pause inherited from the context ends early once this sequence's own text shows
        # it copies (see :meth:`propose`): a story's losing drafts once kept the next
        # request, copy-heavy code, from drafting for 512 steps
        self._inherited = self._paused > 0
        self._inherited_rows = self._shared.loss_rows
        self._retry_after = _hits_to_retry(self._shared.loss_acceptance)
        self._streak = 0
        self.num_pauses = 0
        """How many times the guard stopped this sequence's drafting."""

    @property
    def paused(self) -> bool:
        """Whether the guard keeps this sequence from drafting now (:meth:`audit`)."""
        return self._paused > 0

    def tick(self, rows: int | None = None) -> None:
        """One step of ``rows`` decode rows passed in which this sequence could have
        drafted. A pause inherited from a loss in steps unlike this one (see
        :func:`_similar_rows`) ends here: the sequence is judged on its own steps, as a new
        one. A code request that followed a throughput batch on SmolLM2 once inherited the
        batch's pause of hundreds of steps at one row and drafted 5 tokens of 400."""
        if not self._paused:
            return
        if self._inherited and rows is not None and not _similar_rows(rows, self._inherited_rows):
            self._paused, self._backoff, self._inherited = 0, _FIRST_PAUSE, False
            return
        self._paused -= 1

    def audit(self, gain_s: float, cost_s: float, rows: int = 1) -> None:
        """Check one verified step's realized worth: the accepted tokens saved ``gain_s``
        seconds (what decoding them one step at a time would have cost) and the draft
        tokens added ``cost_s`` seconds to the step (measured, against the measured cost of
        the same step without drafts). When the costs of the last few such steps exceed
        their gains, drafting stops for a while, twice as long each time it stops again
        (half as long after steps that paid; a retry after a pause is judged on its first
        step), whatever the acceptance rate and the pricing line promised: speculation
        never keeps losing time. The context remembers
        the last verdict: after a loss its next sequence starts paused (at most
        :data:`_INHERITED_PAUSE` steps), is judged on its first few verified steps, and if
        those lose too it pauses as long as the context's last verdict said. The inherited
        pause ends early once the new sequence's own text shows it copies more than the
        loser's did (a run of right first guesses, checked for free, that the loser's
        acceptance rate makes unlikely: :func:`_hits_to_retry`), and at once in a step
        whose ``rows`` (decode rows) are unlike the losing one's (:meth:`tick`)."""
        self._inherited = False  # judged on its own steps from now on
        self._gain_s += gain_s
        self._cost_s += cost_s
        self._audits += 1
        # after a pause one step decides (a retry costs one step), else a few together (and
        # always for the first verdict: a new sequence's first step may just be unlucky)
        retry = self._judged and self._backoff > _FIRST_PAUSE
        if self._audits < (1 if retry else _AUDITED_STEPS):
            return
        self._judged = True
        shared = self._shared
        if self._cost_s > self._gain_s:
            self._paused = self._backoff
            self._backoff = min(2 * self._backoff, _LONGEST_PAUSE)
            self.num_pauses += 1
            shared.pause = self._backoff  # a new sequence of this context waits too
            shared.loss_rows = rows
            shared.loss_acceptance = sum(self._successes) / max(1e-9, sum(self._trials))
        else:  # paid: forgiven by halves (a text that paid once may still stop paying)
            self._backoff = max(_FIRST_PAUSE, self._backoff // 2)
            shared.pause = 0
        self._gain_s = self._cost_s = 0.0
        self._audits = 0

    @property
    def acceptance(self) -> float:
        """Estimated probability that a draft token is accepted, given the ones before it."""
        hot = self._hot
        prior = self._shared.rate(hot) * _PSEUDO_TRIALS
        return (self._successes[hot] + prior) / (self._trials[hot] + _PSEUDO_TRIALS)

    def propose(self, token_ids: Sequence[int], limit: int) -> tuple[int, ...]:
        """A draft of at most ``limit`` tokens (``()`` when nothing matches)."""
        shadow, self._shadow = self._shadow, None
        if shadow is not None and shadow[0] < len(token_ids):
            hit = token_ids[shadow[0]] == shadow[1]
            self._learn(int(hit), 1, hot=hit)
            self._streak = self._streak + 1 if hit else 0
            if self._inherited and self._paused and self._streak >= self._retry_after:
                # this text copies: try it now, one step decides; if it loses, the pause
                # skipped now is served twice over
                self._paused = 0
        return self.drafter.propose(token_ids, limit)

    def expected_gain(self, j: int) -> float:
        """Probability that the ``j``-th draft token (1-based) is accepted."""
        return float(self.acceptance**j)

    def skipped(self, position: int, draft: Sequence[int]) -> None:
        """``draft`` was proposed at ``position`` but not verified: check it later."""
        if draft:
            self._shadow = (position, int(draft[0]))

    def record(self, drafted: int, accepted: int) -> None:
        """Learn from one verification of ``drafted`` tokens, ``accepted`` of them kept."""
        if drafted <= 0:
            return
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.last_accepted = accepted
        self._learn(accepted, accepted + (accepted < drafted), hot=accepted == drafted)

    def _learn(self, successes: int, trials: int, *, hot: bool) -> None:
        # decayed counts follow a sequence whose text changes character
        regime = self._hot
        self._successes[regime] = 0.85 * self._successes[regime] + successes
        self._trials[regime] = 0.85 * self._trials[regime] + trials
        self._shared.learn(regime, successes, trials)
        self._hot = hot


def window(num_tokens: int) -> int:
    """The step sizes a line for pricing drafts on a step of ``num_tokens`` is fitted to."""
    return num_tokens + max(num_tokens, 10)


class DecodeCost:
    """What a step of ``n`` decode and draft tokens costs: ``base + per_token * n``
    seconds.

    Draft tokens are priced with it: what one more token adds to a step of decode rows.
    It keeps a moving average of the measured time for each token count seen in steps
    without prompt chunks, and fits the line through them (weighted by how often each
    count was seen), locally: only the counts up to the size being priced. Until two
    such counts were seen the line keeps the prior's shape (6 ms + 8 ms a token,
    measured on a 2-thread CPU with a 135M model) scaled to the one that was. Averages
    per count, unlike a recursive fit, cannot wind up during long runs of equal steps (N
    streams decoding) and then jump.

    The averages are also kept per number of decode rows (``rows``): a step of 4 tokens
    that is 4 sequences attends over 4 sequences' cells, one that is 1 sequence and 3
    draft tokens over one's, and on a context that ran 4-sequence batches the pooled
    average priced a lone sequence's draft token as a whole step (issue 59: a quote
    request that copies at 95% drafted 65 tokens of 210 where a fresh context drafted
    150-192). Given ``rows``, :meth:`plain` and :meth:`line` use that many rows' steps
    when seen, and the pooled averages only until then.
    """

    PRIOR = (0.006, 0.008)

    def __init__(self, *, smoothing: float = 0.1) -> None:
        self.prior = self.PRIOR
        """``(base, per_token)`` before two token counts were measured: :attr:`PRIOR`, or
        this machine's (:mod:`llamax.engine.timing.calibration`)."""
        self._smoothing = smoothing
        self._mean: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self._rows_mean: dict[int, dict[int, float]] = {}  # rows -> tokens -> seconds
        self._rows_count: dict[int, dict[int, int]] = {}

    def observe(self, num_tokens: int, seconds: float, rows: int | None = None) -> None:
        """Update the moving average of steps of ``num_tokens`` tokens (and of such steps
        of ``rows`` decode rows, if given)."""
        self._update(self._mean, self._count, num_tokens, seconds)
        if rows is not None:
            self._update(
                self._rows_mean.setdefault(rows, {}),
                self._rows_count.setdefault(rows, {}),
                num_tokens,
                seconds,
            )

    def _update(
        self, means: dict[int, float], counts: dict[int, int], num_tokens: int, seconds: float
    ) -> None:
        mean = means.get(num_tokens)
        means[num_tokens] = seconds if mean is None else mean + self._smoothing * (seconds - mean)
        counts[num_tokens] = counts.get(num_tokens, 0) + 1

    def plain(self, num_tokens: int) -> float:
        """Seconds a step of ``num_tokens`` decode rows takes: its measured average when
        such steps were seen, else the local line's prediction."""
        mean = self._rows_mean.get(num_tokens, {}).get(num_tokens)
        if mean is None:
            mean = self._mean.get(num_tokens)
        if mean is not None:
            return mean
        base, per_token = self.line(window(num_tokens))
        return base + per_token * num_tokens

    def line(self, up_to: int, rows: int | None = None) -> tuple[float, float]:
        """``(base, per_token)`` seconds, fitted to the steps of at most ``up_to`` tokens
        (of ``rows`` decode rows, once two such token counts were seen; with one, the
        prior's shape scaled to it).

        Local, because the cost is not linear over all sizes: a step of 64 decode rows in a
        unified cache attends over thousands of cells, and a line through it would price a
        one-sequence step as if it had no base cost at all.
        """
        if rows is not None and (own := self._rows_mean.get(rows)):
            seen = [n for n in own if n <= up_to]
            if len(seen) >= 2:
                return self._fit(own, self._rows_count[rows], seen)
            if rows in own:  # the plain step alone: the prior's shape through it
                return self._fit(own, self._rows_count[rows], [rows])
        seen = [n for n in self._mean if n <= up_to]
        if not seen and self._mean:
            seen = [min(self._mean)]
        return self._fit(self._mean, self._count, seen)

    def _fit(
        self, means: dict[int, float], counts: dict[int, int], seen: list[int]
    ) -> tuple[float, float]:
        """The weighted line through ``means`` at the token counts ``seen`` (the prior's
        shape scaled to a single one; the prior itself without any)."""
        prior_base, prior_slope = self.prior
        if len(seen) <= 1:
            if not seen:
                return self.prior
            n = seen[0]
            scale = means[n] / (prior_base + prior_slope * n)
            return prior_base * scale, prior_slope * scale
        ns = np.array(seen, dtype=np.float64)
        ts = np.array([means[n] for n in seen])
        weights = np.array([counts[n] for n in seen], dtype=np.float64)
        w = np.sqrt(np.minimum(weights, 50.0))
        design = np.stack([np.ones_like(ns), ns], axis=1) * w[:, None]
        (base, slope), *_ = np.linalg.lstsq(design, ts * w, rcond=None)
        slope = max(float(slope), 1e-4)
        base = max(float(base), 0.0)
        return base, slope


def new_draft_state(method: DraftMethod, shared: SharedAcceptance | None = None) -> DraftState:
    """A sequence's draft state under ``method``: its own drafter and an acceptance record
    that starts from (and feeds) ``shared``, the context's record."""
    return DraftState(method.new_drafter(), shared)
