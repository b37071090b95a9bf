"""Every grammar a request can cause is budgeted before and while it is built (issue 54,
finding 1): integer ranges with long bounds in rules linear in their digits (exact, checked
by a pure-Python GBNF matcher and by llama.cpp's engine), repetition counts, nesting, the
bytes of the GBNF and of what llama.cpp would expand it to; refusals are 400s in each
dialect's shape, and the native slot route builds its grammar off the event loop."""

from __future__ import annotations

import asyncio
import ctypes
import json
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gbnf import Grammar

import llamax
from llamax.grammar import schema_to_gbnf
from llamax.grammar_budget import (
    MAX_GBNF_NESTING,
    MAX_GRAMMAR_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_REPETITION,
    GrammarCache,
    gbnf_problem,
)
from llamax.grammar_long_ranges import MAX_INTEGER_DIGITS
from llamax.server import BackgroundServer, create_app
from llamax.testing import FakeBackend, assert_idle

TEMPLATE = (Path(__file__).parent / "data" / "smollm2_chat_template.jinja").read_text()
SPECIALS = {"<|im_start|>": 300, "<|im_end|>": 301}
HELLO = [{"role": "user", "content": "Hi"}]
WAIT = 30.0  # seconds a held worker waits for the test before giving up (never reached)


def wide(digits: int) -> dict[str, Any]:
    """The issue's reproducer: ``-10**D <= n <= 10**D``, no ``multipleOf``."""
    return {"type": "integer", "minimum": -(10**digits), "maximum": 10**digits}


def in_object(field: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"n": field}, "required": ["n"]}


@pytest.fixture
def ctx() -> Iterator[llamax.Context]:
    backend = FakeBackend(
        n_ctx=1024, metadata={"tokenizer.chat_template": TEMPLATE}, special_tokens=SPECIALS
    )
    context = llamax.Context(backend=backend)
    yield context
    if not context.closed:
        assert_idle(context)
    context.close()


# ---------------------------------------------------------------- integer ranges
@pytest.mark.parametrize("digits", [450, 900])
def test_a_long_integer_range_builds_a_grammar_linear_in_its_digits(digits: int) -> None:
    """Old: 5 MB (D=450) and 20 MB (D=900) of GBNF, gigabytes in llama.cpp's parser."""
    grammar = schema_to_gbnf(json.dumps(in_object(wide(digits))))
    assert len(grammar) < 40 * digits + 4000, len(grammar)  # about 35 bytes a digit
    assert gbnf_problem(grammar) is None


@pytest.mark.parametrize("digits", [MAX_INTEGER_DIGITS, 4000])
def test_integer_bounds_past_the_digit_limit_are_refused_naming_the_field(digits: int) -> None:
    with pytest.raises(llamax.GrammarError, match=rf"field 'n' .*{MAX_INTEGER_DIGITS} digits"):
        schema_to_gbnf(json.dumps(in_object(wide(digits))))


def _random_bound(rng: random.Random, digits: int) -> int:
    text = str(rng.randint(1, 9)) + "".join(rng.choice("0123456789") for _ in range(digits - 1))
    return int(text) * rng.choice((-1, 1))


def _near(value: int, rng: random.Random, num_digits: int) -> list[int]:
    """Values at and around ``value``: +-1, and ``num_digits`` of its digits changed."""
    out = [value - 1, value, value + 1]
    text = str(abs(value))
    for i in rng.sample(range(len(text)), min(len(text), num_digits)):
        for d in "09" + rng.choice("12345678"):
            changed = int(text[:i] + d + text[i + 1 :])
            out.append(changed if value >= 0 else -changed)
    return out


def _cases(rng: random.Random, num: int, digits: tuple[int, int]) -> list[tuple[int, int]]:
    cases = []
    for _ in range(num):
        a = _random_bound(rng, rng.randint(*digits))
        b = _random_bound(rng, rng.randint(*digits))
        cases.append((min(a, b), max(a, b)))
    same = _random_bound(rng, digits[1])
    cases += [(same, same), (abs(same), abs(same) + 10**5), (-abs(same), 0)]
    return cases


def _texts(low: int, high: int, rng: random.Random, num_digits: int = 8) -> list[str]:
    values = _near(low, rng, num_digits) + _near(high, rng, num_digits) + [0, 1, -1]
    values += [rng.randint(low, high) for _ in range(10)]
    return [str(v) for v in values] + ["-0", "007", "+5", "0" + str(abs(high))]


