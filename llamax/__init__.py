"""llamax: embeddable, thread-safe, continuously batched local LLM inference on llama.cpp.

>>> import llamax
>>> with llamax.Context() as ctx:                       # doctest: +SKIP
...     print(ctx.add_request("Hello", llamax.SamplingParams(max_tokens=8)).result().text)
"""

from importlib import metadata as _metadata

from .config import ContextConfig, ContextOptions
from .context import Context
from .conversation import Chat, TurnStats
from .drafting import PromptLookup
from .embeddings import Embedder
from .engine.sched.sampling import BatchLogitsProcessor, LogitsRow
from .engine.timing.calibration import Calibration
from .errors import (
    CacheClearError,
    ContextClosedError,
    ContextLengthError,
    DeadlockError,
    DefaultModelNotInstalledError,
    EmptyPromptError,
    EngineError,
    GrammarError,
    ImageError,
    InsufficientMemoryError,
    InvalidMessageError,
    InvalidParameterError,
    InvalidRequestError,
    KVCapacityError,
    LlamaxError,
    LoopOwnershipError,
    ModelLoadError,
    NotFoundError,
    ProjectorError,
    RequestFailedError,
    SessionBusyError,
    SessionError,
    SessionLoadError,
    TemplateBudgetError,
    TemplateError,
    TemplateSecurityError,
)
from .facts import ModelFacts
from .handle import RequestHandle
from .images import Image
from .info import MemoryPlan, ModelInfo, model_info, plan_memory
from .models import default_model_path
from .params import LogitsProcessor, SamplingParams
from .results import (
    Choice,
    Completion,
    FinishReason,
    PrefillProgress,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from .session import Session
from .stats import ContextStats
from .tokens import FimTokens

try:
    __version__ = _metadata.version("llamax")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "BatchLogitsProcessor",
    "CacheClearError",
    "Calibration",
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
    "Embedder",
    "EmptyPromptError",
    "EngineError",
    "FimTokens",
    "FinishReason",
    "GrammarError",
    "Image",
    "ImageError",
    "InsufficientMemoryError",
    "InvalidMessageError",
    "InvalidParameterError",
    "InvalidRequestError",
    "KVCapacityError",
    "LlamaxError",
    "LogitsProcessor",
    "LogitsRow",
    "LoopOwnershipError",
    "MemoryPlan",
    "ModelFacts",
    "ModelInfo",
    "ModelLoadError",
    "NotFoundError",
    "PrefillProgress",
    "ProjectorError",
    "PromptLookup",
    "RequestFailedError",
    "RequestHandle",
    "SamplingParams",
    "Session",
    "SessionBusyError",
    "SessionError",
    "SessionLoadError",
    "TemplateBudgetError",
    "TemplateError",
    "TemplateSecurityError",
    "TokenEvent",
    "TokenLogprob",
    "TopLogprob",
    "TurnStats",
    "Usage",
    "__version__",
    "default_model_path",
    "model_info",
    "plan_memory",
]
