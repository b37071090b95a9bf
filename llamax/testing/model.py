"""The fake backend's model: its vocabulary (one token per byte, plus specials), the
default next-token function, its LoRA adapters, the logits it scores, and sampling with a
grammar."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..adapters import AdapterSet
from ..backend.base import Drawn
from ..backend.native import utf8
from ..errors import ModelLoadError, RequestFailedError
from ..params import SamplingParams

__all__ = [
    "EOS",
    "FakeAdapters",
    "FakeGrammar",
    "FakeSampler",
    "FakeVocab",
    "alphabet_model",
    "row_logits",
    "sample",
]

EOS = 0
_GRAMMAR = re.compile(r"root\s*::=\s*\[([^\]\\]*)\](\*|\+|\{\d+(?:,\d*)?\})")


def alphabet_model(history: Sequence[int]) -> int:
    """Default fake model: the next lowercase letter after the last byte, cycling a..z."""
    last = history[-1] - 1 if history and history[-1] > 0 else ord("a") - 1
    nxt = ord("a") + (last - ord("a") + 1) % 26 if ord("a") <= last <= ord("z") else ord("a")
    return nxt + 1


class FakeVocab:
    """Token 0 (renders as nothing), tokens 1..256 for the bytes 0..255, any extra pieces
    and the special tokens. A special token renders as nothing (a control token), unless
    ``extra_pieces`` gives its text (a user-defined token, such as gpt-oss's
    ``<|channel|>``); llama.cpp parses such a token's text even without ``parse_special``,
    as the fake does."""

    def __init__(
        self, extra_pieces: Mapping[int, bytes] | None, specials: Mapping[str, int] | None
    ) -> None:
        self.pieces = {0: b""} | {b + 1: bytes([b]) for b in range(256)} | dict(extra_pieces or {})
        self.specials = dict(specials or {})
        shown = set(extra_pieces or {})
        self.pieces.update({t: b"" for t in self.specials.values() if t not in shown})
        self._user_defined = {text: t for text, t in self.specials.items() if t in shown}

    def token_text(self, token: int) -> str:
        """The token's bytes as text; special tokens by name."""
        for text, special in self.specials.items():
            if special == token:
                return text
        return self.pieces[token].decode("utf-8", "replace")

    def tokenize(self, text: str, parse_special: bool) -> list[int]:
        """One token per UTF-8 byte; specials parsed when ``parse_special`` (user-defined
        ones always)."""
        utf8(text)  # a lone surrogate is refused as by the real tokenizer
        specials = self.specials if parse_special else self._user_defined
        if not specials:
            return [b + 1 for b in text.encode("utf-8")]
        tokens: list[int] = []
        while text:
            hits = [(text.find(s), s) for s in specials if s in text]
            if not hits:
                tokens += [b + 1 for b in text.encode("utf-8")]
                break
            at, special = min(hits)
            tokens += [b + 1 for b in text[:at].encode("utf-8")] + [specials[special]]
            text = text[at + len(special) :]
        return tokens


class FakeAdapters:
    """The fake's LoRA adapters: any file that starts with ``GGUF`` loads; under a set,
    lower-case letters the model picks move ``k`` places along the alphabet, ``k`` being
    the sum of ``load index + 1`` over the set's adapters whose scale is not 0."""

    def __init__(self) -> None:
        self._order: dict[str, int] = {}  # name -> load index

    def load(self, name: str, path: str) -> None:
        """Load ``path`` under ``name``.

        Raises:
            ModelLoadError: no such file, or it does not start with ``GGUF``.
        """
        try:
            with open(path, "rb") as file:
                magic = file.read(4)
        except OSError as exc:
            raise ModelLoadError(f"LoRA adapter {name!r}: cannot read {path}: {exc}") from exc
        if magic != b"GGUF":
            raise ModelLoadError(f"LoRA adapter {name!r}: {path} is not a GGUF file")
        self._order.setdefault(name, len(self._order))

    def check(self, adapters: AdapterSet) -> None:
        """Assert that every adapter of the set was loaded."""
        unknown = [name for name, _ in adapters if name not in self._order]
        if unknown:
            raise AssertionError(f"set_adapters with adapters never loaded: {unknown}")

    def shift(self, token: int, adapters: AdapterSet) -> int:
        """The token the model picks under ``adapters`` instead of ``token``."""
        shift = sum(self._order[n] + 1 for n, scale in adapters if scale != 0)
        if shift % 26 and ord("a") <= token - 1 <= ord("z"):
            return 1 + ord("a") + (token - 1 - ord("a") + shift) % 26
        return token


def row_logits(token: int, n_vocab: int) -> npt.NDArray[np.float32]:
    """The model's token scores 10; three neighbours 9.5, 9 and 8.5; the rest -10."""
    row = np.full(n_vocab, -10.0, np.float32)
    for k in range(3, 0, -1):
        row[1 + (token - 1 + k) % 256] = 10.0 - 0.5 * k
    row[token] = 10.0
    return row


