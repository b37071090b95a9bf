"""Speculative prompt-lookup decoding: llamax with and without it, and llama-cpp-python's.

Greedy workloads, each at N concurrent requests (``--n``, default 1 and 4):

``code`` (copy-heavy)
    "Rewrite this Python code, renaming the variable X to Y" on a ~360-token snippet
    (SmolLM2's ChatML template); request i renames a different variable. The 135M model
    mostly copies the code back (it rarely renames): ~90% of its output 3-grams are in the
    prompt (``workload.code.copy_fraction``).
``quote`` (copy-heavy)
    A ~290-token passage to quote word for word (four phrasings of the request). The model
    quotes most of it (85-98% of its output 3-grams are in the prompt), then stops.
``story`` (free text)
    A story on a one-line prompt: nothing to copy from the prompt (though the model may
    repeat itself, which prompt lookup also drafts from).
``w1`` (throughput, N = 16 and 64; llamax only)
    ``throughput.py``'s workload: N distinct short prompts, 64 tokens each, EOG banned.

The copy and story workloads stop at an end-of-generation token or ``max_tokens``.
Systems, 2 threads each, every request of a run submitted at once:

``llamax_spec``
    ``Context(speculative=PromptLookup())``: llamax's defaults (``config.prompt_lookup``).
``llamax``
    The same context without ``speculative``. Two llama.cpp contexts in one process ran
    4-7% apart at every step for their whole life (issue 59), which a ratio between the
    two carries. ``--one-context``: both on one context, the speculative requests asking
    for it (``SamplingParams.speculative``); its first run drafted a third as much on code
    as a context of its own (issue 59; not understood yet).
``llama_cpp_python_lookup`` / ``llama_cpp_python``
    ``Llama(draft_model=LlamaPromptLookupDecoding(max_ngram_size, num_pred_tokens))`` with
    ``PromptLookup()``'s ``ngram_max`` and ``max_draft``,
    and a plain ``Llama``, one request after another (``Llama.generate``, temperature 0).

Run it without ``OMP_WAIT_POLICY=passive`` on a quiet machine: there the passive policy
halved the plain runs (code N=1 29 tok/s against 50-55, 2026-12-03; docs/performance.md).

Score: generated tokens / wall time of the run (tokenization included). Each repeat runs
every (workload, N, system), the system order rotating; the report holds medians, every
sample, ratios, acceptance rates (accepted / drafted tokens), the greedy-output agreement
between each system and its own run without speculation, and the issue's targets.

::

    .venv/bin/python benchmarks/speculative.py --json-out spec.json
    .venv/bin/python benchmarks/speculative.py --quick      # a smoke run, ~2 min
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from _common import (
    add_common_args,
    base_config,
    emit_report,
    load_average,
    log,
    model_path,
    ratio,
    short_prompts,
    stdout_to_stderr,
    targets,
)
from _peers import LlamaCppPythonPeer
from _runner import (
    Run,
    Runs,
    Workload,
    lcp_run,
    llamax_run,
    measure,
    median_table,
    ratio_table,
    samples,
    worst,
)

import llamax

N_CTX = 8192
N_BATCH = 1024
LCP_N_CTX = 1024
SPEC, PLAIN, LCP_SPEC, LCP = "llamax_spec", "llamax", "llama_cpp_python_lookup", "llama_cpp_python"
SYSTEMS = (SPEC, PLAIN, LCP_SPEC, LCP)
BASELINE = {SPEC: PLAIN, LCP_SPEC: LCP}  # each speculative system and its own baseline
RATIOS = [*BASELINE.items(), (SPEC, LCP_SPEC), (PLAIN, LCP)]
# Ratios llamax_spec / llamax the issue asks for, per workload and N.
LIMITS = {"code_N1": 1.8, "quote_N1": 1.8, "story_N1": 0.95, "story_N4": 0.95}
LIMITS |= {"w1_N16": 0.97, "w1_N64": 0.97}

CODE = """def celsius_to_fahrenheit(celsius):
    return celsius * 9 / 5 + 32


def fahrenheit_to_celsius(fahrenheit):
    return (fahrenheit - 32) * 5 / 9


def celsius_to_kelvin(celsius):
    return celsius + 273.15


