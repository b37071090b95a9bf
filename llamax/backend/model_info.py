"""Reading a GGUF model's facts through llama.cpp (for ``llamax info``)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError
from .llama_cpp import _bindings, _check_gguf
from .platform import default_use_extra_bufts

__all__ = ["read_model_facts"]


def _meta(C: Any, model: Any, key: str) -> str | None:
    size = 1 << 16
    buf = ctypes.create_string_buffer(size)
    n = C.llama_model_meta_val_str(model, key.encode(), buf, size)
    return None if n < 0 else buf.value.decode("utf-8", "replace")


def read_model_facts(path: Path) -> dict[str, Any]:
    """Load ``path`` (weights memory-mapped, on the CPU) with a 256-cell context, and read
    its metadata and what its memory can do. Everything is freed before returning.

    Raises:
        ModelLoadError: the file is missing, not GGUF, or llama.cpp refuses it.
    """
    C = _bindings()
    _check_gguf(path)
    mparams = C.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.use_extra_bufts = default_use_extra_bufts()
    model = C.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise ModelLoadError(f"llama.cpp could not load {path} (corrupt or unsupported model?)")
    try:
        facts = _model_facts(C, model)
        cparams = C.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = 256
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = 1
        ctx = C.llama_init_from_model(model, cparams)
        if not ctx:
            raise ModelLoadError(f"llama.cpp could not create a context for {path}")
        try:
            facts["can_shift"] = bool(C.llama_memory_can_shift(C.llama_get_memory(ctx)))
        finally:
            C.llama_free(ctx)
        return facts
    finally:
        C.llama_model_free(model)


def _model_facts(C: Any, model: Any) -> dict[str, Any]:
    desc = ctypes.create_string_buffer(256)
    C.llama_model_desc(model, desc, 256)
    is_recurrent = bool(C.llama_model_is_recurrent(model))
    is_hybrid = bool(C.llama_model_is_hybrid(model))
    return {
        "name": _meta(C, model, "general.name"),
        "architecture": _meta(C, model, "general.architecture") or "unknown",
        "description": desc.value.decode("utf-8", "replace"),
        "num_params": int(C.llama_model_n_params(model)),
        "size_bytes": int(C.llama_model_size(model)),
        "context_length": int(C.llama_model_n_ctx_train(model)),
        "n_embd": int(C.llama_model_n_embd(model)),
        "n_layer": int(C.llama_model_n_layer(model)),
        "n_vocab": int(C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))),
        "sliding_window": int(C.llama_model_n_swa(model)),
        "has_chat_template": bool(C.llama_model_chat_template(model, None)),
        "is_recurrent": is_recurrent,
        "is_hybrid": is_hybrid,
        "can_copy": not (is_recurrent or is_hybrid),
    }