@dataclass(eq=False, slots=True)
class FakeSampler:
    """What :meth:`FakeBackend.new_sampler` returns: params, seed and the accepted tokens."""

    params: SamplingParams
    seed: int
    rng: random.Random
    accepted: list[int] = field(default_factory=list)
    grammar: FakeGrammar | None = None
    graph: bool = False
    """Built for graph sampling (:class:`~llamax.testing.backend.FakeBackend`'s
    ``graph_sampling``): the decode may sample its rows."""
    seq_id: int | None = None
    """The sequence id its chain is attached to (graph sampling), or None."""
    attached_once: bool = False
    """Its chain was attached and not renewed since: attaching it again, or sampling it on
    the host, would abort llama.cpp (the fake raises AssertionError)."""

    @classmethod
    def new(cls, params: SamplingParams, seed: int, grammar: str | None) -> FakeSampler:
        """A sampler under the :class:`FakeGrammar` ``grammar`` stands for, if any."""
        parsed = None if grammar is None else FakeGrammar.parse(grammar)
        return cls(params, seed, random.Random(seed), grammar=parsed)


@dataclass(frozen=True, slots=True)
class FakeGrammar:
    """The one grammar shape the fake enforces: ``root ::= [chars]{min,max}`` (also ``*``,
    ``+``, ``{n}``; ``a-z`` ranges allowed), that is between ``min`` and ``max`` of the
    listed single-byte characters, then the end of generation. Like llama.cpp's grammar
    sampler it masks what the grammar forbids, and with ``ignore_eos`` (or an empty class)
    it reaches a dead end where :meth:`FakeBackend.sample` raises ``RequestFailedError``.
    Other grammars constrain nothing."""

    allowed: frozenset[int]
    """Token ids of the allowed characters."""
    least: int
    most: int | None

    @classmethod
    def parse(cls, text: str) -> FakeGrammar | None:
        """The fake grammar ``text`` stands for, or None when it is not of that shape."""
        found = _GRAMMAR.fullmatch(text.strip())
        if found is None:
            return None
        chars, repeat = found.group(1), found.group(2)
        allowed: set[int] = set()
        i = 0
        while i < len(chars):
            if i + 2 < len(chars) and chars[i + 1] == "-":
                allowed.update(range(ord(chars[i]), ord(chars[i + 2]) + 1))
                i += 3
            else:
                allowed.add(ord(chars[i]))
                i += 1
        tokens = frozenset(c + 1 for c in allowed if c < 128)
        if repeat in ("*", "+"):
            return cls(tokens, int(repeat == "+"), None)
        low, _, high = repeat.strip("{}").partition(",")
        return cls(tokens, int(low), int(high) if high else None if _ else int(low))


def sample(sampler: FakeSampler, row: npt.NDArray[np.float32], eog: frozenset[int]) -> int:
    """Greedy argmax, or a softmax draw at the sampler's temperature, after logit_bias
    and the grammar's mask; the sampler accepts the token.

    Raises:
        RequestFailedError: the grammar allows no token here (as llama.cpp's backend).
    """
    return draw(sampler, row, eog, 0).token


def draw(
    sampler: FakeSampler, row: npt.NDArray[np.float32], eog: frozenset[int], limit: int
) -> Drawn:
    """:func:`sample`, with the distribution it drew from (its ``limit`` likeliest tokens
    with a probability above 0; greedy: the token alone, probability 1).

    Raises:
        RequestFailedError: the grammar allows no token here (as llama.cpp's backend).
    """
    logits = row.astype(np.float64)
    params = sampler.params
    for token, bias in params.logit_bias.items():
        logits[token] += bias
    grammar = sampler.grammar
    if grammar is not None:
        allowed = set(eog) if len(sampler.accepted) >= grammar.least else set()
        if grammar.most is None or len(sampler.accepted) < grammar.most:
            allowed |= grammar.allowed
        forbidden = np.ones(len(logits), bool)
        forbidden[sorted(allowed)] = False
        logits[forbidden] = -np.inf
    if params.ignore_eos:
        logits[list(eog)] = -np.inf
    if not np.isfinite(logits).any():
        raise RequestFailedError("the grammar allows no token here")
    if params.is_greedy:
        token = int(np.argmax(logits))
        drawn = Drawn(token, 1.0, (token,), (1.0,))
    else:
        probs = np.exp((logits - logits.max()) / params.temperature)
        probs /= probs.sum()
        cumulative = np.cumsum(probs)
        drawn_at = int(np.searchsorted(cumulative, sampler.rng.random()))
        token = min(drawn_at, len(probs) - 1)
        order = np.argsort(-probs, kind="stable")[:limit]
        order = order[probs[order] > 0]
        drawn = Drawn(token, float(probs[token]), tuple(int(t) for t in order),
                      tuple(float(p) for p in probs[order]))  # fmt: skip
    sampler.accepted.append(token)
    return drawn
