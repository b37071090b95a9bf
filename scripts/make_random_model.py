"""Write a llama-architecture GGUF of a named shape with SmolLM2's tokenizer and random weights.

A GPU benchmark needs realistic step costs, not realistic text: a model of the right shape
costs what a trained one costs per token. So this writes one from nothing (no weights
travel to a lent GPU machine, where SmolLM2 does not fit the carry): the tokenizer, its
vocabulary (49,152 tokens), special tokens and chat template are SmolLM2's own, read from
its GGUF (``llamax.default_model_path()`` or ``--tokenizer-from``); the weights are random
and seeded.

Shapes (``SHAPES``):

``tiny``   1 block, 64 wide: decode costs almost nothing, so the engine's own overhead shows
``small``  2 blocks, 256 wide, grouped-query attention: a quick CPU check of a real layout
``1b``     Llama-3.2-1B's blocks (16 x 2048, FFN 8192, 32 heads, 8 KV heads)
``8b``     Llama-3-8B's blocks (32 x 4096, FFN 14336, 32 heads, 8 KV heads)

Every shape has its own output matrix: with random weights a tied one (the embedding
again) makes greedy decoding repeat the input token, since the residual stream is mostly
that token's embedding. The output matmul costs the same either way.

The weights are uniform int8 values times one scale per matrix (``1/sqrt(n_in)`` in
standard deviation), so activations keep their size through the blocks, logits stay finite
and greedy output is not one repeated token. ``F16`` stores them as halves; ``Q8_0`` writes
the quantized blocks directly (a scale and 32 int8 values per block, as ggml lays them out),
which is the same format ``gguf.quants`` produces, without its per-element float work.

Tensors are written one at a time (``GGUFWriter.add_tensor_info`` for all, then
``write_tensor_data`` per tensor; ``add_tensor`` would hold every tensor in memory until
``write_tensors_to_file``), so the peak memory is about the largest tensor, not the file:
for the 8B's 49,152 x 4,096 output matrix, measured 0.44 GB of peak RSS in Q8_0 and 0.62 GB
in F16 (1.8 s and 2.4 s on this 2-core machine).

``--n-vocab N`` pads the vocabulary to N tokens (``128256``: Llama 3's, so an 8B of that
shape samples from rows as wide as a real one's): the added tokens are control tokens
``<|reserved_token_i|>``, which no text tokenizes to; the embedding and output matrices
grow to N rows.

Usage: ``python scripts/make_random_model.py OUT.gguf --shape tiny [--dtype q8_0] [--seed N]
[--n-vocab N] [--tokenizer-from GGUF]``; ``--tokenizer-only`` writes just the tokenizer
(~1 MB), which ``scripts/carry_llama_cpp.sh`` carries to GPU machines in place of SmolLM2.
Needs the ``gguf`` package (the ``bench`` and ``dev`` extras).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

QK8_0 = 32  # values per Q8_0 block (ggml)
INT8_STD = float(np.sqrt((255**2 - 1) / 12))  # std of uniform integers in [-127, 127]


@dataclass(frozen=True)
class Shape:
    """A llama model's dimensions; ``dtype`` is the default storage of its matrices."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    tied_output: bool
    dtype: str

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head


SHAPES = {
    "tiny": Shape(1, 64, 128, 1, 1, tied_output=False, dtype="f16"),
    "small": Shape(2, 256, 512, 4, 2, tied_output=False, dtype="f16"),
    "1b": Shape(16, 2048, 8192, 32, 8, tied_output=False, dtype="f16"),
    "8b": Shape(32, 4096, 14336, 32, 8, tied_output=False, dtype="q8_0"),
}
"""The named shapes; ``1b`` and ``8b`` follow Llama-3.2-1B and Llama-3-8B's blocks."""

DTYPES = ("f16", "q8_0")


def matrices(shape: Shape, n_vocab: int) -> list[tuple[str, int, int]]:
    """``(name, n_out, n_in)`` of every 2-D weight, in file order (numpy shape = (n_out, n_in))."""
    kv = shape.head_dim * shape.n_head_kv
    out = [("token_embd.weight", n_vocab, shape.n_embd)]
    for b in range(shape.n_layer):
        out += [
            (f"blk.{b}.attn_q.weight", shape.n_embd, shape.n_embd),
            (f"blk.{b}.attn_k.weight", kv, shape.n_embd),
            (f"blk.{b}.attn_v.weight", kv, shape.n_embd),
            (f"blk.{b}.attn_output.weight", shape.n_embd, shape.n_embd),
            (f"blk.{b}.ffn_gate.weight", shape.n_ff, shape.n_embd),
            (f"blk.{b}.ffn_up.weight", shape.n_ff, shape.n_embd),
            (f"blk.{b}.ffn_down.weight", shape.n_embd, shape.n_ff),
        ]
    if not shape.tied_output:
        out.append(("output.weight", n_vocab, shape.n_embd))
    return out


def norms(shape: Shape) -> list[str]:
    """The 1-D RMS-norm weights (always F32, all ones)."""
    names = ["output_norm.weight"]
    for b in range(shape.n_layer):
        names += [f"blk.{b}.attn_norm.weight", f"blk.{b}.ffn_norm.weight"]
    return names


