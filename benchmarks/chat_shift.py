"""Chat history-shift benchmark: a 60-turn conversation that outgrows n_ctx=2048.

What is measured
----------------
One deterministic conversation: a system message of about 100 tokens, then ``--turns``
(default 60) user messages of 30-60 tokens each ("Tell me about topic k: ..."), each
answered with at most 64 greedy tokens (temperature 0). After about 15 turns the
conversation no longer fits in 2,048 tokens and the oldest whole turns (user message plus
reply) must be dropped before every later turn. Four systems hold the same conversation,
each with 2 threads and n_ctx=2048:

``llamax_shift``
    ``llamax.Context(model, n_ctx=2048, n_seq_max=4, n_threads=2)``, ``chat = ctx.chat(
    system=SYSTEM, params=SamplingParams(max_tokens=64, temperature=0))`` and one
    ``chat.send(user_k)`` per turn. When a turn does not fit, the Chat drops the oldest
    turns and *shifts* the KV cache (``seq_rm`` of the dropped span + ``seq_add`` of the
    rest), so only the new user message is prefilled.
``llamax_reprefill_session``
    The same, but the Chat is a subclass of ``llamax.chat.history.Chat`` whose ``_shift``
    returns 0 (no cache shift, exactly what ``Chat`` does when the memory cannot shift).
    The session then keeps the longest common prefix of its cells and the shortened prompt
    (the system turn, plus ``<|im_start|>user\\n``) and recomputes everything after it.
``llamax_stateless_truncate``
    The same context options (``prefix_cache=True``, the default), no session: each turn
    calls ``ctx.chat_completion(messages, truncate="oldest_messages", max_tokens=64,
    temperature=0)`` with the whole kept history. Until the context fills, the prefix
    cache reuses the previous turn's retained sequence (prompt + reply); afterwards only
    the system prefix would match. The client keeps the messages the server kept
    (computed untimed with the same ``drop_oldest_turns``) plus the reply, like the Chat.
    Once history is dropped, the previous turn's retained sequence must give up its cells
    for the new prompt: the request takes that slot over, cut to the prefix it shares
    (the system turn), and computes the rest.
``llama_cpp_python``
    ``llama_cpp.Llama(model, n_ctx=2048, n_threads=2, n_threads_batch=2, verbose=False)``
    and ``create_chat_completion(messages, max_tokens=64, temperature=0)``. It raises once
    the context is exceeded, so before each call the oldest user/assistant pair is dropped
    while ``len(tokens) + 64 > 2048``, where ``tokens`` is the prompt rendered with the
    Llama's own chat handler formatter (the GGUF template through llama-cpp-python's
    ``Jinja2ChatFormatter``, tokenized as its chat handler does). This truncation is part
    of the timed turn. Llama reuses the longest common prefix of the new prompt and the
    tokens it evaluated last call (prompt + reply), so its prefilled tokens are counted as
    ``len(prompt) - LCP(prompt, Llama._input_ids before the call)``, and cross-checked by
    counting the tokens given to ``Llama.eval`` for the prompt.

The systems run side by side in one process: every turn is run on each system in turn,
in an order that rotates every turn, so load from other processes hits them alike.
Each turn is timed alone (wall time of the send/call); a system's total is the sum of its
turn times. Every turn also records the CPU share of the process (CPU time / (wall x 2
threads)): a low share means the machine was busy and the times are inflated.

Per system the report gives: total time; prompt tokens computed (llamax: the sum of
``chat.last_turn.computed_tokens`` or ``prompt_tokens - cached_tokens`` of each
response, and the ``ctx.stats().num_prefill_tokens`` delta); the turns with dropped
history; the time per turn once the context is full (mean and median over the turns from
the first drop on); the generated tokens; and how many replies equal ``llamax_shift``'s.
Ratios: ``<system> / llamax_shift`` for prefill tokens, total time and the per-turn time
once full. Replies are greedy and may differ between systems once history was dropped
(the shifted cache holds the kept turns at new positions, computed with their old
context), so the systems need not generate the same number of tokens; llama-cpp-python's
replies can differ from the first turn on (near-tie logits, other kernels/batch shapes).

Run
---
::

    .venv/bin/python benchmarks/chat_shift.py                    # 60 turns, 4 systems
    .venv/bin/python benchmarks/chat_shift.py --turns 30 --json-out chat_shift.json
    .venv/bin/python benchmarks/chat_shift.py --systems llamax_shift llama_cpp_python
    .venv/bin/python benchmarks/chat_shift.py --n-ctx 768 --turns 10 --per-turn  # quick check

``--per-turn`` adds every turn's wall time and token counts; ``--turn-timeout`` (default
1800 s) dumps every thread's stack and exits if a turn hangs.

stdout carries only the JSON report (native prints are sent to stderr); progress goes to
stderr.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import llama_cpp
import llama_cpp.llama_chat_format as chat_format
from _common import load_average, log, ratio, stdout_to_stderr
from llamax.chat.history import Chat

import llamax
from llamax.chat.truncation import drop_oldest_turns
from llamax.kvcache import common_prefix_len

N_CTX = 2048
N_SEQ_MAX = 4
N_THREADS = 2
MAX_TOKENS = 64
DEFAULT_TURNS = 60
SHIFT = "llamax_shift"
REPREFILL = "llamax_reprefill_session"
STATELESS = "llamax_stateless_truncate"
LCP = "llama_cpp_python"
SYSTEM_NAMES = (SHIFT, REPREFILL, STATELESS, LCP)

Message = dict[str, Any]

SYSTEM = (
    "You are Atlas, the research assistant of a small public library. Visitors ask you "
    "about many different subjects, one after another, in a single long conversation. "
    "Answer each question in two or three plain sentences, without lists or headings. "
    "Stay factual and friendly, say so when you are unsure, and never invent book titles, "
    "dates or names. If a question refers to something said earlier, use the conversation "
    "to answer it; otherwise treat it as a new topic."
)

_TOPICS = (
    "the history of the printing press in fifteenth-century Europe",
    "how lighthouses warned ships before electricity existed",
    "the water cycle and why clouds form over warm oceans",
    "the rules of chess and how a pawn can be promoted",
    "bread baking and the role of yeast in the dough",
    "the migration of monarch butterflies across North America",
    "how a bicycle stays upright while it is moving",
    "volcanoes and the difference between lava and magma",
    "the invention of the telephone and its first users",
    "honeybees and how a colony decides where to build a new hive",
    "the solar system and why Pluto is no longer called a planet",
    "composting kitchen waste in a small city garden",
    "the Silk Road and the goods traded along it",
    "how vaccines train the immune system",
)
_ASPECTS = (
    "I am mostly curious about the people involved and what they were trying to achieve",
    "could you explain the basic mechanism in simple terms for a twelve-year-old",
    "what are the most common misconceptions that people still believe about it",
    "how did our understanding of it change over the last hundred years",
    "which everyday objects or habits are connected to it without us noticing",
    "what would be a good first experiment or activity to learn more about it at home",
    "why do experts still disagree about some parts of it today",
)
_ENDINGS = (
    "Please keep the answer short.",
    "A brief answer is enough for now.",
    "Answer in a few sentences, please.",
    "Keep it simple and concrete.",
    "I only need the main idea.",
)


def user_messages(count: int) -> list[str]:
    """``count`` deterministic, varied user messages of about 30-60 tokens."""
    out = []
    for k in range(count):
        topic = _TOPICS[k % len(_TOPICS)]
        aspect = _ASPECTS[(k * 3) % len(_ASPECTS)]
        ending = _ENDINGS[(k * 2) % len(_ENDINGS)]
        out.append(
            f"Tell me about topic {k + 1}: {topic}. {aspect[0].upper()}{aspect[1:]}? {ending}"
        )
    return out


# ---------------------------------------------------------------------------- turns
@dataclass(frozen=True)
class TurnRecord:
    """What one turn of one system cost."""

    wall_s: float
    cpu_share: float
    prompt_tokens: int
    computed_tokens: int
    completion_tokens: int
    dropped_messages: int
    shifted_tokens: int
    reply: str


class ChatSystem(Protocol):
    """One way of holding the conversation."""

    name: str

    def warm_up(self) -> None:
        """A short untimed request, then forget it."""
        ...

    def turn(self, content: str) -> TurnRecord:
        """Send one user message; time it (wall and CPU) and return its costs."""
        ...

    def counters(self) -> dict[str, int]:
        """Cumulative counters of the system (compared before/after the run)."""
        ...

    def close(self) -> None:
        """Free native resources."""
        ...


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """Run ``fn``; return its result, its wall time and the process's CPU share."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return result, wall, cpu / (wall * N_THREADS) if wall > 0 else 0.0


