"""Prefix-cache benchmark: 16 requests sharing a ~1,300-token system prompt, at once.

What is measured
----------------
Sixteen ChatML prompts share one system prompt of about 1,300 tokens (varied sentences)
and each ends with its own ~20-token question (every question starts with a different
word, so two prompts share nothing beyond ``<|im_start|>user\\n``). Each request asks for
32 greedy tokens with the end-of-generation tokens banned, so every system generates
exactly 32 tokens per request. All requests are submitted at once. Four systems run in one
process, with the same model file and 2 threads:

``ideal``
    The floor, on llama-cpp-python's raw ctypes bindings: the shared prefix is prefilled
    once on seq 0 (chunks of ``n_batch``), ``llama_memory_seq_cp`` copies it to seqs 1..15,
    the 16 questions are prefilled in ONE batch (logits on each question's last token),
    then the 16 sequences decode together, each with its own greedy sampler chain.
``llamax_cache``
    ``llamax.Context(n_ctx=8192, n_seq_max=16, n_threads=2)`` (``prefix_cache=True``):
    16 ``add_request`` calls back to back, then every handle is waited for.
``llamax_nocache``
    The same with ``prefix_cache=False``: every request prefills its whole prompt.
``llama_cpp_python``
    ``llama_cpp.Llama`` with a ``LlamaRAMCache``, requests served one after another
    (``create_completion(stream=True)``). Llama also reuses the longest common prefix
    with its previous prompt in-context, so it computes the system prompt only once.

Per system the report gives the total wall time (first submit to last token, tokenization
included), TTFT p50/p95 (submit to each request's first token: the first streamed event
for llamax, the moment the first token is sampled for ``ideal``, the first streamed chunk
for llama-cpp-python, all measured from the common start), and the prompt tokens actually
computed (llamax: ``ctx.stats().num_prefill_tokens`` delta; ideal: counted; llama-cpp-python:
the tokens passed to ``Llama.eval`` for each prompt). It checks greedy outputs: llamax with
the cache against llamax without, against the same prompt run alone on a fresh no-cache
context (``--alone`` prompts), and the ideal loop and llama-cpp-python against llamax.
Ratios: ``llamax_cache.total / ideal.total`` (target <= 1.15) and
``llamax_cache.ttft_p50 / ideal.total`` (target <= 0.7), plus speedups of llamax with the
cache over llamax without it and over llama-cpp-python.

Each system is built, warmed up with a short request, timed and freed before the next one
(memory stays low); with ``--repeats K`` every repeat rebuilds every system, in an order
that rotates between repeats, and the report holds medians. Each system runs on a thread
of its own that exits afterwards (llamax decodes on its engine thread anyway), so each one
decodes with a single OpenMP team alive. That matters on a busy machine: libgomp spins at
ggml's barriers while it manages no more threads than there are cores, and under CPU
contention the same raw loop ran 2-2.6x slower (decode steps ~8x) with one team alive
than with two. Every
sample records ``cpu_share`` (process CPU time / (wall time x 2)) and the load average;
``OMP_WAIT_POLICY=passive`` in the environment makes a busy machine far less noisy (the
report records the variable).

Run
---
::

    .venv/bin/python benchmarks/prefix_cache.py                 # 1 repeat, ~2-3 min if quiet
    .venv/bin/python benchmarks/prefix_cache.py --repeats 3 --json-out prefix_cache.json

stdout carries only the JSON report (native prints are sent to stderr); progress goes to
stderr.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import itertools
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import llama_cpp
import llama_cpp.llama_cpp as C
from _common import eog_token_ids, load_average, log, ratio, stdout_to_stderr

import llamax
from llamax.backend.platform import default_use_extra_bufts

N_REQUESTS = 16
MAX_TOKENS = 32
N_THREADS = 2
N_CTX = 8192
N_SEQ_MAX = 16
N_BATCH = 512
LCP_N_CTX = 2048  # one sequence at a time: prompt (~1,330) + 32 tokens fit
SYSTEM_PROMPT_TOKENS = 1300
WARMUP_TOKENS = 4
DEFAULT_ALONE = 4
TARGET_TOTAL = 1.15
TARGET_TTFT = 0.7
IDEAL, CACHE, NOCACHE, LCP = "ideal", "llamax_cache", "llamax_nocache", "llama_cpp_python"
SYSTEM_NAMES = (IDEAL, CACHE, NOCACHE, LCP)
T = TypeVar("T")


# ---------------------------------------------------------------------------- workload
_SUBJECTS = (
    "Every support agent",
    "A new customer",
    "The night-shift keeper",
    "Our billing team",
    "The warehouse in Brest",
    "Any technician on call",
    "The regional manager",
    "A returning visitor",
    "The safety officer",
)
_ACTIONS = (
    "must confirm the order number before discussing",
    "should politely summarise",
    "is expected to double-check",
    "may only escalate questions about",
    "needs written approval to change",
    "keeps a detailed log of",
    "is never allowed to guess about",
    "can offer a small voucher for delays in",
)
_TOPICS = (
    "refunds for lamps damaged in transit",
    "the rotating Fresnel lens assembly",
    "solar charging kits and their batteries",
    "monthly and annual membership plans",
    "guided tours booked by schools",
    "fog horn maintenance schedules",
    "warranty claims filed after ninety days",
    "loyalty points earned on gift cards",
    "installation manuals in foreign languages",
    "privacy questions about location data",
    "storm alerts sent through the mobile app",
)
_ENDINGS = (
    ", and the answer must stay short and friendly.",
    " whenever the customer sounds confused.",
    " before the end of the same business day.",
    ", unless a supervisor has already replied.",
    " in plain language without internal jargon.",
    ", citing the relevant page of the handbook.",
    " and then thank the customer for their patience.",
)

QUESTIONS = (
    "What is the fastest way to reset my account password if I lost access to my email?",
    "How do I change the shipping address on an order that is confirmed but not shipped?",
    "Why was my credit card charged twice for a single subscription renewal last month?",
    "Can you explain the difference between the standard warranty and the protection plan?",
    "Which lamp models are compatible with the new solar charging kit released this spring?",
    "Where can I find the installation manual for the coastal beacon model in Spanish?",
    "When will the replacement parts for my broken fog horn arrive if I order them today?",
    "Should I pick the annual plan or the monthly plan if I only visit the coast in summer?",
    "Is it possible to transfer my membership benefits to a family member living abroad?",
    "Do you offer discounts for schools, museums or charities that run educational tours?",
    "Please describe the steps to return a lantern that arrived with a cracked glass cover.",
    "Tell me how loyalty points are calculated and when exactly they expire each year.",
    "Could a technician visit my site next week to inspect the rotating lens mechanism?",
    "Give me a short summary of your privacy policy about location data from the app.",
    "List the safety precautions I must follow before climbing the tower to clean the lamp.",
    "Are gift cards refundable if the person who received them never used the balance?",
)


def guideline_sentences() -> Iterator[str]:
    """An endless stream of varied, numbered guideline sentences (deterministic)."""
    for i in itertools.count(1):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        action = _ACTIONS[(i * 3) % len(_ACTIONS)]
        topic = _TOPICS[(i * 5) % len(_TOPICS)]
        ending = _ENDINGS[(i * 2) % len(_ENDINGS)]
        yield f"Guideline {i}: {subject} {action} {topic}{ending}"


def system_text(count_tokens: Callable[[str], int], target: int) -> str:
    """A system message of at least ``target`` tokens, built from varied sentences."""
    lines = [
        "You are the support assistant of the Northwind Lighthouse Company. "
        "Answer customers briefly and follow every guideline below."
    ]
    sentences = guideline_sentences()
    while count_tokens(chatml_system("\n".join(lines))) < target:
        lines.append(next(sentences))
    return "\n".join(lines)


def chatml_system(text: str) -> str:
    """The system turn, in ChatML."""
    return f"<|im_start|>system\n{text}<|im_end|>\n"


def chatml_prompt(system: str, question: str) -> str:
    """A full prompt: system turn, user turn, then the assistant header."""
    return f"{chatml_system(system)}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def common_prefix_len(lists: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix shared by every list."""
    n = 0
    for column in zip(*lists, strict=False):
        if any(t != column[0] for t in column):
            break
        n += 1
    return n


