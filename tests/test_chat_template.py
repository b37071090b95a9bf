"""Chat templates and message validation, no model: rendering, sandbox, budget."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import pytest
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

import llamax
import llamax.templates
from llamax.templates import (
    ChatTemplate,
    InvalidMessageError,
    TemplateBudgetError,
    TemplateError,
    TemplateSecurityError,
    validate_messages,
)

DATA = Path(__file__).parent / "data"
SMOLLM2_SOURCE = (DATA / "smollm2_chat_template.jinja").read_text(encoding="utf-8")
USER = {"role": "user", "content": "Hi there"}
SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = [
    [USER],
    [SYSTEM, USER],
    [
        SYSTEM,
        USER,
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Say 'ü ✓ <b>' & \"quotes\"\nover two lines."},
    ],
    [USER, {"role": "assistant", "content": ""}, {"role": "user", "content": "   "}],
]


def reference_render(source: str, messages: list[dict[str, Any]], **variables: Any) -> str:
    """Plain (unsandboxed) Jinja with the options Hugging Face uses: the ground truth."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source).render(messages=messages, **variables)


# ------------------------------------------------------------------ package surface
def test_public_names_are_pinned() -> None:
    assert sorted(llamax.templates.__all__) == [
        "ChatTemplate",
        "InvalidMessageError",
        "TemplateBudgetError",
        "TemplateError",
        "TemplateSecurityError",
        "validate_messages",
    ]


def test_error_tree() -> None:
    assert issubclass(TemplateError, llamax.LlamaxError)
    assert issubclass(TemplateSecurityError, TemplateError)
    assert issubclass(TemplateBudgetError, TemplateError)
    assert issubclass(InvalidMessageError, llamax.InvalidRequestError)


def test_template_is_frozen_and_compares_by_value() -> None:
    template = ChatTemplate(SMOLLM2_SOURCE, eos_token="<|im_end|>")
    with pytest.raises(dataclasses.FrozenInstanceError):
        template.bos_token = "x"  # type: ignore[misc]
    assert template == ChatTemplate(SMOLLM2_SOURCE, eos_token="<|im_end|>")
    assert template != ChatTemplate(SMOLLM2_SOURCE)


@pytest.mark.parametrize(
    "options", [{"max_render_seconds": 0}, {"max_render_seconds": -1.0}, {"max_output_chars": 0}]
)
def test_budget_options_are_validated(options: dict[str, Any]) -> None:
    with pytest.raises(llamax.InvalidParameterError, match=next(iter(options))):
        ChatTemplate("x", **options)


