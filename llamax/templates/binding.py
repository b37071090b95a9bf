"""A chat template bound to a model: which template, its end-of-turn tokens, prompt tokens."""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from ..backend.base import Backend
from .messages import InvalidMessageError, validate_messages
from .template import ChatTemplate, TemplateError

__all__ = [
    "END_OF_TURN_MARKERS",
    "end_of_turn_ids",
    "load_template",
    "render_tokens",
    "tokenize_conversation",
]

END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eom_id|>")
"""Markers templates end a turn with; those that are single tokens become stop tokens."""


def load_template(backend: Backend, override: str | None, model_name: str) -> ChatTemplate:
    """``override`` or the GGUF's ``tokenizer.chat_template``, with the model's BOS/EOS text.

    Raises:
        TemplateError: there is neither; the message says how to pass one.
    """
    source = override or backend.metadata("tokenizer.chat_template")
    if not source:
        raise TemplateError(
            f"the model {model_name!r} has no chat template in its GGUF metadata; "
            "pass one with llamax.Context(..., chat_template='<jinja source>')"
        )
    bos = backend.token_text(backend.bos_token_id) if backend.bos_token_id is not None else ""
    eos = backend.token_text(backend.eos_token_id) if backend.eos_token_id is not None else ""
    return ChatTemplate(source, bos_token=bos, eos_token=eos)


def end_of_turn_ids(backend: Backend, template: ChatTemplate) -> tuple[int, ...]:
    """The end-of-turn markers found in the template's source that are single control tokens.

    A marker whose token renders as text is skipped: gpt-oss's ``<|end|>`` ends a message
    *inside* the reply (the thinking, before the answer), and llama.cpp makes it a
    user-defined token, shown in the text and not an end of generation, for that reason.
    """
    found = []
    for marker in END_OF_TURN_MARKERS:
        if marker in template.source:
            ids = backend.tokenize(marker, add_special=False, parse_special=True)
            if len(ids) == 1 and backend.token_to_piece(ids[0]) == b"":
                found.append(ids[0])
    return tuple(found)


def render_tokens(
    backend: Backend,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    parse_special_in_content: bool = False,
    **template_vars: Any,
) -> list[int]:
    """Validate, render and tokenize ``messages``; BOS is added once if the text lacks it.

    Message content is data: special-token text in it (``<|im_end|>`` typed by a user)
    stays plain text, while the markers the template writes stay special tokens (see
    :func:`tokenize_conversation`). ``template_vars`` (``tools=...``) go to the template.

    Args:
        backend: The model's tokenizer.
        template: The chat template.
        messages: OpenAI-style messages.
        add_generation_prompt: End with the header that opens the assistant's turn.
        parse_special_in_content: Parse special-token text in message content as special
            tokens too (llama-server's behaviour; lets content forge turns and roles).
        **template_vars: Extra template variables.

    Returns:
        The prompt's token ids.

    Raises:
        InvalidMessageError: a message is malformed, or (rare) it holds special-token text
            that a template which rewrites content would let through.
        TemplateError: the template failed, broke the sandbox or its budget.
    """
    return tokenize_conversation(
        backend,
        template,
        validate_messages(messages),
        add_generation_prompt=add_generation_prompt,
        parse_special_in_content=parse_special_in_content,
        **template_vars,
    )


