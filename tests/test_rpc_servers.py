"""``rpc_servers``: validated in ContextConfig, refused clearly by a build without RPC.

This machine's llama.cpp is built without ``-DGGML_RPC=ON`` and has no GPU, so the path
that registers remote devices is not exercised here (see docs/scale-out.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import llamax
from llamax.config import ContextConfig


@pytest.mark.parametrize("servers", ["", "host", "host:", ":50052", "a:1,b", "a:x"])
def test_bad_rpc_servers_are_refused(servers: str) -> None:
    with pytest.raises(llamax.errors.InvalidParameterError, match="rpc_servers must be"):
        ContextConfig(model_path="m.gguf", rpc_servers=servers)


def test_rpc_servers_accepted_as_option() -> None:
    config = ContextConfig.from_options("m.gguf", {"rpc_servers": "10.0.0.2:50052, 10.0.0.3:50052"})
    assert config.rpc_servers == "10.0.0.2:50052, 10.0.0.3:50052"


@pytest.mark.model
def test_build_without_rpc_says_how_to_get_it(model_path: Path) -> None:
    import llama_cpp.llama_cpp as bindings

    if bindings.llama_supports_rpc():
        pytest.skip("this llama.cpp build has the RPC backend")
    with pytest.raises(llamax.ModelLoadError, match="GGML_RPC=ON"):
        llamax.Context(model_path, rpc_servers="127.0.0.1:50052", n_threads=1)
