"""Giving back the OpenMP worker threads a thread's compute left behind.

llama.cpp's CPU backend, built with OpenMP as llama-cpp-python builds it by default on
Linux, runs each graph in an OpenMP parallel region of the thread that calls
``llama_decode`` (or encodes an image, or embeds). GNU libgomp keeps the workers of that
region in a pool **per calling thread, for that thread's life**, and counts every pooled
worker, busy or asleep. While the count is above the CPUs, every barrier of every region
spins about a hundred times instead of ~300,000 before it sleeps in the kernel
(``do_spin``'s throttled count), and a graph has hundreds of barriers. Measured on a 2-core
AMD EPYC with SmolLM2 (``benchmarks/results/issue59/openmp-pools/``): after the constructor
had calibrated on the main thread, the engine decoded one stream at 11.7-16.7 ms a token
instead of 8.3-8.8, for as long as the main thread lived.

:func:`release_threads` frees the **calling** thread's pool
(``omp_pause_resource_all(omp_pause_soft)``, OpenMP 5.0; libgomp since GCC 9): a thread
that has finished computing calls it, and its next compute makes the pool again (one
thread creation per worker, ~50 µs). It does nothing where libgomp is not loaded (macOS's
builds, Windows, a build without OpenMP, the fake backend), and never loads it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from typing import Any

__all__ = ["release_threads"]

_log = logging.getLogger("llamax.llama_cpp")

_LIBGOMP = "libgomp.so.1"
_OMP_PAUSE_SOFT = 1
"""``omp_pause_soft`` of ``omp_pause_resource_t``: libgomp frees the calling thread's pool
for either kind."""

_lock = threading.Lock()
_pause: Any = None
_looked = False


def _find() -> Any:
    """libgomp's ``omp_pause_resource_all`` if this process has libgomp loaded, else None.

    Looked up once: every caller has computed before it asks, so llama.cpp has loaded its
    CPU backend (and libgomp with it, where it uses OpenMP) by then."""
    global _pause, _looked
    with _lock:
        if not _looked:
            _looked = True
            lib = None
            no_load = getattr(os, "RTLD_NOLOAD", None)  # None on Windows: no libgomp
            if no_load is not None:  # not loaded: llama.cpp runs without OpenMP here
                with contextlib.suppress(OSError):
                    lib = ctypes.CDLL(_LIBGOMP, mode=no_load | os.RTLD_LAZY)
            _pause = getattr(lib, "omp_pause_resource_all", None)  # GCC 9 and later
            if _pause is not None:
                _pause.argtypes = [ctypes.c_int]
                _pause.restype = ctypes.c_int
        return _pause


def release_threads() -> bool:
    """Free the OpenMP worker threads the calling thread's compute keeps; True if it did.

    Call it on a thread that has finished computing and may not compute again soon (not
    inside a parallel region: from Python it never is). Other threads' pools are theirs.
    """
    pause = _find()
    if pause is None:
        return False
    status = int(pause(_OMP_PAUSE_SOFT))
    if status != 0:
        _log.debug("omp_pause_resource_all returned %d", status)
    return status == 0
