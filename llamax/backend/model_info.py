"""Reading a GGUF model's facts through llama.cpp (for ``llamax info``)."""

from __future__ import annotations

import os
from contextlib import closing
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError
from .native import NativeBatch, NativeContext, NativeModel, bindings, context_params

__all__ = ["read_model_facts"]


def read_model_facts(path: Path, *, mmproj: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Load ``path`` (weights memory-mapped, on the CPU) with a 256-cell context, and read
    its metadata and what its memory can do; with ``mmproj``, load that projector for it
    and ask whether it encodes images. Everything is freed before returning: the
    projector, the context, then the model.

    Raises:
        ModelLoadError: the file is missing, not GGUF, or llama.cpp refuses it.
        ProjectorError: ``mmproj`` is not a projector for this model.
    """
    C = bindings()
    with closing(NativeModel(C, path, n_gpu_layers=0)) as model:
        facts = _model_facts(model)
        if mmproj is not None:
            from .vision import Projector

            with closing(Projector.load(model, mmproj, n_threads=1, warmup=False)) as projector:
                facts["sees_images"] = projector.supports_vision
        cparams = context_params(
            C, n_ctx=256, n_batch=256, n_seq_max=1, n_threads=1, n_threads_batch=1
        )
        context = NativeContext.create(model, cparams)
        if context is None:
            raise ModelLoadError(f"llama.cpp could not create a context for {path}")
        with closing(context):
            facts["can_shift"] = context.can_shift()
            facts["kv_bytes_per_cell"], facts["state_bytes_per_seq"] = _measure_memory(
                C, model, context
            )
        return facts


def _measure_memory(C: Any, model: NativeModel, context: NativeContext) -> tuple[int, int]:
    """What one more cell of a sequence costs, and what a sequence costs before any cell,
    measured: the size of sequence 0's saved state after one token, and after two
    (``llama_state_seq_get_size``). Attention KV grows by a cell a token (at the
    context's KV type, F16 here); a recurrent state does not grow."""
    batch = NativeBatch(C, 2)
    try:
        sizes = []
        for pos in (0, 1):
            batch.tokens[0], batch.pos[0], batch.logits[0] = model.bos(), pos, 0
            batch.seq_rows[0][0] = 0
            batch.set_n_tokens(1)
            if context.decode(batch) != 0:
                raise ModelLoadError("llama.cpp could not decode a token to measure the memory")
            sizes.append(int(C.llama_state_seq_get_size(context.ptr, 0)))
    finally:
        batch.close()
    per_cell = max(0, sizes[1] - sizes[0])
    return per_cell, max(0, sizes[0] - per_cell)


def _model_facts(model: NativeModel) -> dict[str, Any]:
    is_recurrent, is_hybrid = model.is_recurrent(), model.is_hybrid()
    return {
        "name": model.meta("general.name"),
        "architecture": model.meta("general.architecture") or "unknown",
        "description": model.desc(),
        "num_params": model.n_params(),
        "size_bytes": model.size(),
        "context_length": model.n_ctx_train(),
        "n_embd": model.n_embd(),
        "n_layer": model.n_layer(),
        "n_vocab": model.n_vocab(),
        "sliding_window": model.n_swa(),
        "has_chat_template": model.has_chat_template(),
        "is_recurrent": is_recurrent,
        "is_hybrid": is_hybrid,
        "can_copy": not (is_recurrent or is_hybrid),
    }
