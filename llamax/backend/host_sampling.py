"""llama.cpp's common sampler chains, run on the host for many rows at once.

A sampled (non-greedy) sequence whose chain is ``logit_bias`` → ``top_k`` → ``top_p`` →
``min_p`` → ``temp`` → ``dist`` (top-k on; bias, top-p and min-p optional) is sampled here
from the step's logits matrix, all such rows together, instead of one
``llama_sampler_sample`` per row, which copies and walks the whole row: one vectorised
pass of group maxima finds where each row's top-k candidates are (:func:`_top`) and only
those are sorted and sampled.

Design note: the goal is the token llama.cpp's chain picks, bit for bit, for the same seed.
What that takes, read from ``llama-sampler.cpp``:

* every step is float32 as there (the bias added, ``logit / temp``, top-p's softmax and its
  running sum, min-p's ``max + logf(p)``), sums in llama.cpp's order (``np.cumsum`` adds
  in sequence, unlike ``np.sum``): top-p's in candidate order, ``dist``'s in double;
* ``expf`` is glibc's (:func:`expf`, its algorithm in float64 NumPy), with the rare value
  whose rounding glibc's FMA variant could decide otherwise asked of libm itself;
* ``dist`` draws one ``uniform_real_distribution<double>`` per row, sampled or not (two
  32-bit outputs of the sequence's ``std::mt19937``, :class:`ChainRng`), and takes the
  first candidate whose running double sum reaches ``sum * u``, in candidate order
  (descending logits);
* the order llama.cpp's ``std::partial_sort`` gives equal logits is its own: a row whose
  kept candidates (or the first one cut) hold equal logits is answered None, and the
  caller runs llama.cpp's filters on that row and only :func:`pick` here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, localcontext
from functools import cache
from typing import Any

import numpy as np
import numpy.typing as npt

from ..config import env_flag
from ..params import SamplingParams

__all__ = [
    "HOST_SAMPLING_ENV",
    "ChainRng",
    "HostChain",
    "expf",
    "host_chain",
    "host_sampling_enabled",
    "pick",
    "sample_rows",
]

HOST_SAMPLING_ENV = "LLAMAX_HOST_SAMPLING"

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

DEFAULT_SEED = 0xFFFFFFFF
"""``LLAMA_DEFAULT_SEED``: llama.cpp's ``dist`` seeds itself from the system instead."""


@dataclass(frozen=True, slots=True, eq=False)
class HostChain:
    """One sequence's chain, as float32 values llama.cpp's samplers hold."""

    bias_ids: I64
    """Tokens ``logit_bias`` changes (``ignore_eos``'s bans included)."""
    bias_values: F32
    top_k: int
    """Rows of one ``top_k`` are sampled together."""
    top_p: np.float32
    """1: off."""
    min_p: np.float32
    """0: off."""
    log_min_p: np.float32
    """``logf(min_p)``, libm's."""
    temperature: np.float32


def host_sampling_enabled() -> bool:
    """Whether a backend samples the chains it can on the host: ``$LLAMAX_HOST_SAMPLING``
    is not off (``0`` sends every row through llama.cpp's own chain, as before).

    Raises:
        InvalidParameterError: the variable holds something else than ``0``/``1``,
            ``false``/``true``, ``no``/``yes``, ``off``/``on``.
    """
    return env_flag(HOST_SAMPLING_ENV, "1")


def host_chain(
    params: SamplingParams, bias: dict[int, float], grammar: str | None
) -> HostChain | None:
    """The host chain for ``params`` (``bias``: the logit bias with ``ignore_eos``'s bans),
    or None when the native chain must sample: greedy, penalties, typical-p, a grammar, and
    no top-k (a softmax over the whole row: glibc's ``expf`` of every token costs NumPy
    several times what it costs llama.cpp, which then wins)."""
    if (
        params.is_greedy
        or params.has_penalties
        or params.typical_p < 1
        or grammar is not None
        or params.top_k == 0
    ):
        return None
    min_p = np.float32(params.min_p)
    return HostChain(
        bias_ids=np.fromiter(bias, dtype=np.int64, count=len(bias)),
        bias_values=np.fromiter(bias.values(), dtype=np.float32, count=len(bias)),
        top_k=params.top_k,
        top_p=np.float32(params.top_p),
        min_p=min_p,
        log_min_p=_libm_logf(min_p) if min_p > 0 else np.float32(0),
        temperature=np.float32(params.temperature),
    )


