"""The ``llamax`` command line: ``run``, ``chat``, ``bench``, ``info`` and ``serve``.

A client of the public API only (``llamax``, ``llamax.batch``, ``llamax.info``). Each
command loads its own context; errors llamax raises on purpose are printed as one line
(exit status 1), never as a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from typing import Any

import llamax
from llamax.batch import generate
from llamax.flags import add_option_flags, byte_size, option_values
from llamax.info import (
    MAX_PLANNED_CTX,
    MemoryPlan,
    ModelInfo,
    max_cells,
    model_info,
    plan_memory,
)

__all__ = ["main"]

_SERVER_MISSING = (
    "llamax serve needs the server extra: pip install '.[server]' in a llamax clone "
    "(install llamax[server])"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit status.

    Args:
        argv: the arguments after the program name.

    Returns:
        0 on success, 1 on a llamax error, 2 on a usage error or a missing extra, 130 when
        interrupted.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "serve":
        return _serve(args[1:])
    ns = _parser().parse_args(args)
    try:
        status: int = ns.handler(ns)
    except llamax.LlamaxError as exc:
        print(f"llamax: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llamax", description="Local LLM inference on llama.cpp, continuously batched."
    )
    parser.add_argument("--version", action="version", version=f"llamax {llamax.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="answer one prompt, streamed to stdout",
        usage="llamax run [options] [MODEL.gguf] [PROMPT ...]",
        description="Answer one prompt with the model's chat template, streamed to stdout. "
        "The command's own flags come first, then sampling, then model and engine flags.",
    )
    run.add_argument(
        "prompt",
        nargs="*",
        metavar="PROMPT",
        help="the user message, its words joined by spaces (default: read stdin); a first "
        "word ending in .gguf is the model file when --model is not given",
    )
    run.add_argument("--system", help="a system message")
    run.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without the chat template"
    )
    _add_sampling_flags(run)
    _add_model_flags(run)
    run.set_defaults(handler=_run)

    chat = commands.add_parser(
        "chat", help="interactive chat", usage="llamax chat [options] [MODEL.gguf]"
    )
    chat.add_argument("model_file", nargs="?", metavar="MODEL.gguf", help="the model (--model)")
    chat.add_argument("--system", help="a system message")
    chat.add_argument("--max-context", type=int, help="conversation budget (default: n_ctx)")
    _add_sampling_flags(chat)
    _add_model_flags(chat)
    chat.set_defaults(handler=_chat)

    bench = commands.add_parser(
        "bench", help="quick throughput check", usage="llamax bench [options] [MODEL.gguf]"
    )
    bench.add_argument("model_file", nargs="?", metavar="MODEL.gguf", help="the model (--model)")
    bench.add_argument("--n", type=int, nargs="+", default=[1, 16], help="streams (1 16)")
    bench.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (64)")
    _add_model_flags(bench)
    bench.set_defaults(handler=_bench)

    info = commands.add_parser(
        "info",
        help="print a model's GGUF metadata, or what a context of it costs in memory",
        usage="llamax info [MODEL] [--json] [--mmproj FILE] [--n-ctx N --n-seq-max S "
        "--kv-type T --memory BYTES ...]",
    )
    info.add_argument("model_path", nargs="?", metavar="MODEL", help="GGUF file")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument(
        "--mmproj", metavar="FILE", help="the model's multimodal projector: does it see images"
    )
    _add_plan_flags(info)
    info.set_defaults(handler=_info)

    commands.add_parser("serve", help="OpenAI-compatible HTTP server (llamax[server])")
    return parser


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    """``--model`` and the engine's flags (``ContextConfig``), as a group after the
    command's own."""
    group = parser.add_argument_group("model and engine (the options of llamax.ContextConfig)")
    group.add_argument(
        "--model", "-m", metavar="PATH", help="GGUF file (default: $LLAMAX_MODEL or SmolLM2)"
    )
    add_option_flags(group, llamax.ContextConfig, skip=("n_seq_max",))  # set by each command


_PLAN_OPTIONS = (
    "n_ctx", "n_seq_max", "n_ctx_seq", "kv_layout", "n_batch", "n_ubatch", "flash_attn",
    "prefix_cache", "prefix_ram_bytes", "kv_type", "kv_type_k", "kv_type_v",
)  # fmt: skip
"""The options of ``llamax.ContextConfig`` that ``llamax info`` plans with (those of
``llamax.plan_memory``)."""