def kelvin_to_celsius(kelvin):
    return kelvin - 273.15


def fahrenheit_to_kelvin(fahrenheit):
    return celsius_to_kelvin(fahrenheit_to_celsius(fahrenheit))


def kelvin_to_fahrenheit(kelvin):
    return celsius_to_fahrenheit(kelvin_to_celsius(kelvin))


def print_table(start, stop, step):
    print("Celsius  Fahrenheit  Kelvin")
    temperature = start
    while temperature <= stop:
        fahrenheit = celsius_to_fahrenheit(temperature)
        kelvin = celsius_to_kelvin(temperature)
        print(temperature, round(fahrenheit, 1), round(kelvin, 2))
        temperature = temperature + step


def main():
    print_table(-40, 100, 10)
    print("Water boils at", celsius_to_fahrenheit(100), "degrees Fahrenheit")
    print("Water freezes at", celsius_to_fahrenheit(0), "degrees Fahrenheit")
    print("Absolute zero is", kelvin_to_celsius(0), "degrees Celsius")


main()
"""
RENAMES = [("temperature", "degrees"), ("kelvin", "k"), ("fahrenheit", "f"), ("step", "delta")]

PASSAGE = """The lighthouse at Point Carrow was built in 1871 from granite quarried on the \
island itself. Its first keeper, Thomas Avery, kept a log of every ship that passed, and the \
log survives in the county archive. The light was first fuelled by whale oil, then by \
paraffin, and was finally electrified in 1934. During the great storm of 1903 the lantern \
glass shattered, and Avery's daughter Margaret kept a lamp burning by hand for three nights \
until the glaziers could reach the island. The station was automated in 1987, and the last \
keepers left in the spring of that year.

The tower is forty-one metres tall and has one hundred and twelve steps. Its lens, made in \
Paris by the firm of Henry-Lepaute, weighs almost four tonnes and floats on a bath of \
mercury so that a single clockwork motor can turn it. The beam can be seen from thirty \
kilometres away on a clear night, and it flashes white twice every fifteen seconds.

Today the tower is open to visitors on summer weekends. The keeper's cottage houses a small \
museum of charts, lenses and logbooks, and a path along the cliffs leads to the old fog \
signal station, where seals rest on the rocks below at low tide."""
QUOTE_ASKS = [  # the passage between a lead-in and a request: ~300-token prompts
    ("Read this passage:", "Quote the passage above word for word."),
    ("Here is a text from a guidebook:", "Repeat the text above exactly, word for word."),
    ("Passage:", "Copy out the passage above exactly as it is written."),
    ("Consider the following text.", "Write out the text above again, without changing a word."),
]
STORY_TOPICS = [
    "a dragon who learns to bake bread",
    "two robots lost in a desert",
    "a girl who can talk to clocks",
    "the last train of the night",
]


def chatml(user: str) -> str:
    """SmolLM2-Instruct's chat template (ChatML), one user turn, the reply to come."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def code_prompt(i: int) -> str:
    old, new = RENAMES[i % len(RENAMES)]
    return chatml(
        f"Rewrite this Python code, renaming the variable `{old}` to `{new}`.\n\n"
        f"```python\n{CODE}```"
    )


def quote_prompt(i: int) -> str:
    lead, ask = QUOTE_ASKS[i % len(QUOTE_ASKS)]
    return chatml(f"{lead}\n\n{PASSAGE}\n\n{ask}")


def story_prompt(i: int) -> str:
    return chatml(f"Write a long story about {STORY_TOPICS[i % len(STORY_TOPICS)]}.")


def workloads(args: argparse.Namespace) -> list[Workload]:
    """The four workloads; code, quote and story run on every system, w1 on llamax's."""
    short = lambda i: short_prompts(i + 1)[i]  # noqa: E731
    return [
        Workload("code", "copy-heavy", code_prompt, args.max_tokens, tuple(args.n)),
        Workload("quote", "copy-heavy", quote_prompt, args.max_tokens, tuple(args.n)),
        Workload("story", "free text", story_prompt, args.max_tokens, tuple(args.n)),
        Workload("w1", "throughput", short, 64, tuple(args.n_throughput), True, (SPEC, PLAIN)),
    ]


