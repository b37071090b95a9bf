"""Write a LoRA adapter GGUF for SmolLM2-135M: rank-``r`` ``lora_a``/``lora_b`` pairs for
the attention query and value projections and the FFN down projection of every block.

No LoRA for SmolLM2 ships on the package index, so the tests and the LoRA benchmark write
their own. The weights are random (seeded): the adapter teaches nothing, but at scale 1 it
moves the model's logits enough to change its greedy output, which is what the tests need.
The shapes and metadata are what llama.cpp's ``llama_adapter_lora_init`` checks: the
model's architecture, ``adapter.type = lora``, ``adapter.lora.alpha``, and for each weight
``W`` (ggml ``ne = [n_in, n_out]``) ``lora_a`` of ``ne = [n_in, r]`` and ``lora_b`` of
``ne = [r, n_out]``.

Usage: ``python scripts/make_lora_adapter.py OUT.gguf [--seed N] [--strength S]``. Needs
the ``gguf`` package (the ``bench`` and ``dev`` extras).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np

RANK = 8
ALPHA = 16.0
TARGETS = ("attn_q", "attn_v", "ffn_down")


def write_lora_adapter(
    out: Path,
    *,
    model: Path | None = None,
    seed: int = 0,
    strength: float = 1.0,
    rank: int = RANK,
    dtype: str = "float32",
    alpha: float = ALPHA,
) -> Path:
    """Write the adapter for ``model`` (default: the default model) to ``out``.

    ``strength`` scales ``lora_b``: 0 writes an adapter that changes nothing. ``dtype``
    is the numpy type of the tensors and ``alpha`` the ``adapter.lora.alpha`` written
    (tests write adapters llama.cpp must not be given: int8 tensors, NaN alphas).
    """
    import gguf

    from llamax.models import default_model_path

    arch, shapes, blocks = _model_layout(str(model or default_model_path()))
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    writer.add_name(f"llamax test LoRA (rank {rank}, seed {seed}, strength {strength})")
    rng = np.random.default_rng(seed)
    for block in range(blocks):
        for target in TARGETS:
            n_in, n_out = shapes[f"blk.{block}.{target}.weight"]
            a = rng.standard_normal((rank, n_in)) / np.sqrt(n_in)  # ne = [n_in, r]
            b = strength * rng.standard_normal((n_out, rank)) / np.sqrt(rank)  # ne = [r, n_out]
            writer.add_tensor(f"blk.{block}.{target}.weight.lora_a", a.astype(dtype))
            writer.add_tensor(f"blk.{block}.{target}.weight.lora_b", b.astype(dtype))
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@functools.cache
def _model_layout(model: str) -> tuple[str, dict[str, list[int]], int]:
    """The model's architecture, tensor shapes (ggml ``ne`` order) and block count.

    Cached: reading the model's header (its whole vocabulary) costs more than writing an
    adapter, and the tests write several for the same model."""
    import gguf

    reader = gguf.GGUFReader(model)
    arch = str(reader.fields["general.architecture"].contents())
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    blocks = int(reader.fields[f"{arch}.block_count"].contents())
    return arch, shapes, blocks


def main(argv: list[str]) -> int:
    """Command line: see the module's docs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strength", type=float, default=1.0)
    args = parser.parse_args(argv)
    print(write_lora_adapter(args.out, seed=args.seed, strength=args.strength))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
