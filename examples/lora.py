"""Per-request LoRA adapters: the default model with and without an adapter, in one batch.

No LoRA for SmolLM2 ships on the package index, so this writes one first with
scripts/make_lora_adapter.py (random weights: it changes the output, and teaches nothing).
Needs the ``gguf`` package (``pip install gguf``)."""

import importlib.util
import tempfile
from pathlib import Path

import llamax

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "make_lora_adapter.py"


def write_adapter(out: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_lora_adapter", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_lora_adapter(out, seed=1)  # type: ignore[no-any-return]


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        adapter = write_adapter(Path(folder) / "random-lora.gguf")
        with llamax.Context(n_ctx=1024, n_seq_max=4, lora={"random": str(adapter)}) as ctx:
            prompt = ctx.chat_prompt([{"role": "user", "content": "Name three colours."}])
            sets = [None, {"random": 0.0}, {"random": 0.3}, {"random": 1.0}]
            handles = [
                ctx.add_request(prompt, llamax.SamplingParams(max_tokens=20, temperature=0, lora=s))
                for s in sets
            ]
            for lora, handle in zip(sets, handles, strict=True):
                print(f"{lora!s:18} {handle.result().text!r}")
            print(f"adapters: {list(ctx.adapters)}")


if __name__ == "__main__":
    main()