@dataclass(frozen=True)
class Workload:
    """The prompts, and their token counts (tokenized as llamax and llama.cpp do)."""

    prompts: tuple[str, ...]
    system_tokens: int
    prompt_tokens: tuple[int, ...]
    shared_prefix_tokens: int

    def describe(self) -> dict[str, Any]:
        """The workload as JSON."""
        suffixes = [n - self.shared_prefix_tokens for n in self.prompt_tokens]
        return {
            "num_requests": len(self.prompts),
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "system_turn_tokens": self.system_tokens,
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "unshared_tokens_per_prompt": {"min": min(suffixes), "max": max(suffixes)},
            "prompt_tokens_total": sum(self.prompt_tokens),
            "min_prompt_tokens_to_compute": self.shared_prefix_tokens + sum(suffixes),
        }


def build_workload(tokenize: Callable[[str], list[int]]) -> Workload:
    """The 16 prompts of the benchmark."""
    system = system_text(lambda s: len(tokenize(s)), SYSTEM_PROMPT_TOKENS)
    prompts = tuple(chatml_prompt(system, q) for q in QUESTIONS[:N_REQUESTS])
    token_lists = [tokenize(p) for p in prompts]
    return Workload(
        prompts=prompts,
        system_tokens=len(tokenize(chatml_system(system))),
        prompt_tokens=tuple(len(t) for t in token_lists),
        shared_prefix_tokens=common_prefix_len(token_lists),
    )


