"""Checkpoints: a hybrid model's chat reuses its KV from turn to turn.

A hybrid model (here a small random LFM2 that ``scripts/make_memory_model.py`` writes, with
SmolLM2's tokenizer; any LFM2, Granite 4, Qwen3-Next or Mamba GGUF works the same) keeps a
recurrent state that llama.cpp cannot cut. llamax takes checkpoints of it while a prompt is
computed, so each turn computes only what is new (plus the last reply, re-tokenized from its
text), where without the prefix cache every turn computes the whole conversation. Prints
each turn's prompt tokens and how many were computed, with and without.

Needs the ``gguf`` package (the ``dev`` or ``bench`` extra) to write the model.
"""

import importlib.util
import sys
import tempfile
from pathlib import Path

import llamax


def write_model(folder: Path) -> Path:
    script = Path(__file__).parent.parent / "scripts" / "make_memory_model.py"
    spec = importlib.util.spec_from_file_location("make_memory_model", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    path: Path = module.write_memory_model(folder / "hybrid.gguf", kind="hybrid")
    return path


def chat(model: Path, *, prefix_cache: bool) -> list[tuple[int, int]]:
    """Six turns of one conversation; per turn (prompt tokens, tokens computed)."""
    params = llamax.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    turns = []
    with llamax.Context(model, n_ctx=4096, n_seq_max=2, prefix_cache=prefix_cache) as ctx:
        messages = [{"role": "system", "content": "You are terse. " * 40}]
        for turn in range(6):
            messages.append({"role": "user", "content": f"Question {turn}: " + "why? " * 30})
            prompt = ctx.chat_prompt(messages)
            done = ctx.add_request(prompt, params).result()
            turns.append(
                (done.usage.prompt_tokens, done.usage.prompt_tokens - done.usage.cached_tokens)
            )
            messages.append({"role": "assistant", "content": done.text})
        stats = ctx.stats()
        print(
            f"prefix_cache={prefix_cache}: {stats.checkpoints.num_taken} checkpoints "
            f"({stats.checkpoints.num_bytes} bytes), {stats.checkpoints.num_restores} restored"
        )
    return turns


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        model = write_model(Path(folder))
        with_cache = chat(model, prefix_cache=True)
        without = chat(model, prefix_cache=False)
    for turn, ((prompt, computed), (_, recomputed)) in enumerate(
        zip(with_cache, without, strict=True), 1
    ):
        print(
            f"turn {turn}: {prompt:5d} prompt tokens, {computed:5d} computed ({recomputed} without)"
        )


if __name__ == "__main__":
    main()
