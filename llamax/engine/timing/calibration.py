"""Step costs measured on the machine the engine runs on, before its first request.

The time-budgeted steps (:mod:`llamax.engine.timing.step_budget`) and the pricing of speculative
drafts (:class:`~llamax.engine.spec.speculative.DecodeCost`) predict what a step will cost. They
learn online from measured steps, but their first predictions came from coefficients
fitted on one machine (a 2-thread AVX-512 CPU and SmolLM2-135M). On a CPU whose prefill is
1.6x slower the first chunks of a long prompt overran their budget, and the decode rows
that never saw a prompt chunk kept the wrong attention cost for long.

:func:`calibrate` times a few steps of chosen shapes on free sequences, once, before the
engine starts:

- one decode row, three times (the fixed cost of a step);
- one row in each of up to 8 sequences, twice (what a decode row adds);
- a 64-token prompt chunk at position 0 (a token's cost in the tiled kernels);
- the same sequence grown, without computing, to ``depth`` cells of filler K/V
  (:class:`~llamax.backend.base.Calibratable`), then a 64-token chunk, a 16-token chunk and
  one decode row on top of them (attention over a long context, tiled and row by row).

With SmolLM2 on 2 cores that is about 150 computed tokens, a fraction of a second. The
step-cost coefficients are fitted to those steps by least squares on relative errors,
drawn toward the built-in prior scaled by the machine's measured speed (so a coefficient
the shapes barely excite, such as attention when the KV stream is short, is the prior's
shape at this machine's speed, not another machine's number). The line for draft tokens is
fitted to the decode steps. The result is cached under the backend's
:meth:`~llamax.backend.base.Calibratable.calibration_key` (model, llama.cpp build and
settings, CPU model and flags), so later contexts on the same machine and model skip it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ...backend.base import Backend, BatchItem, Calibratable, Clocked, DecodeStatus
from ...errors import EngineError
from ..spec.speculative import DecodeCost
from .chunk_budget import ChunkBudget
from .step_budget import PRIOR_COEFFICIENTS, StepCostModel, StepFeatures

__all__ = [
    "CALIBRATION_VERSION",
    "Calibration",
    "CalibrationCache",
    "calibrate",
    "default_cache_dir",
    "fit_coefficients",
]

CALIBRATION_VERSION = 1
"""Bumped whenever the shapes or the fit change: older cached calibrations are ignored."""
CHUNK = 64
"""Tokens of the tiled prompt chunks timed."""
ROW_CHUNK = 16
"""Tokens of the row-by-row prompt chunk timed at depth."""
MAX_DEPTH = 2048
"""The most filler cells the attention is timed over."""
MAX_DECODE_ROWS = 8
"""The most sequences whose decode rows are timed together."""
_RIDGE = 0.05  # pull, per coefficient, toward the prior scaled to this machine
_log = logging.getLogger("llamax.engine.timing.calibration")


@dataclass(frozen=True, slots=True)
class Calibration:
    """Step costs measured on this machine, in seconds.

    A step is predicted to cost ``fixed_s + token_s x tokens + attention_s x attended cells
    (+ row_attention_s x those attended row by row)``; a step of ``n`` decode rows,
    ``decode_base_s + decode_token_s x n``.
    """

    fixed_s: float
    """A step's fixed cost."""
    token_s: float
    """What each token adds."""
    attention_s: float
    """What each attended KV cell adds, per token."""
    row_attention_s: float
    """What each cell adds on top when attended row by row (micro-batches of fewer than 64
    rows, see :mod:`llamax.engine.timing.step_budget`)."""
    decode_base_s: float
    """A decode-only step's fixed cost (the line draft tokens are priced with)."""
    decode_token_s: float
    """What each decode row adds to it."""
    depth: int
    """The KV cells the attention was timed over (0: not timed; the prior's shape)."""
    measured_s: float
    """Wall time the calibration took, decodes and set-up."""
    num_steps: int
    """Steps timed."""
    version: int = CALIBRATION_VERSION

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """``(fixed_s, token_s, attention_s, row_attention_s)``, as
        :class:`~llamax.engine.timing.step_budget.StepCostModel` takes them."""
        return (self.fixed_s, self.token_s, self.attention_s, self.row_attention_s)

    def to_json(self) -> str:
        """The calibration as a JSON object."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        """Read :meth:`to_json`'s output back.

        Raises:
            ValueError: not such an object, another version, or a value that is not a
                finite non-negative number (a file that lies is not believed).
        """
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("version") != CALIBRATION_VERSION:
            raise ValueError("not a calibration of this version")
        floats = (
            "fixed_s", "token_s", "attention_s", "row_attention_s",
            "decode_base_s", "decode_token_s", "measured_s",
        )  # fmt: skip
        values: dict[str, float | int] = {}
        for name in floats:
            value = raw.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} is not a number")
            if not math.isfinite(value) or value < 0 or value > 60:
                raise ValueError(f"{name} = {value} is out of range")
            values[name] = float(value)
        if values["token_s"] <= 0 or values["decode_token_s"] <= 0:
            raise ValueError("a token that costs nothing")
        for name in ("depth", "num_steps"):
            value = raw.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} is not a count")
            values[name] = value
        return cls(**values)  # type: ignore[arg-type]


def default_cache_dir() -> Path:
    """``$LLAMAX_CACHE_DIR/calibration``, else ``$XDG_CACHE_HOME/llamax/calibration``, else
    ``~/.cache/llamax/calibration``."""
    root = os.environ.get("LLAMAX_CACHE_DIR")
    if root:
        return Path(root) / "calibration"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "llamax" / "calibration"


class CalibrationCache:
    """Calibrations on disk, one JSON file per key. Unreadable or implausible files are
    ignored (and replaced by the next calibration), and a cache that cannot be written is
    not an error: the next context calibrates again."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = default_cache_dir() if directory is None else directory

    def path(self, key: str) -> Path:
        """The file a key's calibration lives in."""
        digest = hashlib.sha256(f"{CALIBRATION_VERSION}|{key}".encode()).hexdigest()[:24]
        return self.directory / f"{digest}.json"

    def get(self, key: str) -> Calibration | None:
        """The cached calibration for ``key``, or None."""
        try:
            return Calibration.from_json(self.path(key).read_text())
        except (OSError, ValueError, TypeError, UnicodeDecodeError) as exc:
            if not isinstance(exc, FileNotFoundError):
                _log.warning("ignoring the cached calibration %s: %s", self.path(key), exc)
            return None

    def put(self, key: str, calibration: Calibration) -> None:
        """Store ``calibration`` (atomically: a reader never sees half a file)."""
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(calibration.to_json() + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            _log.warning("could not cache the calibration in %s: %s", path, exc)


def calibrate(
    backend: Backend, *, cache: CalibrationCache | None = None, use_cache: bool = True
) -> Calibration | None:
    """This machine's step costs for ``backend``: cached, else measured (and cached).

    Runs before the engine starts, on an empty KV cache. None when the backend cannot be
    calibrated (not :class:`~llamax.backend.base.Calibratable`, no free room, or a decode
    failed); the engine then starts from the built-in prior, as before. Every cell it
    made is removed again, whatever happens.

    Raises:
        EngineError: cells it made could not be removed (the backend cannot serve).
    """
    if not isinstance(backend, Calibratable):
        return None
    key = backend.calibration_key()
    cache = cache or CalibrationCache()
    if use_cache and key is not None:
        cached = cache.get(key)
        if cached is not None:
            return cached
    calibration: Calibration | None = None
    try:
        calibration = _measure(backend)
    except Exception as exc:  # a failed calibration must not fail the context
        _log.warning("calibration failed, starting from the built-in step costs: %s", exc)
    finally:
        left = []
        for seq_id in range(backend.facts.n_seq_max):
            with contextlib.suppress(Exception):
                backend.seq_rm(seq_id)
            with contextlib.suppress(Exception):
                if backend.seq_pos_max(seq_id) < 0:
                    continue
            left.append(seq_id)
        if left:  # the engine must start on an empty cache it knows
            raise EngineError(f"the calibration could not remove its cells (sequences {left})")
    if calibration is not None and use_cache and key is not None:
        cache.put(key, calibration)
    return calibration


class _Timer:
    """Times decodes on the backend's clock; a decode that fails raises."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.clock: Callable[[], float] = (
            backend.clock if isinstance(backend, Clocked) else time.perf_counter
        )
        self.steps: list[tuple[StepFeatures, float]] = []
        self.decodes: list[tuple[int, float]] = []
        self._budget = ChunkBudget(backend.n_batch, None)

    def run(self, items: Sequence[BatchItem], *, cells_used: int, record: bool = True) -> float:
        start = self.clock()
        status = self.backend.decode(items)
        seconds = self.clock() - start
        if status != DecodeStatus.OK:
            raise RuntimeError(f"llama_decode returned {status}")
        if record:
            entries = [(len(i.token_ids), i.start_pos, i.start_pos) for i in items]
            unified = self.backend.is_unified
            features = self._budget.step_features(entries, cells_used, unified=unified)
            self.steps.append((features, seconds))
            if all(len(i.token_ids) == 1 for i in items):
                self.decodes.append((len(items), seconds))
        return seconds


def _measure(backend: Backend) -> Calibration | None:
    started = time.perf_counter()
    n_ctx = backend.facts.n_ctx
    room = min(backend.n_ctx_stream, n_ctx) if not backend.is_unified else n_ctx
    need = CHUNK + CHUNK + ROW_CHUNK + 2
    if backend.n_batch < CHUNK or room < need:
        return None
    timer = _Timer(backend)
    token = _filler_token(backend)
    one = [BatchItem(0, [token], 0, (0,))]
    timer.run(one, cells_used=0, record=False)  # the first decode allocates its buffers
    backend.seq_rm(0)
    for _ in range(3):
        timer.run(one, cells_used=0)
        backend.seq_rm(0)
    rows = min(MAX_DECODE_ROWS, backend.facts.n_seq_max, backend.n_batch)
    if rows > 1:
        many = [BatchItem(s, [token], 0, (s,)) for s in range(rows)]
        for _ in range(2):
            timer.run(many, cells_used=0)
            for s in range(rows):
                backend.seq_rm(s)
    chunk = [BatchItem(0, [token] * CHUNK, 0, (CHUNK - 1,))]
    timer.run(chunk, cells_used=0)
    depth = min(MAX_DEPTH, room - CHUNK - ROW_CHUNK - 2)
    if depth > CHUNK and isinstance(backend, Calibratable) and backend.fill_cells(0, depth):
        pos = depth
        timer.run([BatchItem(0, [token] * CHUNK, pos, (CHUNK - 1,))], cells_used=pos)
        pos += CHUNK
        timer.run([BatchItem(0, [token] * ROW_CHUNK, pos, (ROW_CHUNK - 1,))], cells_used=pos)
        pos += ROW_CHUNK
        timer.run([BatchItem(0, [token], pos, (0,))], cells_used=pos)
    else:
        depth = 0
    backend.seq_rm(0)
    fixed, token_s, attention, row_attention = fit_coefficients(timer.steps)
    base, per_row = _decode_line(timer.decodes)
    return Calibration(
        fixed_s=fixed,
        token_s=token_s,
        attention_s=attention,
        row_attention_s=row_attention,
        decode_base_s=base,
        decode_token_s=per_row,
        depth=depth,
        measured_s=round(time.perf_counter() - started, 4),
        num_steps=len(timer.steps),
    )


def fit_coefficients(
    steps: Sequence[tuple[StepFeatures, float]],
) -> tuple[float, float, float, float]:
    """Step-cost coefficients (seconds) fitted to measured ``(features, seconds)`` steps.

    Least squares on relative errors, each coefficient drawn toward the built-in prior
    scaled by this machine's speed (the median ratio of measured to prior-predicted
    seconds), so what the steps do not excite keeps the prior's proportions. Coefficients
    are at least zero, and a token costs something.
    """
    prior = np.asarray(PRIOR_COEFFICIENTS, dtype=np.float64)
    if not steps:
        return tuple(float(x) for x in prior)  # type: ignore[return-value]
    x = np.array([f.vector(scaled=False) for f, _ in steps], dtype=np.float64)
    y = np.array([max(s, 1e-6) for _, s in steps], dtype=np.float64)
    speed = float(np.median(y / np.maximum(x @ prior, 1e-9)))
    anchor = prior * speed
    # unknowns u = theta / anchor (so the ridge is relative); rows divided by the measured time
    design = (x * anchor) / y[:, None]
    lam = math.sqrt(_RIDGE)
    a = np.vstack([design, lam * np.eye(len(prior))])
    b = np.concatenate([np.ones(len(y)), lam * np.ones(len(prior))])
    u, *_ = np.linalg.lstsq(a, b, rcond=None)
    theta = np.maximum(u, 0.0) * anchor
    theta[1] = max(theta[1], 0.1 * anchor[1])
    return tuple(float(v) for v in theta)  # type: ignore[return-value]


def _decode_line(decodes: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """``(base, per_row)`` of decode-only steps: through the medians at each row count, or
    the prior line scaled to the one count seen."""
    by_rows: dict[int, list[float]] = {}
    for rows, seconds in decodes:
        by_rows.setdefault(rows, []).append(seconds)
    medians = {n: float(np.median(ts)) for n, ts in by_rows.items()}
    prior_base, prior_slope = DecodeCost.PRIOR
    if len(medians) < 2:
        if not medians:
            return DecodeCost.PRIOR
        ((n, t),) = medians.items()
        scale = t / (prior_base + prior_slope * n)
        return prior_base * scale, prior_slope * scale
    ns = np.array(sorted(medians), dtype=np.float64)
    ts = np.array([medians[int(n)] for n in ns])
    slope, base = np.polyfit(ns, ts, 1)
    slope = max(float(slope), 1e-5)
    base = max(float(base), 0.0)
    return base, slope


def _filler_token(backend: Backend) -> int:
    """A plain token to time steps with (any token costs the same)."""
    ids = backend.tokenize(" the", add_special=False, parse_special=False)
    return int(ids[0]) if ids else 0


def apply(calibration: Calibration, cost: StepCostModel, decode: DecodeCost) -> None:
    """Start ``cost`` and ``decode`` from ``calibration`` instead of the built-in prior."""
    cost.start_from(calibration.coefficients)
    decode.prior = (calibration.decode_base_s, calibration.decode_token_s)