# ---------------------------------------------------------------------------- results
def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) with linear interpolation between order statistics."""
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(frozen=True)
class RunResult:
    """One timed run of one system on every prompt."""

    total_s: float
    ttft_s: tuple[float, ...]
    prefill_tokens: int | None
    generated_tokens: int
    token_ids: tuple[tuple[int, ...], ...] = ()
    texts: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft_p50(self) -> float:
        """Median time to first token."""
        return percentile(self.ttft_s, 0.5)

    @property
    def ttft_p95(self) -> float:
        """95th percentile time to first token."""
        return percentile(self.ttft_s, 0.95)

    def sample(self) -> dict[str, Any]:
        """This run as a JSON sample."""
        return {
            "total_s": round(self.total_s, 4),
            "ttft_p50_s": round(self.ttft_p50, 4),
            "ttft_p95_s": round(self.ttft_p95, 4),
            "ttft_min_s": round(min(self.ttft_s), 4),
            "ttft_max_s": round(max(self.ttft_s), 4),
            "prefill_tokens": self.prefill_tokens,
            "generated_tokens": self.generated_tokens,
            **self.extra,
        }


class System(Protocol):
    """A way of completing every prompt, all submitted at once."""

    name: str

    def run(self, prompts: Sequence[str], max_tokens: int = MAX_TOKENS) -> RunResult:
        """Complete every prompt with ``max_tokens`` greedy tokens, EOG banned."""
        ...

    def close(self) -> None:
        """Free native resources."""
        ...


def greedy(max_tokens: int) -> llamax.SamplingParams:
    """The benchmark's sampling: greedy, EOG banned, exactly ``max_tokens`` tokens."""
    return llamax.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------------------- llamax
class FirstTokenWatcher:
    """Consumes a handle's event stream in a thread and records when the first event came."""

    def __init__(self, handle: llamax.RequestHandle, start: float) -> None:
        self.handle = handle
        self.start = start
        self.ttft: float | None = None
        self.thread = threading.Thread(target=self._consume, daemon=True)
        self.thread.start()

    def _consume(self) -> None:
        for _event in self.handle:
            if self.ttft is None:
                self.ttft = time.perf_counter() - self.start

    def wait(self) -> float:
        """Join the thread; return the time to first token."""
        self.thread.join()
        assert self.ttft is not None, "the request produced no event"
        return self.ttft


