"""Inference backends. Only this package touches ctypes."""

from .base import Backend, BatchItem, DecodeStatus, Sampler

__all__ = ["Backend", "BatchItem", "DecodeStatus", "Sampler"]