class ChainRng:
    """llama.cpp's ``dist`` random numbers: ``std::mt19937`` seeded with the seed (NumPy's
    legacy seeding is the same ``init_genrand``), and libstdc++'s
    ``uniform_real_distribution<double>(0, 1)``, i.e. ``generate_canonical<double, 53>``:
    ``(a + b * 2**32) / 2**64`` of two 32-bit outputs, in double."""

    __slots__ = ("_bits", "seed")

    def __init__(self, seed: int) -> None:
        while seed == DEFAULT_SEED:  # as get_rng_seed: a seed from the system
            seed = secrets.randbits(32)
        self.seed = seed
        """The seed used (the system's when given ``LLAMA_DEFAULT_SEED``)."""
        self._bits = np.random.MT19937()
        state: Any = np.random.RandomState(seed).get_state(legacy=False)
        self._bits.state = state

    def skip(self, n: int) -> None:
        """Move on ``n`` draws (those llama.cpp's ``dist`` of the same seed made)."""
        if n > 0:
            self._bits.random_raw(2 * n)

    def uniform(self) -> float:
        """The next draw, in [0, 1)."""
        a, b = self._bits.random_raw(2)
        u = (float(a) + float(b) * 4294967296.0) / 18446744073709551616.0
        return u if u < 1.0 else math.nextafter(1.0, 0.0)


def sample_rows(
    chains: Sequence[HostChain], logits: F32, draws: Sequence[float]
) -> list[int | None]:
    """The tokens llama.cpp's chains pick from ``logits`` (one row per chain, written to:
    the biases are added in place), row ``i`` with the uniform number ``draws[i]``.

    A row is None where equal logits among its candidates leave the answer to llama.cpp's
    own sort order (see the module note)."""
    out: list[int | None] = [None] * len(chains)
    groups: dict[int, list[int]] = {}
    for i, chain in enumerate(chains):
        if chain.bias_ids.size:
            logits[i, chain.bias_ids] += chain.bias_values
        groups.setdefault(chain.top_k, []).append(i)
    for top_k, rows in groups.items():
        block = logits if len(rows) == len(chains) else logits[rows]
        u = np.array([draws[i] for i in rows])
        picks = _sorted(block, [chains[i] for i in rows], u, top_k)
        for i, token in zip(rows, picks, strict=True):
            out[i] = token
    return out


def pick(logits: F32, u: float) -> tuple[int, F32]:
    """``dist`` over candidates in llama.cpp's order (their logits after ``temp``): the
    index of the candidate ``u`` selects, and every candidate's probability."""
    if logits.size == 1:
        return 0, np.ones(1, np.float32)
    p = expf(logits - logits.max())
    total = np.cumsum(p, dtype=np.float64)
    index = int(np.argmax(total >= total[-1] * u))
    return index, (p / total[-1]).astype(np.float32)


def _sorted(block: F32, chains: Sequence[HostChain], u: F64, top_k: int) -> list[int | None]:
    """Top-k rows: their candidates in descending order, top-p and min-p cut, ``dist``."""
    kept = min(top_k, block.shape[1])
    ids, values = _top(block, min(kept + 1, block.shape[1]))
    top_p = _column(chains, "top_p")
    cut = np.full(len(chains), kept)
    if (top_p < 1).any():  # top-p's softmax and running sum, in float32 as llama.cpp's
        p = expf(values[:, :kept] - values[:, :1])
        p /= np.cumsum(p, axis=1, dtype=np.float32)[:, -1:]
        running = np.cumsum(p, axis=1, dtype=np.float32) >= top_p
        reached = running.any(axis=1) & (top_p[:, 0] < 1)  # top-p 1: no sampler
        cut = np.where(reached, running.argmax(axis=1) + 1, kept)
    return _cut_and_draw(ids, values, cut, chains, u)


def _cut_and_draw(
    ids: I64, values: F32, cut: I64, chains: Sequence[HostChain], u: F64
) -> list[int | None]:
    """Min-p, temperature and ``dist`` over each row's first ``cut`` sorted candidates."""
    width = values.shape[1]
    cols = np.arange(width)
    floor = values[:, :1] + _column(chains, "log_min_p")
    has_min_p = _column(chains, "min_p") > 0
    below = has_min_p & (values < floor) & (cols >= 1)
    cut = np.minimum(cut, np.where(below.any(axis=1), below.argmax(axis=1), width))
    live = cols < cut[:, None]
    scaled = values / _column(chains, "temperature")
    p = expf(scaled - scaled[:, :1])
    p[~live] = 0
    index = _draw(p, u)
    ties = (values[:, :-1] == values[:, 1:]) & (cols[:-1] < cut[:, None])
    tied = ties.any(axis=1)
    tokens = np.take_along_axis(ids, index[:, None], axis=1)[:, 0]
    return [None if t else int(token) for t, token in zip(tied, tokens, strict=True)]


def _draw(p: F32, u: F64) -> I64:
    """``dist``'s choice per row: the first running double sum at least ``sum * u``."""
    total = np.cumsum(p, axis=1, dtype=np.float64)
    index: I64 = (total >= total[:, -1:] * u[:, None]).argmax(axis=1)
    return index


