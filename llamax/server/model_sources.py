"""Where a pool's models come from: a GGUF path or a function per name, each model's
context options (its share of the prefix tiers' budgets, its own disk-tier folder), and how
many fit in memory at once."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import llamax

__all__ = [
    "DEFAULT_MAX_LOADED",
    "ModelSource",
    "available_memory",
    "default_max_loaded",
    "factory",
    "options_of",
    "shared_budgets",
]

DEFAULT_MAX_LOADED = 2
"""Most models of a directory loaded at once when no bound is given (fewer when memory is
short: :meth:`ModelPool.default_max_loaded`)."""

ModelSource = str | os.PathLike[str] | Callable[..., llamax.Context]
"""A GGUF path, or a function that builds the context (tests pass fake contexts so); a
function that takes ``**options`` is called with the model's context options, its share of
the pool's prefix budgets included (:func:`factory`)."""


def default_max_loaded(
    paths: Iterable[str | os.PathLike[str]], available_bytes: int | None = None
) -> int:
    """:data:`DEFAULT_MAX_LOADED`, or as many of the largest file of ``paths`` as fit in
    half of ``available_bytes`` (default: :func:`available_memory`), if fewer; at least 1.
    A context needs more than its file (KV cache, buffers), so the constant is small."""
    sizes = []
    for path in paths:
        with contextlib.suppress(OSError):  # a missing file fails its load, later
            sizes.append(os.stat(path).st_size)
    available = available_memory() if available_bytes is None else available_bytes
    largest = max(sizes, default=0)
    if largest == 0 or available <= 0:
        return DEFAULT_MAX_LOADED
    return max(1, min(DEFAULT_MAX_LOADED, available // 2 // largest))


def available_memory(meminfo: str = "/proc/meminfo") -> int:
    """The memory available now (``MemAvailable``, else the free pages); 0 if unknown."""
    try:
        with open(meminfo, encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 0


def shared_budgets(
    options: Mapping[str, Any], num_models: int, max_loaded: int | None
) -> dict[str, Any]:
    """``options`` with each model's share of the prefix tiers' budgets. The host-RAM
    tier's budget is one for the whole pool, the one given (``prefix_ram_bytes``) or the
    machine's default, divided among the models loaded at once; the disk tier's default
    is divided among all the models (a model's files stay on disk when it unloads), and a
    disk budget given is each model's."""
    shared = dict(options)
    at_once = num_models if max_loaded is None else min(max_loaded, num_models)
    ram_bytes = shared.get("prefix_ram_bytes")
    if isinstance(ram_bytes, int) and not isinstance(ram_bytes, bool) and ram_bytes > 0:
        shared["prefix_ram_bytes"] = max(1, ram_bytes // at_once)
    elif ram_bytes is None:
        shared.setdefault("prefix_ram_share", 1 / at_once)
    if shared.get("prefix_disk_bytes") is None:
        shared.setdefault("prefix_disk_share", 1 / num_models)
    return shared


_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def options_of(name: str, options: Mapping[str, Any]) -> Mapping[str, Any]:
    """``options`` for the model named ``name``: its disk prefix tier (if any) in a folder
    of its own, ``<prefix_disk_dir>/<name>/``, so one GGUF served under two names gets two
    tiers rather than a lock conflict (one context per tier folder). A name that is not a
    plain file name is folded into ``model-<hash>``."""
    directory = options.get("prefix_disk_dir")
    if directory is None:
        return options
    folder = (
        name
        if _PLAIN_NAME.fullmatch(name)
        else "model-" + hashlib.sha256(name.encode()).hexdigest()[:16]
    )
    return {**options, "prefix_disk_dir": os.path.join(os.fspath(directory), folder)}


def factory(source: ModelSource, options: Mapping[str, Any]) -> Callable[[], llamax.Context]:
    """A function that builds ``source``'s context with ``options``: a function source
    that takes keyword arguments (``**options``) is given them, its share of the pool's
    budgets included; one that takes none builds its context as it likes."""
    if callable(source):
        if _takes_options(source):
            return functools.partial(source, **options)
        return source
    path = os.fspath(source)
    return lambda: llamax.Context(path, **options)


def _takes_options(function: Callable[..., Any]) -> bool:
    """Whether ``function`` takes arbitrary keyword arguments (``**options``)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