def tokenize_conversation(
    backend: Backend,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    parse_special_in_content: bool = False,
    **template_vars: Any,
) -> list[int]:
    """Render already-validated ``messages`` and tokenize them, content as plain text.

    The template is rendered a second time with each message's content replaced by a
    unique placeholder. Where the placeholders land is where content was written; the
    template's own text is split at the special tokens it contains, and the plain text
    between two special tokens (template text and content alike) is tokenized with
    special parsing off. llama.cpp splits text at special tokens before tokenizing the
    pieces in between, so on ordinary content the tokens are exactly those of tokenizing
    the whole rendering with special parsing on. When the template rewrites content
    (anything other than trimming it), placeholders cannot show where content went: the
    rendering is then tokenized as a whole, which is safe unless some content holds
    special-token text, and that is refused.

    Args:
        backend: The model's tokenizer.
        template: The chat template.
        messages: Messages as :func:`~llamax.templates.validate_messages` returns them.
        add_generation_prompt: End with the header that opens the assistant's turn.
        parse_special_in_content: Parse special-token text in content too (the old way).
        **template_vars: Extra template variables.

    Returns:
        The prompt's token ids, BOS first when the model has one.

    Raises:
        InvalidMessageError: content holds special-token text and the template rewrites
            content, so it cannot be kept plain.
        TemplateError: the template failed, broke the sandbox or its budget.
    """
    text = template.render(messages, add_generation_prompt=add_generation_prompt, **template_vars)
    tokens: list[int] | None = None
    if not parse_special_in_content:
        tokens = _tokens_with_plain_content(
            backend, template, messages, text, add_generation_prompt, template_vars
        )
    if tokens is None:
        tokens = backend.tokenize(text, add_special=False, parse_special=True)
    bos = backend.bos_token_id
    if bos is not None and (not tokens or tokens[0] != bos):
        tokens.insert(0, bos)
    return tokens


def _tokens_with_plain_content(
    backend: Backend,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    text: str,
    add_generation_prompt: bool,
    template_vars: dict[str, Any],
) -> list[int] | None:
    """The tokens of ``text`` with every message's content as plain text; ``None`` when
    whole-text tokenizing is just as safe (no content has special-token text).

    Raises:
        InvalidMessageError: see :func:`tokenize_conversation`.
    """
    nonce = secrets.token_hex(8)
    cores: list[str] = []
    shaped: list[Mapping[str, Any]] = []
    for message in messages:
        content = message.get("content")
        core = content.strip() if isinstance(content, str) else ""
        if not core:  # no content, or only whitespace: nothing special can hide there
            shaped.append(message)
            continue
        assert isinstance(content, str)
        lead = content[: len(content) - len(content.lstrip())]
        trail = content[len(content.rstrip()) :]
        # the content's own edge whitespace around the mark, so a template that trims
        # content trims the placeholder the same way
        shaped.append({**message, "content": f"{lead}\ue000{nonce}:{len(cores)}\ue001{trail}"})
        cores.append(core)
    if not cores:
        return None
    rendered = template.render(shaped, add_generation_prompt=add_generation_prompt, **template_vars)
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
    pieces = [(part, k % 2 == 1) for k, part in enumerate(parts)]
    pieces = [(cores[int(part)] if is_content else part, is_content) for part, is_content in pieces]
    if "".join(part for part, _ in pieces) != text:
        _refuse_special_content(backend, messages)
        return None
    tokens: list[int] = []
    run: list[str] = []  # plain text since the last special token

    def flush() -> None:
        if run:
            tokens.extend(backend.tokenize("".join(run), add_special=False, parse_special=False))
            run.clear()

    for part, is_content in pieces:
        if is_content:
            run.append(part)
            continue
        at = 0
        for special, marker in _specials_in(backend, part):
            found = part.find(marker, at)
            if found < 0:  # a special token whose text is not where it should be
                _refuse_special_content(backend, messages)
                return None
            run.append(part[at:found])
            flush()
            tokens.append(special)
            at = found + len(marker)
        run.append(part[at:])
    flush()
    return tokens


def _specials_in(backend: Backend, text: str) -> list[tuple[int, str]]:
    """The special tokens that parsing ``text`` finds, in order, with their text."""
    found = []
    for token in backend.tokenize(text, add_special=False, parse_special=True):
        if backend.token_to_piece(token) == b"":
            marker = backend.token_text(token)
            if marker:
                found.append((token, marker))
    return found


def _refuse_special_content(backend: Backend, messages: Sequence[Mapping[str, Any]]) -> None:
    """Raise if some content holds special-token text (the template rewrites content, so
    it cannot be kept plain)."""
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, str) or not content:
            continue
        special = backend.tokenize(content, add_special=False, parse_special=True)
        if special != backend.tokenize(content, add_special=False, parse_special=False):
            raise InvalidMessageError(
                f"messages[{index}].content holds special-token text, and this chat template "
                "rewrites message content, so that text cannot be kept as plain text; remove "
                "it, or pass parse_special_in_content=True to let it act as special tokens",
                index=index,
                field="content",
            )