def sampling() -> llamax.SamplingParams:
    """The sampling parameters of every llamax turn."""
    return llamax.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


class NoShiftChat(Chat):
    """A Chat that never shifts its cache: after a drop, the session's LCP keeps only the
    system turn and the rest of the shortened conversation is prefilled again."""

    def _shift(self, kept: list[Message], num_dropped: int) -> int:
        return 0


class LlamaxContextSystem:
    """Common parts of the llamax systems: the context, warm-up and counters."""

    name = ""

    def __init__(self, model_path: Path, n_ctx: int) -> None:
        self.ctx = llamax.Context(model_path, n_ctx=n_ctx, n_seq_max=N_SEQ_MAX, n_threads=N_THREADS)
        self.n_ctx = self.ctx.n_ctx  # what llama.cpp granted (what Chat and truncate use)

    def warm_up(self) -> None:
        self.ctx.completion("Hello there!", max_tokens=4, temperature=0)
        self.ctx.clear_cache()

    def counters(self) -> dict[str, int]:
        s = self.ctx.stats()
        return {
            "num_prefill_tokens": s.num_prefill_tokens,
            "num_decode_tokens": s.num_decode_tokens,
            "num_cached_tokens": s.num_cached_tokens,
            "num_preemptions": s.num_preemptions,
        }

    def close(self) -> None:
        self.ctx.close()


