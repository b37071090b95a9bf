""":class:`ServerConfig`: every setting of the server in one frozen, validated object.

Built like :class:`llamax.ContextConfig`: each setting is a dataclass field whose metadata
(:func:`llamax.optionspec.spec`) holds its doc and its flag. ``llamax serve`` and
``python -m llamax.ray`` take their flags from the fields (:func:`llamax.flags.add_option_flags`,
read back by :meth:`ServerConfig.from_flags`), :func:`~llamax.server.create_app` takes the
config (or its fields as keywords), and the app's state holds it (``state.config``); the
settings table of docs/server.md is generated from it. So a new server setting is one field
with its doc, and its typed line in :class:`ServerSettings` (``create_app``'s keywords).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import llamax
from llamax.flags import byte_size, nested_options, option_values, spec

from .fairness import DEFAULT_MAX_SEQUENCES
from .guard import SitePolicy
from .images import ImagePolicy

__all__ = ["API_KEY_ENV", "SERVER_OPTION_LISTS", "ServerConfig", "ServerSettings"]

API_KEY_ENV = "LLAMAX_API_KEY"
"""The variable the command lines read the API key from when ``--api-key`` is not given."""


def _minus_one_is_none(value: int) -> int | None:
    """A flag's ``-1`` as None (``--seed -1``: llama-server's "not set")."""
    return None if value == -1 else value


def _host_list(text: str) -> tuple[str, ...]:
    """``--allowed-hosts``' comma-separated names."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise llamax.InvalidParameterError(message, param=param)


_COUNTS = ("max_queue", "max_sequences", "max_body_bytes", "retry_after_seconds",
           "max_stored_responses")  # fmt: skip
"""Settings that are ints >= 1."""
_SECONDS = ("stream_ping_seconds", "slot_idle_seconds")
"""Settings that are numbers > 0."""
_FLAGS = ("parse_special_in_content", "lenient", "keep_billing_header", "native_cors")
"""Settings that are bools."""
_NAMES = ("cors_origins", "allowed_hosts")
"""Settings that are lists of names (kept as tuples)."""


