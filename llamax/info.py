"""What a GGUF model is, without creating a full :class:`~llamax.Context`: :func:`model_info`;
and what a context of it will cost in memory: :func:`plan_memory` (from
:mod:`llamax.memory_plan`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .memory_plan import MAX_PLANNED_CTX, MemoryPlan, plan_memory
from .models import default_model_path

__all__ = [
    "MAX_PLANNED_CTX",
    "MemoryPlan",
    "ModelInfo",
    "max_cells",
    "model_info",
    "plan_memory",
]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts read from a GGUF file by llama.cpp."""

    path: Path
    name: str | None
    """``general.name`` from the metadata."""
    architecture: str
    """``general.architecture`` (``llama``, ``qwen2``, ``mamba`` ...)."""
    description: str
    """llama.cpp's one-line summary (type, size, quantisation)."""
    num_params: int
    size_bytes: int
    context_length: int
    """The context length the model was trained with."""
    n_embd: int
    n_layer: int
    n_vocab: int
    sliding_window: int
    """Sliding-window attention span, 0 when none."""
    has_chat_template: bool
    """Whether the GGUF carries a chat template (``tokenizer.chat_template``)."""
    is_recurrent: bool
    is_hybrid: bool
    can_shift: bool
    """Whether the KV memory supports position shifts (chat history shift)."""
    can_copy: bool
    """Whether partial sequence copies work (prefix sharing): false for recurrent memories."""
    kv_bytes_per_cell: int = 0
    """Memory one more token of a sequence takes (attention KV at F16), measured on a
    small context as the growth of a sequence's saved state (which adds a cell's position
    and sequence id, 12 bytes): ``n_ctx`` cells take about ``n_ctx * kv_bytes_per_cell``.
    0 for a recurrent model. A sliding-window layer holds only its window, so past the
    window this is an upper bound."""
    state_bytes_per_seq: int = 0
    """Memory a sequence takes whatever its length (a recurrent or hybrid model's state;
    about 0 for attention alone), measured as :attr:`kv_bytes_per_cell` is."""
    sees_images: bool = False
    """Whether prompts may hold images: a projector (``mmproj``) that encodes them goes
    with the model (``model_info(path, mmproj=...)``, or a context's ``model_info()``)."""


def model_info(
    model_path: str | os.PathLike[str] | None = None,
    *,
    mmproj: str | os.PathLike[str] | None = None,
) -> ModelInfo:
    """Read a model's metadata and memory capabilities.

    The weights are memory-mapped and a 256-cell context is created (and freed) to ask
    the memory what it supports; with ``mmproj``, the projector is loaded (and freed) to
    ask whether it encodes images.

    Args:
        model_path: a GGUF file; ``None`` means ``$LLAMAX_MODEL`` or the default model.
        mmproj: the model's multimodal projector GGUF, if any.

    Returns:
        The model's :class:`ModelInfo`.

    Raises:
        ModelLoadError: the file is missing, not GGUF, or llama.cpp refuses it
            (:class:`~llamax.ProjectorError` for the projector).
    """
    from .backend.model_info import read_model_facts

    path = Path(model_path or os.environ.get("LLAMAX_MODEL") or default_model_path()).expanduser()
    return ModelInfo(path=path, **read_model_facts(path, mmproj=mmproj))


def max_cells(info: ModelInfo, ram_bytes: int, *, n_seq_max: int = 1) -> int:
    """The most KV cells (``n_ctx``, over all sequences) that fit in ``ram_bytes`` beside
    the model's weights and ``n_seq_max`` sequences' fixed state, by ``info``'s measured
    costs; 0 when the weights alone do not fit. A rough plan: llama.cpp's compute buffers
    (about 100 MiB for a small model) and the process come on top; :func:`plan_memory`
    counts them, at any KV type and layout."""
    room = ram_bytes - info.size_bytes - n_seq_max * info.state_bytes_per_seq
    if room <= 0:
        return 0
    if info.kv_bytes_per_cell == 0:
        return info.context_length * n_seq_max
    return room // info.kv_bytes_per_cell