def test_long_integer_ranges_are_exact() -> None:
    rng = random.Random(54)
    for low, high in _cases(rng, 30, (19, 40)):
        schema = {"type": "integer", "minimum": low, "maximum": high}
        matcher = Grammar.parse(schema_to_gbnf(json.dumps(schema)))
        for text in _texts(low, high, rng):
            inside = text.lstrip("-").isdigit() and str(int(text)) == text
            inside = inside and low <= int(text) <= high
            assert matcher.accepts(text) == inside, (low, high, text)


def test_an_open_side_allows_sixteen_digits_as_llama_cpps() -> None:
    matcher = Grammar.parse(schema_to_gbnf(json.dumps({"type": "integer",
                                                       "minimum": -(10**30)})))  # fmt: skip
    assert matcher.accepts(f"{-(10**30)} ") and matcher.accepts(f"{10**16 - 1} ")
    assert not matcher.accepts(f"{10**16} ") and not matcher.accepts(f"{-(10**30) - 1} ")
    with pytest.raises(llamax.GrammarError, match="16 digits"):
        schema_to_gbnf(json.dumps({"type": "integer", "minimum": 10**30}))


@pytest.fixture(scope="module")
def llama_accepts(model_path: Path) -> Iterator[Callable[[str, str], bool]]:
    """``accepts(grammar, text)`` by llama.cpp's grammar sampler on SmolLM2's vocabulary
    (as tests/test_grammar_numbers.py's): each character's token must survive the mask."""
    import llama_cpp as C

    C.llama_backend_init()
    params = C.llama_model_default_params()
    params.vocab_only = True
    model = C.llama_model_load_from_file(str(model_path).encode(), params)
    assert model
    vocab = C.llama_model_get_vocab(model)
    tokens = {}
    for char in "-+0123456789":
        buffer = (C.llama_token * 4)()
        assert C.llama_tokenize(vocab, char.encode(), 1, buffer, 4, False, True) == 1
        tokens[char] = buffer[0]
    end = C.llama_vocab_eos(vocab)

    def survives(sampler: Any, token: int) -> bool:
        data = (C.llama_token_data * 1)(C.llama_token_data(token, 0.0, 0.0))
        array = C.llama_token_data_array(data, 1, -1, False)
        C.llama_sampler_apply(sampler, ctypes.byref(array))
        return bool(data[0].logit != float("-inf"))

    def accepts(grammar: str, text: str) -> bool:
        sampler = C.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        assert sampler, "llama.cpp refused the grammar"
        try:
            for char in text:
                if not survives(sampler, tokens[char]):
                    return False
                C.llama_sampler_accept(sampler, tokens[char])
            return survives(sampler, end)
        finally:
            C.llama_sampler_free(sampler)

    yield accepts
    C.llama_model_free(model)


@pytest.mark.model
def test_llama_cpps_engine_agrees_on_ranges_near_the_digit_limit(
    llama_accepts: Callable[[str, str], bool],
) -> None:
    rng = random.Random(540)
    cases = _cases(rng, 1, (MAX_INTEGER_DIGITS - 20, MAX_INTEGER_DIGITS))[:3]
    cases.append((-(10**999), 10**999))
    for low, high in cases:
        grammar = schema_to_gbnf(json.dumps({"type": "integer", "minimum": low, "maximum": high}))
        for text in _texts(low, high, rng, num_digits=3):
            inside = text.lstrip("-").isdigit() and str(int(text)) == text
            inside = inside and low <= int(text) <= high
            assert llama_accepts(grammar, text) == inside, (len(str(low)), text[:40])


# ---------------------------------------------------------------- other schema constructs
@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "string", "maxLength": 200_000}, "maxLength"),
        ({"type": "string", "minLength": 10**9}, "minLength"),
        ({"type": "array", "items": {"type": "integer"}, "maxItems": 50_000}, "maxItems"),
        ({"type": "string", "pattern": "^a{0,50000}$"}, "pattern"),
    ],
)
def test_repetition_counts_are_refused_before_the_converter_writes_them(
    schema: dict[str, Any], named: str
) -> None:
    """Old: the converter wrote each repetition out (``minLength: 10**9`` never ends)."""
    with pytest.raises(llamax.GrammarError, match=rf"{named}.*limit of {MAX_SCHEMA_REPETITION}"):
        schema_to_gbnf(json.dumps(in_object(schema)))