class LlamaxChatSystem(LlamaxContextSystem):
    """``ctx.chat(...)`` and ``chat.send`` per turn (with or without the cache shift)."""

    def __init__(self, model_path: Path, n_ctx: int, *, shift: bool) -> None:
        super().__init__(model_path, n_ctx)
        self.name = SHIFT if shift else REPREFILL
        if shift:
            self.chat = self.ctx.chat(system=SYSTEM, params=sampling())
        else:
            self.chat = NoShiftChat(self.ctx, system=SYSTEM, params=sampling())

    def turn(self, content: str) -> TurnRecord:
        completion, wall, share = timed(lambda: self.chat.send(content))
        stats = self.chat.last_turn
        assert stats is not None
        return TurnRecord(
            wall_s=wall,
            cpu_share=share,
            prompt_tokens=stats.prompt_tokens,
            computed_tokens=stats.computed_tokens,
            completion_tokens=completion.usage.completion_tokens,
            dropped_messages=stats.dropped_messages,
            shifted_tokens=stats.shifted_tokens,
            reply=completion.text,
        )

    def close(self) -> None:
        self.chat.close()
        super().close()


class LlamaxStatelessSystem(LlamaxContextSystem):
    """``ctx.chat_completion(messages, truncate="oldest_messages")`` per turn."""

    name = STATELESS

    def __init__(self, model_path: Path, n_ctx: int) -> None:
        super().__init__(model_path, n_ctx)
        self.messages: list[Message] = [{"role": "system", "content": SYSTEM}]

    def turn(self, content: str) -> TurnRecord:
        wanted = [*self.messages, {"role": "user", "content": content}]
        # Untimed bookkeeping: which messages the server will keep (same function, budget).
        kept = drop_oldest_turns(
            wanted, lambda m: len(self.ctx.chat_prompt(m)), self.n_ctx - MAX_TOKENS
        )

        def call() -> Any:
            return self.ctx.chat_completion(
                wanted, truncate="oldest_messages", max_tokens=MAX_TOKENS, temperature=0
            )

        response, wall, share = timed(call)
        usage = response["usage"]
        if usage["prompt_tokens"] != len(self.ctx.chat_prompt(kept)):
            log(f"  warning: {self.name}: the server kept other messages than expected")
        reply = response["choices"][0]["message"]["content"] or ""
        self.messages = [*kept, {"role": "assistant", "content": reply}]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return TurnRecord(
            wall_s=wall,
            cpu_share=share,
            prompt_tokens=usage["prompt_tokens"],
            computed_tokens=usage["prompt_tokens"] - cached,
            completion_tokens=usage["completion_tokens"],
            dropped_messages=len(wanted) - len(kept),
            shifted_tokens=0,
            reply=reply,
        )


