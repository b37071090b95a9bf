"""llamax: embeddable, thread-safe, continuously batched local LLM inference on llama.cpp.

>>> import llamax
>>> with llamax.Context() as ctx:                       # doctest: +SKIP
...     print(ctx.add_request("Hello", llamax.SamplingParams(max_tokens=8)).result().text)
"""

from .context import Context
from .conversation import Chat, TurnStats
from .errors import (
    ContextClosedError,
    ContextLengthError,
    DeadlockError,
    DefaultModelNotInstalledError,
    EmptyPromptError,
    EngineError,
    GrammarError,
    InvalidParameterError,
    InvalidRequestError,
    LlamaxError,
    LoopOwnershipError,
    ModelLoadError,
    RequestFailedError,
    SessionBusyError,
    SessionError,
    SessionLoadError,
)
from .handle import RequestHandle
from .models import default_model_path
from .params import ContextConfig, ContextOptions, LogitsProcessor, SamplingParams
from .results import Choice, Completion, FinishReason, TokenEvent, TokenLogprob, TopLogprob, Usage
from .sampling import BatchLogitsProcessor, LogitsRow
from .session import Session
from .stats import ContextStats

__version__ = "0.1.0"

__all__ = [
    "BatchLogitsProcessor",
    "Chat",
    "Choice",
    "Completion",
    "Context",
    "ContextClosedError",
    "ContextConfig",
    "ContextLengthError",
    "ContextOptions",
    "ContextStats",
    "DeadlockError",
    "DefaultModelNotInstalledError",
    "EmptyPromptError",
    "EngineError",
    "FinishReason",
    "GrammarError",
    "InvalidParameterError",
    "InvalidRequestError",
    "LlamaxError",
    "LogitsProcessor",
    "LogitsRow",
    "LoopOwnershipError",
    "ModelLoadError",
    "RequestFailedError",
    "RequestHandle",
    "SamplingParams",
    "Session",
    "SessionBusyError",
    "SessionError",
    "SessionLoadError",
    "TokenEvent",
    "TokenLogprob",
    "TopLogprob",
    "TurnStats",
    "Usage",
    "__version__",
    "default_model_path",
]