class LlamaxSystem:
    """llamax through its public API: one ``Context`` with the background loop."""

    def __init__(self, model_path: Path, *, prefix_cache: bool) -> None:
        self.name = CACHE if prefix_cache else NOCACHE
        self.ctx = llamax.Context(
            model_path,
            n_ctx=N_CTX,
            n_seq_max=N_SEQ_MAX,
            n_threads=N_THREADS,
            prefix_cache=prefix_cache,
        )

    def warm_up(self) -> None:
        """One short request; then drop what the cache retained."""
        self.ctx.add_request("Hello there!", greedy(WARMUP_TOKENS)).result()
        self.ctx.clear_cache()

    def run(self, prompts: Sequence[str], max_tokens: int = MAX_TOKENS) -> RunResult:
        params = greedy(max_tokens)
        before = self.ctx.stats()
        start = time.perf_counter()
        handles = [self.ctx.add_request(p, params) for p in prompts]
        watchers = [FirstTokenWatcher(h, start) for h in handles]
        ttfts = tuple(w.wait() for w in watchers)
        completions = [h.result() for h in handles]
        total = time.perf_counter() - start
        after = self.ctx.stats()
        self.ctx.clear_cache()  # the next run starts cold
        return RunResult(
            total_s=total,
            ttft_s=ttfts,
            prefill_tokens=after.num_prefill_tokens - before.num_prefill_tokens,
            generated_tokens=sum(c.usage.completion_tokens for c in completions),
            token_ids=tuple(c.token_ids for c in completions),
            texts=tuple(c.text for c in completions),
            extra={
                "steps": after.num_steps - before.num_steps,
                "cached_tokens": after.num_cached_tokens - before.num_cached_tokens,
                "preemptions": after.num_preemptions - before.num_preemptions,
            },
        )

    def close(self) -> None:
        self.ctx.close()


def run_alone(model_path: Path, prompts: Sequence[str]) -> list[tuple[int, ...]]:
    """Each prompt on its own (nothing else in the batch), fresh no-cache context."""
    outputs = []
    with llamax.Context(
        model_path, n_ctx=N_CTX, n_seq_max=N_SEQ_MAX, n_threads=N_THREADS, prefix_cache=False
    ) as ctx:
        for i, prompt in enumerate(prompts):
            outputs.append(ctx.add_request(prompt, greedy(MAX_TOKENS)).result().token_ids)
            log(f"  alone {i + 1}/{len(prompts)} done")
    return outputs