def _top(block: F32, width: int) -> tuple[I64, F32]:
    """Each row's ``width`` largest logits, in descending order, and their token ids.

    When the row splits into :data:`_GROUP`-token strided groups (tokens ``g``, ``g + n``,
    ``g + 2n`` ... of ``n`` groups) and ``width`` groups are few of them, only the logits at
    least the ``width``-th largest group maximum are sorted: the ``width`` groups with the
    largest maxima hold one each, so the ``width`` largest logits are among them. The
    maxima and the comparison are vectorised passes over the rows, far cheaper than
    partitioning them whole."""
    n_rows, n_vocab = block.shape
    if n_vocab % _GROUP or width * _GROUP * 4 > n_vocab:
        ids = np.argpartition(block, n_vocab - width, axis=1)[:, n_vocab - width :]
        values = np.take_along_axis(block, ids, axis=1)
        order = np.argsort(-values, axis=1, kind="stable")
        return np.take_along_axis(ids, order, axis=1), np.take_along_axis(values, order, axis=1)
    n_groups = n_vocab // _GROUP
    peaks = block.reshape(n_rows, _GROUP, n_groups).max(axis=1)
    floor = np.partition(peaks, n_groups - width, axis=1)[:, n_groups - width, None]
    flat = np.flatnonzero(block >= floor)  # row by row: each row's at least width
    rows, ids = np.divmod(flat, n_vocab)
    values = block.reshape(-1)[flat]
    order = np.lexsort((-values, rows))  # by row, then descending logit
    kept = order[np.searchsorted(rows, np.arange(n_rows))[:, None] + np.arange(width)]
    return ids[kept], values[kept]


_GROUP = 64
"""Tokens per group of :func:`_top`'s first pass."""


def _column(chains: Sequence[HostChain], name: str) -> F32:
    return np.array([getattr(c, name) for c in chains], dtype=np.float32)[:, None]


# glibc's expf (sysdeps/ieee754/flt-32/e_expf.c and e_exp2f_data.c): 2^(k/32) from a table
# times a cubic in r, in double, rounded once to float.
_N = 32
_SHIFT = float.fromhex("0x1.8p+52")
_INVLN2N = float.fromhex("0x1.71547652b82fep+0") * _N
_C0 = float.fromhex("0x1.c6af84b912394p-5") / _N**3
_C1 = float.fromhex("0x1.ebfce50fac4f3p-3") / _N**2
_C2 = float.fromhex("0x1.62e42ff0c52d6p-1") / _N
_UNDERFLOW = np.float32(float.fromhex("-0x1.9fe368p6"))
_OVERFLOW = np.float32(float.fromhex("0x1.62e42ep6"))
_MARGIN = 2.0**-46
"""Relative distance from a float's rounding boundary within which glibc's FMA variant
(a few double ulps apart from this one before the final rounding) might round otherwise."""


@cache
def _exp2_table() -> npt.NDArray[np.uint64]:
    with localcontext() as ctx:
        ctx.prec = 60
        exact = [float(Decimal(2) ** (Decimal(i) / _N)) for i in range(_N)]
    bits = np.array(exact, dtype=np.float64).view(np.uint64)
    return bits - (np.arange(_N, dtype=np.uint64) << np.uint64(52 - 5))


def expf(x: F32) -> F32:
    """glibc's ``expf`` of every element, bit for bit: its algorithm in float64 NumPy, and
    libm itself for the rare value within :data:`_MARGIN` of a rounding boundary."""
    with np.errstate(invalid="ignore", over="ignore"):
        z = x.astype(np.float64)
        z *= _INVLN2N
        kd = z + _SHIFT  # rounds z to an integer k, held in the low bits
        ki = kd.view(np.uint64)  # its int64 view indexes faster
        s = _exp2_table().take(kd.view(np.int64) & (_N - 1)) + (ki << np.uint64(52 - 5))
        kd -= _SHIFT
        r = z
        r -= kd
        y = _C0 * r
        y += _C1
        y *= r * r
        y += _C2 * r + 1
        y *= s.view(np.float64)
        out = y.astype(np.float32)
        near = (y * (1 - _MARGIN)).astype(np.float32) != (y * (1 + _MARGIN)).astype(np.float32)
    out[x < _UNDERFLOW] = 0
    out[x > _OVERFLOW] = np.inf
    if near.any():
        where = np.nonzero(near & (x >= _UNDERFLOW) & (x <= _OVERFLOW))
        out[where] = [_libm_expf(v) for v in x[where]]
    return out


@cache
def _libm() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    for name in ("expf", "logf"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return lib


def _libm_expf(x: np.float32) -> np.float32:
    return np.float32(_libm().expf(float(x)))


def _libm_logf(x: np.float32) -> np.float32:
    return np.float32(_libm().logf(float(x)))