def test_many_repetitions_together_are_held_by_the_byte_budget() -> None:
    field = {"type": "array", "items": {"type": "integer"}, "maxItems": MAX_SCHEMA_REPETITION}
    many = {"type": "object", "properties": {f"f{i}": field for i in range(40)}}
    with pytest.raises(llamax.GrammarError, match=f"limit of {MAX_GRAMMAR_BYTES} bytes"):
        schema_to_gbnf(json.dumps(many))


def test_a_repetition_is_charged_at_the_length_of_its_rule_name() -> None:
    """Each repeated item is the item's rule name, made of every key on its path: a long
    name repeated 5,000 times is 10 MB that the converter would write before adding it."""
    items = {"type": "array", "items": {"type": "integer"}, "maxItems": 5000}
    schema = {"type": "object", "properties": {"k" * 2000: items}}
    with pytest.raises(llamax.GrammarError, match=f"limit of {MAX_GRAMMAR_BYTES} bytes"):
        schema_to_gbnf(json.dumps(schema))


def test_deep_schemas_are_grammar_errors_never_recursion_errors() -> None:
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(900):
        deep = {"type": "array", "items": deep}
    with pytest.raises(llamax.GrammarError, match=f"deeper than the limit of {MAX_SCHEMA_DEPTH}"):
        schema_to_gbnf(json.dumps(deep))
    deeper = '{"type": "array", "items": ' * 5000 + '{"type": "integer"}' + "}" * 5000
    with pytest.raises(llamax.GrammarError, match="nested too deeply"):
        schema_to_gbnf(deeper)  # past Python's own JSON reader
    # Optional properties in schema order take two rules each (llamax.grammar_objects): 3,000
    # of them build in linear size (the converter's own rule was quadratic and over the
    # budget); 30,000 pass the rule limit.
    def optional(n: int) -> str:
        properties = {f"p{i}": {"type": "integer"} for i in range(n)}
        return json.dumps({"type": "object", "properties": properties})

    assert len(schema_to_gbnf(optional(3000))) < 200 * 3000
    with pytest.raises(llamax.GrammarError, match="limit of"):
        schema_to_gbnf(optional(30000))


def test_a_requests_tools_share_one_grammar_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from llamax.tools import call_grammar, prepare_tools, spec, tool_call_grammar

    field = {"type": "array", "items": {"type": "integer"}, "maxItems": 2000}
    schema = {"type": "object", "properties": {"xs": field}}
    size = len(schema_to_gbnf(json.dumps(schema)))
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": schema}}
             for i in range(10)]  # fmt: skip
    monkeypatch.setattr(spec, "MAX_GRAMMAR_BYTES", 5 * size)
    with pytest.raises(llamax.InvalidParameterError, match=r"tools\[5\].*in all"):
        prepare_tools(tools)
    monkeypatch.setattr(spec, "MAX_GRAMMAR_BYTES", 20 * size)
    monkeypatch.setattr(call_grammar, "MAX_GRAMMAR_BYTES", 5 * size)  # with rule prefixes
    with pytest.raises(llamax.GrammarError, match="at function 'f3'"):
        tool_call_grammar(prepare_tools(tools))


