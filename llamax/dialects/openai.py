# ruff: noqa: E501  (the tables hold one-line docs)
"""OpenAI's request fields: one :data:`~llamax.dialects.fields.FieldTable` per route
(``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/responses``) and
the value checks of its hints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..chat.options import one_of
from ..errors import InvalidParameterError
from .fields import FieldTable, RequestField, Support, check_bool, check_object, table

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "EMBEDDINGS",
    "MAX_METADATA_KEY_CHARS",
    "MAX_METADATA_PAIRS",
    "MAX_METADATA_VALUE_CHARS",
    "RESPONSES",
    "ROUTES",
    "check_include",
    "check_metadata",
]

H, HINT, R = Support.HONOURED, Support.HINT, Support.REFUSED

MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
"""OpenAI's bounds on ``metadata``: pairs, and characters of a key and of a value."""


def check_metadata(name: str, metadata: Any) -> None:
    """Refuse ``metadata`` that OpenAI refuses (it may be echoed and stored).

    Raises:
        InvalidParameterError: not an object of at most 16 string pairs, with keys of at
            most 64 characters and values of at most 512.
    """
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise InvalidParameterError(
            f"{name} must be an object of string pairs, got {type(metadata).__name__}", param=name
        )
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidParameterError(
            f"{name} has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed",
            param=name,
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidParameterError(
                f"{name} keys must be strings of at most {MAX_METADATA_KEY_CHARS} characters",
                param=name,
            )
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidParameterError(
                f"{name}[{key!r}] must be a string of at most {MAX_METADATA_VALUE_CHARS} characters",
                param=name,
            )


def _modalities(name: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise InvalidParameterError(f"{name} must be a list of strings", param=name)
    other = sorted(set(value) - {"text"})
    if other:
        raise InvalidParameterError(
            f"{name}: llamax produces text only; {', '.join(other)} output is not supported",
            param=name,
        )


def _stream_options(name: str, value: Any) -> None:
    check_object(name, value)
    for key, flag in (value or {}).items():
        if key not in ("include_obfuscation", "include_usage"):
            raise InvalidParameterError(f"{name} has unknown field {key!r}", param=name)
        check_bool(f"{name}.{key}", flag)


_RESPONSE_INCLUDES = frozenset(
    {
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        "reasoning.encrypted_content",
        "web_search_call.action.sources",
        "web_search_call.results",
    }
)
"""``include`` items that name outputs llamax never produces (built-in tools, images,
encrypted reasoning): asking for them changes nothing."""


def check_include(name: str, value: Any) -> None:
    """A list of ``include`` items that name outputs llamax never produces, or null."""
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidParameterError(f"{name} must be a list of strings", param=name)
    for item in value:
        if item == "message.output_text.logprobs":
            raise InvalidParameterError(
                f"{name}: {item} is not supported on /v1/responses (use /v1/chat/completions "
                "with logprobs)",
                param=name,
            )
        if item not in _RESPONSE_INCLUDES:
            raise InvalidParameterError(f"{name}: unknown item {item!r}", param=name)


def _count(name: str, value: Any) -> None:
    """A count: an integer from 0 (``max_tool_calls: 0`` allows no calls), or null."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise InvalidParameterError(
            f"{name} must be a non-negative integer, got {value!r}", param=name
        )


def _slot(name: str, value: Any) -> None:
    """llama-server's ``id_slot``: an int >= -1 (``-1``: any slot), or null."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < -1):
        raise InvalidParameterError(f"{name} must be an int >= -1, got {value!r}", param=name)


_SAMPLING = table(
    RequestField(
        "model", H, "echoed as the response's `model`; picks a model when the server has several"
    ),
    RequestField("frequency_penalty", H, "OpenAI's frequency penalty"),
    RequestField("logit_bias", H, "token id → bias in [-100, 100]"),
    RequestField("max_tokens", H, "most tokens to generate"),
    RequestField("n", H, "number of choices"),
    RequestField("presence_penalty", H, "OpenAI's presence penalty"),
    RequestField(
        "response_format",
        H,
        "`text`, `json_object` or `json_schema` (a grammar; see docs/tools.md)",
    ),
    RequestField("seed", H, "the sampler's seed"),
    RequestField("stop", H, "up to 4 (OpenAI), here up to 400 stop strings"),
    RequestField("stream", H, "server-sent events"),
    RequestField(
        "stream_options",
        H,
        "`include_usage` adds the usage chunk; `include_obfuscation` is accepted (no obfuscation padding is sent)",
    ),
    "temperature",
    "top_p",
    "user",
    RequestField("top_k", H, "top-k sampling (0: off, OpenAI's behaviour)", extension=True),
    RequestField("min_p", H, "min-p sampling (0: off)", extension=True),
    RequestField("repeat_penalty", H, "llama.cpp's repeat penalty (1: off)", extension=True),
    RequestField("grammar", H, "a GBNF grammar constraining the output", extension=True),
    RequestField(
        "speculative", H, "prompt-lookup speculative decoding (docs/speculative.md)", extension=True
    ),
    RequestField("lora", H, "LoRA adapters for this request (docs/lora.md)", extension=True),
)

CHAT = table(
    RequestField("messages", H, "the conversation (docs/chat.md)"),
    *_SAMPLING,
    RequestField("max_completion_tokens", H, "the newer name of `max_tokens` (give one)"),
    RequestField("logprobs", H, "log probabilities of the output tokens"),
    RequestField("top_logprobs", H, "with `logprobs`: the k most likely tokens at each position"),
    RequestField("tools", H, "function tools (docs/tools.md)"),
    RequestField("tool_choice", H, "`none`, `auto`, `required` or one function"),
    "parallel_tool_calls",
    RequestField(
        "reasoning_effort",
        H,
        "`none`/`minimal` turn the template's thinking switch (`enable_thinking`) off, `low`…`xhigh` on; no token budget",
    ),
    RequestField(
        "store", HINT, "no effect: chat completions are not stored (use /v1/responses)", check_bool
    ),
    RequestField(
        "metadata",
        HINT,
        "no effect: not stored; checked as OpenAI checks it (16 pairs of strings)",
        check_metadata,
    ),
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
    "safety_identifier",
    RequestField(
        "verbosity",
        HINT,
        "no effect: the model's length is steered by the prompt and `max_tokens`",
        one_of("low", "medium", "high"),
    ),
    RequestField(
        "modalities", HINT, '`["text"]` is what llamax produces; `audio` is refused', _modalities
    ),
    RequestField(
        "prediction",
        HINT,
        "no effect on the output: OpenAI's predicted outputs only speed a reply up; llamax's own speculation drafts from the prompt (`speculative`)",
        check_object,
    ),
    "prompt_cache_options",
    RequestField("audio", R, "audio output is not supported (llamax produces text)"),
    "moderation",
    RequestField("web_search_options", R, "web search is a hosted tool llamax does not run"),
    RequestField(
        "functions",
        R,
        "the deprecated function-calling shape is not supported: send `tools` (the reply's `tool_calls` replace `function_call`)",
    ),
    RequestField(
        "function_call",
        R,
        "the deprecated function-calling shape is not supported: send `tool_choice`",
    ),
    RequestField(
        "truncate",
        H,
        "`oldest_messages` drops the oldest whole turns when the conversation does not fit",
        extension=True,
    ),
    RequestField(
        "reasoning_format",
        H,
        "where a thinking model's thinking goes (docs/reasoning.md)",
        extension=True,
    ),
    RequestField("enable_thinking", H, "the template's thinking switch", extension=True),
    RequestField(
        "chat_template_kwargs",
        H,
        "vLLM's and llama-server's way to say `enable_thinking` (the only key taken)",
        extension=True,
    ),
    RequestField(
        "timings_per_token",
        H,
        "llama-server's: a stream's usage chunk (`stream_options.include_usage`) carries its `timings` (`prompt_n`, `cache_n`, `predicted_n`, their milliseconds and rates)",
        extension=True,
    ),
    RequestField(
        "verbose",
        H,
        "llama-server's: a whole (not streamed) reply carries `__verbose` with the rendered `prompt` and the `content`",
        extension=True,
    ),
    RequestField(
        "id_slot",
        HINT,
        "llama-server's slot: no effect, llamax has no fixed slots (any free sequence serves a chat request, and the prefix cache reuses what an earlier one computed); an int >= -1",
        _slot,
        extension=True,
    ),
    RequestField(
        "return_progress",
        H,
        "llama-server's: a stream reports the prompt's progress in chunks of its own before the reply (`prompt_progress`: `total`, `cache`, `processed`, `time_ms`), one when it is admitted and one after each chunk computed",
        extension=True,
    ),
)

COMPLETIONS = table(
    RequestField("prompt", H, "a string or a list of token ids"),
    *_SAMPLING,
    RequestField("logprobs", H, "k: the k most likely tokens at each position"),
    RequestField(
        "echo", H, "the prompt's text is put before each choice's text (not its logprobs)"
    ),
    RequestField(
        "best_of",
        R,
        "server-side best-of ranking is not supported (`1` or equal to `n` is accepted: it changes nothing)",
        harmless=lambda v, r: v is None or v == 1 or v == (r.get("n") or 1),
    ),
    RequestField(
        "suffix",
        H,
        "fill-in-the-middle with the model's FIM tokens (the prompt, then the suffix: the reply is what goes between); a 400 on a model without them; null or empty: no suffix",
    ),
)

EMBEDDINGS = table(
    RequestField("input", H, "a string or a list of strings"),
    "model",
    RequestField("encoding_format", H, "`float` or `base64`"),
    RequestField(
        "dimensions",
        H,
        "the first `dimensions` components, renormalised to length 1 (meaningful for Matryoshka-trained models); more than the model has is a 400",
    ),
    "user",
)

RESPONSES = table(
    "model",
    RequestField("input", H, "a string or items (docs/responses.md)"),
    RequestField("instructions", H, "a system message before the input"),
    RequestField("tools", H, "function tools (built-in tools such as `web_search` are refused)"),
    RequestField("tool_choice", H, "`auto`, `none`, `required` or one function"),
    "parallel_tool_calls",
    RequestField("max_output_tokens", H, "most tokens to generate"),
    "temperature",
    "top_p",
    RequestField(
        "text", H, "`format` (`text`, `json_object`, `json_schema`); `verbosity` has no effect"
    ),
    RequestField(
        "reasoning",
        H,
        "`effort` turns the template's thinking switch off (`none`, `minimal`) or on; `summary` returns the thinking",
    ),
    RequestField(
        "truncation", H, "`auto` drops the oldest turns when the conversation does not fit"
    ),
    RequestField("previous_response_id", H, "continues a stored response"),
    RequestField("store", H, "`false`: the response is not kept"),
    RequestField("metadata", H, "stored and echoed (16 pairs of strings)"),
    RequestField("user", H, "echoed (at most 256 characters)"),
    "stream",
    RequestField(
        "include",
        HINT,
        "the items name outputs llamax never produces (built-in tool results, images, encrypted reasoning); `message.output_text.logprobs` is refused",
        check_include,
    ),
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
    "safety_identifier",
    RequestField(
        "stream_options",
        HINT,
        "`include_obfuscation`: no obfuscation padding is sent",
        _stream_options,
    ),
    RequestField(
        "max_tool_calls",
        HINT,
        "no effect: it bounds built-in tool calls, and llamax runs none (0 or more)",
        _count,
    ),
    "prompt_cache_options",
    RequestField(
        "image",
        HINT,
        "no effect: options of image generation, which llamax does not do",
        check_object,
    ),
    RequestField(
        "return_progress",
        H,
        "llama-server's: a stream reports the prompt's progress in `response.in_progress` events (`prompt_progress`: `total`, `cache`, `processed`, `time_ms`)",
        extension=True,
    ),
    RequestField(
        "timings_per_token",
        H,
        "llama-server's (the HTTP server's): each `response.output_text.delta` event and `response.completed` carry `timings` (`prompt_n`, `cache_n`, `predicted_n`, their milliseconds and rates)",
        extension=True,
    ),
    RequestField(
        "top_logprobs",
        R,
        "log probabilities are not produced on /v1/responses (use /v1/chat/completions); `0` is accepted",
        harmless=lambda v, r: v is None or v == 0,
    ),
    RequestField(
        "background",
        R,
        "background mode is not supported (`false` is accepted)",
        harmless=lambda v, r: v is None or v is False,
    ),
    RequestField(
        "conversation",
        R,
        "the Conversations API is not supported: continue with `previous_response_id`",
    ),
    RequestField(
        "context_management",
        R,
        "server-side compaction is not supported: `truncation: auto` drops the oldest turns",
    ),
    RequestField(
        "prompt",
        R,
        "stored prompt templates live on OpenAI's platform: send `instructions` and `input`",
    ),
    RequestField("background_options", R, "background mode is not supported"),
    "moderation",
    RequestField("access_programs", R, "OpenAI's access programs do not exist here"),
)

ROUTES: dict[str, FieldTable] = {
    "chat": CHAT,
    "completions": COMPLETIONS,
    "embeddings": EMBEDDINGS,
    "responses": RESPONSES,
}
"""Each OpenAI route's fields (the Messages table is :data:`llamax.dialects.anthropic.MESSAGES`)."""
