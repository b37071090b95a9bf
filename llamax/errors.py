"""The llamax exception tree.

Every error llamax raises on purpose derives from :class:`LlamaxError`::

    LlamaxError
    ├── ModelLoadError              model file missing, unreadable or not a model
    │   ├── DefaultModelNotInstalledError
    │   ├── ProjectorError          an ``mmproj`` file missing, not a projector, or unfit
    │   └── InsufficientMemoryError the context's buffers cannot fit the memory available
    ├── InvalidRequestError (also ValueError)
    │   ├── InvalidParameterError   a SamplingParams / config field is out of range
    │   ├── EmptyPromptError
    │   ├── ContextLengthError      the prompt cannot fit in the context
    │   ├── GrammarError            the grammar or JSON schema cannot be used
    │   ├── ImageError              an image cannot be read (not one, truncated, too large)
    │   └── NotFoundError (also LookupError)   a stored item it names does not exist
    ├── ContextClosedError (also RuntimeError)
    ├── LoopOwnershipError (also RuntimeError)   process() called where it must not be
    ├── EngineError                 llama.cpp failed; the context is closed
    ├── CacheClearError             clear_cache could not delete every disk-tier file
    ├── RequestFailedError          one request failed; the engine keeps serving others
    │   └── KVCapacityError         it can never fit beside the open sessions
    └── SessionError                a session cannot do what was asked
        ├── SessionBusyError        it is already running a request
        └── SessionLoadError        a saved session does not fit this model or is damaged
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CacheClearError",
    "ContextClosedError",
    "ContextLengthError",
    "DefaultModelNotInstalledError",
    "EmptyPromptError",
    "EngineError",
    "GrammarError",
    "ImageError",
    "InsufficientMemoryError",
    "InvalidMessageError",
    "InvalidParameterError",
    "InvalidRequestError",
    "KVCapacityError",
    "LlamaxError",
    "LoopOwnershipError",
    "ModelLoadError",
    "NotFoundError",
    "ProjectorError",
    "RequestFailedError",
    "SessionBusyError",
    "SessionError",
    "SessionLoadError",
    "TemplateBudgetError",
    "TemplateError",
    "TemplateSecurityError",
]


class LlamaxError(Exception):
    """Base class of every error llamax raises on purpose.

    Every one pickles (a Ray replica sends its errors to the caller's process): it is
    rebuilt from its ``args`` and attributes, whatever its ``__init__`` takes.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[LlamaxError], args: tuple[Any, ...], state: dict[str, Any]) -> LlamaxError:
    """An error of ``cls`` with ``args`` and the attributes ``state``, without calling its
    ``__init__`` (whose keyword-only arguments ``args`` does not hold)."""
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class ModelLoadError(LlamaxError):
    """The model file is missing, unreadable, or llama.cpp refused to load it."""


class DefaultModelNotInstalledError(ModelLoadError):
    """No model path was given and the default model package is not installed."""


class ProjectorError(ModelLoadError):
    """A multimodal projector (``mmproj`` GGUF) is missing, is not a projector llama.cpp's
    ``mtmd`` can load, or does not fit the model (its output width is not the model's
    embedding width, or it needs positions the model does not use)."""


class InsufficientMemoryError(ModelLoadError):
    """A context's buffers (its KV cache, a recurrent model's state, llama.cpp's compute
    and output buffers) would not fit in the memory the kernel can hand out, so it was
    refused before llama.cpp allocated them (it zeroes the KV cache as it allocates it:
    the process would be killed halfway). The message gives the numbers and the largest
    ``n_ctx`` that fits; ``$LLAMAX_MEMORY_CHECK=0`` turns the check off (docs/memory.md).

    Args:
        message: What was refused and why.
        plan: The context's :class:`~llamax.MemoryPlan`.
        available_bytes: The memory it was compared with (``MemAvailable + SwapFree``).
    """

    plan: Any
    """The refused context's :class:`~llamax.MemoryPlan`."""
    available_bytes: int
    """The memory the context's buffers were compared with."""

    def __init__(self, message: str, *, plan: Any = None, available_bytes: int = 0) -> None:
        super().__init__(message)
        self.plan = plan
        self.available_bytes = available_bytes