# ---------------------------------------------------------------- GBNF text
def test_a_gbnf_is_measured_before_llama_cpp_parses_it(ctx: llamax.Context) -> None:
    """Old: llama.cpp's parser got each (a 1 KB literal repeated 10,000 times is 10 MB of
    its elements; 300 nested groups are 300 recursive calls)."""
    literal = f'root ::= "{"a" * 1000}"{{10000}}'
    nested = "root ::= " + "(" * (MAX_GBNF_NESTING + 1) + '"a"' + ")" * (MAX_GBNF_NESTING + 1)
    huge = 'root ::= "a"\n' + "# padding\n" * (MAX_GRAMMAR_BYTES // 10)
    assert gbnf_problem('root ::= "a"{3} [0-9]{0,15} ("b"){2}') is None
    assert "expand" in (gbnf_problem('root ::= "a"{' + "9" * 5000 + "}") or "")
    named = "r" * 500  # llama.cpp names each optional copy after its rule
    assert gbnf_problem(f'root ::= {named}\n{named} ::= "a"{{0,1000}}') is None
    many = "\n".join(f'{named}{i} ::= "a"{{0,10000}}' for i in range(10))
    assert "expand" in (gbnf_problem(many) or "")
    parsed: list[str] = []
    check = ctx._backend.check_grammar
    ctx._backend.check_grammar = lambda g: parsed.append(g) or check(g)  # type: ignore[method-assign,func-returns-value]
    for grammar, why in ((literal, "expand"), (nested, "nests"), (huge, "bytes")):
        assert why in (gbnf_problem(grammar) or "")
        with pytest.raises(llamax.GrammarError, match=why):
            ctx.completion("a", grammar=grammar, max_tokens=1)
    assert parsed == []  # refused before the (native) parse


def test_the_grammar_cache_is_bounded_in_bytes() -> None:
    built: list[str] = []

    def build(text: str) -> str:
        built.append(text)
        return text * 100

    cache = GrammarCache(build, max_bytes=5_000)  # 1,010 bytes an entry; 1,250 at most
    for key in ("a", "b", "a", "cc", "d", "e", "f", "a", "b"):
        assert cache(key * 10) == key * 1000
    # "a" kept, "cc" too large to keep, "b" the least recent when "f" passed 5,000 bytes
    assert built == [k * 10 for k in ("a", "b", "cc", "d", "e", "f", "b")]


# ---------------------------------------------------------------- over HTTP
def call(app: Any, requests: list[tuple[str, dict[str, Any]]]) -> list[httpx.Response]:
    """POST each ``(path, body)`` at once through httpx's ASGI transport."""

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return list(
                await asyncio.gather(*(client.post(p, json=b, timeout=WAIT) for p, b in requests))
            )

    return asyncio.run(go())


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}


def test_a_huge_integer_range_is_a_400_and_a_bystander_is_served(ctx: llamax.Context) -> None:
    too_long = {
        "messages": HELLO,
        "max_tokens": 1,
        "response_format": _schema_format(in_object(wide(MAX_INTEGER_DIGITS))),
    }
    small = {
        "messages": HELLO,
        "max_tokens": 1,
        "response_format": _schema_format(in_object(wide(450))),
    }  # the 1 KB body
    bomb = {"prompt": "a", "n_predict": 1, "grammar": f'root ::= "{"a" * 1000}"{{10000}}'}
    bystander = {"messages": HELLO, "max_tokens": 2}
    refused, built, native, served = call(create_app(ctx), [
        ("/v1/chat/completions", too_long), ("/v1/chat/completions", small),
        ("/completion", bomb), ("/v1/chat/completions", bystander),
    ])  # fmt: skip
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_grammar"
    assert f"at most {MAX_INTEGER_DIGITS} digits" in error["message"]
    assert built.status_code == 200, built.text
    assert native.status_code == 400 and "expand" in native.json()["error"]["message"]
    assert served.status_code == 200 and served.json()["choices"][0]["message"]


FIM = {"<fim_prefix>": 300, "<fim_suffix>": 301, "<fim_middle>": 302}


def test_the_native_slot_route_builds_its_grammar_off_the_event_loop() -> None:
    """``/infill`` (and ``/completion`` with ``id_slot``) submitted on the event loop: a
    grammar's build (and llama.cpp's parse) stalled every client."""
    backend = FakeBackend(n_ctx=1024, special_tokens=FIM)
    entered, opened = threading.Event(), threading.Event()
    held: list[bool] = []
    check = backend.check_grammar

    def slow(grammar: str) -> str | None:
        if "slow" in grammar:
            entered.set()
            held.append(opened.wait(WAIT))
        return check(grammar)

    backend.check_grammar = slow  # type: ignore[method-assign]
    body = {"input_prefix": "a", "input_suffix": "b", "n_predict": 1,
            "grammar": 'root ::= "slow"'}  # fmt: skip
    with llamax.Context(backend=backend) as ctx, BackgroundServer(create_app(ctx)) as server:
        replies: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: replies.append(
            httpx.post(server.url + "/infill", json=body, timeout=2 * WAIT)
        ))  # fmt: skip
        worker.start()
        assert entered.wait(WAIT)
        health = httpx.get(server.url + "/health", timeout=2 * WAIT)
        answered_while_held = not held
        opened.set()
        worker.join()
        assert_idle(ctx)
    assert health.status_code == 200 and replies[0].status_code == 200, replies[0].text
    assert answered_while_held, "/health waited for the grammar: it was built on the event loop"
