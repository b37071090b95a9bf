"""Inference backends. Only this package touches ctypes."""

from .base import (
    Backend,
    BatchDecoder,
    BatchItem,
    Calibratable,
    Clocked,
    DecodeStatus,
    Inspectable,
    KVMemory,
    LoadedModel,
    MachineLoad,
    Sampler,
    SamplerFactory,
)

__all__ = [
    "Backend",
    "BatchDecoder",
    "BatchItem",
    "Calibratable",
    "Clocked",
    "DecodeStatus",
    "Inspectable",
    "KVMemory",
    "LoadedModel",
    "MachineLoad",
    "Sampler",
    "SamplerFactory",
]
