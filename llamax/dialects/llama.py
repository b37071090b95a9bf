# ruff: noqa: E501, RUF001  (the tables hold one-line docs, some with a multiplication sign)
"""llama-server's native request fields, ``/completion``'s and ``/infill``'s, as
:data:`~llamax.dialects.fields.FieldTable` tables (the policy mechanism of every
dialect): each field is honoured, a hint (accepted with any value, no effect) or refused
unless :attr:`~llamax.dialects.fields.RequestField.harmless` (at the value that turns its
feature off). The parsers (:mod:`llamax.dialects.llama_native`, the server's ``.infill``) check a
body against these rows (:func:`field_refusal`) and the tables in docs/server.md are
generated from them (``python scripts/option_tables.py``).

The one mapping of llama-server's sampling names onto :class:`~llamax.SamplingParams` is
here too: the rows of :data:`SAMPLING` (each names its option), which both routes take as
given, and :func:`generation_settings`, which reports what a request runs in
llama-server's names. So a sampling option llama-server names is its field in
``llamax/params.py`` plus one row of :data:`SAMPLING`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..params import SamplingParams
from .fields import FieldTable, RequestField, Support, refusal

__all__ = [
    "COMPLETION",
    "DEFAULT_SETTINGS",
    "INFILL",
    "NATIVE_TABLES",
    "NO_SEED",
    "SAMPLERS",
    "SAMPLER_OFF",
    "SAMPLING",
    "TAKEN_AS_GIVEN",
    "FieldRefusal",
    "field_refusal",
    "generation_settings",
]

H, HINT, R = Support.HONOURED, Support.HINT, Support.REFUSED

NO_SEED = 0xFFFFFFFF
"""llama-server's ``LLAMA_DEFAULT_SEED``: a random seed."""

_DEFAULTS = SamplingParams(max_tokens=None)
""":class:`~llamax.SamplingParams`' defaults, replying until the end of generation or of the
context (llama-server's ``n_predict: -1``)."""


def _sampling(name: str, doc: str, option: str | None = None) -> RequestField:
    """An honoured field that is the :class:`~llamax.SamplingParams` option ``option``
    (default: the same name), a number taken as given."""
    return RequestField(name, H, doc, option=option or name)


SAMPLING = (
    _sampling("temperature", "`0` is greedy"),
    _sampling("top_k", "top-k sampling; `0` disables it"),
    _sampling("top_p", "nucleus sampling; `1` disables it"),
    _sampling("min_p", "min-p sampling; `0` disables it"),
    _sampling("typical_p", "locally typical sampling; `1` disables it"),
    _sampling(
        "repeat_last_n",
        "how many recent tokens the penalties look at (`SamplingParams.penalty_last_n`); `-1`: the whole context",
        "penalty_last_n",
    ),
    _sampling("repeat_penalty", "llama.cpp's repeat penalty; `1` disables it"),
    _sampling("presence_penalty", "OpenAI's presence penalty, in [-2, 2]"),
    _sampling("frequency_penalty", "OpenAI's frequency penalty, in [-2, 2]"),
)
"""llama-server's numeric sampling fields, each a :class:`~llamax.SamplingParams` option
(:attr:`~llamax.dialects.fields.RequestField.option`) taken as given, in the order
llama-server reports them (:func:`generation_settings`)."""

_IGNORE_EOS = RequestField(
    "ignore_eos",
    H,
    "ban the end-of-generation tokens: generate `n_predict` tokens",
    option="ignore_eos",
)
_GRAMMAR = RequestField("grammar", H, "a GBNF grammar the output must follow", option="grammar")
_JSON_SCHEMA = RequestField(
    "json_schema",
    H,
    "a JSON schema the output must follow (not with `grammar`)",
    option="json_schema",
)

_SEED = RequestField(
    "seed", H,
    "the sampler's seed; `-1`: random (the server's `--seed` stands for a body that gives none)",
    option="seed",
)  # fmt: skip

