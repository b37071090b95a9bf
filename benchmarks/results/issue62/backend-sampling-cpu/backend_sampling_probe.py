"""Probe llama.cpp 0.3.36's backend sampling on the CPU backend (issue 62), raw bindings only.

The same chain (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8, dist with a seed per
sequence) samples ``N`` sequences for 32 steps three ways on SmolLM2: on the host
(``llama_sampler_sample`` after each decode), in the graph through the context params'
``samplers`` (``llama_get_sampled_token_ith``), and in the graph through
``llama_set_sampler`` on a context made without samplers; then the samplers are detached
and one more step is sampled on the host. Prints one JSON line.

    python backend_sampling_probe.py N
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import time
from typing import Any

import llama_cpp.llama_cpp as C

import llamax

N_SEQ = int(sys.argv[1]) if len(sys.argv) > 1 else 4
STEPS = 32

C.llama_backend_init()
MODEL = C.llama_model_load_from_file(
    str(llamax.default_model_path()).encode(), C.llama_model_default_params()
)
VOCAB = C.llama_model_get_vocab(MODEL)


def chain(seed: int) -> Any:
    made = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
    C.llama_sampler_chain_add(made, C.llama_sampler_init_top_k(40))
    C.llama_sampler_chain_add(made, C.llama_sampler_init_top_p(0.95, 1))
    C.llama_sampler_chain_add(made, C.llama_sampler_init_min_p(0.05, 1))
    C.llama_sampler_chain_add(made, C.llama_sampler_init_temp(0.8))
    C.llama_sampler_chain_add(made, C.llama_sampler_init_dist(seed))
    return made


def make_context(in_params: bool) -> tuple[Any, list[Any], Any]:
    """A context, its chains (one a sequence), and the params' sampler array (kept alive)."""
    params = C.llama_context_default_params()
    params.n_ctx = 4096
    params.n_batch = 512
    params.n_seq_max = N_SEQ
    params.n_threads = 2
    params.n_threads_batch = 2
    chains = [chain(1000 + s) for s in range(N_SEQ)]
    configs = None
    if in_params:
        configs = (C.llama_sampler_seq_config * N_SEQ)()
        for s in range(N_SEQ):
            configs[s].seq_id = s
            configs[s].sampler = ctypes.cast(chains[s], ctypes.c_void_p)
        params.samplers = configs
        params.n_samplers = N_SEQ
    ctx = C.llama_init_from_model(MODEL, params)
    assert ctx, "no context"
    return ctx, chains, configs


def tokenize(text: str) -> list[int]:
    data = text.encode()
    buf = (C.llama_token * 512)()
    n = C.llama_tokenize(VOCAB, data, len(data), buf, 512, True, False)
    return list(buf[:n])


PROMPTS = [
    tokenize(f"Story {s}: once upon a time in the land of {s} there was") for s in range(N_SEQ)
]


def run(mode: str) -> dict[str, Any]:
    """``mode``: ``host``, ``params`` or ``runtime``."""
    ctx, chains, _configs = make_context(mode == "params")
    attach_ms = None
    if mode == "runtime":
        started = time.perf_counter()
        for s in range(N_SEQ):
            assert C.llama_set_sampler(ctx, s, chains[s]), "llama_set_sampler refused"
        attach_ms = round(1000 * (time.perf_counter() - started), 3)
    batch = C.llama_batch_init(512, 0, 1)
    pos = [0] * N_SEQ

    def fill(items: list[tuple[int, list[int]]]) -> dict[int, int]:
        batch.n_tokens = 0
        rows = {}
        for s, tokens in items:
            for j, token in enumerate(tokens):
                i = batch.n_tokens
                batch.token[i] = token
                batch.pos[i] = pos[s] + j
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = s
                batch.logits[i] = j == len(tokens) - 1
                batch.n_tokens += 1
            rows[s] = batch.n_tokens - 1
            pos[s] += len(tokens)
        return rows

    outs: list[list[int]] = [[] for _ in range(N_SEQ)]
    items = [(s, PROMPTS[s]) for s in range(N_SEQ)]
    steps = []
    for _ in range(STEPS):
        rows = fill(items)
        started = time.perf_counter()
        assert C.llama_decode(ctx, batch) == 0
        for s in range(N_SEQ):
            if mode == "host":
                token = C.llama_sampler_sample(chains[s], ctx, rows[s])
            else:
                token = C.llama_get_sampled_token_ith(ctx, rows[s])
                C.llama_sampler_accept(chains[s], token)
            outs[s].append(token)
        steps.append(time.perf_counter() - started)
        items = [(s, [outs[s][-1]]) for s in range(N_SEQ)]
    result: dict[str, Any] = {
        "tokens": outs,
        "first_step_ms": round(1000 * steps[0], 3),
        "step_ms_median": round(1000 * statistics.median(steps[1:]), 3),
    }
    if mode == "runtime":
        for s in range(N_SEQ):
            C.llama_set_sampler(ctx, s, None)
        rows = fill(items)
        assert C.llama_decode(ctx, batch) == 0
        # sampling with an attached chain object on the host after detaching aborted
        # (GGML_ASSERT(cur_p.selected ...) in llama_sampler_sample): a fresh chain here
        result |= {
            "attach_ms": attach_ms,
            "sampled_token_ith_after_detach": [
                C.llama_get_sampled_token_ith(ctx, rows[s]) for s in range(min(N_SEQ, 4))
            ],
            "host_token_after_detach": C.llama_sampler_sample(chain(1), ctx, rows[0]),
        }
    C.llama_batch_free(batch)
    C.llama_free(ctx)
    return result


def main() -> None:
    host, params, runtime = run("host"), run("params"), run("runtime")
    report: dict[str, Any] = {"n_seq": N_SEQ, "steps": STEPS}
    for name, other in (("params", params), ("runtime", runtime)):
        same = sum(a == b for a, b in zip(host["tokens"], other["tokens"], strict=True))
        report[f"{name}_identical_sequences"] = same
    for name, result in (("host", host), ("params", params), ("runtime", runtime)):
        tokens = result.pop("tokens")
        report[name] = result | {"seq0_tokens": tokens[0][:8]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