class ServerSettings(TypedDict, total=False):
    """:class:`ServerConfig`'s fields as keywords (``create_app(ctx, api_key="k")``), typed
    for checkers; each is documented on the field. A test keeps the two in step."""

    api_key: str | None
    max_queue: int
    max_sequences: int
    max_body_bytes: int
    retry_after_seconds: int
    max_stored_responses: int
    parse_special_in_content: bool
    lenient: bool
    keep_billing_header: bool
    stream_ping_seconds: float
    cors_origins: Sequence[str]
    native_cors: bool
    allowed_hosts: Sequence[str]
    slot_save_path: str | os.PathLike[str] | None
    slot_idle_seconds: float
    default_max_tokens: int | None
    default_seed: int | None
    model_alias: str | None
    images: ImagePolicy | Mapping[str, Any]
    """An :class:`~.images.ImagePolicy`, or a mapping of some of its fields."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """The settings of one server app (:func:`~llamax.server.create_app`); each is also a
    flag of ``llamax serve`` and ``python -m llamax.ray`` (docs/server.md has the table).

    Checked when built: a bad value raises :class:`~llamax.errors.InvalidParameterError`
    (a ``ValueError``) naming the setting, before any model loads or any port is bound.
    What depends on more than the settings (``slot_save_path`` must be an existing folder,
    ``model_alias`` needs a single model) is checked by ``create_app``.
    """

    api_key: str | None = field(
        default=None,
        metadata=spec(
            doc="the key every route but `/` and `/health` needs, sent as `Authorization: "
            "Bearer KEY` or `x-api-key: KEY` (else 401)",
            default_doc="none",
            flag_default_doc="`$LLAMAX_API_KEY`, else none",
            flag=True,
            metavar="KEY",
        ),
    )
    max_queue: int = field(
        default=256,
        metadata=spec(
            doc="most requests in flight (being parsed, rendered, tokenized, running or "
            "waiting; `/tokenize`, `/detokenize` and `/v1/embeddings` included); more get 503 "
            "with `Retry-After`",
            flag=True,
            metavar="N",
        ),
    )
    max_sequences: int = field(
        default=DEFAULT_MAX_SEQUENCES,
        metadata=spec(
            doc="most sequences one request may queue: its prompts times its choices (`n`, "
            "`n_cmpl`); more get 400 `too_many_sequences` (docs/server.md#fair-turns)",
            flag=True,
            flag_name="--max-sequences-per-request",
            metavar="N",
        ),
    )
    max_body_bytes: int = field(
        default=8 << 20,
        metadata=spec(
            doc="largest request body; larger gets 413 (flag: also `512K`, `16M`)",
            default_doc="8 MiB",
            flag=True,
            flag_type=byte_size,
            metavar="BYTES",
        ),
    )
    retry_after_seconds: int = field(
        default=1,
        metadata=spec(
            doc="the `Retry-After` of a 503 (a full queue, a model not loaded yet)",
            flag=True,
            metavar="S",
        ),
    )
    max_stored_responses: int = field(
        default=1024,
        metadata=spec(
            doc="most responses `/v1/responses` keeps for `previous_response_id` (least "
            "recently used go first; their conversations are also bounded to 64 MiB of text)",
            flag=True,
            metavar="N",
        ),
    )
    parse_special_in_content: bool = field(
        default=False,
        metadata=spec(
            doc="let special-token text in chat message content act as special tokens, as "
            "llama-server does (unsafe: a user can forge turns and roles, see "
            "docs/server.md#role-injection); off: content is plain text",
            default_doc="off",
            flag=True,
        ),
    )
    lenient: bool = field(
        default=False,
        metadata=spec(
            doc="on the OpenAI and Anthropic routes, drop and log (a warning naming them) "
            "top-level request fields that are in neither API's reference, instead of a 400 "
            "(off: a typo is not silently ignored; docs/server.md#request-fields)",
            default_doc="off (strict)",
            flag=True,
        ),
    )
    keep_billing_header: bool = field(
        default=False,
        metadata=spec(
            doc="render Claude Code's per-request `x-anthropic-billing-header:` system block "
            "on `/v1/messages`; off, it is left out of the prompt, as it changes every request "
            "and would defeat the prefix cache (docs/anthropic.md)",
            default_doc="off (left out)",
            flag=True,
        ),
    )
    stream_ping_seconds: float = field(
        default=10.0,
        metadata=spec(
            doc="an Anthropic Messages stream quiet this long (a long prefill, a slow step) "
            "gets a `ping` event, as Anthropic's API sends, so that idle timeouts along the "
            "way do not cut it",
            flag=True,
            metavar="S",
        ),
    )
    cors_origins: tuple[str, ...] = field(
        default=(),
        metadata=spec(
            doc="origins allowed by CORS on every route (`*`: any; flag: repeatable)",
            default_doc="none: `native_cors` only",
            flag_default_doc="llama-server's own routes answer any origin, the others none",
            flag=True,
            flag_name="--cors-origin",
            metavar="ORIGIN",
        ),
    )
    native_cors: bool = field(
        default=True,
        metadata=spec(
            doc="without `cors_origins`, answer any origin by CORS on llama-server's own "
            "inference and information routes (`/completion`, `/infill`, `/props` ...), as "
            "llama-server does; the other routes keep CORS off (`llamax.server.cors` says "
            "why); off: CORS off everywhere",
            default_doc="on",
            flag_default_doc="on (`--no-native-cors`: off)",
            flag=True,
        ),
    )
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata=spec(
            doc="`Host` names answered beside localhost names, IP literals, this machine's "
            "name and the address listened on (`*.example.com`: a domain's names; `*`: any); "
            "every other `Host` gets 403, which stops DNS rebinding (flag: comma-separated; "
            "`llamax serve` adds `--host`; docs/server.md#security-defaults)",
            default_doc="none more",
            flag=True,
            flag_type=_host_list,
            metavar="HOSTS",
        ),
    )
    slot_save_path: str | os.PathLike[str] | None = field(
        default=None,
        metadata=spec(
            doc="the folder llama-server's `POST /slots/ID?action=save` writes to and "
            "`restore` reads from (file names only; `llamax serve` creates it)",
            default_doc="none: those actions get 501",
            flag=True,
            metavar="DIR",
        ),
    )
    slot_idle_seconds: float = field(
        default=300.0,
        metadata=spec(
            doc="a slot (`id_slot`) whose session has run nothing for this long is closed, "
            "its KV freed (an idle slot yields its sequence to other requests before then)",
            flag=True,
            metavar="S",
        ),
    )
    default_max_tokens: int | None = field(
        default=None,
        metadata=spec(
            doc="reply length of a request that sets none, on every API (`n_predict`, "
            "`max_tokens`, `max_output_tokens`; llama-server's `-n`: a request may ask for "
            "more); `None` (flag: `-1`): each API's own, until the end of generation or of "
            "the context, 16 on `/v1/completions`",
            default_doc="each API's own",
            flag=True,
            flag_name="--n-predict",
            short_flag="-n",
            metavar="N",
            from_flag=_minus_one_is_none,
        ),
    )
    default_seed: int | None = field(
        default=None,
        metadata=spec(
            doc="seed of a request that sets none (llama-server's `--seed`); `None` (flag: "
            '`-1`): a random one (a request\'s own `"seed": -1` still draws one)',
            default_doc="random",
            flag=True,
            flag_name="--seed",
            metavar="N",
            from_flag=_minus_one_is_none,
        ),
    )
    model_alias: str | None = field(
        default=None,
        metadata=spec(
            doc="the name the model is served under in `/v1/models`, `/models`, `/props` and "
            "the `model` of a response to a request that names none (llama-server's "
            "`--alias`; one model only)",
            default_doc="the GGUF file's name without `.gguf`",
            flag=True,
            flag_name="--alias",
            metavar="NAME",
        ),
    )
    images: ImagePolicy = field(
        default=ImagePolicy(),
        metadata=spec(
            doc="what a request may do with images: how many it may send, whether remote "
            "image URLs are fetched, within what size and time (`ImagePolicy`; its fields "
            "are flags too; docs/images.md)",
            default_doc="`ImagePolicy()`",
            flag=True,
        ),
    )

    def __post_init__(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            _require(
                _is_int(value) and value >= 1, f"{name} must be an int >= 1, got {value!r}", name
            )
            _require(value.bit_length() <= 63, f"{name} is out of range: {value}", name)
        for name in _SECONDS:
            value = getattr(self, name)
            ok = _is_number(value) and value > 0
            _require(ok, f"{name} must be a number > 0, got {value!r}", name)
        for name in _FLAGS:
            value = getattr(self, name)
            _require(isinstance(value, bool), f"{name} must be a bool, got {value!r}", name)
        for name in _NAMES:
            value = getattr(self, name)
            ok = not isinstance(value, (str, bytes, Mapping)) and hasattr(value, "__iter__")
            value = tuple(value) if ok else value
            ok = ok and all(isinstance(item, str) for item in value)
            _require(ok, f"{name} must be a list of names, got {value!r}", name)
            object.__setattr__(self, name, value)
        _require(
            self.api_key is None or (isinstance(self.api_key, str) and self.api_key != ""),
            "api_key must be a non-empty str (None for no key)",
            "api_key",
        )
        seed = self.default_seed
        _require(
            seed is None or (_is_int(seed) and 0 <= seed < 1 << 32),
            f"default_seed must be None or an int in [0, 2**32), got {seed!r}",
            "default_seed",
        )
        tokens = self.default_max_tokens
        _require(
            tokens is None or (_is_int(tokens) and 1 <= tokens < 1 << 63),
            f"default_max_tokens must be None or an int >= 1, got {tokens!r}",
            "default_max_tokens",
        )
        alias = self.model_alias
        _require(
            alias is None or (isinstance(alias, str) and alias != ""),
            f"model_alias must be None or a non-empty name, got {alias!r}",
            "model_alias",
        )
        path = self.slot_save_path
        _require(
            path is None or (isinstance(path, (str, os.PathLike)) and os.fspath(path) != ""),
            f"slot_save_path must be None or a folder path, got {path!r}",
            "slot_save_path",
        )
        if path is not None:
            object.__setattr__(self, "slot_save_path", os.fspath(path))
        _require(
            isinstance(self.images, ImagePolicy),
            f"images must be an ImagePolicy, got {type(self.images).__name__}",
            "images",
        )
        try:
            self.site  # noqa: B018 - checks allowed_hosts
        except ValueError as exc:
            raise llamax.InvalidParameterError(str(exc), param="allowed_hosts") from None

    @property
    def site(self) -> SitePolicy:
        """Which hosts and origins may use the server (:class:`~.guard.SitePolicy`)."""
        return SitePolicy.of(self.allowed_hosts, self.cors_origins, self.native_cors)

    @classmethod
    def from_options(
        cls, *layers: Mapping[str, Any], base: ServerConfig | None = None
    ) -> ServerConfig:
        """A config from keyword settings, as JSON, YAML or keyword arguments give them.

        Args:
            *layers: Mappings of settings; a later one wins. ``images`` may be an
                :class:`~.images.ImagePolicy` or a mapping of some of its fields (merged
                field by field over what the layers below gave; an unknown field is an
                ``InvalidParameterError``).
            base: The config the layers change (default: the defaults).

        Raises:
            TypeError: an unknown setting, naming the closest valid one.
            InvalidParameterError: a bad value.
        """
        values = {f.name: getattr(base or cls(), f.name) for f in dataclasses.fields(cls)}
        for layer in layers:
            for name, value in layer.items():
                if name not in values:
                    close = difflib.get_close_matches(name, list(values), n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise TypeError(f"unknown server setting {name!r}{hint}")
                values[name] = _merged(name, values[name], value)
        return cls(**values)

    @classmethod
    def from_flags(cls, ns: argparse.Namespace, *layers: Mapping[str, Any]) -> ServerConfig:
        """The config the flags of ``add_option_flags(parser, ServerConfig)`` give: the
        flags over ``layers`` (:meth:`from_options`; Ray's ``--server-options``), over
        ``$LLAMAX_API_KEY`` for the key.

        Raises:
            TypeError: an unknown setting in ``layers``.
            InvalidParameterError: a bad value.
        """
        env = {"api_key": os.environ[API_KEY_ENV]} if os.environ.get(API_KEY_ENV) else {}
        return cls.from_options(env, *layers, option_values(ns, cls))


def _merged(name: str, old: Any, new: Any) -> Any:
    """Setting ``name``'s value ``new`` over ``old``: a mapping of a nested option class's
    fields changes ``old`` field by field."""
    inner = nested_options(type(old))
    if inner is None or not isinstance(new, Mapping):
        return new
    unknown = sorted(set(new) - {f.name for f in dataclasses.fields(inner)})
    if unknown:  # a value (from JSON, YAML) that is wrong, not a wrong keyword
        message = f"{name}: {inner.__name__} has no field {unknown[0]!r}"
        raise llamax.InvalidParameterError(message, param=f"{name}.{unknown[0]}")
    try:
        return dataclasses.replace(old, **new)
    except llamax.InvalidParameterError as exc:  # about a field of the nested class
        param = name if exc.param is None else f"{name}.{exc.param}"
        raise llamax.InvalidParameterError(str(exc), param=param) from None


SERVER_OPTION_LISTS: dict[str, type] = {"ServerConfig": ServerConfig, "ImagePolicy": ImagePolicy}
"""The server's option lists by the names the docs' generated tables use
(``<!-- options: ServerConfig flags -->``; ``scripts/option_tables.py`` regenerates them)."""
