"""A small GBNF recognizer and sampler in pure Python, for checking generated grammars
against a reference without a model.

It reads what llama.cpp's parser reads in the grammars llamax writes: rules ``name ::= ...``
(one per line, or spanning lines inside parentheses), alternatives ``|`` (empty ones too),
string literals, character classes (``[^...]``, ranges, the escapes below), rule references,
groups, ``.``, and the postfix operators ``*``, ``+``, ``?``, ``{m}``, ``{m,}``, ``{m,n}``.
Matching is by sets of end positions, memoised per rule and position; the grammars must not
be left-recursive (llama.cpp refuses those too).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]"}


@dataclass(frozen=True)
class _Lit:
    text: str


@dataclass(frozen=True)
class _Class:
    ranges: tuple[tuple[str, str], ...]
    negated: bool

    def has(self, char: str) -> bool:
        return any(lo <= char <= hi for lo, hi in self.ranges) != self.negated


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Alt:
    options: tuple[tuple[object, ...], ...]


@dataclass(frozen=True)
class _Rep:
    item: object
    least: int
    most: int | None


_ANY = _Class((), True)


@dataclass
class Grammar:
    """A parsed GBNF grammar: :meth:`accepts` and :meth:`sample`."""

    rules: dict[str, _Alt] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Grammar:
        """Parse ``text``.

        Raises:
            ValueError: the text is not GBNF this reader knows, or a rule is undefined.
        """
        parser = _Parser(text)
        grammar = cls(parser.rules())
        for name in parser.referenced:
            if name not in grammar.rules:
                raise ValueError(f"undefined rule {name!r}")
        return grammar

    def accepts(self, text: str, root: str = "root") -> bool:
        """Whether ``root`` matches all of ``text``."""
        memo: dict[tuple[str, int], frozenset[int]] = {}
        return len(text) in self._ends(_Ref(root), text, 0, memo)

    def _ends(
        self, item: object, text: str, at: int, memo: dict[tuple[str, int], frozenset[int]]
    ) -> frozenset[int]:
        if isinstance(item, _Lit):
            return (
                frozenset([at + len(item.text)]) if text.startswith(item.text, at) else frozenset()
            )
        if isinstance(item, _Class):
            return frozenset([at + 1]) if at < len(text) and item.has(text[at]) else frozenset()
        if isinstance(item, _Ref):
            key = (item.name, at)
            if key not in memo:
                memo[key] = frozenset()  # a left-recursive rule matches nothing here
                memo[key] = self._ends(self.rules[item.name], text, at, memo)
            return memo[key]
        if isinstance(item, _Alt):
            ends: set[int] = set()
            for option in item.options:
                ends |= self._sequence(option, text, at, memo)
            return frozenset(ends)
        assert isinstance(item, _Rep)
        found = {at} if item.least == 0 else set()
        frontier, count = {at}, 0
        while frontier and (item.most is None or count < item.most):
            count += 1
            frontier = {e for s in frontier for e in self._ends(item.item, text, s, memo)}
            frontier -= {s for s in frontier if item.most is None and s in found}
            if count >= item.least:
                found |= frontier
        return frozenset(found)

    def _sequence(
        self,
        items: tuple[object, ...],
        text: str,
        at: int,
        memo: dict[tuple[str, int], frozenset[int]],
    ) -> frozenset[int]:
        positions = frozenset([at])
        for item in items:
            positions = frozenset(e for s in positions for e in self._ends(item, text, s, memo))
            if not positions:
                break
        return positions

    def sample(self, rng: random.Random, root: str = "root", most: int = 8) -> str:
        """A random string ``root`` matches: random alternatives and characters, and
        repetitions of at most ``most`` beyond their least (``*``, ``+`` and open ``{m,}``)."""
        out: list[str] = []
        self._sample(_Ref(root), rng, out, most)
        return "".join(out)

    def _sample(self, item: object, rng: random.Random, out: list[str], most: int) -> None:
        if isinstance(item, _Lit):
            out.append(item.text)
        elif isinstance(item, _Class):
            chars = [chr(c) for c in range(32, 127) if item.has(chr(c))]
            out.append(rng.choice(chars))
        elif isinstance(item, _Ref):
            self._sample(self.rules[item.name], rng, out, most)
        elif isinstance(item, _Alt):
            for part in rng.choice(item.options):
                self._sample(part, rng, out, most)
        else:
            assert isinstance(item, _Rep)
            top = item.least + most if item.most is None else item.most
            for _ in range(rng.randint(item.least, top)):
                self._sample(item.item, rng, out, most)


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.at, self.referenced = text, 0, set[str]()

    def rules(self) -> dict[str, _Alt]:
        rules: dict[str, _Alt] = {}
        self._space(newlines=True)
        while self.at < len(self.text):
            name = self._name()
            self._space(newlines=False)
            if not self.text.startswith("::=", self.at):
                raise ValueError(f"expected ::= at {self.at}")
            self.at += 3
            rules[name] = self._alternatives(nested=False)
            self._space(newlines=True)
        return rules

    def _space(self, newlines: bool) -> None:
        while self.at < len(self.text):
            c = self.text[self.at]
            if c == "#":
                while self.at < len(self.text) and self.text[self.at] != "\n":
                    self.at += 1
            elif c in " \t" or (newlines and c in "\r\n"):
                self.at += 1
            else:
                return

    def _name(self) -> str:
        start = self.at
        while self.at < len(self.text) and (
            self.text[self.at].isalnum() or self.text[self.at] == "-"
        ):
            self.at += 1
        if start == self.at:
            raise ValueError(f"expected a name at {start}: {self.text[start : start + 20]!r}")
        return self.text[start : self.at]

    def _alternatives(self, nested: bool) -> _Alt:
        options = [self._sequence(nested)]
        while self.at < len(self.text) and self.text[self.at] == "|":
            self.at += 1
            options.append(self._sequence(nested))
        return _Alt(tuple(options))

    def _sequence(self, nested: bool) -> tuple[object, ...]:
        items: list[object] = []
        while True:
            self._space(newlines=nested)
            if self.at >= len(self.text) or self.text[self.at] in "|)\r\n":
                return tuple(items)
            items.append(self._postfix(self._item()))

    def _item(self) -> object:
        c = self.text[self.at]
        if c == '"':
            self.at += 1
            chars = []
            while self.text[self.at] != '"':
                chars.append(self._char())
            self.at += 1
            return _Lit("".join(chars))
        if c == "[":
            self.at += 1
            negated = self.text[self.at] == "^"
            self.at += negated
            ranges = []
            while self.text[self.at] != "]":
                lo = self._char()
                hi = lo
                if self.text[self.at] == "-" and self.text[self.at + 1] != "]":
                    self.at += 1
                    hi = self._char()
                ranges.append((lo, hi))
            self.at += 1
            return _Class(tuple(ranges), negated)
        if c == "(":
            self.at += 1
            group = self._alternatives(nested=True)
            self._space(newlines=True)
            if self.text[self.at] != ")":
                raise ValueError(f"expected ) at {self.at}")
            self.at += 1
            return group
        if c == ".":
            self.at += 1
            return _ANY
        name = self._name()
        self.referenced.add(name)
        return _Ref(name)

    def _char(self) -> str:
        c = self.text[self.at]
        self.at += 1
        if c != "\\":
            return c
        e = self.text[self.at]
        self.at += 1
        if e in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[e]
            code = int(self.text[self.at : self.at + width], 16)
            self.at += width
            return chr(code)
        return _ESCAPES[e]

    def _postfix(self, item: object) -> object:
        while self.at < len(self.text):
            c = self.text[self.at]
            if c in "*+?":
                self.at += 1
                item = _Rep(item, 1 if c == "+" else 0, 1 if c == "?" else None)
            elif c == "{":
                end = self.text.index("}", self.at)
                low, comma, high = self.text[self.at + 1 : end].partition(",")
                least = int(low)
                most = least if not comma else (int(high) if high.strip() else None)
                self.at = end + 1
                item = _Rep(item, least, most)
            else:
                return item
        return item
