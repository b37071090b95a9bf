"""What attaching costs, and what a chain may not do once attached (issue 62), raw bindings.

One sequence of SmolLM2 decodes 48 steps, host-sampled. Every 4th step from step 8 on, a
fresh chain is attached before the decode and detached after it (``llama_set_sampler``):
the decodes right after each change are timed against the others (llama.cpp re-reserves its
scheduler after every change). Then, in a child process, one chain is attached a second
time after being detached (llama.cpp initialises a chain's backend part once:
``GGML_ASSERT(chain->is_init == false)``): the child's exit status is reported.

    python attach_probe.py
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

import llama_cpp.llama_cpp as C

import llamax


def setup() -> tuple[Any, Any, Any]:
    C.llama_backend_init()
    model = C.llama_model_load_from_file(
        str(llamax.default_model_path()).encode(), C.llama_model_default_params()
    )
    params = C.llama_context_default_params()
    params.n_ctx = 2048
    params.n_threads = 2
    params.n_threads_batch = 2
    return model, C.llama_init_from_model(model, params), C.llama_model_get_vocab(model)


def chain(seed: int) -> Any:
    made = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
    C.llama_sampler_chain_add(made, C.llama_sampler_init_top_k(40))
    C.llama_sampler_chain_add(made, C.llama_sampler_init_temp(0.8))
    C.llama_sampler_chain_add(made, C.llama_sampler_init_dist(seed))
    return made


def decode_one(ctx: Any, batch: Any, token: int, pos: int) -> float:
    batch.n_tokens = 1
    batch.token[0] = token
    batch.pos[0] = pos
    batch.n_seq_id[0] = 1
    batch.seq_id[0][0] = 0
    batch.logits[0] = True
    started = time.perf_counter()
    assert C.llama_decode(ctx, batch) == 0
    C.llama_synchronize(ctx)
    return time.perf_counter() - started


def timing() -> dict[str, Any]:
    _model, ctx, _vocab = setup()
    batch = C.llama_batch_init(512, 0, 1)
    host = chain(7)
    token, plain, changed = 1, [], []
    for step in range(48):
        attach = step >= 8 and step % 4 == 0
        device = chain(100 + step) if attach else None
        if device is not None:
            assert C.llama_set_sampler(ctx, 0, device)
        seconds = decode_one(ctx, batch, token, step)
        if device is not None:
            token = C.llama_get_sampled_token_ith(ctx, 0)
            C.llama_set_sampler(ctx, 0, None)  # never sampled on the host afterwards
        else:
            token = C.llama_sampler_sample(host, ctx, 0)
        if step >= 4:
            (changed if attach or (step > 8 and step % 4 == 1) else plain).append(seconds)
    return {
        "plain_step_ms_median": round(1000 * statistics.median(plain), 3),
        "step_ms_after_a_change_median": round(1000 * statistics.median(changed), 3),
        "steps_after_a_change": len(changed),
    }


def attach_twice() -> None:
    _model, ctx, _vocab = setup()
    once = chain(1)
    C.llama_set_sampler(ctx, 0, once)
    C.llama_set_sampler(ctx, 0, None)
    C.llama_set_sampler(ctx, 0, once)  # the second backend_init of this chain
    print("attached twice without an abort", flush=True)


def main() -> None:
    if sys.argv[1:] == ["--twice"]:
        attach_twice()
        return
    report = timing()
    child = subprocess.run(
        [sys.executable, __file__, "--twice"], capture_output=True, text=True, check=False
    )
    asserts = [line for line in child.stderr.splitlines() if "GGML_ASSERT" in line]
    report |= {
        "attach_twice_exit_status": child.returncode,
        "attach_twice_assert": asserts[0].split("llama.cpp/")[-1] if asserts else None,
        "attach_twice_printed": "attached twice without an abort" in child.stdout,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