class InvalidRequestError(LlamaxError, ValueError):
    """The request cannot be served as given; nothing was enqueued.

    Args:
        *args: The message (as for any exception).
        param: The request field the error is about, when one is: a top-level field
            (``"top_p"``) or a path into one in the API's spelling
            (``"response_format.json_schema"``, ``"tools[0].function.name"``). HTTP layers
            answer with it as OpenAI's ``param``; ``None`` when no one field is at fault.
    """

    param: str | None
    """The request field the error is about (see above), or ``None``."""

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class InvalidParameterError(InvalidRequestError):
    """A parameter is out of range. The message names the field, and ``param`` holds it."""


class EmptyPromptError(InvalidRequestError):
    """The prompt tokenized to zero tokens."""


class ContextLengthError(InvalidRequestError):
    """The prompt (plus room for one new token) does not fit in the context."""

    def __init__(
        self, message: str, *, num_prompt_tokens: int, n_ctx: int, param: str | None = None
    ) -> None:
        super().__init__(message, param=param)
        self.num_prompt_tokens = num_prompt_tokens
        self.n_ctx = n_ctx


class GrammarError(InvalidRequestError):
    """A GBNF grammar does not parse, or a JSON schema cannot be converted to one."""


class ImageError(InvalidRequestError):
    """An image in a prompt cannot be used: not an image in a format llamax reads, cut
    short, too large, or the model has no projector for it. Nothing was enqueued."""


class NotFoundError(InvalidRequestError, LookupError):
    """Something the request names by id (a stored response's ``previous_response_id``)
    does not exist, or no longer: HTTP layers answer it with 404."""


class ContextClosedError(LlamaxError, RuntimeError):
    """The context has been closed (by ``close()`` or after a fatal engine error)."""


class LoopOwnershipError(LlamaxError, RuntimeError):
    """``process()`` was called while another thread (or the background loop) drives the engine."""


class DeadlockError(LoopOwnershipError):
    """A wait that could never finish: waiting for a running request on the engine's loop
    thread (inside a done-callback or a logits processor), or a KV operation inside a step."""


class EngineError(LlamaxError):
    """llama.cpp reported a fatal error. Every pending request fails with it."""


class CacheClearError(LlamaxError):
    """``clear_cache`` emptied the KV cache and the RAM tier, but some files of the disk
    tier could not be deleted (a read-only filesystem ...). They stay on disk, and the next
    context on that directory would use them again; the message says how many and where."""


class RequestFailedError(LlamaxError):
    """One request failed (its cause is chained); other requests are unaffected."""


class KVCapacityError(RequestFailedError):
    """The request can never get the KV cells (or a sequence id) it needs while the open
    sessions named in the message hold theirs; close a session or raise ``n_ctx``."""


class SessionError(LlamaxError):
    """A session cannot do what was asked (closed, out of sequence ids ...)."""


class SessionBusyError(SessionError):
    """The session is running a request; wait for it (or cancel it) first."""


class SessionLoadError(SessionError):
    """A saved session belongs to another model, or its file is damaged."""


class InvalidMessageError(InvalidRequestError):
    """A chat message is malformed. ``index`` and ``field`` say where (when known)."""

    def __init__(
        self,
        message: str,
        *,
        index: int | None = None,
        field: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message, param=param)
        self.index = index
        self.field = field


class TemplateError(LlamaxError):
    """The chat template does not compile, raised an error, or failed to render."""


class TemplateSecurityError(TemplateError):
    """The chat template tried something the sandbox forbids (internals, mutation)."""


class TemplateBudgetError(TemplateError):
    """Rendering went over ``max_render_seconds`` or ``max_output_chars``."""