def _add_plan_flags(parser: argparse.ArgumentParser) -> None:
    """``llamax info``'s memory-plan flags: the context options a plan depends on, and
    ``--memory``. Any of them prints the plan instead of the metadata."""
    group = parser.add_argument_group(
        "memory plan (any of these prints what a context of these options costs; "
        "llamax.plan_memory)"
    )
    names = {f.name for f in dataclasses.fields(llamax.ContextConfig)}
    add_option_flags(group, llamax.ContextConfig, skip=sorted(names - set(_PLAN_OPTIONS)))
    group.add_argument(
        "--memory",
        type=byte_size,
        metavar="BYTES",
        help="the memory to plan for (also 8G, 512M; default: what the kernel reports "
        "available, MemAvailable)",
    )


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """The sampling flags (``SamplingParams``), as a group after the command's own."""
    group = parser.add_argument_group("sampling (the options of llamax.SamplingParams)")
    add_option_flags(group, llamax.SamplingParams, defaults=_SAMPLING_DEFAULTS)


_SAMPLING_DEFAULTS = {"max_tokens": 256, "temperature": 0.7}
"""Where the command line's sampling defaults differ from ``SamplingParams``'."""


def _context(ns: argparse.Namespace, *, n_seq_max: int) -> llamax.Context:
    options = {"n_seq_max": n_seq_max, **option_values(ns, llamax.ContextConfig)}
    return llamax.Context(_model_path(ns), **options)


def _model_path(ns: argparse.Namespace) -> str | None:
    """The model a command names: ``--model``, or its ``MODEL.gguf`` argument.

    Raises:
        ModelLoadError: the model file does not exist (said before a prompt is read).
    """
    given = getattr(ns, "model_file", None)
    if given is not None and ns.model is not None and given != ns.model:
        raise llamax.ModelLoadError(f"two models given: {given} and --model {ns.model}")
    path: str | None = ns.model or given
    if path is not None and not os.path.isfile(os.path.expanduser(path)):
        raise llamax.ModelLoadError(f"model file not found: {path}")
    return path


def _params(ns: argparse.Namespace) -> llamax.SamplingParams:
    return llamax.SamplingParams(**option_values(ns, llamax.SamplingParams))


def _write_events(events: Iterable[llamax.TokenEvent]) -> None:
    """Write each event's text as it arrives, then a newline."""
    for event in events:
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()


def _run(ns: argparse.Namespace) -> int:
    words = list(ns.prompt)
    if words and ns.model is None and words[0].lower().endswith(".gguf"):
        ns.model_file = words.pop(0)  # llamax run model.gguf "prompt"
    _model_path(ns)  # a missing model is said before stdin is read
    prompt = " ".join(words) if words else None
    if prompt is None:
        if sys.stdin.isatty():
            print("llamax run: give a prompt, or pipe one on stdin", file=sys.stderr)
            return 2
        prompt = sys.stdin.read()
    params = _params(ns)
    with _context(ns, n_seq_max=1) as ctx:
        if ns.raw:
            _write_events(ctx.add_request(prompt, params))
            return 0
        with ctx.chat(system=ns.system, params=params) as chat:
            _write_events(chat.stream(prompt, params))
    return 0


def _chat(ns: argparse.Namespace) -> int:
    with contextlib.suppress(ImportError):  # line editing and history for input()
        import readline  # noqa: F401
    params = _params(ns)
    with _context(ns, n_seq_max=2) as ctx:
        print(f"llamax chat with {ctx.model_name}. /reset clears the conversation; /exit quits.")
        chat = ctx.chat(system=ns.system, params=params, max_context=ns.max_context)
        try:
            while (line := _read_line()) is not None:
                text = line.strip()
                if text in ("/exit", "/quit"):
                    break
                if text == "/reset":
                    chat.close()
                    chat = ctx.chat(system=ns.system, params=params, max_context=ns.max_context)
                    print("(conversation cleared)")
                elif text.startswith("/"):
                    print(f"unknown command {text}: use /reset or /exit")
                elif text:
                    chat = _chat_turn(ctx, chat, text, params, ns.max_context)
        finally:
            chat.close()
    return 0