def random_matrix(rng: np.random.Generator, n_out: int, n_in: int, dtype: str) -> np.ndarray:
    """One random matrix in its stored form: float16 ``(n_out, n_in)``, or Q8_0 bytes
    ``(n_out, n_in / 32 * 34)`` (per block: an f16 scale, then 32 int8 values)."""
    q = rng.integers(-127, 128, size=(n_out, n_in), dtype=np.int8)
    scale = 1.0 / (np.sqrt(n_in) * INT8_STD)
    if dtype == "f16":
        out = q.astype(np.float16)
        out *= np.float16(scale)
        return out
    blocks = np.empty((n_out, n_in // QK8_0, 2 + QK8_0), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    blocks[:, :, 2:] = q.view(np.uint8).reshape(n_out, n_in // QK8_0, QK8_0)
    return blocks.reshape(n_out, -1)


def _copy_tokenizer(writer: Any, reader: Any, n_vocab: int | None = None) -> None:
    """Every ``tokenizer.*`` key of the source GGUF, with its own value type; with
    ``n_vocab``, the per-token arrays padded with control tokens to that many."""
    import gguf

    pads: dict[str, Any] = {}
    if n_vocab is not None:
        start = len(reader.fields["tokenizer.ggml.tokens"].data)
        pads = {
            "tokenizer.ggml.tokens": [f"<|reserved_token_{i}|>" for i in range(start, n_vocab)],
            "tokenizer.ggml.token_type": [gguf.TokenType.CONTROL] * (n_vocab - start),
            "tokenizer.ggml.scores": [0.0] * (n_vocab - start),
        }
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if key in pads:
            value = [*value, *pads[key]]
        writer.add_key_value(key, value, vtype, sub_type)


def write_random_model(
    out: Path,
    *,
    shape: str = "tiny",
    dtype: str | None = None,
    seed: int = 0,
    tokenizer_from: Path | None = None,
    n_vocab: int | None = None,
) -> Path:
    """Write a random llama GGUF of the named shape to ``out`` and return ``out``.

    Args:
        out: the file to write (its folder is created).
        shape: a key of :data:`SHAPES`.
        dtype: ``"f16"`` or ``"q8_0"`` for the matrices (default: the shape's own).
        seed: the random generator's seed (same seed, same file).
        tokenizer_from: the GGUF whose tokenizer is copied (default: llamax's default model).
        n_vocab: pad the vocabulary to this many tokens (default: the tokenizer's own).

    Raises:
        ValueError: an unknown shape or dtype, or ``n_vocab`` below the tokenizer's.
    """
    import gguf

    from llamax.models import default_model_path

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    spec = SHAPES[shape]
    dtype = dtype or spec.dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    reader = gguf.GGUFReader(str(tokenizer_from or default_model_path()))
    n_source = len(reader.fields["tokenizer.ggml.tokens"].data)
    if n_vocab is not None and n_vocab < n_source:
        raise ValueError(f"n_vocab must be at least the tokenizer's {n_source}, got {n_vocab}")
    pad_to, n_vocab = n_vocab, n_vocab or n_source
    ctx_len = int(reader.fields["llama.context_length"].contents())
    rope_base = float(reader.fields["llama.rope.freq_base"].contents())

    writer = gguf.GGUFWriter(str(out), "llama")
    vocab = f", {n_vocab} tokens" if pad_to else ""
    writer.add_name(f"llamax random {shape} ({dtype}, seed {seed}, SmolLM2 tokenizer{vocab})")
    writer.add_block_count(spec.n_layer)
    writer.add_context_length(ctx_len)
    writer.add_embedding_length(spec.n_embd)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    file_type = gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0
    writer.add_file_type(file_type)
    _copy_tokenizer(writer, reader, pad_to)

    qtype = gguf.GGMLQuantizationType.F16 if dtype == "f16" else gguf.GGMLQuantizationType.Q8_0
    weights = matrices(spec, n_vocab)
    for name, n_out, n_in in weights:
        if dtype == "q8_0":
            nbytes = n_out * n_in // QK8_0 * (2 + QK8_0)
            writer.add_tensor_info(
                name, (n_out, nbytes // n_out), np.dtype(np.uint8), nbytes, qtype
            )
        else:
            writer.add_tensor_info(name, (n_out, n_in), np.dtype(np.float16), n_out * n_in * 2)
    for name in norms(spec):
        writer.add_tensor_info(name, (spec.n_embd,), np.dtype(np.float32), spec.n_embd * 4)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, n_out, n_in in weights:
        writer.write_tensor_data(random_matrix(rng, n_out, n_in, dtype))
    for _name in norms(spec):
        writer.write_tensor_data(np.ones(spec.n_embd, dtype=np.float32))
    writer.close()
    return out


def write_tokenizer(out: Path, *, source: Path | None = None) -> Path:
    """Write a weightless GGUF holding only ``source``'s tokenizer keys (default: the
    default model's) and the two llama keys :func:`write_random_model` reads: what a machine
    without SmolLM2 needs (``--tokenizer-from``), ~1 MB instead of 93 MB."""
    import gguf

    from llamax.models import default_model_path

    reader = gguf.GGUFReader(str(source or default_model_path()))
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("SmolLM2 tokenizer (no weights)")
    writer.add_context_length(int(reader.fields["llama.context_length"].contents()))
    writer.add_rope_freq_base(float(reader.fields["llama.rope.freq_base"].contents()))
    _copy_tokenizer(writer, reader)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return out


def main(argv: list[str]) -> int:
    """Command line: see the module's docs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", choices=DTYPES, help="default: the shape's own")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", type=Path, help="GGUF to take the tokenizer from")
    parser.add_argument("--n-vocab", type=int, help="pad the vocabulary (128256: Llama 3's)")
    parser.add_argument(
        "--tokenizer-only", action="store_true", help="write only the tokenizer (no weights)"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.tokenizer_only:
        print(write_tokenizer(args.out, source=args.tokenizer_from))
        return 0
    path = write_random_model(
        args.out,
        shape=args.shape,
        dtype=args.dtype,
        seed=args.seed,
        tokenizer_from=args.tokenizer_from,
        n_vocab=args.n_vocab,
    )
    size = path.stat().st_size / 1e6
    print(f"{path} ({size:.1f} MB, {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