def lookup() -> llamax.PromptLookup:
    """llamax's default drafter (llama-cpp-python's gets the same draft and n-gram sizes)."""
    return llamax.PromptLookup()


def build(
    args: argparse.Namespace, closers: list[Callable[[], None]]
) -> tuple[dict[str, Run], llamax.Context | None]:
    """Load the systems that are not skipped (llamax first: it routes native logs); also
    return a llamax context for tokenizing, if any."""
    n_seq_max = max(args.n + args.n_throughput)
    common: dict[str, Any] = {"n_ctx": N_CTX, "n_seq_max": n_seq_max, "n_batch": N_BATCH}
    common |= {"n_threads": 2, **args.llamax_options}
    systems: dict[str, Run] = {}
    ctx: llamax.Context | None = None
    if not args.one_context:
        if SPEC not in args.skip:
            ctx = llamax.Context(args.model, speculative=lookup(), **common)
            closers.append(ctx.close)
            systems[SPEC] = llamax_run(ctx, spec=True)
        if PLAIN not in args.skip:
            ctx = llamax.Context(args.model, **common)
            closers.append(ctx.close)
            systems[PLAIN] = llamax_run(ctx, spec=False)
    elif SPEC not in args.skip or PLAIN not in args.skip:
        # one context for both: no instance bias (two llama.cpp contexts in one process ran
        # 4-7% apart for their whole life, results/issue59/speculation/context_instances.txt)
        ctx = llamax.Context(args.model, **common)
        closers.append(ctx.close)
        if SPEC not in args.skip:
            systems[SPEC] = llamax_run(ctx, spec=True, speculative=lookup())
        if PLAIN not in args.skip:
            systems[PLAIN] = llamax_run(ctx, spec=False)
    for name, draft in ((LCP_SPEC, lookup().max_draft), (LCP, None)):
        if name not in args.skip:
            peer = LlamaCppPythonPeer(
                args.model, LCP_N_CTX, draft_tokens=draft, ngram_max=lookup().ngram_max
            )
            closers.append(peer.close)
            systems[name] = lcp_run(peer)
    return systems, ctx if SPEC not in args.skip or PLAIN not in args.skip else None


def copy_fraction(
    ctx_tokenize: Callable[[str], list[int]], prompt: str, out: Sequence[int]
) -> float:
    """The share of the output's token 3-grams that occur in the prompt."""
    p = ctx_tokenize(prompt)
    grams = {tuple(p[i : i + 3]) for i in range(len(p) - 2)}
    n = max(1, len(out) - 2)
    return round(sum(tuple(out[i : i + 3]) in grams for i in range(len(out) - 2)) / n, 3)


def report(runs: Runs, loads: Sequence[Workload], config: dict[str, Any]) -> dict[str, Any]:
    def acceptance(w: str, system: str, n: int) -> float | None:
        rs = runs[w].get(system, {}).get(n) or []
        return ratio(sum(r.accepted for r in rs), sum(r.drafted for r in rs))

    medians: dict[str, Any] = {}
    decode: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    decode_ratios: dict[str, Any] = {}
    accept: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    for load in loads:
        w = load.name
        medians[w] = median_table(runs, load)
        decode[w] = median_table(runs, load, decode=True)
        ratios[w] = ratio_table(medians[w], RATIOS, load)
        decode_ratios[w] = ratio_table(decode[w], list(BASELINE.items()), load)
        accept[w] = {
            s: {str(n): acceptance(w, s, n) for n in load.ns} for s in BASELINE if s in runs[w]
        }
        outputs[w] = {}
        for spec, base in BASELINE.items():
            for n in load.ns:
                a, b = runs[w].get(spec, {}).get(n), runs[w].get(base, {}).get(n)
                if a and b:  # each repeat against the baseline repeat most like it: the worst
                    outputs[w].setdefault(f"{spec}_vs_{base}", {})[str(n)] = worst(a, b)
                if b and len(b) > 1:  # the noise floor: the baseline against its first run
                    outputs[w].setdefault(f"{base}_repeats", {})[str(n)] = worst(b[1:], b[:1])
    values = {
        key: ratios.get(w, {}).get(f"{SPEC}_over_{PLAIN}", {}).get(n)
        for key in LIMITS
        for w, n in [key.split("_N")]
    }
    return {
        "config": config,
        "workload": {
            load.name: {"kind": load.kind, "max_tokens": load.max_tokens, "n": list(load.ns)}
            for load in loads
        },
        "median_tokens_per_s": medians,
        "median_decode_tokens_per_s": decode,
        "ratios": ratios,
        "decode_ratios": decode_ratios,
        "acceptance_rate": accept,
        "targets": targets(values, LIMITS, at_least=True),
        "outputs": outputs,
        "samples": samples(runs),
    }


