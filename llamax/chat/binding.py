"""A chat template bound to a model: which template, its end-of-turn tokens, prompt tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..backend.base import Backend
from .messages import validate_messages
from .template import ChatTemplate, TemplateError

__all__ = ["END_OF_TURN_MARKERS", "end_of_turn_ids", "load_template", "render_tokens"]

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
    """The end-of-turn markers found in the template's source that are single tokens."""
    found = []
    for marker in END_OF_TURN_MARKERS:
        if marker in template.source:
            ids = backend.tokenize(marker, add_special=False, parse_special=True)
            if len(ids) == 1:
                found.append(ids[0])
    return tuple(found)


def render_tokens(
    backend: Backend,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    **template_vars: Any,
) -> list[int]:
    """Validate, render and tokenize ``messages``; BOS is added once if the text lacks it.
    ``template_vars`` (``tools=...``) go to the template."""
    text = template.render(
        validate_messages(messages), add_generation_prompt=add_generation_prompt, **template_vars
    )
    tokens = backend.tokenize(text, add_special=False, parse_special=True)
    bos = backend.bos_token_id
    if bos is not None and (not tokens or tokens[0] != bos):
        tokens.insert(0, bos)
    return tokens
