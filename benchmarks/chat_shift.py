"""Chat history-shift benchmark: a long conversation that outgrows n_ctx.

One deterministic conversation: a ~100-token system message, then ``--turns`` (default 60)
user messages of 30-60 tokens, each answered with at most 64 greedy tokens. At n_ctx=2048
the conversation no longer fits after about 15 turns, and the oldest whole turns (user
message plus reply) must be dropped before every later turn. Systems, 2 threads each:

``llamax_shift``
    ``ctx.chat(system=...)`` and ``chat.send``: old turns are dropped by shifting the KV
    cache, so only the new user message is prefilled.
``llamax_reprefill_session``
    The same conversation on a public ``ctx.session()`` with the same turn dropping but no
    shift (``ReprefillChat``): the session keeps the common prefix with its cells (the
    system turn) and prefills everything after it again.
``llamax_stateless_truncate``
    ``ctx.chat_completion(messages, truncate="oldest_messages")`` with the prefix cache.
``llama_cpp_python``
    ``Llama.create_chat_completion``; the oldest user/assistant pairs are dropped by hand
    (timed) while prompt + 64 does not fit.

Every turn runs on every system, the order rotating per turn. The report gives per system
the prefill tokens, the total time, the time per turn before and once the context is full,
and the ratios against ``llamax_shift``.

::

    .venv/bin/python benchmarks/chat_shift.py --json-out chat_shift.json     # ~10 min
    .venv/bin/python benchmarks/chat_shift.py --n-ctx 768 --turns 10 --per-turn
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llama_cpp.llama_chat_format as chat_format
from _chat import SYSTEM, Message, ReprefillChat, drop_oldest_turns, user_messages
from _common import (
    N_THREADS,
    add_common_args,
    base_config,
    common_prefix_len,
    emit_report,
    load_average,
    log,
    model_path,
    ratio,
    stats_delta,
    stdout_to_stderr,
)
from _peers import LlamaCppPythonPeer

import llamax

N_CTX, N_SEQ_MAX, MAX_TOKENS, DEFAULT_TURNS = 2048, 4, 64, 60
SHIFT, REPREFILL = "llamax_shift", "llamax_reprefill_session"
STATELESS, LCP = "llamax_stateless_truncate", "llama_cpp_python"
SYSTEM_NAMES = (SHIFT, REPREFILL, STATELESS, LCP)
COUNTERS = ("prefill_tokens", "decode_tokens", "cached_tokens", "preemptions")


@dataclasses.dataclass(frozen=True)
class Turn:
    """What one turn of one system cost (``computed`` = prompt tokens prefilled)."""

    wall_s: float
    cpu_share: float
    prompt: int
    computed: int
    generated: int
    dropped: int
    shifted: int
    reply: str


class System:
    """One way of holding the conversation; ``turn`` times ``_send``."""

    name = ""
    ctx: llamax.Context | None = None

    def turn(self, content: str) -> Turn:
        cpu, wall = time.process_time(), time.perf_counter()
        fields = self._send(content)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        return Turn(wall, cpu / (wall * N_THREADS), *fields)

    def _send(self, content: str) -> tuple[int, int, int, int, int, str]:
        raise NotImplementedError

    def counters(self) -> Any:
        return self.ctx.stats() if self.ctx else None

    def close(self) -> None:
        if self.ctx:
            self.ctx.close()


class LlamaxChatSystem(System):
    """``ctx.chat`` (shift) or ``ReprefillChat`` (no shift); ``chat.send`` per turn."""

    def __init__(self, model: Path, n_ctx: int, *, shift: bool) -> None:
        self.name = SHIFT if shift else REPREFILL
        self.ctx = llamax.Context(model, n_ctx=n_ctx, n_seq_max=N_SEQ_MAX, n_threads=N_THREADS)
        self.ctx.completion("Hello there!", max_tokens=4, temperature=0)
        self.ctx.clear_cache()
        params = llamax.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        self.chat = (
            self.ctx.chat(system=SYSTEM, params=params)
            if shift
            else ReprefillChat(self.ctx, SYSTEM, params)
        )

    def _send(self, content: str) -> tuple[int, int, int, int, int, str]:
        completion = self.chat.send(content)
        t = self.chat.last_turn
        assert t is not None
        n = completion.usage.completion_tokens
        return (
            t.prompt_tokens,
            t.computed_tokens,
            n,
            t.dropped_messages,
            t.shifted_tokens,
            completion.text,
        )

    def close(self) -> None:
        self.chat.close()
        super().close()


class LlamaxStatelessSystem(System):
    """``ctx.chat_completion(messages, truncate="oldest_messages")`` per turn."""

    name = STATELESS

    def __init__(self, model: Path, n_ctx: int) -> None:
        self.ctx = llamax.Context(model, n_ctx=n_ctx, n_seq_max=N_SEQ_MAX, n_threads=N_THREADS)
        self.ctx.completion("Hello there!", max_tokens=4, temperature=0)
        self.ctx.clear_cache()
        self.messages: list[Message] = [{"role": "system", "content": SYSTEM}]

    def _send(self, content: str) -> tuple[int, int, int, int, int, str]:
        wanted = [*self.messages, {"role": "user", "content": content}]
        response = self.ctx.chat_completion(
            wanted, truncate="oldest_messages", max_tokens=MAX_TOKENS, temperature=0
        )
        usage = response["usage"]
        count = lambda m: len(self.ctx.chat_prompt(m))  # noqa: E731
        kept = drop_oldest_turns(wanted, count, self.ctx.n_ctx - MAX_TOKENS)  # what it kept
        if usage["prompt_tokens"] != count(kept):
            log(f"  warning: {self.name}: the server kept other messages than expected")
        reply = response["choices"][0]["message"]["content"] or ""
        self.messages = [*kept, {"role": "assistant", "content": reply}]
        computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        dropped = len(wanted) - len(kept)
        return usage["prompt_tokens"], computed, usage["completion_tokens"], dropped, 0, reply


class LlamaCppPythonSystem(System):
    """``Llama.create_chat_completion`` with the history truncated by hand (timed)."""

    name = LCP

    def __init__(self, model: Path, n_ctx: int) -> None:
        self.n_ctx, self.peer = n_ctx, LlamaCppPythonPeer(model, n_ctx)
        llm = self.peer.llm
        eos, bos = llm.token_eos(), llm.token_bos()
        self.formatter = chat_format.Jinja2ChatFormatter(  # the one Llama builds for its GGUF
            template=llm.metadata["tokenizer.chat_template"],
            eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
            bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
            stop_token_ids=[eos],
        )
        llm.create_completion("Hello there!", max_tokens=4, temperature=0.0)
        self.peer.reset()
        self.messages: list[Message] = [{"role": "system", "content": SYSTEM}]

    def prompt_tokens(self, messages: list[Message]) -> list[int]:
        result = self.formatter(messages=messages)  # type: ignore[arg-type]
        add_bos = not result.added_special
        return list(self.peer.llm.tokenize(result.prompt.encode(), add_bos=add_bos, special=True))

    def _send(self, content: str) -> tuple[int, int, int, int, int, str]:
        wanted = [*self.messages, {"role": "user", "content": content}]
        budget = self.n_ctx - MAX_TOKENS
        kept = drop_oldest_turns(wanted, lambda m: len(self.prompt_tokens(m)), budget)
        tokens = self.prompt_tokens(kept)
        held = self.peer.llm._input_ids.tolist()  # evaluated last call: prompt + reply
        response: Any = self.peer.llm.create_chat_completion(
            kept, max_tokens=MAX_TOKENS, temperature=0.0
        )  # type: ignore[arg-type]
        reply = response["choices"][0]["message"]["content"] or ""
        self.messages = [*kept, {"role": "assistant", "content": reply}]
        computed = len(tokens) - common_prefix_len(held, tokens)  # Llama keeps the common prefix
        n = response["usage"]["completion_tokens"]
        return len(tokens), computed, n, len(wanted) - len(kept), 0, reply

    def close(self) -> None:
        self.peer.close()


BUILDERS: dict[str, Callable[[Path, int], System]] = {
    SHIFT: lambda path, n_ctx: LlamaxChatSystem(path, n_ctx, shift=True),
    REPREFILL: lambda path, n_ctx: LlamaxChatSystem(path, n_ctx, shift=False),
    STATELESS: LlamaxStatelessSystem,
    LCP: LlamaCppPythonSystem,
}


def run(
    args: argparse.Namespace, names: Sequence[str]
) -> tuple[dict[str, list[Turn]], dict[str, Any]]:
    """Every turn on every system, interleaved (rotating order); records and counter deltas."""
    systems = {}
    try:
        for name in names:
            log(f"building {name} ...")
            systems[name] = BUILDERS[name](args.model, args.n_ctx)
        before = {name: s.counters() for name, s in systems.items()}
        records: dict[str, list[Turn]] = {name: [] for name in names}
        for k, content in enumerate(user_messages(args.turns)):
            for name in [*names[k % len(names) :], *names[: k % len(names)]]:
                faulthandler.dump_traceback_later(
                    args.turn_timeout, exit=True
                )  # a hang ends the run
                records[name].append(systems[name].turn(content))
                faulthandler.cancel_dump_traceback_later()
            log(
                f"turn {k + 1}: "
                + ", ".join(
                    f"{n} {r[-1].wall_s:.2f}s/{r[-1].computed}t/-{r[-1].dropped}m"
                    for n, r in records.items()
                )
            )
        deltas = {
            n: stats_delta(before[n], s.counters(), COUNTERS) for n, s in systems.items() if s.ctx
        }
        return records, deltas
    finally:
        for system in systems.values():
            system.close()


def summarize(name: str, turns: Sequence[Turn], reference: Sequence[Turn]) -> dict[str, Any]:
    """One system's numbers (``once_full`` = from the first turn with a drop on)."""
    first_drop = next((i for i, t in enumerate(turns) if t.dropped), None)
    full = turns[first_drop:] if first_drop is not None else []
    before = turns[:first_drop] if first_drop is not None else turns

    def times(part: Sequence[Turn]) -> dict[str, Any]:
        walls = [t.wall_s for t in part]
        return {
            "turns": len(part),
            "mean": round(statistics.mean(walls), 4) if walls else None,
            "median": round(statistics.median(walls), 4) if walls else None,
        }

    same = [a.reply == b.reply for a, b in zip(turns, reference, strict=False)]
    return {
        "total_s": round(sum(t.wall_s for t in turns), 4),
        "prefill_tokens": sum(t.computed for t in turns),
        "prompt_tokens": sum(t.prompt for t in turns),
        "generated_tokens": sum(t.generated for t in turns),
        "turns_with_dropped_history": sum(1 for t in turns if t.dropped),
        "first_drop_turn": first_drop + 1 if first_drop is not None else None,
        "per_turn_before_full_s": times(before),
        "per_turn_once_full_s": times(full),
        "prefill_tokens_per_turn_once_full": statistics.median(t.computed for t in full)
        if full
        else None,
        "shifted_tokens": sum(t.shifted for t in turns),
        "turns_where_shift_failed": sum(1 for t in turns if t.dropped and not t.shifted)
        if name == SHIFT
        else None,
        "cpu_share": {
            "median": round(statistics.median(t.cpu_share for t in turns), 3),
            "min": round(min(t.cpu_share for t in turns), 3),
        },
        "replies_equal_to_llamax_shift": sum(same),
    }


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """``<system> / llamax_shift``: prefill tokens, total time, per-turn time once full."""
    base = summary.get(SHIFT)
    if base is None:
        return {}
    keys = {
        "prefill_tokens": ("prefill_tokens",),
        "total_s": ("total_s",),
        "per_turn_once_full_median_s": ("per_turn_once_full_s", "median"),
    }

    def get(s: dict[str, Any], path: tuple[str, ...]) -> Any:
        return s[path[0]] if len(path) == 1 else s[path[0]][path[1]]

    return {
        f"{name}_over_{SHIFT}": {k: ratio(get(s, p), get(base, p)) for k, p in keys.items()}
        for name, s in summary.items()
        if name != SHIFT
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_common_args(parser)
    parser.add_argument("--turns", type=int, default=DEFAULT_TURNS, help="user messages")
    parser.add_argument("--systems", nargs="+", choices=SYSTEM_NAMES, default=list(SYSTEM_NAMES))
    parser.add_argument("--per-turn", action="store_true", help="add every turn's record")
    parser.add_argument("--n-ctx", type=int, default=N_CTX, help="context size (default 2048)")
    parser.add_argument(
        "--turn-timeout",
        type=float,
        default=1800.0,
        help="seconds before a hanging turn dumps the stacks and exits",
    )
    args = parser.parse_args(argv)
    if args.turns < 1:
        parser.error("--turns must be >= 1")
    args.model = model_path(args.model)
    load = load_average()
    names = [n for n in SYSTEM_NAMES if n in args.systems]
    with stdout_to_stderr() as stdout:
        records, deltas = run(args, names)
        ref = records.get(SHIFT, [])
        summary = {n: summarize(n, r, ref) | {"stats": deltas.get(n)} for n, r in records.items()}
        config = base_config(args, load, n_seq_max=N_SEQ_MAX, max_tokens=MAX_TOKENS)
        report: dict[str, Any] = {"config": config, "systems": summary, "ratios": ratios(summary)}
        if args.per_turn:
            report["per_turn"] = {
                n: [dataclasses.asdict(t) | {"reply": None} for t in r] for n, r in records.items()
            }
        emit_report(report, stdout, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
