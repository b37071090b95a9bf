"""A chat template bound to a model: which template, its end-of-turn tokens, prompt tokens.

:class:`BoundTemplate` is what a context hands down to chat preparation
(:mod:`llamax.chat.prepare`, :mod:`llamax.tools`): the template loaded once, the tokens a
turn ends at, rendering to prompt tokens, and the sizes a request is fitted to. Nothing in
it calls back into the context.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from ..backend.base import Backend
from ..facts import ModelFacts
from ..images import Image, ImagePrompts
from .messages import InvalidMessageError, has_images, validate_messages
from .template import ChatTemplate, TemplateError

__all__ = [
    "END_OF_TURN_MARKERS",
    "BoundTemplate",
    "ChatParts",
    "end_of_turn_ids",
    "load_template",
    "render_tokens",
    "tokenize_conversation",
]

END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eom_id|>")
"""Markers templates end a turn with; those that are single tokens become stop tokens."""

ChatParts = list[int | Image]
"""A rendered chat prompt: token ids, with a :class:`~llamax.Image` where each image sits
(what ``add_request`` takes)."""


class BoundTemplate:
    """A model's chat side: its chat template (the ``chat_template=`` override or the
    GGUF's, compiled on first use and kept), its end-of-turn tokens, rendering messages to
    prompt tokens, and the facts a chat request is fitted to. Built once per context; the
    backend guards its own lifetime (a call after close raises
    :class:`~llamax.ContextClosedError`).

    Args:
        backend: The model's tokenizer and metadata.
        override: Jinja source to use instead of the GGUF's template.
        images: The context's image reader, which counts an image's positions (``None``:
            counting a prompt with images raises :class:`~llamax.ImageError`).
    """

    __slots__ = ("_backend", "_end_of_turn", "_facts", "_images", "_override", "_template")

    def __init__(
        self, backend: Backend, override: str | None = None, images: ImagePrompts | None = None
    ) -> None:
        self._backend, self._override = backend, override
        self._facts = backend.facts
        self._images = images
        self._template: ChatTemplate | None = None
        self._end_of_turn: tuple[int, ...] | None = None

    @property
    def chat_template(self) -> ChatTemplate:
        """The template, compiled on first use (a race compiles it twice, harmlessly).

        Raises:
            TemplateError: the model has no template and none was given.
        """
        if self._template is None:
            self._template = load_template(self._backend, self._override, self._facts.model_name)
        return self._template

    @property
    def end_of_turn_token_ids(self) -> tuple[int, ...]:
        """Special tokens the template ends a turn with: chat stops there."""
        if self._end_of_turn is None:
            self._end_of_turn = end_of_turn_ids(self._backend, self.chat_template)
        return self._end_of_turn

    @property
    def facts(self) -> ModelFacts:
        """The model's facts (the backend's, computed at load)."""
        return self._facts

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_vars: Any,
    ) -> list[int]:
        """Validate, render and tokenize ``messages`` (see :func:`render_tokens`): token
        ids only.

        Raises:
            InvalidMessageError: as :func:`render_tokens`, or a message holds an image
                (:meth:`chat_prompt_parts` renders those).
        """
        parts = self.chat_prompt_parts(
            messages, add_generation_prompt=add_generation_prompt, **template_vars
        )
        return only_token_ids(parts)

    def chat_prompt_parts(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_vars: Any,
    ) -> ChatParts:
        """Validate, render and tokenize ``messages`` (see :func:`render_tokens`), with a
        :class:`~llamax.Image` where each image sits."""
        return render_tokens(
            self._backend,
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **template_vars,
        )

    def prompt_positions(self, prompt: Sequence[int | Image]) -> int:
        """The positions ``prompt`` takes in a sequence (an image takes its embeddings'
        and its marker tokens').

        Raises:
            ImageError: the prompt holds an image and the context has no projector, or an
                image cannot be read.
        """
        if not any(isinstance(part, Image) for part in prompt):
            return len(prompt)
        return (self._images or ImagePrompts(None)).num_positions(prompt)

    def tokenize(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Tokenize ``text`` as a prompt would be."""
        return self._backend.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Join the pieces of ``token_ids`` (ids the model produced or tokenized)."""
        pieces = b"".join(self._backend.token_to_piece(t) for t in token_ids)
        return pieces.decode("utf-8", "replace")


def only_token_ids(parts: ChatParts) -> list[int]:
    """``parts`` when they are token ids only.

    Raises:
        InvalidMessageError: they hold an image.
    """
    if any(isinstance(part, Image) for part in parts):
        raise InvalidMessageError(
            "the messages hold images, which token ids alone cannot carry: render them with "
            "chat_prompt_parts (token ids and llamax.Image), or send them with chat_completion"
        )
    return parts  # type: ignore[return-value]


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
    bos_id, eos_id = backend.facts.bos_token_id, backend.facts.eos_token_id
    bos = backend.token_text(bos_id) if bos_id is not None else ""
    eos = backend.token_text(eos_id) if eos_id is not None else ""
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
) -> ChatParts:
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
        The prompt's token ids, with each image of a user message as a
        :class:`~llamax.Image` where the template put that message's content.

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
) -> ChatParts:
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

    Images: the template sees a user message's content as one string, each image a
    unique marker in it (llama-server's media marker); the text is split at each marker
    and the image put there, the text on either side tokenized apart (as ``mtmd`` does).

    Args:
        backend: The model's tokenizer.
        template: The chat template.
        messages: Messages as :func:`~llamax.templates.validate_messages` returns them.
        add_generation_prompt: End with the header that opens the assistant's turn.
        parse_special_in_content: Parse special-token text in content too (the old way).
        **template_vars: Extra template variables.

    Returns:
        The prompt's token ids (and images), BOS first when the model has one.

    Raises:
        InvalidMessageError: content holds special-token text and the template rewrites
            content, so it cannot be kept plain.
        TemplateError: the template failed, broke the sandbox or its budget, or left an
            image out.
    """
    images: list[Image] = []
    marks = None
    if has_images(messages):
        nonce = secrets.token_hex(8)
        messages = _with_image_marks(messages, nonce, images)
        marks = re.compile(f"\ue000{nonce}:image(\\d+)\ue001")
    text = template.render(messages, add_generation_prompt=add_generation_prompt, **template_vars)
    pieces = _ImagePieces(backend, marks, images)
    tokens: ChatParts | None = None
    if not parse_special_in_content:
        tokens = _tokens_with_plain_content(
            backend, template, messages, text, add_generation_prompt, template_vars, pieces
        )
    if tokens is None:
        tokens = []
        pieces.tokenize(tokens, text, parse_special=True)
    bos = backend.facts.bos_token_id
    if bos is not None and (not tokens or tokens[0] != bos):
        tokens.insert(0, bos)
    pieces.check_placed()
    return tokens


def _with_image_marks(
    messages: Sequence[Mapping[str, Any]], nonce: str, images: list[Image]
) -> list[Mapping[str, Any]]:
    """``messages`` with each image-holding content as one string, a marker per image;
    the images are appended to ``images`` in order (a marker's number is its index)."""
    marked: list[Mapping[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            marked.append(message)
            continue
        texts = []
        for part in content:
            if isinstance(part, Image):
                texts.append(f"\ue000{nonce}:image{len(images)}\ue001")
                images.append(part)
            else:
                texts.append(part["text"])
        marked.append({**message, "content": "".join(texts)})
    return marked


class _ImagePieces:
    """Tokenizes text with image markers: the text between markers, each marker's image."""

    __slots__ = ("_backend", "_images", "_marks", "_placed")

    def __init__(self, backend: Backend, marks: re.Pattern[str] | None, images: list[Image]):
        self._backend, self._marks, self._images = backend, marks, images
        self._placed: set[int] = set()

    def split(self, text: str) -> list[str | Image]:
        """``text`` cut at its markers, each marker its image (text pieces may be empty)."""
        if self._marks is None:
            return [text]
        parts: list[str | Image] = []
        for k, piece in enumerate(self._marks.split(text)):
            if k % 2 == 0:
                parts.append(piece)
            else:
                self._placed.add(int(piece))
                parts.append(self._images[int(piece)])
        return parts

    def tokenize(self, out: ChatParts, text: str, *, parse_special: bool) -> None:
        """Append the tokens (and images) of ``text`` to ``out``."""
        for part in self.split(text):
            if isinstance(part, Image):
                out.append(part)
            elif part:
                out.extend(
                    self._backend.tokenize(part, add_special=False, parse_special=parse_special)
                )

    def check_placed(self) -> None:
        """Raise unless every image landed in the rendering.

        Raises:
            TemplateError: the template left an image's message (or marker) out.
        """
        missing = len(self._images) - len(self._placed)
        if missing:
            raise TemplateError(
                f"the chat template left {missing} of the {len(self._images)} images out of "
                "the prompt (it dropped or rewrote the content that held them)"
            )


def _tokens_with_plain_content(
    backend: Backend,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    text: str,
    add_generation_prompt: bool,
    template_vars: dict[str, Any],
    images: _ImagePieces,
) -> ChatParts | None:
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
    tokens: ChatParts = []
    run: list[str] = []  # plain text since the last special token or image

    def flush() -> None:
        if run:
            tokens.extend(backend.tokenize("".join(run), add_special=False, parse_special=False))
            run.clear()

    for part, is_content in pieces:
        if is_content:
            for piece in images.split(part):
                if isinstance(piece, Image):
                    flush()
                    tokens.append(piece)
                else:
                    run.append(piece)
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
