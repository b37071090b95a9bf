"""Concurrent streaming demo: ``python -m llamax.demo`` (or ``bash scripts/demo.sh``).

Several threads submit a prompt each to one :class:`llamax.Context` at the same moment and
stream the replies to the terminal as they arrive. The engine batches every stream into
one ``llama_decode`` per step, so the replies interleave token by token. Each stream has a
colour (when stdout is a terminal) and a ``[k]`` tag printed whenever the output switches
stream or starts a new line. The demo ends with a summary per request and the aggregate
throughput (completion tokens / wall time).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from .config import ContextOptions
from .context import Context
from .params import SamplingParams
from .results import Completion
from .stats import ContextStats

__all__ = ["PROMPTS", "main"]

PROMPTS = (
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "Tell a very short story about a robot who learns to paint.",
    "List five animals that live in the Arctic.",
    "What makes a good password?",
    "Describe a sunset to someone who has never seen one.",
)
"""Demo prompts; ``--prompts N`` cycles through them."""

_COLOURS = ("36", "33", "35", "32", "34", "31", "96", "93")
_RESET = "\033[0m"


class StreamPrinter:
    """Writes text of concurrent streams under one lock, tagging each stream switch.

    Each stream's text is gathered until it holds ``chunk`` characters or a newline, so
    the interleaved output shows phrases rather than single tokens (``chunk=0`` prints
    every token as it arrives).
    """

    def __init__(self, out: TextIO, *, colour: bool, chunk: int = 0) -> None:
        self._out = out
        self._colour = colour
        self._chunk = chunk
        self._lock = threading.Lock()
        self._pending: dict[int, str] = {}
        self._last: int | None = None
        self._at_line_start = True

    def write(self, k: int, text: str, *, final: bool = False) -> None:
        """Stream ``text`` of stream ``k``; ``final`` prints whatever it still holds."""
        with self._lock:
            buf = self._pending.pop(k, "") + text
            cut = len(buf) if final or len(buf) >= self._chunk else buf.rfind("\n") + 1
            if cut < len(buf):
                self._pending[k] = buf[cut:]
            self._emit(k, buf[:cut])

    def _emit(self, k: int, text: str) -> None:
        for piece in text.splitlines(keepends=True):
            if k != self._last or self._at_line_start:
                self._tag(k)
            body = piece.rstrip("\n")
            self._out.write(self._paint(k, body) + piece[len(body) :])  # newline unpainted
            self._at_line_start = piece.endswith("\n")
        self._out.flush()

    def line(self, text: str = "") -> None:
        """Print a whole line of plain text, on a line of its own."""
        with self._lock:
            if not self._at_line_start:
                self._out.write("\n")
            self._out.write(text + "\n")
            self._out.flush()
            self._last, self._at_line_start = None, True

    def _tag(self, k: int) -> None:
        if not self._at_line_start:
            self._out.write("\n")
        self._out.write(self._paint(k, f"[{k}] "))
        self._last, self._at_line_start = k, False

    def _paint(self, k: int, text: str) -> str:
        if not self._colour or not text:
            return text
        return f"\033[{_COLOURS[k % len(_COLOURS)]}m{text}{_RESET}"


@dataclasses.dataclass(slots=True)
class Outcome:
    """What one stream produced."""

    k: int
    prompt: str
    completion: Completion | None = None
    error: BaseException | None = None
    first_token_s: float | None = None
    events: int = 0


def stream_one(
    ctx: Context,
    outcome: Outcome,
    params: SamplingParams,
    printer: StreamPrinter,
    start: threading.Barrier,
) -> None:
    """Thread body: submit one prompt when every thread is ready, then stream its events."""
    try:
        start.wait()
        t0 = time.perf_counter()
        seeded = dataclasses.replace(params, seed=outcome.k)  # different but reproducible
        prompt = ctx.chat_prompt([{"role": "user", "content": outcome.prompt}])
        seeded = seeded.with_stop_token_ids(ctx.end_of_turn_token_ids)
        handle = ctx.add_request(prompt, seeded)  # the model's own chat template
        for event in handle:
            if outcome.first_token_s is None:
                outcome.first_token_s = time.perf_counter() - t0
            outcome.events += 1
            end = f" <{event.finish_reason.value}>" if event.finish_reason else ""
            printer.write(outcome.k, event.text + end, final=bool(end))
        outcome.completion = handle.result()
    except Exception as exc:  # report it in the summary instead of killing the demo
        outcome.error = exc


def run_streams(
    ctx: Context, prompts: Sequence[str], params: SamplingParams, printer: StreamPrinter
) -> tuple[list[Outcome], float]:
    """Stream every prompt from its own thread at once; return the outcomes and wall time."""
    outcomes = [Outcome(k, p) for k, p in enumerate(prompts)]
    start = threading.Barrier(len(outcomes) + 1)
    threads = [
        threading.Thread(
            target=stream_one,
            args=(ctx, o, params, printer, start),
            name=f"demo-{o.k}",
            daemon=True,
        )
        for o in outcomes
    ]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    try:
        for t in threads:
            t.join()
    except KeyboardInterrupt:
        printer.line("\n^C: closing the context; pending requests finish as 'cancelled'")
        ctx.close()
        for t in threads:
            t.join()
    return outcomes, time.perf_counter() - t0


def describe(outcome: Outcome) -> str:
    """One summary line for one request."""
    head = f"[{outcome.k}] {outcome.prompt[:44]:<44}"
    if outcome.error is not None or outcome.completion is None:
        return f"{head}  failed: {outcome.error!r}"
    c = outcome.completion
    ttft = f"{outcome.first_token_s * 1000:6.0f} ms" if outcome.first_token_s is not None else "-"
    return (
        f"{head}  finish={c.finish_reason.value:<9} prompt={c.usage.prompt_tokens:>3} "
        f"completion={c.usage.completion_tokens:>3}  first event after {ttft}"
    )


def print_summary(
    printer: StreamPrinter, outcomes: Sequence[Outcome], wall_s: float, stats: ContextStats
) -> None:
    """Per-request lines, aggregate throughput and the engine's counters."""
    printer.line()
    printer.line("-" * 100)
    for outcome in outcomes:
        printer.line(describe(outcome))
    total = sum(o.completion.usage.completion_tokens for o in outcomes if o.completion)
    rate = total / wall_s if wall_s > 0 else 0.0
    printer.line(
        f"{len(outcomes)} concurrent requests: {total} completion tokens in {wall_s:.2f} s "
        f"= {rate:.1f} tokens/s aggregate"
    )
    printer.line(f"stats: {stats}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m llamax.demo",
        description="Stream several prompts from several threads through one llamax.Context.",
    )
    add = parser.add_argument
    add("--model", metavar="PATH", help="GGUF model (default: $LLAMAX_MODEL or SmolLM2-135M)")
    add("--prompts", type=int, default=6, metavar="N", help="concurrent requests (default: 6)")
    add("--max-tokens", type=int, default=96, metavar="N", help="tokens per reply (default: 96)")
    add(
        "--temperature",
        type=float,
        default=0.7,
        metavar="T",
        help="sampling temperature (default: 0.7)",
    )
    add(  # the llamax command's spelling; --threads, the demo's first, still works
        "--n-threads",
        "--threads",
        dest="threads",
        type=int,
        metavar="N",
        help="llama.cpp CPU threads (default: every core; --threads is the same)",
    )
    add("--chunk", type=int, default=40, metavar="N", help="characters per printed piece (40)")
    add("--n-ctx", type=int, default=4096, metavar="N", help="KV cells for all streams (4096)")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1:
        parser.error("--prompts and --max-tokens must be >= 1")
    return args


def open_context(args: argparse.Namespace) -> Context:
    """Load the model with room for every stream at once."""
    options: ContextOptions = {"n_ctx": args.n_ctx, "n_seq_max": min(256, max(16, args.prompts))}
    if args.threads is not None:
        options["n_threads"] = args.threads
    return Context(args.model, **options)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return the process exit code."""
    args = parse_args(argv)
    colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    printer = StreamPrinter(sys.stdout, colour=colour, chunk=args.chunk)
    base = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(args.prompts)]
    t_load = time.perf_counter()
    with open_context(args) as ctx:
        printer.line(
            f"model {ctx.model_name!r} loaded in {time.perf_counter() - t_load:.2f} s; "
            f"streaming {len(prompts)} requests from {len(prompts)} threads\n"
        )
        outcomes, wall_s = run_streams(ctx, prompts, base, printer)
        print_summary(printer, outcomes, wall_s, ctx.stats())
    return 0 if all(o.error is None for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