# ------------------------------------------------------------------ golden rendering
def test_smollm2_renders_chatml_exactly() -> None:
    assert ChatTemplate(SMOLLM2_SOURCE).render([USER]) == (
        "<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm2_matches_reference_jinja(
    messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    template = ChatTemplate(SMOLLM2_SOURCE, bos_token="<|im_start|>", eos_token="<|im_end|>")
    expected = reference_render(
        SMOLLM2_SOURCE,
        messages,
        add_generation_prompt=add_generation_prompt,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


# Exercises what the sandbox instruments (loops, ``~``, filters, calls, operators), which
# must render exactly as in Hugging Face's own environment.
FEATURES_SOURCE = (DATA / "jinja_features.jinja").read_text(encoding="utf-8")


def hf_reference_render(source: str, **variables: Any) -> str:
    """Hugging Face's ``apply_chat_template`` environment, rebuilt here independently."""

    def tojson(value: Any, ensure_ascii: bool = False, **options: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, **options)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    return env.from_string(source).render(**variables)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_jinja_features_match_hugging_face_environment(
    messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    expected = hf_reference_render(
        FEATURES_SOURCE,
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        extra="E",
        bos_token="",
        eos_token="",
    )
    rendered = ChatTemplate(FEATURES_SOURCE).render(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, extra="E"
    )
    assert rendered == expected


def test_tokens_tools_and_extra_variables_reach_the_template() -> None:
    source = "{{ bos_token }}|{{ eos_token }}|{{ tools is none }}|{{ enable_thinking }}"
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert template.render([USER], enable_thinking=False) == "<s>|</s>|True|False"
    assert template.render([USER], tools=[], eos_token="<eot>") == "<s>|<eot>|False|"


def test_generation_tag_renders_its_body() -> None:
    source = (
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    )
    assert ChatTemplate(source).render([USER]) == "[Hi there]"


def test_tojson_matches_transformers() -> None:
    template = ChatTemplate(
        "{{ x|tojson }}#{{ x|tojson(indent=2) }}"
        "#{{ x|tojson(separators=(',', ':'), sort_keys=true) }}"
    )
    x = {"z": "<b>é & 'q'</b>", "a": [1, None, True]}
    compact = json.dumps(x, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    expected = f"{json.dumps(x, ensure_ascii=False)}#{json.dumps(x, ensure_ascii=False, indent=2)}"
    assert template.render([], x=x) == f"{expected}#{compact}"


def test_strftime_now_formats_the_current_date() -> None:
    before = datetime.now().strftime("%d %b %Y")
    rendered = ChatTemplate("{{ strftime_now('%d %b %Y') }}").render([])
    assert rendered in (before, datetime.now().strftime("%d %b %Y"))
    assert re.fullmatch(r"\d\d \w+ \d{4}", rendered)


def test_concurrent_renders_are_independent() -> None:
    template = ChatTemplate(SMOLLM2_SOURCE)
    slow = ChatTemplate(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        max_render_seconds=0.3,
    )
    expected = template.render(CONVERSATIONS[2])
    results: list[bool] = []

    def render_many() -> None:
        results.extend(template.render(CONVERSATIONS[2]) == expected for _ in range(200))

    threads = [threading.Thread(target=render_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    with pytest.raises(TemplateBudgetError):
        slow.render([])
    for thread in threads:
        thread.join()
    assert results == [True] * 800


# ------------------------------------------------------------------ sandbox
@pytest.mark.parametrize(
    "payload",
    [
        "{{ self.__init__.__globals__ }}",
        "{{ self.__init__.__globals__.__builtins__.__import__('os').popen('id').read() }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{{ joiner.__init__.__globals__ }}",
        "{{ namespace.__init__.__globals__ }}",
        "{{ messages.__class__.__base__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ strftime_now.__globals__['datetime'] }}",
        "{{ (messages|first)['__class__'] }}",
        "{{ ''.format.__globals__ }}",
        "{{ '{0.__class__}'.format('') }}",
    ],
)
def test_injection_payloads_are_refused(payload: str) -> None:
    with pytest.raises(TemplateSecurityError) as info:
        ChatTemplate(payload).render([dict(USER)])
    assert isinstance(info.value.__cause__, SecurityError)


@pytest.mark.parametrize(
    "payload",
    [
        "{% set _ = messages.append(1) %}",
        "{% set _ = messages.pop() %}",
        "{% set _ = messages.clear() %}",
        "{% set _ = messages[0].update({'role': 'system'}) %}",
        "{% set _ = messages[0].pop('content') %}",
        "{% set _ = messages[0].setdefault('x', 1) %}",
        "{{ messages.append }}",
    ],
)
def test_mutating_the_inputs_is_refused(payload: str) -> None:
    messages = [dict(USER)]
    with pytest.raises(TemplateSecurityError):
        ChatTemplate(payload).render(messages)
    assert messages == [USER]


def test_raise_exception_carries_the_template_message() -> None:
    source = (
        "{% if messages[0].role != 'system' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    )
    with pytest.raises(TemplateError, match="Conversation roles must alternate") as info:
        ChatTemplate(source).render([USER])
    assert type(info.value) is TemplateError
    assert ChatTemplate(source).render([SYSTEM]) == ""


def test_template_that_does_not_compile() -> None:
    with pytest.raises(TemplateError, match="does not compile") as info:
        ChatTemplate("{% for m in messages %}{{ m.content }")
    assert isinstance(info.value.__cause__, jinja2.TemplateSyntaxError)


@pytest.mark.parametrize(
    ("source", "cause"),
    [
        ("{{ 1 / 0 }}", ZeroDivisionError),
        ("{{ 'a' + 1 }}", TypeError),
        ("{{ missing.attribute }}", jinja2.UndefinedError),
        ("{{ lipsum(3) }}", jinja2.UndefinedError),
    ],
)
def test_render_failures_become_template_errors(source: str, cause: type[Exception]) -> None:
    with pytest.raises(TemplateError) as info:
        ChatTemplate(source).render([USER])
    assert type(info.value) is TemplateError
    assert isinstance(info.value.__cause__, cause)


# ------------------------------------------------------------------ budget
BUDGET_PAYLOADS = {
    "nested loops, no output": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    ),
    "nested loops over strings": (
        "{% set s = 'a' * 3000000 %}{% for i in s %}{% for j in s %}{% endfor %}{% endfor %}"
    ),
    "nested loops with output": (
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    ),
    "exponential macro": (
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(60) }}"
    ),
    "endless recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "recursive loop": "{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}",
    "huge output": "{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}",
    "string repetition": "{{ 'a' * 10**9 }}",
    "list repetition": "{{ ([0] * 10**9)|length }}",
    "repeated big strings": "{{ ([('a' * 1000000)] * 1000)|join }}",
    "huge power": "{{ 2 ** (10 ** 9) }}",
    "huge product": "{% set n = 2 ** 60000 %}{{ n * n }}",
    "doubling with +": (
        "{% set ns = namespace(s='a') %}"
        "{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
    ),
    "doubling with ~": (
        "{% set ns = namespace(s='a') %}"
        "{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    ),
    "doubling with join": (
        "{% set ns = namespace(s='a') %}"
        "{% for i in range(64) %}{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}"
    ),
    "center filter": "{{ 'a'|center(10**9) }}",
    "indent filter": "{{ ('\\n' * 100000)|indent(1000) }}",
    "str.ljust": "{{ 'a'.ljust(10**9) }}",
    "str.join": "{{ ('a' * 1000000).join(['x'] * 100) }}",
    "str.replace": "{{ ('a' * 100000).replace('', 'b' * 1000) }}",
    "replace filter": "{{ ('a' * 100000)|replace('a', 'b' * 1000) }}",
    "percent format": "{{ '%1000000000s' % 'a' }}",
    "format filter": "{{ '%1000000000s'|format('a') }}",
    "starred width": "{{ '%*s' % (10**9, 'a') }}",
    "named width": "{{ '%(a)1000000000s' % {'a': 1} }}",
    "str.format width": "{{ '{:>1000000000}'.format('a') }}",
    "nested format width": "{{ '{:>{w}}'.format('a', w=10**9) }}",
    "long range": "{{ range(10**9)|list|length }}",
    "endless range": "{{ range(10**30)|length }}",
}


@pytest.mark.parametrize("source", BUDGET_PAYLOADS.values(), ids=BUDGET_PAYLOADS.keys())
def test_pathological_templates_hit_the_budget_quickly(source: str) -> None:
    """Stopped within its budget (1 s) of the rendering thread's CPU time, the clock the
    budget counts, however busy the machine; the wall clock only within the backstop (ten
    times the budget). Timed on the wall clock (< 3 s), two payloads failed in a full run
    beside a benchmark on 2 cores."""
    template = ChatTemplate(source)
    started, cpu_started = time.monotonic(), time.thread_time()
    with pytest.raises(TemplateBudgetError):
        template.render([USER])
    assert time.thread_time() - cpu_started < 1.5
    assert time.monotonic() - started < 12.0


def test_time_budget_is_configurable() -> None:
    template = ChatTemplate(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        max_render_seconds=0.2,
    )
    started = time.monotonic()
    with pytest.raises(TemplateBudgetError, match=r"longer than 0\.2 s"):
        template.render([])
    assert time.monotonic() - started < 1.0


def test_a_render_that_waits_for_a_core_is_within_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a busy machine a render of a few milliseconds may wait seconds for a core or the
    GIL: the budget counts the rendering thread's CPU time, so the wall clock jumping 3 s
    does not refuse it (a wall-clock budget did: a forced tool's schema came back 400
    under a loaded test run); ten times the budget on the wall clock still stops it."""
    template = ChatTemplate(SMOLLM2_SOURCE, max_render_seconds=1.0)
    expected = template.render(CONVERSATIONS[2])
    real = time.monotonic
    jump = [0.0]

    def busy_clock() -> float:
        value = real() + jump[0]
        jump[0] = 3.0  # every reading after the budget's start is 3 s later
        return value

    monkeypatch.setattr(time, "monotonic", busy_clock)
    assert template.render(CONVERSATIONS[2]) == expected
    jump[0] = 0.0

    def stalled_clock() -> float:
        value = real() + jump[0]
        jump[0] = 11.0
        return value

    monkeypatch.setattr(time, "monotonic", stalled_clock)
    with pytest.raises(TemplateBudgetError, match="10 s on the wall clock"):
        template.render(CONVERSATIONS[2])


def test_output_budget_is_exact() -> None:
    source = "{% for i in range(n) %}x{% endfor %}"
    assert ChatTemplate(source, max_output_chars=50).render([], n=50) == "x" * 50
    with pytest.raises(TemplateBudgetError, match="max_output_chars=50"):
        ChatTemplate(source, max_output_chars=50).render([], n=51)


def test_budget_errors_chain_their_cause() -> None:
    with pytest.raises(TemplateBudgetError) as info:
        ChatTemplate("{{ 'a' * 10**9 }}").render([])
    assert info.value.__cause__ is not None


def test_long_legitimate_conversation_renders() -> None:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20}
        for i in range(2000)
    ]
    template = ChatTemplate(SMOLLM2_SOURCE)
    expected = reference_render(SMOLLM2_SOURCE, messages, add_generation_prompt=True)
    assert template.render(messages) == expected


# ------------------------------------------------------------------ validate_messages
def test_validate_messages_normalises_copies() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "S"},
        {
            "role": "user",
            "name": "ann",
            "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}],
        },
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
        {"role": "tool", "tool_call_id": "1", "content": "42"},
        {"role": "developer", "content": "D"},
    ]
    result = validate_messages(messages)
    assert [m["content"] for m in result] == ["S", "Hello world", None, "42", "D"]
    assert result[1]["name"] == "ann"
    assert result[2]["tool_calls"] == [{"id": "1", "type": "function"}]
    assert result[3]["tool_call_id"] == "1"
    assert isinstance(messages[1]["content"], list)  # the input is untouched
    assert all(r is not m for r, m in zip(result, messages, strict=True))


def test_assistant_tool_call_may_omit_content() -> None:
    result = validate_messages([{"role": "assistant", "tool_calls": [{"id": "1"}]}])
    assert result[0]["content"] is None


@pytest.mark.parametrize(
    ("messages", "index", "field", "pattern"),
    [
        ([{"role": "robot", "content": "x"}], 0, "role", r"messages\[0\]\.role must be one of"),
        ([USER, {"content": "x"}], 1, "role", r"messages\[1\]\.role is missing"),
        ([{"role": ["user"], "content": "x"}], 0, "role", r"got \['user'\]"),
        ([USER, {"role": "user"}], 1, "content", r"messages\[1\]\.content is missing"),
        ([{"role": "user", "content": None}], 0, "content", r"messages\[0\]\.content is null"),
        ([{"role": "assistant", "content": None}], 0, "content", r"tool_calls"),
        ([{"role": "user", "content": 42}], 0, "content", r"must be a str or a list"),
        ([{"role": "user", "content": b"x"}], 0, "content", r"must be a str or a list"),
        (
            [USER, USER, {"role": "user", "content": [{"type": "input_audio"}]}],
            2,
            "content",
            r"messages\[2\]\.content\[0\] has type 'input_audio'; content parts are 'text' "
            "and 'image_url'",
        ),
        (  # images are parts since issue 42; this one has no url
            [USER, USER, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            2,
            "content",
            r"messages\[2\]\.content\[0\]\.image_url must be an object with a \"url\"",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 1}]}],
            0,
            "content",
            r"messages\[0\]\.content\[0\]\.text must be a str",
        ),
        ([{"role": "user", "content": ["hi"]}], 0, "content", r"content part dict"),
        ([{"role": "user", "content": "x", "name": 3}], 0, "name", r"messages\[0\]\.name"),
        ([USER, "hello"], 1, None, r"messages\[1\] must be a dict"),
    ],
)
def test_invalid_messages_name_index_and_field(
    messages: list[Any], index: int, field: str | None, pattern: str
) -> None:
    with pytest.raises(InvalidMessageError, match=pattern) as info:
        validate_messages(messages)
    assert (info.value.index, info.value.field) == (index, field)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("messages", ["hello", None, {"role": "user"}, []])
def test_message_list_itself_is_checked(messages: Any) -> None:
    with pytest.raises(InvalidMessageError, match="messages"):
        validate_messages(messages)


# ------------------------------------------------------------- templates without a system role
DATA = Path(__file__).parent / "data"
GEMMA2 = (DATA / "gemma2_chat_template.jinja").read_text()


def test_a_template_without_a_system_role_gets_the_system_text_in_the_next_turn() -> None:
    """gemma 2's template raises on a system message. As llama.cpp's server does, the
    leading system message is merged into the next one (its text, a newline, the next
    text), so a system prompt reaches the model instead of failing the request (the old
    code raised TemplateError: "System role not supported")."""
    gemma = ChatTemplate(GEMMA2, bos_token="<bos>")
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert gemma.render(system) == (
        "<bos><start_of_turn>user\nBe brief.\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text",
              "text": "brief."}]}, {"role": "user", "content": "Hi"}]  # fmt: skip
    assert gemma.render(parts) == gemma.render(system)
    # a template with a system role renders it as written
    smol = ChatTemplate((DATA / "smollm2_chat_template.jinja").read_text())
    assert "<|im_start|>system\nBe brief.<|im_end|>" in smol.render(system)
    # a template that renders a system message's text, role or not, is left alone too
    plain = ChatTemplate("{% for m in messages %}{{ m['content'] }};{% endfor %}")
    assert plain.render(system) == "Be brief.;Hi;"


def test_tools_on_a_template_without_a_system_role_go_into_the_first_user_turn() -> None:
    """The tool fallback writes the tools into a system turn; on gemma 2 that turn is
    merged into the user's, so the request is served and its prompt holds the schemas
    (the old code answered TemplateError: "System role not supported")."""
    from test_chat import make as make_chat

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    with make_chat("Sunny.", template=GEMMA2) as ctx:
        plain = ctx.chat_completion(asked, max_tokens=2)["usage"]["prompt_tokens"]
        with_tools = ctx.chat_completion(asked, tools=tools, max_tokens=2)["usage"]
        schema = len(ctx.tokenize(json.dumps(tools[0]["function"]["parameters"])))
        assert with_tools["prompt_tokens"] > plain + schema
        prompt = ctx.detokenize(ctx.chat_prompt(asked))
        assert prompt.startswith("<start_of_turn>user\nBe brief.\nWeather?<end_of_turn>")