def _read_line() -> str | None:
    """The next line typed at the ``> `` prompt; None at end of input (Ctrl-D)."""
    while True:
        try:
            return input("> ")
        except EOFError:
            print()
            return None
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, like a shell
            print()


def _chat_turn(
    ctx: llamax.Context,
    chat: llamax.Chat[llamax.Session],
    text: str,
    params: llamax.SamplingParams,
    max_context: int | None,
) -> llamax.Chat[llamax.Session]:
    """Stream one reply; Ctrl-C stops it and the conversation goes on without that turn."""
    try:
        _write_events(chat.stream(text, params))
    except KeyboardInterrupt:
        print("\n(interrupted)")
        messages = chat.messages
        chat.close()  # cancels the reply
        return ctx.chat(messages=messages, params=params, max_context=max_context)
    turn = chat.last_turn
    if turn is not None and turn.dropped_messages:
        print(
            f"(history: dropped {turn.dropped_messages} old messages, "
            f"shifted {turn.shifted_tokens} cached tokens)",
            file=sys.stderr,
        )
    return chat


def _bench(ns: argparse.Namespace) -> int:
    if min(ns.n) < 1 or ns.max_tokens < 1:
        print("llamax bench: --n and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    params = llamax.SamplingParams(max_tokens=ns.max_tokens, temperature=0.0, ignore_eos=True)
    with _context(ns, n_seq_max=max(ns.n)) as ctx:
        prompts = [
            ctx.chat_prompt([{"role": "user", "content": f"Tell me fact number {i} about space."}])
            for i in range(max(ns.n))
        ]
        print(f"{ctx.model_name}: {ns.max_tokens} greedy tokens per stream")
        generate(ctx, prompts[:1], llamax.SamplingParams(max_tokens=4), progress=False)  # warm up
        baseline = None
        for n in ns.n:
            ctx.clear_cache()
            start = time.perf_counter()
            done = generate(ctx, prompts[:n], params, progress=False)
            seconds = time.perf_counter() - start
            rate = sum(c.usage.completion_tokens for c in done) / seconds
            baseline = baseline or rate
            print(
                f"N={n:<3} {rate:8.1f} tok/s  ({seconds:.2f} s, {rate / baseline:.2f}x N={ns.n[0]})"
            )
    return 0


def _info(ns: argparse.Namespace) -> int:
    options: dict[str, Any] = {
        name: value
        for name, value in vars(ns).items()
        if name in _PLAN_OPTIONS and value is not None
    }
    if options or ns.memory is not None:
        return _plan(ns, options)
    info = model_info(ns.model_path, mmproj=ns.mmproj)
    if ns.json:
        print(json.dumps(asdict(info), default=str, indent=2))
        return 0
    for label, value in _info_rows(info, ns.mmproj):
        print(f"{label + ':':<16}{value}")
    return 0


def _info_rows(info: ModelInfo, mmproj: str | None = None) -> list[tuple[str, str]]:
    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    memory = "recurrent" if info.is_recurrent else "hybrid" if info.is_hybrid else "attention KV"
    return [
        ("path", str(info.path)),
        ("name", info.name or "-"),
        ("architecture", info.architecture),
        ("description", info.description),
        ("parameters", f"{info.num_params / 1e6:.1f} M"),
        ("file size", f"{info.size_bytes / 1e6:.1f} MB"),
        ("context length", f"{info.context_length} (trained)"),
        ("embedding size", str(info.n_embd)),
        ("layers", str(info.n_layer)),
        ("vocabulary", f"{info.n_vocab} tokens"),
        ("sliding window", str(info.sliding_window) if info.sliding_window else "none"),
        ("chat template", yes(info.has_chat_template)),
        ("memory", f"{memory}; can shift: {yes(info.can_shift)}, can copy: {yes(info.can_copy)}"),
        ("sees images", yes(info.sees_images) + ("" if mmproj else " (no --mmproj given)")),
        *_memory_rows(info),
    ]


def _memory_rows(info: ModelInfo) -> list[tuple[str, str]]:
    """What the KV cache costs (measured by :func:`~llamax.model_info`) and the largest
    ``n_ctx`` (cells over all sequences) beside the weights in a few RAM sizes."""
    cell = info.kv_bytes_per_cell
    per_8k = f"n_ctx 8192: {cell * 8192 / 2**20:.0f} MiB"
    rows = [("KV per cell", f"{cell / 1024:.1f} KiB (F16; {per_8k})")]
    state = info.state_bytes_per_seq
    if state >= 1024:
        rows.append(("state per seq", f"{state / 1024:.1f} KiB (whatever its length)"))
    if cell:
        fits = ", ".join(f"{gib} GiB: {max_cells(info, gib << 30):,}" for gib in (8, 16, 32))
        rows.append(("n_ctx in RAM", f"{fits} (beside the weights; compute buffers extra)"))
    elif state:
        fits = ", ".join(
            f"{gib} GiB: {max(0, (gib << 30) - info.size_bytes) // state:,}" for gib in (8, 16, 32)
        )
        rows.append(("seqs in RAM", f"{fits} (beside the weights; compute buffers extra)"))
    return rows


def _plan(ns: argparse.Namespace, options: dict[str, Any]) -> int:
    if ns.model_path is not None and not os.path.isfile(os.path.expanduser(ns.model_path)):
        raise llamax.ModelLoadError(f"model file not found: {ns.model_path}")
    plan = plan_memory(ns.model_path, memory_bytes=ns.memory, **options)
    if ns.json:
        print(json.dumps(asdict(plan), default=str, indent=2))
        return 0
    for label, value in _plan_rows(plan, given_memory=ns.memory is not None):
        print(f"{label + ':':<20}{value}")
    return 0


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _plan_rows(plan: MemoryPlan, *, given_memory: bool) -> list[tuple[str, str]]:
    """:func:`llamax.plan_memory`'s plan as ``llamax info`` prints it."""
    layout = f"{plan.kv_layout}, {plan.kv_cells:,} cells"
    if plan.kv_layout == "streams":
        layout += f" ({plan.kv_cells // plan.n_ctx_stream} x {plan.n_ctx_stream:,})"
    rows = [
        ("model", f"{plan.model_path.name} ({plan.description})"),
        ("options", f"n_ctx {plan.n_ctx:,}, n_seq_max {plan.n_seq_max}"),
        ("KV layout", layout + ("; moves to unified and back" if plan.moves_layout else "")),
        ("weights", f"{_size(plan.weights_bytes)} (mapped from the file)"),
        (
            "KV cache",
            f"{_size(plan.kv_bytes)} ({plan.kv_bytes_per_cell:,} bytes a cell at "
            f"{plan.kv_type_k}/{plan.kv_type_v})",
        ),
    ]
    if plan.state_bytes_per_seq:
        rows.append(
            (
                "recurrent state",
                f"{_size(plan.state_bytes)} ({plan.state_bytes_per_seq:,} bytes a sequence)",
            )
        )
    rows += [
        ("compute buffers", _size(plan.compute_bytes)),
        ("output buffer", f"{_size(plan.output_bytes)} (logits of {plan.n_seq_max} rows)"),
        ("at creation", f"{_size(plan.context_bytes)} (the above, beside the weights)"),
    ]
    if plan.relayout_bytes:
        rows.append(("layout move", f"{_size(plan.relayout_bytes)} (both layouts for a moment)"))
    rows += [
        ("RAM prefix tier", f"{_size(plan.prefix_ram_bytes)} (a budget, filled as prefixes go)"),
        ("total", _size(plan.total_bytes)),
        (
            "memory",
            f"{_size(plan.memory_bytes)} ({'given' if given_memory else 'available now'}): "
            + ("fits" if plan.fits else "does NOT fit"),
        ),
        (
            "largest n_ctx",
            f"{plan.max_n_ctx:,}{' or more' if plan.max_n_ctx == MAX_PLANNED_CTX else ''} "
            f"(with n_seq_max {plan.n_seq_max})",
        ),
        ("largest n_seq_max", f"{plan.max_n_seq_max} (with n_ctx {plan.n_ctx:,})"),
    ]
    return rows


def _serve(argv: list[str]) -> int:
    try:
        server = importlib.import_module("llamax.server")
    except ImportError:
        print(_SERVER_MISSING, file=sys.stderr)
        return 2
    return int(server.main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
