"""Numeric bounds and ``multipleOf`` in JSON schemas are enforced by the grammar (issue 44):
the rules of :mod:`llamax.grammar_numbers`, through :func:`llamax.grammar.schema_to_gbnf`,
checked against a reference in Python with a pure-Python GBNF matcher (``tests/gbnf.py``),
and, with SmolLM2's vocabulary, by llama.cpp's own grammar engine on the same reference.
"""

from __future__ import annotations

import ctypes
import json
import math
import random
import re
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from gbnf import Grammar
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llamax
from llamax.grammar import number_bounds, schema_to_gbnf
from llamax.grammar_numbers import MAX_NUMBER_RULES, MAX_SCHEMA_NUMBER_RULES

PLAIN = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")


class Reference:
    """What a schema's numeric keywords allow, in the form the grammar writes, in Python."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.integral = schema["type"] == "integer"
        self.low, self.high = number_bounds(schema)
        multiple = schema.get("multipleOf")
        self.multiple = None if multiple is None else Decimal(repr(multiple))
        self.schema = schema

    def allows(self, value: Decimal) -> bool:
        """The bounds and the multiple, on exact decimals."""
        if self.low is not None and not (
            value > self.low.value or (self.low.inclusive and value == self.low.value)
        ):
            return False
        if self.high is not None and not (
            value < self.high.value or (self.high.inclusive and value == self.high.value)
        ):
            return False
        if self.integral and value != value.to_integral_value():
            return False
        return self.multiple is None or value % self.multiple == 0

    def allows_text(self, text: str) -> bool:
        """``text`` is a plain decimal (no exponent, no ``-0``, at most 15 significant
        and 16 fraction digits) that :meth:`allows`."""
        if not PLAIN.fullmatch(text) or (text.startswith("-") and Decimal(text) == 0):
            return False
        whole, point, fraction = text.lstrip("-").partition(".")
        if (self.integral and point) or len(fraction) > 16:
            return False
        if len((whole + fraction).lstrip("0")) > 15:
            return False
        return self.allows(Decimal(text))

    def allows_double(self, text: str) -> bool:
        """The bounds as a client comparing doubles sees them (pydantic, JavaScript)."""
        value, schema = float(text), self.schema
        return (
            value >= schema.get("minimum", -math.inf)
            and value > schema.get("exclusiveMinimum", -math.inf)
            and value <= schema.get("maximum", math.inf)
            and value < schema.get("exclusiveMaximum", math.inf)
        )

    def is_empty(self) -> bool:
        """No value at all meets the keywords (the digit caps aside)."""
        step = self.multiple
        if self.integral:
            step = Decimal(1) if step is None else _integer_step(step)
        if self.low is None or self.high is None:
            return False
        if step is None:
            return self.low.value > self.high.value or (
                self.low.value == self.high.value
                and not (self.low.inclusive and self.high.inclusive)
            )
        first = math.ceil(self.low.value / step) * step
        if first == self.low.value and not self.low.inclusive:
            first += step
        return not (first < self.high.value or (first == self.high.value and self.high.inclusive))


def _integer_step(multiple: Decimal) -> Decimal:
    """The least integer that is a multiple of ``multiple``."""
    numerator, denominator = multiple.as_integer_ratio()
    return Decimal(numerator // math.gcd(numerator, denominator))


def _grammar(schema: dict[str, Any]) -> Grammar:
    return Grammar.parse(schema_to_gbnf(json.dumps(schema)))


def _plain(value: Decimal) -> str:
    text = f"{value:f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _variants(value: Decimal) -> list[str]:
    """``value`` written plainly, with a trailing zero, and as ``-0`` where it is zero."""
    text = _plain(value)
    out = [text, text + ("0" if "." in text else ".0")]
    return [*out, "-0", "-0.0"] if value == 0 else out


# --- the brief's cases, string by string -------------------------------------------------------
EDGES: list[tuple[dict[str, Any], list[str], list[str]]] = [
    (  # pydantic's Field(gt=0, lt=1) on a float
        {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
        ["0.5", "0.0001", "0.999999999999999", "0.10", "0.000000000000001"],
        ["0", "0.0", "0.00", "-0", "-0.5", "1", "1.0", "0.9999999999999999", ".5", "5e-1"],
    ),
    (  # Field(ge=-2.5, le=1e3)
        {"minimum": -2.5, "maximum": 1e3},
        ["-2.5", "-2.50", "-2", "-0.1", "0", "0.0", "999.99", "1000", "1000.000"],
        ["-2.51", "-3", "-0", "-0.0", "1000.01", "1001", "1e3", "01", "+1", "-02"],
    ),
    (  # negative on both sides
        {"minimum": -7.25, "exclusiveMaximum": -3},
        ["-7.25", "-7.2", "-3.001", "-4"],
        ["-7.26", "-8", "-3", "-3.0", "-2.9", "0", "3.5"],
    ),
    (  # one-sided, fractional bound
        {"exclusiveMinimum": 0.05},
        ["0.051", "0.06", "1", "123456789012345"],
        ["0.05", "0.050", "0", "0.049", "-1", "1234567890123456"],
    ),
    (  # one-sided, upper
        {"maximum": -0.5},
        ["-0.5", "-0.50", "-1", "-123.456"],
        ["-0.49", "0", "-0", "0.5"],
    ),
    (  # a single value
        {"minimum": 0, "maximum": 0},
        ["0", "0.0"],
        ["-0", "0.1", "-0.1", "1"],
    ),
]


@pytest.mark.parametrize(("bounds", "inside", "outside"), EDGES)
def test_number_bounds_at_their_edges(
    bounds: dict[str, Any], inside: list[str], outside: list[str]
) -> None:
    grammar = _grammar({"type": "number", **bounds})
    for text in inside:
        assert grammar.accepts(text), text
    for text in outside:
        assert not grammar.accepts(text), text


@pytest.mark.parametrize(
    ("schema", "inside", "outside"),
    [
        (
            {"type": "number", "multipleOf": 0.5, "minimum": -2, "exclusiveMaximum": 3},
            ["-2", "-1.5", "0", "0.5", "2.5", "2.50", "1.0"],
            ["-2.5", "0.25", "3", "3.0", "2.6", "-0"],
        ),
        (
            {"type": "number", "multipleOf": 0.01},
            ["0.01", "-12.34", "5", "5.1", "5.10", "1"],
            ["0.001", "12.345", "5.101"],
        ),
        (
            {"type": "integer", "multipleOf": 5, "minimum": -12, "maximum": 40},
            ["-10", "-5", "0", "5", "40"],
            ["-15", "-12", "3", "45", "5.0", "-0"],
        ),
        (
            {"type": "integer", "multipleOf": 7},
            ["0", "7", "-49", "700000000000000"],
            ["1", "-50", "7.0"],
        ),
        (
            {"type": "number", "multipleOf": 3600, "exclusiveMinimum": 0},
            ["3600", "7200", "86400", "360000.0"],
            ["0", "3601", "1800", "-3600"],
        ),
    ],
)
def test_multiples_are_enforced(
    schema: dict[str, Any], inside: list[str], outside: list[str]
) -> None:
    grammar = _grammar(schema)
    for text in inside:
        assert grammar.accepts(text), text
    for text in outside:
        assert not grammar.accepts(text), text


# --- property tests against the reference ------------------------------------------------------
_BOUND = st.decimals(min_value=-2000, max_value=2000, places=3, allow_nan=False)
_MULTIPLES = [None, None, 0.5, 0.25, 5, 0.01, 3, 7, 0.3, 1.5, 12, 0.125, 100]


@st.composite
def numeric_schemas(draw: st.DrawFn) -> dict[str, Any]:
    """A number with bounds and/or a multiple, or an integer with a multiple (and bounds)."""
    kind = draw(st.sampled_from(["number", "number", "integer"]))
    schema: dict[str, Any] = {"type": kind}
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        if draw(st.integers(0, 2)) == 0:
            value = draw(_BOUND)
            schema[key] = int(value) if value == value.to_integral_value() else float(value)
    multiple = draw(st.sampled_from(_MULTIPLES))
    if multiple is not None:
        schema["multipleOf"] = multiple
    if len(schema) == 1 or (kind == "integer" and multiple is None):
        schema["multipleOf"] = 0.5 if kind == "number" else 2
    return schema


_SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(numeric_schemas(), st.randoms(use_true_random=False))
def test_every_value_the_grammar_writes_meets_the_schema(
    schema: dict[str, Any], rng: random.Random
) -> None:
    reference = Reference(schema)
    try:
        grammar = _grammar(schema)
    except llamax.GrammarError as exc:
        assert reference.is_empty(), (schema, str(exc))
        return
    assert not reference.is_empty(), schema
    for _ in range(40):
        text = grammar.sample(rng).rstrip()
        assert reference.allows_text(text), (schema, text)
        assert reference.allows_double(text), (schema, text)
        json.loads(text)


@_SETTINGS
@given(numeric_schemas(), st.lists(_BOUND, max_size=8), st.integers(-60, 60))
def test_the_grammar_accepts_exactly_the_values_in_range(
    schema: dict[str, Any], values: list[Decimal], steps: int
) -> None:
    reference = Reference(schema)
    try:
        grammar = _grammar(schema)
    except llamax.GrammarError:
        assert reference.is_empty(), schema
        return
    candidates = [Decimal(0), *values]
    tiny = Decimal("0.001")
    for bound in (reference.low, reference.high):
        if bound is not None:
            candidates += [bound.value + k * tiny for k in (-11, -1, 0, 1, 11)]
    if reference.multiple is not None:  # multiples near the bounds and around zero
        for start in [Decimal(0)] + [b.value for b in (reference.low, reference.high) if b]:
            near = (start / reference.multiple).to_integral_value() * reference.multiple
            candidates += [near + k * reference.multiple for k in (-1, 0, 1, steps)]
    for value in candidates:
        for text in _variants(value):
            assert grammar.accepts(text) == reference.allows_text(text), (schema, text)


# --- limits, errors and the schema forms --------------------------------------------------------
@pytest.mark.parametrize("multiple", [0.01, 0.5, 0.25, 5, 7, 60, 0.37, 360, 1024, 3600, 86400])
def test_common_multiples_fit_without_bounds(multiple: float) -> None:
    for kind in ("number", "integer"):
        grammar = schema_to_gbnf(json.dumps({"type": kind, "multipleOf": multiple}))
        assert grammar.count("::=") <= MAX_NUMBER_RULES + 10


def test_a_multiple_past_the_limit_is_refused_naming_the_field() -> None:
    schema = {
        "type": "object",
        "properties": {"step": {"type": "number", "multipleOf": 999983, "minimum": 0}},
    }
    where = r"field 'step' \(number, minimum=0, multipleOf=999983\)"
    with pytest.raises(llamax.GrammarError, match=where) as caught:
        schema_to_gbnf(json.dumps(schema))
    assert f"{MAX_NUMBER_RULES} rules" in str(caught.value)
    bounded = {"type": "number", "multipleOf": 999983, "minimum": 0, "maximum": 5e6}
    assert _grammar(bounded).accepts("1999966")  # with a few multiples in range, it fits


def test_fields_alike_share_their_rules_and_a_schema_has_a_budget() -> None:
    # A field's rules grow a thousandfold over its text: thirty fields alike cost one
    # automaton, and distinct heavy ones stop at the schema's budget, naming the field.
    alike = {f"f{i}": {"type": "number", "multipleOf": 86400} for i in range(30)}
    grammar = schema_to_gbnf(json.dumps({"type": "object", "properties": alike}))
    assert grammar.count("::=") < MAX_NUMBER_RULES
    matcher = Grammar.parse(grammar)
    assert matcher.accepts('{"f0": 172800, "f29": -86400}')
    assert not matcher.accepts('{"f0": 172800, "f29": 86401}')
    primes = [37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101, 103, 107, 109]
    distinct = {f"f{i}": {"type": "number", "multipleOf": p / 100} for i, p in enumerate(primes)}
    message = f"numeric fields would exceed their limit of {MAX_SCHEMA_NUMBER_RULES} rules in all"
    with pytest.raises(llamax.GrammarError, match=r"field 'f\d+' .*" + message):
        schema_to_gbnf(json.dumps({"type": "object", "properties": distinct}))


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "number", "multipleOf": 0}, "multipleOf must be a number above 0"),
        ({"type": "integer", "multipleOf": -2}, "multipleOf must be a number above 0"),
        ({"type": "number", "multipleOf": "5"}, "multipleOf must be a number above 0"),
        ({"type": "number", "minimum": 2, "exclusiveMaximum": 2}, "no number"),
        ({"type": "number", "multipleOf": 5, "minimum": 1, "maximum": 4}, "no number"),
        ({"type": "integer", "multipleOf": 10, "minimum": 1, "maximum": 9}, "no number"),
        ({"type": "number", "exclusiveMinimum": 1e15}, "at most 15 significant digits"),
        # a bound that is not a number was skipped by the converter: now named
        ({"type": "number", "minimum": "5"}, "minimum must be a number, got '5'"),
        ({"type": "integer", "maximum": [3]}, r"maximum must be a number, got \[3\]"),
        (
            {"type": "object", "properties": {"x": {"type": "number", "exclusiveMinimum": "0"}}},
            "properties.x.exclusiveMinimum must be a number",
        ),
    ],
)
def test_impossible_or_malformed_keywords_are_grammar_errors(
    schema: dict[str, Any], message: str
) -> None:
    with pytest.raises(llamax.GrammarError, match=message):
        schema_to_gbnf(json.dumps(schema))


def test_a_type_list_keeps_its_bounds() -> None:
    grammar = _grammar({"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1})
    assert grammar.accepts("null") and grammar.accepts("0.5") and grammar.accepts("1")
    assert not grammar.accepts("0") and not grammar.accepts("1.5")


def test_draft_4_boolean_exclusive_bounds() -> None:
    grammar = _grammar({"type": "number", "minimum": 0, "exclusiveMinimum": True})
    assert not grammar.accepts("0") and grammar.accepts("0.1")
    integers = _grammar({"type": "integer", "maximum": 5, "exclusiveMaximum": True})
    assert integers.accepts("4") and not integers.accepts("5")


def test_enum_and_const_win_over_the_bounds() -> None:
    # the converter reads enum and const before type; the bounds must not replace them
    enum = _grammar({"type": "integer", "minimum": 1, "enum": [1, 2]})
    assert enum.accepts("1") and enum.accepts("2") and not enum.accepts("3")
    const = _grammar({"type": "number", "maximum": 9, "const": 4.5})
    assert const.accepts("4.5") and not const.accepts("4")


def test_rule_names_stay_apart_from_the_converters() -> None:
    # a property named like a primitive rule gets its own rule (the converter's naming)
    schema = {
        "type": "object",
        "properties": {
            "number": {"type": "number", "minimum": 1, "maximum": 2},
            "decimal-part": {"type": "number", "exclusiveMinimum": 0},
            "free": {"type": "number"},
        },
        "required": ["number", "decimal-part", "free"],
    }
    grammar = _grammar(schema)
    assert grammar.accepts('{"number": 1.5, "decimal-part": 0.25, "free": 1.0}')
    assert grammar.accepts('{"number": 2, "decimal-part": 7, "free": -3e5}')
    assert not grammar.accepts('{"number": 3, "decimal-part": 0.25, "free": 1}')
    assert not grammar.accepts('{"number": 1, "decimal-part": 0, "free": 1}')


# --- llama.cpp's grammar engine reads the same grammars alike ----------------------------------
@pytest.fixture(scope="module")
def llama_accepts(model_path: Path) -> Iterator[Callable[[str, str], bool]]:
    """``accepts(grammar, text)`` by llama.cpp's grammar sampler on SmolLM2's vocabulary (a
    vocabulary-only load): each character's token must survive the sampler's mask and is
    accepted, then the end-of-generation token must survive."""
    import llama_cpp as C

    C.llama_backend_init()
    params = C.llama_model_default_params()
    params.vocab_only = True
    model = C.llama_model_load_from_file(str(model_path).encode(), params)
    assert model
    vocab = C.llama_model_get_vocab(model)
    tokens = {}
    for char in "-+.e0123456789":
        buffer = (C.llama_token * 4)()
        assert C.llama_tokenize(vocab, char.encode(), 1, buffer, 4, False, True) == 1
        tokens[char] = buffer[0]
    end = C.llama_vocab_eos(vocab)

    def survives(sampler: Any, token: int) -> bool:
        data = (C.llama_token_data * 1)(C.llama_token_data(token, 0.0, 0.0))
        array = C.llama_token_data_array(data, 1, -1, False)
        C.llama_sampler_apply(sampler, ctypes.byref(array))
        return bool(data[0].logit != -math.inf)

    parsed: dict[str, Any] = {}  # a clone copies the parsed rules: parsing is the cost

    def accepts(grammar: str, text: str) -> bool:
        if grammar not in parsed:
            parsed[grammar] = C.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
            assert parsed[grammar], "llama.cpp refused the grammar"
        sampler = C.llama_sampler_clone(parsed[grammar])
        try:
            for char in text:
                if not survives(sampler, tokens[char]):
                    return False
                C.llama_sampler_accept(sampler, tokens[char])
            return survives(sampler, end)
        finally:
            C.llama_sampler_free(sampler)

    yield accepts
    for sampler in parsed.values():
        C.llama_sampler_free(sampler)
    C.llama_model_free(model)


@pytest.mark.model
@pytest.mark.parametrize(
    "schema",
    [{"type": "number", **bounds} for bounds, _, _ in EDGES]
    + [
        {"type": "number", "multipleOf": 0.25, "minimum": -2, "maximum": 3},
        {"type": "number", "multipleOf": 0.37},
        {"type": "integer", "multipleOf": 7, "exclusiveMinimum": -50},
    ],
)
def test_llama_cpps_grammar_engine_agrees(
    schema: dict[str, Any], llama_accepts: Callable[[str, str], bool]
) -> None:
    grammar = schema_to_gbnf(json.dumps(schema))
    reference = Reference(schema)
    rng = random.Random(44)
    texts = [text for bounds, inside, outside in EDGES for text in inside + outside]
    for _ in range(1500):
        text = "".join(rng.choice("0123456789.") for _ in range(rng.randint(1, 6)))
        texts.append(text if rng.random() < 0.7 else "-" + text)
    sampler = Grammar.parse(grammar)
    texts += [sampler.sample(rng).rstrip() for _ in range(100)]
    for text in texts:
        assert llama_accepts(grammar, text) == reference.allows_text(text), (schema, text)
