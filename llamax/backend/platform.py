"""Facts about the host that change how llama.cpp must be driven."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "calibration_key",
    "cpu_advertises_amx",
    "cpu_description",
    "default_use_extra_bufts",
]


def cpu_advertises_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU reports Intel AMX tiles (Linux only; False elsewhere)."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with cpuinfo.open() as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        return False
    return False


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, object]:
    """The CPU's model name and flags (from ``/proc/cpuinfo`` where there is one, else what
    :mod:`platform` says) and the cores: what step costs depend on besides the model."""
    model, flags = "", ""
    try:
        with cpuinfo.open() as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model name") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return {
        "model": model or platform.processor() or platform.machine(),
        "flags": flags,
        "cores": os.cpu_count(),
        "system": sys.platform,
    }


def default_use_extra_bufts() -> bool:
    """Whether to let ggml use extra CPU buffer types (AMX, repacked weights).

    A native build of ggml enables its AMX matmul on CPUs that advertise AMX, and in VMs
    that advertise AMX without usable tile state it segfaults inside
    ``ggml_backend_amx_mul_mat`` at the first decode. Turning extra buffer types off avoids
    that path and measured the same throughput, so we do it wherever AMX is advertised.
    """
    return not cpu_advertises_amx()


def calibration_key(C: Any, identity: dict[str, object], settings: Sequence[object]) -> str:
    """What a calibration is cached under: the model's ``identity``, llama.cpp's build and
    version, the ``settings`` step costs depend on, and the CPU (model and SIMD flags)."""
    import json

    import llama_cpp

    system = C.llama_print_system_info()
    return json.dumps(
        {
            "model": identity,
            "llama_cpp": [llama_cpp.__version__, bytes(system or b"").decode(errors="replace")],
            "cpu": cpu_description(),
            "settings": settings,
        },
        sort_keys=True,
        default=str,
    )