# ---------------------------------------------------------------------------- ideal
class IdealSystem:
    """The floor: shared prefix prefilled once, copied with seq_cp, questions in one batch."""

    name = IDEAL

    def __init__(self, model_path: Path) -> None:
        mparams = C.llama_model_default_params()
        mparams.use_extra_bufts = default_use_extra_bufts()  # as llamax chooses
        self.model = C.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"could not load {model_path}")
        cparams = C.llama_context_default_params()
        cparams.n_ctx, cparams.n_seq_max = N_CTX, N_SEQ_MAX
        cparams.n_batch, cparams.n_ubatch = N_BATCH, N_BATCH
        cparams.n_threads = cparams.n_threads_batch = N_THREADS
        cparams.kv_unified = True
        self.ctx = C.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("could not create a llama.cpp context")
        self.memory = C.llama_get_memory(self.ctx)
        self.vocab = C.llama_model_get_vocab(self.model)
        self.n_vocab = C.llama_vocab_n_tokens(self.vocab)
        self.batch = C.llama_batch_init(N_BATCH, 0, 1)
        eog = eog_token_ids(self.vocab)
        self.eog_bias = (C.llama_logit_bias * len(eog))(
            *(C.llama_logit_bias(t, float("-inf")) for t in eog)
        )

    def warm_up(self) -> None:
        self.run(["<|im_start|>user\nHello there!<|im_end|>\n"], max_tokens=WARMUP_TOKENS)

    def new_chain(self) -> Any:
        """Per-sequence sampler chain: ban EOG (ignore_eos), then greedy."""
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        bias = C.llama_sampler_init_logit_bias(self.n_vocab, len(self.eog_bias), self.eog_bias)
        C.llama_sampler_chain_add(chain, bias)
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
        return chain

    def decode(self, items: Sequence[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of (token, pos, seq_id, wants_logits) items."""
        batch = self.batch
        for i, (token, pos, seq_id, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq_id, logits
        batch.n_tokens = len(items)
        status = C.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")

    def prefill(self, prompts: Sequence[list[int]]) -> tuple[int, list[int]]:
        """Shared prefix once on seq 0, copied to the others, then every suffix in one batch.

        Returns the number of prompt tokens computed and each sequence's logits row.
        """
        shortest = min(len(t) for t in prompts)
        prefix_len = min(common_prefix_len(prompts), shortest - 1)
        shared = prompts[0][:prefix_len]
        for begin in range(0, prefix_len, N_BATCH):
            chunk = shared[begin : begin + N_BATCH]
            self.decode([(t, begin + i, 0, False) for i, t in enumerate(chunk)])
        for seq_id in range(1, len(prompts)):
            C.llama_memory_seq_cp(self.memory, 0, seq_id, 0, prefix_len)
        items: list[tuple[int, int, int, bool]] = []
        rows = []
        for seq_id, tokens in enumerate(prompts):
            for pos in range(prefix_len, len(tokens)):
                items.append((tokens[pos], pos, seq_id, pos == len(tokens) - 1))
            rows.append(len(items) - 1)
        if len(items) > N_BATCH:
            raise RuntimeError(f"{len(items)} question tokens do not fit one batch of {N_BATCH}")
        self.decode(items)
        return prefix_len + len(items), rows

    def generate(
        self,
        prompts: Sequence[list[int]],
        chains: list[Any],
        rows: list[int],
        start: float,
        max_tokens: int,
    ) -> tuple[list[float], list[list[int]]]:
        """Sample, then decode the sequences together; return TTFTs and the outputs."""
        ttfts: list[float] = []
        outputs: list[list[int]] = [[] for _ in prompts]
        for step in range(max_tokens):
            for seq_id, (chain, row) in enumerate(zip(chains, rows, strict=True)):
                outputs[seq_id].append(C.llama_sampler_sample(chain, self.ctx, row))
                if step == 0:
                    ttfts.append(time.perf_counter() - start)
            if step == max_tokens - 1:
                break
            self.decode(
                [
                    (out[-1], len(p) + step, s, True)
                    for s, (p, out) in enumerate(zip(prompts, outputs, strict=True))
                ]
            )
            rows = list(range(len(prompts)))
        return ttfts, outputs

    def run(self, prompts: Sequence[str], max_tokens: int = MAX_TOKENS) -> RunResult:
        start = time.perf_counter()
        token_lists = [tokenize(self.vocab, p) for p in prompts]
        C.llama_memory_clear(self.memory, True)
        chains = [self.new_chain() for _ in prompts]
        try:
            computed, rows = self.prefill(token_lists)
            ttfts, outputs = self.generate(token_lists, chains, rows, start, max_tokens)
        finally:
            for chain in chains:
                C.llama_sampler_free(chain)
        total = time.perf_counter() - start
        return RunResult(
            total_s=total,
            ttft_s=tuple(ttfts),
            prefill_tokens=computed,
            generated_tokens=sum(len(o) for o in outputs),
            token_ids=tuple(tuple(o) for o in outputs),
        )

    def close(self) -> None:
        C.llama_batch_free(self.batch)
        C.llama_free(self.ctx)
        C.llama_model_free(self.model)


# ---------------------------------------------------------------------------- llama-cpp-python
class LlamaCppPythonSystem:
    """``Llama`` + ``LlamaRAMCache``: ``create_completion(stream=True)``, one after another."""

    name = LCP

    def __init__(self, model_path: Path) -> None:
        self.llm = llama_cpp.Llama(
            str(model_path),
            n_ctx=LCP_N_CTX,
            n_threads=N_THREADS,
            n_threads_batch=N_THREADS,
            verbose=False,
        )
        self.logit_bias = dict.fromkeys(eog_token_ids(self.llm._model.vocab), float("-inf"))
        self.eval_calls: list[int] = []
        original = self.llm.eval

        def counting_eval(tokens: Sequence[int]) -> None:
            self.eval_calls.append(len(tokens))  # prompt suffix first, then 1 per new token
            original(tokens)

        self.llm.eval = counting_eval

    def warm_up(self) -> None:
        self.llm.create_completion(
            "Hello there!", max_tokens=WARMUP_TOKENS, temperature=0.0, logit_bias=self.logit_bias
        )

    def complete(self, prompt: str, max_tokens: int, start: float) -> tuple[float, str]:
        """One streamed completion; returns its TTFT (from ``start``) and its text."""
        ttft: float | None = None
        pieces = []
        stream = self.llm.create_completion(
            prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            logit_bias=self.logit_bias,
            stream=True,
        )
        for chunk in stream:  # the RAM-cache save happens when the stream ends
            if ttft is None:
                ttft = time.perf_counter() - start
            pieces.append(chunk["choices"][0]["text"])
        assert ttft is not None, "the completion produced no chunk"
        return ttft, "".join(pieces)

    def run(self, prompts: Sequence[str], max_tokens: int = MAX_TOKENS) -> RunResult:
        self.llm.reset()  # type: ignore[no-untyped-call]  # start cold, like the others
        self.llm.set_cache(llama_cpp.LlamaRAMCache())
        ttfts, texts, prefill, generated = [], [], 0, 0
        start = time.perf_counter()
        for prompt in prompts:
            first_call = len(self.eval_calls)
            ttft, text = self.complete(prompt, max_tokens, start)
            calls = self.eval_calls[first_call:]
            prefill += calls[0]
            generated += len(calls)  # the prompt eval yields token 1; each later eval one more
            ttfts.append(ttft)
            texts.append(text)
        total = time.perf_counter() - start
        return RunResult(
            total_s=total,
            ttft_s=tuple(ttfts),
            prefill_tokens=prefill,
            generated_tokens=generated,
            texts=tuple(texts),
        )

    def close(self) -> None:
        self.llm.set_cache(None)
        self.llm.close()
        del self.llm


# ---------------------------------------------------------------------------- driver
class Benchmarked(System, Protocol):
    """A system that can also warm itself up."""

    def warm_up(self) -> None:
        """A short untimed request."""
        ...


BUILDERS: dict[str, Callable[[Path], Benchmarked]] = {
    IDEAL: IdealSystem,
    CACHE: lambda path: LlamaxSystem(path, prefix_cache=True),
    NOCACHE: lambda path: LlamaxSystem(path, prefix_cache=False),
    LCP: LlamaCppPythonSystem,
}


def run_once(name: str, model_path: Path, prompts: Sequence[str]) -> RunResult:
    """Build one system, warm it up, time one run, free it."""
    system = BUILDERS[name](model_path)
    try:
        system.warm_up()
        cpu, wall = time.process_time(), time.perf_counter()
        result = system.run(prompts)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        # Share of N_THREADS cores this process got: low values mean a busy machine.
        noise = {"cpu_share": round(cpu / (wall * N_THREADS), 3), "load_1min": load_average()[0]}
        return dataclasses.replace(result, extra={**result.extra, **noise})
    finally:
        system.close()
        del system


def in_fresh_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a new thread that exits afterwards, and return its result.

    ggml runs its graph on an OpenMP team owned by the calling thread. llamax decodes on
    its own engine thread, so every system here also decodes on a thread of its own, one
    team at a time: libgomp spins at barriers for long only while it manages no more
    threads than there are cores, and under CPU contention that spinning made a loop run
    2-7x slower when one team was alive than when two were (see ``OMP_WAIT_POLICY``).
    """
    box: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=target, name="benchmark-system")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return box[0]


def measure(
    model_path: Path, prompts: Sequence[str], names: Sequence[str], repeats: int
) -> dict[str, list[RunResult]]:
    """Every (repeat, system); the system order rotates between repeats."""
    runs: dict[str, list[RunResult]] = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in [*names[shift:], *names[:shift]]:
            log(f"repeat {repeat + 1}/{repeats}: {name} ...")
            result = in_fresh_thread(lambda n=name: run_once(n, model_path, prompts))
            expected = len(prompts) * MAX_TOKENS
            if result.generated_tokens != expected:
                log(f"  warning: {name} generated {result.generated_tokens} != {expected}")
            runs[name].append(result)
            log(
                f"  {name}: total {result.total_s:.2f} s, TTFT p50 {result.ttft_p50:.2f} s "
                f"p95 {result.ttft_p95:.2f} s, prefill {result.prefill_tokens} tokens"
            )
    return runs


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Index of the first differing element (token or character) of two sequences."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def agreement(a: Sequence[Sequence[Any]], b: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """How many outputs are identical (over the shorter list); for the others, where the
    first difference is (output index -> token or character position)."""
    n = min(len(a), len(b))
    differ = {i: first_difference(a[i], b[i]) for i in range(n) if tuple(a[i]) != tuple(b[i])}
    return {"identical": n - len(differ), "of": n, "first_difference_at": differ}


def compare_outputs(
    runs: dict[str, list[RunResult]], alone: Sequence[tuple[int, ...]]
) -> dict[str, Any]:
    """Greedy-output agreement between systems (first repeat of each)."""
    first = {name: results[0] for name, results in runs.items() if results}
    out: dict[str, Any] = {}
    pairs = [(CACHE, NOCACHE), (IDEAL, CACHE), (IDEAL, NOCACHE)]
    for a, b in pairs:
        if a in first and b in first:
            out[f"{a}_vs_{b}"] = agreement(first[a].token_ids, first[b].token_ids)
    for name in (CACHE, NOCACHE, IDEAL):
        if name in first and alone:
            out[f"{name}_vs_alone"] = agreement(first[name].token_ids, alone)
    if CACHE in first and LCP in first:
        out[f"{LCP}_vs_{CACHE}_text"] = agreement(first[LCP].texts, first[CACHE].texts)
    for name, results in runs.items():
        if len(results) > 1 and results[0].token_ids:
            same = all(r.token_ids == results[0].token_ids for r in results)
            out[f"{name}_same_across_repeats"] = same
    return out


def summarize(results: Sequence[RunResult]) -> dict[str, Any]:
    """Medians over repeats, and every sample."""

    def med(values: Sequence[float]) -> float:
        return round(statistics.median(values), 4)

    prefill = [r.prefill_tokens for r in results if r.prefill_tokens is not None]
    return {
        "total_s": med([r.total_s for r in results]),
        "ttft_p50_s": med([r.ttft_p50 for r in results]),
        "ttft_p95_s": med([r.ttft_p95 for r in results]),
        "prefill_tokens": int(statistics.median(prefill)) if prefill else None,
        "generated_tokens": results[0].generated_tokens,
        "samples": [r.sample() for r in results],
    }


def ratios(summary: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """The issue's ratios (None when a system was not run)."""

    def get(name: str, key: str) -> float | None:
        value = summary.get(name, {}).get(key)
        return float(value) if value is not None else None

    total, p50, p95 = "total_s", "ttft_p50_s", "ttft_p95_s"
    return {
        "llamax_cache_total_over_ideal_total": ratio(get(CACHE, total), get(IDEAL, total)),
        "llamax_cache_ttft_p50_over_ideal_total": ratio(get(CACHE, p50), get(IDEAL, total)),
        "llamax_cache_ttft_p50_over_ideal_ttft_p50": ratio(get(CACHE, p50), get(IDEAL, p50)),
        "speedup_total_vs_nocache": ratio(get(NOCACHE, total), get(CACHE, total)),
        "speedup_ttft_p50_vs_nocache": ratio(get(NOCACHE, p50), get(CACHE, p50)),
        "speedup_ttft_p95_vs_nocache": ratio(get(NOCACHE, p95), get(CACHE, p95)),
        "speedup_total_vs_llama_cpp_python": ratio(get(LCP, total), get(CACHE, total)),
        "speedup_ttft_p50_vs_llama_cpp_python": ratio(get(LCP, p50), get(CACHE, p50)),
        "speedup_ttft_p95_vs_llama_cpp_python": ratio(get(LCP, p95), get(CACHE, p95)),
    }


def targets(r: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    """Whether llamax with the cache is close enough to the ideal."""
    checks = {
        "llamax_cache_total_over_ideal_total": TARGET_TOTAL,
        "llamax_cache_ttft_p50_over_ideal_total": TARGET_TTFT,
    }
    return {
        key: {"ratio": r[key], "max": limit, "met": None if r[key] is None else r[key] <= limit}
        for key, limit in checks.items()
    }


def config(args: argparse.Namespace, model: Path, names: Sequence[str]) -> dict[str, Any]:
    """What was run, and how."""
    return {
        "model": str(model),
        "systems": list(names),
        "repeats": args.repeats,
        "alone_prompts": args.alone,
        "n_threads": N_THREADS,
        "n_ctx": N_CTX,
        "n_seq_max": N_SEQ_MAX,
        "n_batch": N_BATCH,
        "llama_cpp_python_n_ctx": LCP_N_CTX,
        "llama_cpp_python_version": llama_cpp.__version__,
        "llamax_version": llamax.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_average_at_start": args.load_at_start,
        "load_average_at_end": load_average(),
    }


def report(
    args: argparse.Namespace,
    model: Path,
    workload: Workload,
    runs: dict[str, list[RunResult]],
    alone: Sequence[tuple[int, ...]],
) -> dict[str, Any]:
    summary = {name: summarize(results) for name, results in runs.items() if results}
    r = ratios(summary)
    return {
        "config": config(args, model, list(runs)),
        "workload": workload.describe(),
        "systems": summary,
        "ratios": r,
        "targets": targets(r),
        "outputs": compare_outputs(runs, alone),
        "notes": {
            LCP: "sequential; Llama reuses the longest common prefix with its previous prompt "
            "in-context (the RAM cache then never holds a longer one), so prefill_tokens "
            "counts the tokens passed to Llama.eval for each prompt",
        },
    }


# ---------------------------------------------------------------------------- main
def tokenize(vocab: Any, text: str) -> list[int]:
    """Tokenize as a prompt (special tokens parsed, BOS added if the model wants it)."""
    data = text.encode()
    buf = (ctypes.c_int32 * (len(data) + 8))()
    n = C.llama_tokenize(vocab, data, len(data), buf, len(buf), True, True)
    if n < 0:
        raise RuntimeError(f"could not tokenize {text[:40]!r}...")
    return list(buf[:n])


def load_workload(model_path: Path) -> Workload:
    """Build the prompts with a vocabulary-only load of the model."""
    mparams = C.llama_model_default_params()
    mparams.vocab_only = True
    model = C.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise RuntimeError(f"could not load {model_path}")
    try:
        vocab = C.llama_model_get_vocab(model)
        return build_workload(lambda text: tokenize(vocab, text))
    finally:
        C.llama_model_free(model)


@C.llama_log_callback  # type: ignore[untyped-decorator]
def _quiet_log(_level: int, _text: bytes, _user: ctypes.c_void_p) -> None:
    """Drops llama.cpp's load-time chatter until llamax installs its own logging hook."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=1, help="runs per system (medians)")
    parser.add_argument("--json-out", type=Path, help="also write the JSON report here")
    parser.add_argument("--model", type=Path, help="GGUF file (default: llamax's default model)")
    parser.add_argument(
        "--alone",
        type=int,
        default=DEFAULT_ALONE,
        help="prompts also run alone on a fresh no-cache context, for the output check",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEM_NAMES,
        default=list(SYSTEM_NAMES),
        help="systems to run (default: all)",
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or not 0 <= args.alone <= N_REQUESTS:
        parser.error(f"--repeats must be >= 1 and --alone in [0, {N_REQUESTS}]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.load_at_start = load_average()
    model = args.model or llamax.default_model_path()
    log(f"load average: {args.load_at_start}")
    C.llama_log_set(_quiet_log, ctypes.c_void_p(0))
    with stdout_to_stderr() as stdout:
        workload = load_workload(model)
        log(f"workload: {json.dumps(workload.describe())}")
        names = [n for n in SYSTEM_NAMES if n in args.systems]
        runs = measure(model, workload.prompts, names, args.repeats)
        alone: list[tuple[int, ...]] = []
        if args.alone and (CACHE in names or NOCACHE in names):
            log(f"running {args.alone} prompts alone on a fresh no-cache llamax context")
            alone = run_alone(model, workload.prompts[: args.alone])
        text = json.dumps(report(args, model, workload, runs, alone), indent=2)
        if args.json_out:
            args.json_out.write_text(text + "\n")
        stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
