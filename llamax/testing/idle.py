"""The leak check every test ends with: :func:`assert_idle`."""

from __future__ import annotations

import time

from ..context import Context

__all__ = ["assert_idle"]


def assert_idle(ctx: Context, timeout: float = 60.0, *, clear_cache: bool = True) -> None:
    """Assert that ``ctx`` leaked nothing, using only its public API.

    Checks (from :meth:`Context.stats` and :meth:`Context.audit`): no queued or running
    sequence, no unsettled request, no open session; the bookkeeping agrees with the
    backend's memory (every sequence id free or held by a slot whose KV extent matches its
    tokens, cell counts, live samplers). Then, with ``clear_cache``, drops the retained
    prefixes and checks that no KV cell is left in use. Waits up to ``timeout`` seconds for
    the background loop to go idle; it waits only while work remains, so the generous
    default costs an idle context nothing and holds on a busy machine.

    Raises:
        AssertionError: something leaked; the message says what.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (ctx.has_work() or ctx.stats().num_unsettled):
        time.sleep(0.005)
    problems = _leaks(ctx)
    if not problems and clear_cache and not ctx.closed:
        ctx.clear_cache()
        problems = _leaks(ctx)
        stats = ctx.stats()
        ram, disk = stats.prefix_ram, stats.prefix_disk
        if stats.kv.cells_used or stats.prefix.num_retained:
            problems.append(
                f"{stats.kv.cells_used} cells in {stats.prefix.num_retained} retained sequences "
                "after clear_cache()"
            )
        if ram.num_entries or ram.num_bytes:
            problems.append(
                f"{ram.num_bytes} bytes in {ram.num_entries} RAM prefixes after clear_cache()"
            )
        if disk.num_entries or disk.num_bytes:
            problems.append(
                f"{disk.num_bytes} bytes in {disk.num_entries} disk prefixes after clear_cache()"
            )
    if problems:
        raise AssertionError("engine not idle: " + "; ".join(problems))


def _leaks(ctx: Context) -> list[str]:
    stats = ctx.stats()
    problems = []
    if ctx.has_work():
        problems.append("engine still has work")
    queue = stats.sequences
    if queue.num_running or queue.num_waiting:
        problems.append(f"{queue.num_running} running / {queue.num_waiting} waiting sequences")
    if stats.num_unsettled:
        problems.append(f"{stats.num_unsettled} requests never settled")
    if stats.num_sessions:
        problems.append(f"{stats.num_sessions} sessions still open")
    if not ctx.closed:
        problems += ctx.audit()
    return problems
