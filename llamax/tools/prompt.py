"""Render a conversation with tools: through the model's own template, or the fallback.

The model's template is used when it renders tools, tool calls and tool results itself
and speaks the Hermes call markup (``<tool_call>``) that the grammar and the parsers use
(Qwen2.5, Qwen3, Hermes 2/3 and their kin). Any other template gets the fallback: the
tool schemas and the call format go into the system turn, assistant ``tool_calls`` become
``<tool_call>`` text and ``role: "tool"`` results become a user turn of
``<tool_response>`` blocks, so any template (ChatML, SmolLM2's) renders them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ..images import Image
from ..templates import (
    ChatTemplate,
    InvalidMessageError,
    TemplateBudgetError,
    TemplateError,
    validate_messages,
)
from .call_grammar import CALL_CLOSE, CALL_OPEN
from .spec import ToolPlan

__all__ = [
    "PromptRenderer",
    "fallback_messages",
    "native_messages",
    "render_tool_prompt",
    "template_supports_tools",
    "tool_prompt_tokens",
    "tool_system_text",
]

_PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "llamax_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"probe_arg": {"type": "string"}}},
    },
}
_PROBE_CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "probe"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_probe",
                "type": "function",
                "function": {"name": "llamax_probe_call", "arguments": {"probe_arg": "x"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_probe", "content": "llamax_probe_result"},
]


class PromptRenderer(Protocol):
    """A chat template with its tokenizer: a :class:`llamax.Context` is one, and so is the
    template binding a context hands down to chat preparation."""

    @property
    def chat_template(self) -> ChatTemplate:
        """The compiled chat template."""

    def chat_prompt_parts(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_vars: Any,
    ) -> list[int | Image]:
        """Validate, render and tokenize ``messages`` (token ids, and an image where each
        image sits)."""


def template_supports_tools(template: ChatTemplate) -> bool:
    """Whether ``template`` renders tools, tool calls and tool results in Hermes markup.

    Probes by rendering: the tool list must appear only when passed as ``tools``, and a
    conversation with an assistant call and a tool result must show both. Cached per
    template, except a probe that ran out of its render budget (a machine too busy to
    render within ``max_render_seconds``): that answers False this once and is probed
    again next time, so a moment of load never sets the answer for good.

    Args:
        template: A compiled chat template (e.g. ``ctx.chat_template``).

    Returns:
        True when :func:`render_tool_prompt` may hand tools to the template itself.
    """
    try:
        return _probe_tools(template)
    except TemplateBudgetError:
        return False


@functools.lru_cache(maxsize=16)
def _probe_tools(template: ChatTemplate) -> bool:
    """:func:`template_supports_tools`'s probe; a :class:`TemplateBudgetError` is raised,
    so ``lru_cache`` does not keep it."""
    if "tools" not in template.source or CALL_OPEN not in template.source:
        return False
    user = _PROBE_CONVERSATION[:1]
    try:
        with_tools = template.render(user, tools=[_PROBE_TOOL])
        without_tools = template.render(user)
        conversation = template.render(_PROBE_CONVERSATION, tools=[_PROBE_TOOL])
    except TemplateBudgetError:
        raise
    except TemplateError:
        return False
    name = "llamax_probe_tool"
    return (
        name in with_tools
        and name not in without_tools
        and "llamax_probe_call" in conversation
        and "llamax_probe_result" in conversation
    )


def tool_system_text(plan: ToolPlan) -> str:
    """The fallback's system-turn text: the tool schemas and how to call them.

    Args:
        plan: The checked tool options; its callable functions are listed.

    Returns:
        The text (empty when the plan offers no tools).
    """
    functions = plan.callable_functions
    if not functions:
        return ""
    how_many = "one or more functions" if plan.parallel else "one function"
    schemas = "\n".join(json.dumps(f.as_openai(), ensure_ascii=False) for f in functions)
    text = (
        f"# Tools\n\nYou may call {how_many} to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{schemas}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        f"within {CALL_OPEN}{CALL_CLOSE} XML tags:\n"
        f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}'
    )
    if plan.forced_name is not None:
        text += f"\n\nYou must call the function {plan.forced_name}."
    elif plan.mode == "required":
        text += "\n\nYou must call at least one function."
    return text


def fallback_messages(
    messages: Sequence[Mapping[str, Any]], plan: ToolPlan
) -> list[dict[str, Any]]:
    """Messages any chat template renders: tools in the system turn, calls and results as text.

    The tool text is appended to the first system message (or becomes a new one at the
    front); an assistant turn's ``tool_calls`` are appended to its content as
    ``<tool_call>`` blocks; each run of ``tool`` messages becomes one user turn of
    ``<tool_response>`` blocks.

    Args:
        messages: OpenAI-style messages.
        plan: The checked tool options.

    Returns:
        New message dicts with ``role`` and ``content`` only (and ``name``, and an
        assistant's ``reasoning_content``, if given).

    Raises:
        InvalidMessageError: a message, a ``tool_calls`` entry or a ``tool`` message is
            malformed, or a tool result answers no preceding call.
    """
    converted: list[dict[str, Any]] = []
    previous_role = None
    for index, message in enumerate(_checked(messages)):
        role = message["role"]
        if role == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if previous_role == "tool":
                converted[-1]["content"] += "\n" + block
            else:
                converted.append({"role": "user", "content": block})
        else:
            converted.append(_text_turn(index, message))
        previous_role = role
    return _with_system_text(converted, tool_system_text(plan))


def _text_turn(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """A user, system or assistant turn, its calls appended to the content as markup."""
    turn = {"role": message["role"], "content": message["content"] or ""}
    if message.get("name") is not None:
        turn["name"] = message["name"]
    if message["role"] == "assistant" and message.get("reasoning_content") is not None:
        # the template decides, as in a chat without tools (Qwen3 keeps the thinking of
        # the turns after the last user message: a tool loop's KV stays reusable)
        turn["reasoning_content"] = message["reasoning_content"]
    calls = _calls(index, message)
    if calls:
        sent = message["tool_calls"]
        blocks = [_call_block(call, written) for call, written in zip(calls, sent, strict=True)]
        turn["content"] = "\n".join([turn["content"].rstrip(), *blocks]).lstrip("\n")
    return turn


def native_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tools itself (Hugging Face conventions).

    Calls' ``arguments`` become objects (templates ``tojson`` them), as ``transformers``
    expects; everything else is kept.

    Raises:
        InvalidMessageError: as :func:`fallback_messages`.
    """
    converted = []
    for index, message in enumerate(_checked(messages)):
        calls = _calls(index, message)
        if calls:
            message = {**message, "tool_calls": calls}
        converted.append(message)
    return converted


def render_tool_prompt(
    template: ChatTemplate, messages: Sequence[Mapping[str, Any]], plan: ToolPlan
) -> str:
    """The prompt text of a conversation with tools, ending with the assistant's header.

    Args:
        template: The model's chat template.
        messages: OpenAI-style messages, possibly with ``tool_calls`` and ``tool`` turns.
        plan: The checked tool options (``mode="none"`` shows no tools).

    Returns:
        The rendered text (special tokens as text).

    Raises:
        InvalidMessageError: a message is malformed.
        TemplateError: the template failed to render.
    """
    if template_supports_tools(template):
        tools = [f.as_openai() for f in plan.callable_functions] or None
        return template.render(native_messages(messages), tools=tools)
    return template.render(validate_messages(fallback_messages(messages, plan)))


def tool_prompt_tokens(
    ctx: PromptRenderer,
    messages: Sequence[Mapping[str, Any]],
    plan: ToolPlan,
    **template_vars: Any,
) -> list[int | Image]:
    """The prompt tokens of :func:`render_tool_prompt` with ``ctx``'s template (``ctx``: a
    context, or anything else that renders chat prompts), with an image where each image
    of a user message sits.

    The fallback goes through ``ctx.chat_prompt_parts``, so its tokens (and prefix-cache
    hits) are those of an ordinary chat with the same messages. ``template_vars``
    (``enable_thinking=...``) are passed to the template.

    Raises:
        InvalidMessageError: a message is malformed.
        TemplateError: the template failed to render.
    """
    template = ctx.chat_template
    if not template_supports_tools(template):
        return ctx.chat_prompt_parts(fallback_messages(messages, plan), **template_vars)
    tools = [f.as_openai() for f in plan.callable_functions] or None
    # content stays text
    return ctx.chat_prompt_parts(native_messages(messages), tools=tools, **template_vars)


def _checked(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validated messages whose ``tool`` turns each answer a call of the turn before, each
    run of them in the order of the calls (:func:`_in_call_order`)."""
    checked = validate_messages(messages)
    pending: list[str] = []
    runs: list[tuple[int, list[str]]] = []
    for index, message in enumerate(checked):
        if message["role"] != "tool":
            pending = [call["id"] for call in _calls(index, message)]
            runs.append((index + 1, pending))
            continue
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise InvalidMessageError(
                f"messages[{index}].tool_call_id must be a str, got {type(call_id).__name__}",
                index=index,
                field="tool_call_id",
            )
        if call_id not in pending:
            raise InvalidMessageError(
                f"messages[{index}] is a tool result for {call_id!r}, which no preceding "
                "assistant tool_calls (followed only by tool messages) made",
                index=index,
                field="tool_call_id",
            )
    for start, call_ids in runs:
        _in_call_order(checked, start, call_ids)
    return checked


def _in_call_order(messages: list[dict[str, Any]], start: int, call_ids: list[str]) -> None:
    """Sort the run of ``tool`` messages from ``start`` into the order of the calls they
    answer, matched by ``tool_call_id``: a client may send results in any order (parallel
    calls finish when they finish), and the prompt pairs results with calls by position."""
    end = start
    while end < len(messages) and messages[end]["role"] == "tool":
        end += 1
    order = {call_id: n for n, call_id in reversed(list(enumerate(call_ids)))}
    messages[start:end] = sorted(messages[start:end], key=lambda m: order[m["tool_call_id"]])


def _calls(index: int, message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The message's ``tool_calls``, checked, with ``arguments`` parsed into objects."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    where = f"messages[{index}].tool_calls"
    if message["role"] != "assistant":
        raise InvalidMessageError(
            f"{where} is only allowed on assistant messages", index=index, field="tool_calls"
        )
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        raise InvalidMessageError(f"{where} must be a list", index=index, field="tool_calls")
    return [_call(f"{where}[{n}]", index, call) for n, call in enumerate(calls)]


def _call(where: str, index: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(call, Mapping) or call.get("type", "function") != "function":
        raise InvalidMessageError(
            f"{where} must be a dict with type 'function'", index=index, field="tool_calls"
        )
    if (
        not isinstance(call.get("id"), str)
        or not isinstance(function, Mapping)
        or not isinstance(function.get("name"), str)
    ):
        raise InvalidMessageError(
            f"{where} needs a str 'id' and a 'function' with a str 'name'",
            index=index,
            field="tool_calls",
        )
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise InvalidMessageError(
                f"{where}.function.arguments is not JSON: {exc}", index=index, field="tool_calls"
            ) from exc
    if not isinstance(arguments, Mapping):
        raise InvalidMessageError(
            f"{where}.function.arguments must be a JSON object", index=index, field="tool_calls"
        )
    return {
        "id": call["id"],
        "type": "function",
        "function": {"name": function["name"], "arguments": dict(arguments)},
    }


def _call_block(call: Mapping[str, Any], written: Mapping[str, Any]) -> str:
    """``call`` as the Hermes markup the tool grammar makes the model write. ``arguments``
    sent as a string (OpenAI's shape, and what llamax's reply held: the model's own text)
    are kept as they are, so the block is the model's reply again, to the byte, and the
    next turn reuses its KV past it; re-serialized, they would differ wherever the model
    spaced its JSON otherwise (the grammar lets it). Objects are serialized."""
    function = call["function"]
    arguments = written["function"].get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(function["arguments"], ensure_ascii=False)
    name = json.dumps(function["name"], ensure_ascii=False)
    return f'{CALL_OPEN}\n{{"name": {name}, "arguments": {arguments.strip()}}}\n{CALL_CLOSE}'


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if not text:
        return messages
    for message in messages:
        if message["role"] == "system":
            message["content"] = f"{message['content']}\n\n{text}" if message["content"] else text
            return messages
    return [{"role": "system", "content": text}, *messages]