def describe_outputs(
    runs: Runs, loads: Sequence[Workload], tok: llamax.Context, report_: dict[str, Any]
) -> None:
    """Print a sample output of each workload to stderr and record how much it copies."""
    for load in loads:
        by_n = runs[load.name].get(PLAIN) or runs[load.name].get(SPEC) or {}
        if not by_n:
            continue
        first = by_n[min(by_n)][0]
        prompts = load.prompts(len(first.token_ids))
        info = report_["workload"][load.name]
        info["prompt_tokens"] = [len(tok.tokenize(p)) for p in prompts]
        info["copy_fraction"] = [
            copy_fraction(tok.tokenize, p, ids)
            for p, ids in zip(prompts, first.token_ids, strict=True)
        ]
        log(f"--- {load.name}: sample output (copy fraction {info['copy_fraction'][0]}) ---")
        log(tok.detokenize(first.token_ids[0])[:600])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add_common_args(parser)
    parser.add_argument("--n", type=int, nargs="+", default=[1, 4], help="N for code/quote/story")
    parser.add_argument("--n-throughput", type=int, nargs="*", default=[16, 64], help="N for w1")
    parser.add_argument("--max-tokens", type=int, default=400, help="for code, quote and story")
    parser.add_argument(
        "--peer-n", type=int, nargs="*", help="N at which llama-cpp-python runs (default: --n)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per system and N (median)")
    parser.add_argument(
        "--one-context",
        action="store_true",
        help="both llamax systems on one context, the speculative requests asking for it "
        "(SamplingParams.speculative), instead of a context each",
    )
    parser.add_argument("--skip", nargs="*", default=[], choices=SYSTEMS, help="systems to skip")
    parser.add_argument(
        "--quick", action="store_true", help="1 repeat, N=1 and 4, 64 tokens, w1 at N=16 only"
    )
    parser.add_argument(
        "--llamax-option", action="append", default=[], metavar="NAME=JSON",
        help="one more llamax.Context option for both llamax systems, its value as JSON "
        "(reproducible=true, kv_type_v='\"q8_0\"'); repeatable",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.llamax_options = {}
    for option in args.llamax_option:
        name, _, value = option.partition("=")
        args.llamax_options[name] = json.loads(value)
    if args.quick:
        args.repeats, args.n, args.n_throughput, args.max_tokens = 1, [1, 4], [16], 64
    if args.repeats < 1 or any(n < 1 for n in args.n + args.n_throughput):
        parser.error("--repeats and N values must be >= 1")
    if SPEC not in args.skip and not hasattr(llamax, "PromptLookup"):
        parser.error(
            f"this llamax ({llamax.__version__}) has no llamax.PromptLookup: speculative "
            f"decoding is not there yet (run with --skip {SPEC} to measure the rest)"
        )
    args.model = model_path(args.model)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    load = load_average()
    log(f"load average: {load}")
    loads = workloads(args)
    closers: list[Callable[[], None]] = []
    with stdout_to_stderr() as stdout:
        settings = {"n_ctx": N_CTX, "n_batch": N_BATCH, "llama_cpp_python_n_ctx": LCP_N_CTX}
        if hasattr(llamax, "PromptLookup"):
            settings["prompt_lookup"] = dataclasses.asdict(lookup())
        try:
            systems, tokenizer = build(args, closers)
            peer_ns = args.peer_n or args.n
            runs = measure(systems, loads, args.repeats, peers=(LCP, LCP_SPEC), peer_ns=peer_ns)
            result = report(runs, loads, base_config(args, load, **settings))
            if tokenizer is not None:
                describe_outputs(runs, loads, tokenizer, result)
        finally:
            for close in reversed(closers):
                close()
        emit_report(result, stdout, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