class LlamaCppPythonSystem:
    """``Llama.create_chat_completion`` with the history truncated by hand."""

    name = LCP

    def __init__(self, model_path: Path, n_ctx: int) -> None:
        self.n_ctx = n_ctx
        self.llm = llama_cpp.Llama(
            str(model_path),
            n_ctx=n_ctx,
            n_threads=N_THREADS,
            n_threads_batch=N_THREADS,
            verbose=False,
        )
        if self.llm.chat_format != "chat_template.default":
            raise RuntimeError(f"unexpected chat format {self.llm.chat_format!r}")
        model = self.llm._model
        eos, bos = self.llm.token_eos(), self.llm.token_bos()
        # The formatter Llama built for "chat_template.default" (llama.py, Llama.__init__).
        self.formatter = chat_format.Jinja2ChatFormatter(
            template=self.llm.metadata["tokenizer.chat_template"],
            eos_token=model.token_get_text(eos) if eos != -1 else "",
            bos_token=model.token_get_text(bos) if bos != -1 else "",
            stop_token_ids=[eos],
        )
        self.messages: list[Message] = [{"role": "system", "content": SYSTEM}]
        self.eval_calls: list[int] = []
        self.prefill_by_eval = 0
        original = self.llm.eval

        def counting_eval(tokens: Sequence[int]) -> None:
            self.eval_calls.append(len(tokens))  # the prompt suffix first, then 1 per token
            original(tokens)

        self.llm.eval = counting_eval  # type: ignore[method-assign]

    def prompt_tokens(self, messages: list[Message]) -> list[int]:
        """The prompt as ``create_chat_completion`` tokenizes it."""
        result = self.formatter(messages=messages)  # type: ignore[arg-type]
        tokens: list[int] = self.llm.tokenize(
            result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True
        )
        return tokens

    def warm_up(self) -> None:
        self.llm.create_completion("Hello there!", max_tokens=4, temperature=0.0)
        self.llm.reset()  # type: ignore[no-untyped-call]

    def counters(self) -> dict[str, int]:
        return {"eval_calls": len(self.eval_calls)}

    def _call(self, wanted: list[Message]) -> tuple[list[Message], list[int], int, Any]:
        kept = list(wanted)
        tokens = self.prompt_tokens(kept)
        dropped = 0
        while len(tokens) + MAX_TOKENS > self.n_ctx:
            if len(kept) < 4:  # system + newest user only: nothing left to drop
                raise RuntimeError("the newest turn alone does not fit")
            del kept[1:3]  # the oldest user/assistant pair
            dropped += 2
            tokens = self.prompt_tokens(kept)
        held: list[int] = self.llm._input_ids.tolist()  # evaluated last call: prompt + reply
        first_call = len(self.eval_calls)
        response = self.llm.create_chat_completion(
            kept,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0.0,
        )
        if len(self.eval_calls) > first_call:
            self.prefill_by_eval += self.eval_calls[first_call]  # the prompt suffix evaluated
        return kept, tokens, len(tokens) - common_prefix_len(held, tokens), response

    def turn(self, content: str) -> TurnRecord:
        wanted = [*self.messages, {"role": "user", "content": content}]
        (kept, tokens, computed, response), wall, share = timed(lambda: self._call(wanted))
        usage = response["usage"]
        if usage["prompt_tokens"] != len(tokens):
            log(f"  warning: {self.name}: prompt has {usage['prompt_tokens']} != {len(tokens)}")
        reply = response["choices"][0]["message"]["content"] or ""
        self.messages = [*kept, {"role": "assistant", "content": reply}]
        return TurnRecord(
            wall_s=wall,
            cpu_share=share,
            prompt_tokens=len(tokens),
            computed_tokens=computed,
            completion_tokens=usage["completion_tokens"],
            dropped_messages=len(wanted) - len(kept),
            shifted_tokens=0,
            reply=reply,
        )

    def close(self) -> None:
        self.llm.close()


BUILDERS: dict[str, Callable[[Path, int], ChatSystem]] = {
    SHIFT: lambda path, n_ctx: LlamaxChatSystem(path, n_ctx, shift=True),
    REPREFILL: lambda path, n_ctx: LlamaxChatSystem(path, n_ctx, shift=False),
    STATELESS: LlamaxStatelessSystem,
    LCP: LlamaCppPythonSystem,
}