TAKEN_AS_GIVEN = (*SAMPLING, _IGNORE_EOS, _GRAMMAR, _JSON_SCHEMA)
"""The ``/infill`` fields handed to :class:`~llamax.SamplingParams` as they are (``null``:
left out)."""

SAMPLERS = ("dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
"""llama-server's default sampler order; llamax's chain applies the same order (penalties
first), with ``dry`` and ``xtc`` never active."""

SAMPLER_OFF: dict[str, tuple[str, float]] = {
    "top_k": ("top_k", 0), "typ_p": ("typical_p", 1.0), "top_p": ("top_p", 1.0),
    "min_p": ("min_p", 0.0),
}  # fmt: skip
"""The samplers of :data:`SAMPLERS` a ``samplers`` list turns off by leaving them out, each
with the :class:`~llamax.SamplingParams` option and value that turn it off (``temperature``
left out is ``1``; ``dry`` and ``xtc`` are never on)."""


def _off(name: str, value: object, why: str) -> RequestField:
    """A ``/completion`` field refused unless at ``value``, which turns its feature off."""
    return RequestField(
        name, R, f"{why}; accepted at `{json.dumps(value)}`, which turns it off",
        harmless=lambda given, body: bool(given == value),
        refusal=f"{name} is not supported by llamax (only {value!r}, which turns it off); see "
        "docs/server.md",
    )  # fmt: skip


def _unless(name: str, value: object, why: str) -> RequestField:
    """An ``/infill`` field refused unless absent, null or at ``value`` (llama-server's
    default)."""
    accepted = "absent or null" if value is None else f"absent, null or `{json.dumps(value)}`"
    return RequestField(
        name, R, f"{why}; accepted only {accepted}",
        harmless=lambda given, body: given is None or given == value,
        refusal=f"{name} is not supported by llamax on this route (send {value!r} or leave it "
        "out)",
    )  # fmt: skip


def _moot(name: str, why: str) -> RequestField:
    return RequestField(name, HINT, why)


_NO_DRY = "llamax has no DRY sampler"
_NO_MIROSTAT = "llamax has no Mirostat sampler"
_NO_XTC = "llamax has no XTC sampler"
_NO_DYNATEMP = "llamax has no dynamic temperature"
_NO_SIGMA = "llamax has no top-n-sigma sampler"
_NO_SHIFT = "llamax never shifts the context"
_TUNES = "no effect: it tunes a sampler llamax does not have (see `{}`)"
_ID_SLOT = "`-1` (default) lets the engine pick a sequence (the shared prefix cache reuses what earlier requests computed); a slot's number runs the request on that slot's session (see [slots](#llama-servers-native-api-infill-slots-models)), so it continues from the slot's KV: its last request, or a file restored into it with `POST /slots/{id}?action=restore`"

COMPLETION = (
    RequestField(
        "prompt",
        H,
        'a string, token ids, ids mixed with strings (only a leading string gets BOS), `{"prompt_string": text}` (with `multimodal_data`: base64 images, each where the media marker `<__media__>` sits in the text, as `/props`\' `media_marker` says; [images.md](images.md#over-http)), or a list of those (one result each, in an array)',
    ),
    RequestField(
        "n_predict",
        H,
        "`-1` (default) until the sequence fills `n_ctx_seq` (or the server's `-n`); `0` returns at once with no tokens (differently: the prompt is not evaluated into the cache)",
        option="max_tokens",
    ),
    *SAMPLING,
    _SEED,
    RequestField("stop", H, "a list of stop strings (empty ones are dropped)", option="stop"),
    _IGNORE_EOS,
    _GRAMMAR,
    _JSON_SCHEMA,
    RequestField(
        "logit_bias",
        H,
        '`[[token, bias], ...]` (token an id or text, `false` bans) or `{"token": bias}`',
        option="logit_bias",
    ),
    RequestField(
        "n_probs",
        H,
        "`completion_probabilities` with `id`, `token`, `bytes`, `logprob`, `top_logprobs` (at most 20)",
        option="logprobs",
    ),
    RequestField(
        "post_sampling_probs",
        H,
        "with `n_probs`, `completion_probabilities` carry `prob` and `top_probs` (not `logprob`, `top_logprobs`), the probabilities of the distribution the sampler chain drew each token from, as llama-server computes them: the candidates the chain kept (top-k, typical-p, top-p, min-p) with the probabilities its last sampler gave them at the temperature, at most `n_probs` of them, none at 0 (greedy: the token alone, `prob` 1). `SamplingParams(logprobs_after_sampling=True)` in the library",
    ),
    RequestField(
        "samplers",
        H,
        "lists in llama-server's default order: a sampler left out is turned off (`top_k` 0, `typ_p` 1, `top_p` 1, `min_p` 0, `temperature` 1); another order, a repeated or unknown name is refused (llamax's chain order is fixed)",
    ),
    RequestField(
        "n_cmpl",
        H,
        "`n` choices sharing one prefill; `prompts × n_cmpl` results, `index` = prompt × n_cmpl + choice",
        option="n",
    ),
    RequestField(
        "cache_prompt",
        H,
        "differently: accepted, the prefix cache is always on (it never changes the tokens sampled)",
    ),
    RequestField(
        "id_slot",
        H,
        _ID_SLOT
        + ". With a slot, one prompt and one choice (several prompts or `n_cmpl` > 1 are refused, 400), images (`multimodal_data`) included; requests on one slot run one at a time",
    ),
    RequestField("return_tokens", H, "the result carries `tokens`"),
    RequestField("timings_per_token", H, "each streamed chunk carries `timings`"),
    RequestField("stream", H, "`data: {...}` per step, then the final result (below)"),
    RequestField(
        "response_fields",
        H,
        "the result holds only these fields (`generation_settings/n_ctx` names a nested one)",
    ),
    RequestField("lora", H, '`[{"id", "scale"}]`, by load index', option="lora"),
    RequestField(
        "return_progress",
        H,
        "in streams: chunks of their own (no `content`, no `tokens`) with `prompt_progress` (`total`, `cache`, `processed`, `time_ms`): one when the prompt is admitted (`processed` is what the cache held), one after each chunk computed, before the reply (llamax's chunks follow its step budget, not `n_batch` alone)",
    ),
    RequestField(
        "model", H, "echoed as the result's `model`; picks a model when the server has several"
    ),
    _moot("dynatemp_exponent", _TUNES.format("dynatemp_range")),
    _moot("dry_base", _TUNES.format("dry_multiplier")),
    _moot("dry_allowed_length", _TUNES.format("dry_multiplier")),
    _moot("dry_penalty_last_n", _TUNES.format("dry_multiplier")),
    _moot("dry_sequence_breakers", _TUNES.format("dry_multiplier")),
    _moot("mirostat_tau", _TUNES.format("mirostat")),
    _moot("mirostat_eta", _TUNES.format("mirostat")),
    _moot("xtc_threshold", _TUNES.format("xtc_probability")),
    _moot("adaptive_decay", _TUNES.format("adaptive_target")),
    _moot("n_keep", f"no effect: {_NO_SHIFT}"),
    _moot(
        "n_cache_reuse",
        "no effect: llamax does not reuse by shifting; its prefix cache needs no setting",
    ),
    _moot("sse_ping_interval", "no effect: no pings on this route"),
    _moot("verbose", "no effect on this route"),
    _moot("stream_options", "no effect on this route"),
    _moot(
        "backend_sampling",
        "no effect per request: where a plain request's chain runs is the server's "
        "`--backend-sampling` (docs/logits.md#backend-sampling), the same tokens either way "
        "on the CPU",
    ),
    _off("mirostat", 0, _NO_MIROSTAT),
    _off("dry_multiplier", 0, _NO_DRY),
    _off("xtc_probability", 0, _NO_XTC),
    _off("dynatemp_range", 0, _NO_DYNATEMP),
    _off("top_n_sigma", -1, _NO_SIGMA),
    _off("adaptive_target", -1, "llamax has no adaptive sampler"),
    _off("n_indent", 0, "llamax has no indentation limit"),
    _off("n_discard", 0, _NO_SHIFT),
    _off("t_max_predict_ms", 0, "llamax has no time limit"),
    _off("t_max_prompt_ms", -1, "llamax has no time limit"),
    _off("min_keep", 0, "llamax's samplers keep their own minimum"),
    _off("grammar_lazy", False, "llamax's grammars apply from the first token"),
)
"""Every field ``POST /completion`` takes (a field in no row is refused: unknown)."""

INFILL = (
    RequestField(
        "input_prefix",
        H,
        "required (a missing one is 400 here; llama-server answers 500 from a JSON exception); a string, or a list of token ids and strings",
    ),
    RequestField(
        "input_suffix",
        H,
        "required, as `input_prefix`; a string, or a list of token ids and strings",
    ),
    RequestField(
        "input_extra",
        H,
        'a list of `{"filename"?, "text"}`; anything else is 400 with llama-server\'s messages',
    ),
    RequestField("prompt", H, "a string (400 otherwise), placed after the prefix"),
    RequestField(
        "n_predict",
        H,
        "an int; `-1` (default): the server's `-n`, else until the end of generation or of the context",
        option="max_tokens",
    ),
    RequestField(
        "max_tokens",
        H,
        "llama-server's other name for `n_predict`, read when `n_predict` is absent",
        option="max_tokens",
    ),
    *SAMPLING,
    _SEED,
    RequestField("stop", H, "a stop string or a list of them", option="stop"),
    _IGNORE_EOS,
    _GRAMMAR,
    _JSON_SCHEMA,
    RequestField(
        "stream",
        H,
        "`data:` chunks (`content`, `tokens`, `stop: false`, `id_slot`, `tokens_predicted`, `tokens_evaluated`), then the final answer with `stop: true`; no `[DONE]`, as llama-server's native stream",
    ),
    RequestField("return_tokens", H, "the answer carries `tokens`"),
    RequestField(
        "cache_prompt",
        H,
        "differently: llamax always reuses a cached prefix (the shared prefix cache, or the slot's session); `false` changes only the timings, never the text",
    ),
    RequestField(
        "id_slot",
        H,
        "differently: runs the request on that slot's session (below), so its KV stays resident for the next request on the slot; `-1` (default): any sequence. A slot never locks other clients out: its session [yields](kv-cache.md#sessions-that-yield), so while it is idle and another request (slot or not, any API) lacks the sequence id or cells it holds, the least recently used idle slot gives them back: its KV becomes an ordinary retained prefix, which the slot's next request reuses if it survived (else it computes again). A slot idle for `--slot-idle-seconds` (300) is closed (checked at each native request, `GET /slots` and slot action); `erase` frees it at once",
    ),
    RequestField(
        "model", H, "picks a model when the server has several; echoed as the answer's `model`"
    ),
    _unless("mirostat", 0, _NO_MIROSTAT),
    _unless("dynatemp_range", 0.0, _NO_DYNATEMP),
    _unless("xtc_probability", 0.0, _NO_XTC),
    _unless("dry_multiplier", 0.0, _NO_DRY),
    _unless("top_n_sigma", -1.0, _NO_SIGMA),
    _unless("n_probs", 0, "not on this route (`/completion` takes it)"),
    _unless("n_cmpl", 1, "one choice per request on this route (`/completion` takes more)"),
    _unless("samplers", None, "not on this route (`/completion` takes it)"),
    _unless("lora", None, "not on this route (`/completion` takes it)"),
    _unless("logit_bias", None, "not on this route (`/completion` takes it)"),
    _unless("n_keep", 0, _NO_SHIFT),
)
"""The ``POST /infill`` fields llamax reads or refuses; other fields, which editor plugins
send for llama-server's own limits, are ignored."""

NATIVE_TABLES: dict[str, FieldTable] = {"completion": COMPLETION, "infill": INFILL}
"""The native routes' tables, by the name the docs blocks use (``<!-- fields: infill -->``)."""


@dataclass(frozen=True, slots=True)
class FieldRefusal:
    """Why a native route refuses a body: the field (``param``), the message and the code
    (``unknown_field`` or ``unsupported_field``); the server answers it as a 400."""

    param: str
    message: str
    code: Literal["unknown_field", "unsupported_field"]


def field_refusal(
    table: FieldTable, body: Mapping[str, Any], *, unknown: Literal["refuse", "ignore"]
) -> FieldRefusal | None:
    """Check a body's fields against a native route's table: a field in no row is refused
    (``unknown="refuse"``, the first in sorted order) or left alone (``"ignore"``), then the
    first refused field (in the table's order) that is not harmless is refused (its row's
    :func:`~llamax.dialects.fields.refusal` is the message). Hints and honoured fields are
    left to the route's parser. ``None``: nothing is refused."""
    if unknown == "refuse":
        extra = sorted(set(body) - {f.name for f in table})
        if extra:
            return FieldRefusal(extra[0], f"unknown field {extra[0]!r}", "unknown_field")
    for f in table:
        if f.support is R and f.name in body and not f.harmless(body[f.name], body):
            return FieldRefusal(f.name, refusal(f), "unsupported_field")
    return None


def generation_settings(params: SamplingParams) -> dict[str, Any]:
    """What ``params`` runs, in llama-server's ``generation_settings`` names: ``n_predict``
    (``-1``: until the end), ``seed`` (:data:`NO_SEED`: random), the options of
    :data:`SAMPLING`, ``ignore_eos`` and ``stop``."""
    return {
        "n_predict": -1 if params.max_tokens is None else params.max_tokens,
        "seed": NO_SEED if params.seed is None else params.seed,
        **{f.name: getattr(params, f.option) for f in SAMPLING if f.option is not None},
        "ignore_eos": params.ignore_eos,
        "stop": list(params.stop),
    }


_LLAMA_SERVER_SETTINGS: dict[str, Any] = {
    "seed": NO_SEED, "temperature": 0.8, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
    "top_k": 40, "top_p": 0.95, "min_p": 0.05, "top_n_sigma": -1.0, "xtc_probability": 0.0,
    "xtc_threshold": 0.1, "typical_p": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0,
    "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
    "dry_sequence_breakers": ["\n", ":", "\"", "*"], "mirostat": 0, "mirostat_tau": 5.0,
    "mirostat_eta": 0.1, "adaptive_target": -1.0, "adaptive_decay": 0.9, "stop": [],
    "max_tokens": -1, "n_predict": -1, "n_keep": 0, "n_discard": 0, "ignore_eos": False,
    "stream": False, "logit_bias": [], "n_probs": 0, "min_keep": 0, "grammar": "",
    "grammar_lazy": False, "samplers": ["top_k", "typ_p", "top_p", "min_p", "temperature"],
    "timings_per_token": False, "post_sampling_probs": False, "backend_sampling": False,
    "lora": [],
}  # fmt: skip
"""llama-server's ``generation_settings``, in its order, with its defaults."""

DEFAULT_SETTINGS: dict[str, Any] = _LLAMA_SERVER_SETTINGS | generation_settings(_DEFAULTS)
"""``generation_settings`` (and ``/props``' defaults) in llama-server's names and order:
what ``/completion`` uses for a field a request leaves out, llamax's own defaults for what
it runs (:func:`generation_settings` of ``SamplingParams``' defaults; ``n_predict: -1``:
until the sequence fills its context)."""
