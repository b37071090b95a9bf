"""llama.cpp's RPC backend: remote ``rpc-server`` hosts as extra devices for one model.

llama.cpp dropped the ``rpc_servers`` field of ``llama_model_params`` (llama-cpp-python
0.3.36's struct has none). Remote servers are now registered with ggml's device registry
before the model loads, as llama.cpp's own ``--rpc`` flag does (``common/arg.cpp``); the
model then splits its layers over every registered device, local and remote.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError

__all__ = ["register_rpc_servers"]

_registered: set[str] = set()
"""Endpoints already registered: ggml's device registry is process-wide and only grows."""


def register_rpc_servers(bindings: Any, servers: str) -> None:
    """Register each RPC endpoint as a ggml device (once per process).

    Args:
        bindings: The ``llama_cpp.llama_cpp`` module.
        servers: Comma-separated ``host:port`` endpoints of running ``rpc-server`` hosts
            (validated by ``ContextConfig``).

    Raises:
        ModelLoadError: this llama.cpp build has no RPC backend (rebuild with
            ``LLAMAX_CMAKE_ARGS=-DGGML_RPC=ON``), or a server could not be added.
    """
    if not bindings.llama_supports_rpc():
        raise ModelLoadError(
            "rpc_servers needs llama.cpp built with its RPC backend; rebuild llama-cpp-python "
            "with LLAMAX_CMAKE_ARGS='-DGGML_RPC=ON' bash scripts/bootstrap.sh"
        )
    ggml = ctypes.CDLL(str(Path(bindings.__file__).parent / "lib" / "libggml.so"))
    ggml.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    registry = ggml.ggml_backend_reg_by_name(b"RPC")
    if not registry:
        raise ModelLoadError("llama.cpp reports RPC support but has no 'RPC' backend registry")
    add_server = ggml.ggml_backend_reg_get_proc_address(registry, b"ggml_backend_rpc_add_server")
    add_device = ggml.ggml_backend_reg_get_proc_address(registry, b"ggml_backend_rpc_add_device")
    for endpoint in (part.strip() for part in servers.split(",")):
        if endpoint in _registered:
            continue
        if add_server:  # newer ggml: one registry per server, holding its devices
            fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(add_server)
            handle, register = fn(endpoint.encode()), ggml.ggml_backend_register
        elif add_device:  # older ggml: one device per server
            fn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(add_device)
            handle, register = fn(endpoint.encode()), ggml.ggml_backend_device_register
        else:
            raise ModelLoadError("this ggml's RPC backend exposes no add_server/add_device")
        if not handle:
            raise ModelLoadError(f"could not connect to the RPC server at {endpoint}")
        register.argtypes = [ctypes.c_void_p]
        register(handle)
        _registered.add(endpoint)