# ---------------------------------------------------------------------------- run
def run(
    model_path: Path,
    n_ctx: int,
    names: Sequence[str],
    messages: Sequence[str],
    turn_timeout: float,
) -> tuple[dict[str, list[TurnRecord]], dict[str, dict[str, int]], dict[str, int]]:
    """Every turn on every system, interleaved (rotating order); the records, the counter
    deltas and (llama-cpp-python) the prompt tokens given to eval."""
    systems: dict[str, ChatSystem] = {}
    try:
        for name in names:
            log(f"building {name} ...")
            systems[name] = BUILDERS[name](model_path, n_ctx)
            systems[name].warm_up()
        before = {name: s.counters() for name, s in systems.items()}
        records: dict[str, list[TurnRecord]] = {name: [] for name in names}
        for k, content in enumerate(messages):
            shift = k % len(names)
            for name in [*names[shift:], *names[:shift]]:
                # A turn that hangs dumps every thread's stack and ends the run.
                faulthandler.dump_traceback_later(turn_timeout, exit=True)
                try:
                    records[name].append(systems[name].turn(content))
                finally:
                    faulthandler.cancel_dump_traceback_later()
            log(
                f"turn {k + 1}/{len(messages)}: "
                + ", ".join(
                    f"{n} {records[n][-1].wall_s:.2f}s/{records[n][-1].computed_tokens}t"
                    + (
                        f"/-{records[n][-1].dropped_messages}m"
                        if records[n][-1].dropped_messages
                        else ""
                    )
                    for n in names
                )
            )
        deltas = {}
        for name, system in systems.items():
            after = system.counters()
            deltas[name] = {key: after[key] - before[name][key] for key in after}
        lcp_prefill = {}
        lcp_system = systems.get(LCP)
        if isinstance(lcp_system, LlamaCppPythonSystem):
            lcp_prefill[LCP] = lcp_system.prefill_by_eval
        return records, deltas, lcp_prefill
    finally:
        for system in systems.values():
            system.close()


def rounded(x: float) -> float:
    return round(x, 4)


def summarize(
    name: str,
    records: Sequence[TurnRecord],
    deltas: dict[str, int],
    lcp_prefill: int | None,
    reference: Sequence[TurnRecord] | None,
) -> dict[str, Any]:
    """One system's numbers."""
    dropped = [i for i, r in enumerate(records) if r.dropped_messages]
    first_drop = dropped[0] if dropped else None
    full = records[first_drop:] if first_drop is not None else []
    before = records[:first_drop] if first_drop is not None else records
    out: dict[str, Any] = {
        "total_s": rounded(sum(r.wall_s for r in records)),
        "prefill_tokens": sum(r.computed_tokens for r in records),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "generated_tokens": sum(r.completion_tokens for r in records),
        "turns_with_dropped_history": len(dropped),
        "first_drop_turn": first_drop + 1 if first_drop is not None else None,
        "dropped_messages": sum(r.dropped_messages for r in records),
        "per_turn_before_full_s": {
            "mean": rounded(statistics.mean(r.wall_s for r in before)) if before else None,
            "median": rounded(statistics.median(r.wall_s for r in before)) if before else None,
        },
        "per_turn_once_full_s": {
            "turns": len(full),
            "mean": rounded(statistics.mean(r.wall_s for r in full)) if full else None,
            "median": rounded(statistics.median(r.wall_s for r in full)) if full else None,
        },
        "prefill_tokens_per_turn_once_full": {
            "mean": round(statistics.mean(r.computed_tokens for r in full), 1) if full else None,
            "median": statistics.median(r.computed_tokens for r in full) if full else None,
        },
        "generated_tokens_per_turn_once_full": (
            round(statistics.mean(r.completion_tokens for r in full), 1) if full else None
        ),
        "cpu_share": {
            "median": rounded(statistics.median(r.cpu_share for r in records)),
            "min": rounded(min(r.cpu_share for r in records)),
        },
    }
    if name.startswith("llamax"):
        out["stats_num_prefill_tokens"] = deltas["num_prefill_tokens"]
        out["stats_num_cached_tokens"] = deltas["num_cached_tokens"]
        out["stats_num_decode_tokens"] = deltas["num_decode_tokens"]
        out["stats_num_preemptions"] = deltas["num_preemptions"]
    if name == SHIFT:
        out["shifted_tokens"] = sum(r.shifted_tokens for r in records)
        out["turns_where_shift_failed"] = sum(
            1 for r in records if r.dropped_messages and not r.shifted_tokens
        )
    if lcp_prefill is not None:
        out["prefill_tokens_by_eval_calls"] = lcp_prefill
        out["prefill_tokens_note"] = (
            "prefill_tokens sums len(prompt) - LCP(prompt, Llama._input_ids before the call), "
            "the prefix Llama keeps; prefill_tokens_by_eval_calls sums the prompt tokens "
            "actually passed to Llama.eval (they should agree)"
        )
    if reference is not None:
        same = [a.reply == b.reply for a, b in zip(records, reference, strict=False)]
        out["replies_equal_to_llamax_shift"] = sum(same)
        out["first_reply_differing_from_llamax_shift"] = (
            same.index(False) + 1 if False in same else None
        )
    return out


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """``<system> / llamax_shift`` for prefill tokens, total and per-turn (once full) time."""
    base = summary.get(SHIFT)
    out: dict[str, dict[str, float | None]] = {}
    if base is None:
        return out
    for name, s in summary.items():
        if name == SHIFT:
            continue
        out[f"{name}_over_{SHIFT}"] = {
            "prefill_tokens": ratio(s["prefill_tokens"], base["prefill_tokens"]),
            "total_s": ratio(s["total_s"], base["total_s"]),
            "per_turn_once_full_mean_s": ratio(
                s["per_turn_once_full_s"]["mean"], base["per_turn_once_full_s"]["mean"]
            ),
            "per_turn_once_full_median_s": ratio(
                s["per_turn_once_full_s"]["median"], base["per_turn_once_full_s"]["median"]
            ),
        }
    return out


def workload(messages: Sequence[str], model_path: Path) -> dict[str, Any]:
    """Token counts of the system message and the user messages (llamax tokenizer)."""
    ctx = llamax.Context(model_path, n_ctx=256, n_seq_max=1, n_threads=N_THREADS)
    try:
        system = len(
            ctx.chat_prompt([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)
        )
        user = [len(ctx.tokenize(m, add_special=False)) for m in messages]
    finally:
        ctx.close()
    return {
        "turns": len(messages),
        "system_turn_tokens": system,
        "user_message_tokens": {
            "min": min(user),
            "max": max(user),
            "mean": round(statistics.mean(user), 1),
        },
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "first_user_message": messages[0],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--turns", type=int, default=DEFAULT_TURNS, help="user messages")
    parser.add_argument("--json-out", type=Path, help="also write the JSON report here")
    parser.add_argument("--model", type=Path, help="GGUF file (default: llamax's default model)")
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEM_NAMES,
        default=list(SYSTEM_NAMES),
        help="systems to run (default: all)",
    )
    parser.add_argument("--per-turn", action="store_true", help="add per-turn records")
    parser.add_argument("--n-ctx", type=int, default=N_CTX, help="context size (default 2048)")
    parser.add_argument(
        "--turn-timeout",
        type=float,
        default=1800.0,
        help="seconds after which a hanging turn dumps the stacks and exits",
    )
    args = parser.parse_args(argv)
    if args.turns < 1:
        parser.error("--turns must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = load_average()
    model = args.model or llamax.default_model_path()
    names = [n for n in SYSTEM_NAMES if n in args.systems]
    log(f"load average: {load_at_start}")
    with stdout_to_stderr() as stdout:
        messages = user_messages(args.turns)
        work = workload(messages, model)
        log(f"workload: {json.dumps(work)}")
        records, deltas, lcp_prefill = run(model, args.n_ctx, names, messages, args.turn_timeout)
        reference = records.get(SHIFT)
        summary = {
            name: summarize(
                name,
                recs,
                deltas[name],
                lcp_prefill.get(name),
                reference if name != SHIFT else None,
            )
            for name, recs in records.items()
        }
        report: dict[str, Any] = {
            "config": {
                "model": str(model),
                "systems": names,
                "n_ctx": args.n_ctx,
                "n_seq_max": N_SEQ_MAX,
                "n_threads": N_THREADS,
                "interleaved": "each turn runs on every system, order rotating per turn",
                "llama_cpp_python_version": llama_cpp.__version__,
                "llamax_version": llamax.__version__,
                "load_average_at_start": load_at_start,
                "load_average_at_end": load_average(),
            },
            "workload": work,
            "systems": summary,
            "ratios": ratios(summary),
        }
        if args.per_turn:
            report["per_turn"] = {
                name: [
                    {
                        "wall_s": rounded(r.wall_s),
                        "prompt": r.prompt_tokens,
                        "computed": r.computed_tokens,
                        "generated": r.completion_tokens,
                        "dropped": r.dropped_messages,
                        "shifted": r.shifted_tokens,
                        "cpu_share": round(r.cpu_share, 3),
                    }
                    for r in recs
                ]
                for name, recs in records.items()
            }
        text = json.dumps(report, indent=2)
        if args.json_out:
            args.json_out.write_text(text + "\n")
        stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
