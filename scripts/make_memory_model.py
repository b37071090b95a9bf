"""Write a small random-weight GGUF whose memory is not one plain KV cache, with SmolLM2's
tokenizer and chat template.

No recurrent, hybrid or small sliding-window GGUF ships on the package index, so the tests
of checkpoints (issue 40) write their own. Random weights are what those tests want: a
restored state that differs from a cold one shows up in the logits at once. Each kind is
the smallest shape of a real architecture that llama.cpp's loader accepts
(``src/models/*.cpp`` in the vendored llama.cpp):

``hybrid``          LFM2: 4 blocks 64 wide, short-convolution (recurrent) blocks 0 and 2,
                    attention blocks 1 and 3 (``llama_model_is_hybrid``)
``recurrent``       Mamba2: 2 blocks 64 wide, state 16, 4 heads, one group
                    (``llama_model_is_recurrent``)
``hybrid_350m``     LFM2 in LFM2-350M's shape: 16 blocks 1024 wide (10 convolution, 6
                    attention), Q8_0 matmuls, ~390 MB: for timings where compute decides
``sliding_window``  Gemma 3: 6 blocks 64 wide, a 32-token window on blocks 0-4, block 5
                    global (``llama_model_n_swa`` = 32)

The embedding and output matrices are Q8_0, the other matmul weights F16 and the rest
F32, ~9 MB a file, written
in about a second. The same seed writes the same bytes.

Usage: ``python scripts/make_memory_model.py OUT.gguf --kind hybrid [--seed N]
[--tokenizer-from GGUF]``. Needs the ``gguf`` package (the ``bench`` and ``dev`` extras).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

KINDS = ("hybrid", "hybrid_350m", "recurrent", "sliding_window")
N_EMBD = 64
WIDTHS = {"hybrid_350m": 1024}
"""The kinds whose width is not :data:`N_EMBD`; their matmul weights are Q8_0."""
N_FF = 128
WINDOW = 32  # the sliding_window kind's window, in tokens

Init = Callable[[np.random.Generator, tuple[int, ...]], np.ndarray]
"""Makes one tensor's values (float32) from the generator and the numpy shape."""


def _matrix(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def _const(value: float) -> Init:
    return lambda _rng, shape: np.full(shape, value, dtype=np.float32)


def _uniform(low: float, high: float) -> Init:
    return lambda rng, shape: rng.uniform(low, high, shape).astype(np.float32)


def _a_log(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (-np.exp(rng.uniform(0.0, 1.0, shape))).astype(np.float32)  # Mamba's A < 0


ONES = _const(1.0)
Tensor = tuple[str, tuple[int, ...], Init]
"""A tensor's name, its numpy shape (ggml's dimensions reversed) and its values."""


def _ffn(b: int) -> list[Tensor]:
    return [
        (f"blk.{b}.ffn_gate.weight", (N_FF, N_EMBD), _matrix),
        (f"blk.{b}.ffn_up.weight", (N_FF, N_EMBD), _matrix),
        (f"blk.{b}.ffn_down.weight", (N_EMBD, N_FF), _matrix),
        (f"blk.{b}.ffn_norm.weight", (N_EMBD,), ONES),
    ]


def _attention(b: int, head_dim: int) -> list[Tensor]:
    return [
        (f"blk.{b}.attn_q.weight", (N_EMBD, N_EMBD), _matrix),
        (f"blk.{b}.attn_k.weight", (N_EMBD, N_EMBD), _matrix),
        (f"blk.{b}.attn_v.weight", (N_EMBD, N_EMBD), _matrix),
        (f"blk.{b}.attn_output.weight", (N_EMBD, N_EMBD), _matrix),
        (f"blk.{b}.attn_q_norm.weight", (head_dim,), ONES),
        (f"blk.{b}.attn_k_norm.weight", (head_dim,), ONES),
    ]


def _hybrid(writer: Any) -> list[Tensor]:
    """LFM2 (``src/models/lfm2.cpp``): a block with no KV heads is a short convolution."""
    return _lfm2(
        writer, n_embd=N_EMBD, n_ff=N_FF, n_head=2, n_head_kv=2, attention=(1, 3), n_layer=4
    )


def _hybrid_350m(writer: Any) -> list[Tensor]:
    """LFM2-350M's shape (its ``config.json``: 16 blocks 1024 wide, 16 heads over 8 KV
    heads, attention in blocks 2, 5, 8, 10, 12 and 14, feed-forward 4,608 after LFM2's
    ``block_auto_adjust_ff_dim``): what a user runs, so compute, not per-step overhead,
    decides its timings."""
    return _lfm2(
        writer,
        n_embd=WIDTHS["hybrid_350m"],
        n_ff=4608,
        n_head=16,
        n_head_kv=8,
        attention=(2, 5, 8, 10, 12, 14),
        n_layer=16,
    )


def _lfm2(
    writer: Any,
    *,
    n_embd: int,
    n_ff: int,
    n_head: int,
    n_head_kv: int,
    attention: tuple[int, ...],
    n_layer: int,
) -> list[Tensor]:
    head_dim = n_embd // n_head
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv([n_head_kv if b in attention else 0 for b in range(n_layer)])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_uint32("lfm2.shortconv.l_cache", 3)
    tensors: list[Tensor] = [("token_embd_norm.weight", (n_embd,), ONES)]  # the output norm
    for b in range(n_layer):
        tensors += [
            (f"blk.{b}.ffn_gate.weight", (n_ff, n_embd), _matrix),
            (f"blk.{b}.ffn_up.weight", (n_ff, n_embd), _matrix),
            (f"blk.{b}.ffn_down.weight", (n_embd, n_ff), _matrix),
            (f"blk.{b}.ffn_norm.weight", (n_embd,), ONES),
            (f"blk.{b}.attn_norm.weight", (n_embd,), ONES),
        ]
        if b in attention:
            tensors += [
                (f"blk.{b}.attn_q.weight", (n_embd, n_embd), _matrix),
                (f"blk.{b}.attn_k.weight", (n_head_kv * head_dim, n_embd), _matrix),
                (f"blk.{b}.attn_v.weight", (n_head_kv * head_dim, n_embd), _matrix),
                (f"blk.{b}.attn_output.weight", (n_embd, n_embd), _matrix),
                (f"blk.{b}.attn_q_norm.weight", (head_dim,), ONES),
                (f"blk.{b}.attn_k_norm.weight", (head_dim,), ONES),
            ]
        else:
            tensors += [
                (f"blk.{b}.shortconv.conv.weight", (n_embd, 3), _uniform(-0.5, 0.5)),
                (f"blk.{b}.shortconv.in_proj.weight", (3 * n_embd, n_embd), _matrix),
                (f"blk.{b}.shortconv.out_proj.weight", (n_embd, n_embd), _matrix),
            ]
    return tensors


def _recurrent(writer: Any) -> list[Tensor]:
    """Mamba2 (``src/models/mamba2.cpp``)."""
    n_layer, d_inner, d_state, d_conv, n_heads = 2, 2 * N_EMBD, 16, 4, 4
    conv_dim = d_inner + 2 * d_state  # one group
    writer.add_block_count(n_layer)
    for key, value in (
        ("conv_kernel", d_conv),
        ("inner_size", d_inner),
        ("state_size", d_state),
        ("time_step_rank", n_heads),
        ("group_count", 1),
    ):
        writer.add_uint32(f"mamba2.ssm.{key}", value)
    tensors: list[Tensor] = [("output_norm.weight", (N_EMBD,), ONES)]
    for b in range(n_layer):
        tensors += [
            (f"blk.{b}.attn_norm.weight", (N_EMBD,), ONES),
            (f"blk.{b}.ssm_in.weight", (d_inner + conv_dim + n_heads, N_EMBD), _matrix),
            (f"blk.{b}.ssm_conv1d.weight", (conv_dim, d_conv), _uniform(-0.5, 0.5)),
            (f"blk.{b}.ssm_conv1d.bias", (conv_dim,), _const(0.0)),
            (f"blk.{b}.ssm_dt.bias", (n_heads,), _const(-2.0)),
            (f"blk.{b}.ssm_a", (n_heads, 1), _a_log),
            (f"blk.{b}.ssm_d", (n_heads, 1), ONES),
            (f"blk.{b}.ssm_norm.weight", (1, d_inner), ONES),
            (f"blk.{b}.ssm_out.weight", (N_EMBD, d_inner), _matrix),
        ]
    return tensors


def _sliding_window(writer: Any) -> list[Tensor]:
    """Gemma 3 (``src/models/gemma3.cpp``): five windowed blocks, then a global one."""
    n_layer, n_head = 6, 2
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_key_length(N_EMBD // n_head)
    writer.add_value_length(N_EMBD // n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_sliding_window(WINDOW)
    tensors: list[Tensor] = [("output_norm.weight", (N_EMBD,), ONES)]
    for b in range(n_layer):
        tensors += _ffn(b) + _attention(b, N_EMBD // n_head)
        tensors += [
            (f"blk.{b}.attn_norm.weight", (N_EMBD,), ONES),
            (f"blk.{b}.post_attention_norm.weight", (N_EMBD,), ONES),
            (f"blk.{b}.post_ffw_norm.weight", (N_EMBD,), ONES),
        ]
    return tensors


ARCHITECTURES = {
    "hybrid": "lfm2",
    "hybrid_350m": "lfm2",
    "recurrent": "mamba2",
    "sliding_window": "gemma3",
}
_BLOCKS = {
    "hybrid": _hybrid,
    "hybrid_350m": _hybrid_350m,
    "recurrent": _recurrent,
    "sliding_window": _sliding_window,
}


def _random_model_script() -> Any:
    """``make_random_model.py`` beside this file (its tokenizer copy and Q8_0 writer)."""
    path = Path(__file__).with_name("make_random_model.py")
    name = "make_random_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclass looks its module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def _add_q8_info(writer: Any, name: str, rows: int, cols: int, block: int) -> None:
    import gguf

    row_bytes = cols // block * (2 + block)
    writer.add_tensor_info(
        name,
        (rows, row_bytes),
        np.dtype(np.uint8),
        rows * row_bytes,
        gguf.GGMLQuantizationType.Q8_0,
    )


def write_memory_model(
    out: Path, *, kind: str, seed: int = 0, tokenizer_from: Path | None = None
) -> Path:
    """Write a random GGUF of memory ``kind`` (a key of :data:`ARCHITECTURES`) to ``out``.

    Args:
        out: the file to write (its folder is created).
        kind: one of :data:`KINDS`.
        seed: the random generator's seed (same seed, same file).
        tokenizer_from: the GGUF whose tokenizer is copied (default: llamax's default model).

    Raises:
        ValueError: an unknown kind.
    """
    import gguf

    from llamax.models import default_model_path

    if kind not in ARCHITECTURES:
        raise ValueError(f"kind must be one of {sorted(ARCHITECTURES)}, got {kind!r}")
    base = _random_model_script()
    reader = gguf.GGUFReader(str(tokenizer_from or default_model_path()))
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(str(out), ARCHITECTURES[kind])
    writer.add_name(f"llamax random {kind} ({ARCHITECTURES[kind]}, seed {seed})")
    n_embd = WIDTHS.get(kind, N_EMBD)
    matmul = "q8_0" if kind in WIDTHS else "f16"
    writer.add_context_length(8192)
    writer.add_embedding_length(n_embd)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    tensors = _BLOCKS[kind](writer)
    base._copy_tokenizer(writer, reader)

    rng = np.random.default_rng(seed)
    embeddings = [("token_embd.weight", n_vocab), ("output.weight", n_vocab)]
    for name, rows in embeddings:
        _add_q8_info(writer, name, rows, n_embd, base.QK8_0)
    # matmul weights as F16 (Q8_0 in the wide kinds: made later, tensor by tensor);
    # norms, biases and convolutions stay F32
    stored: list[tuple[str, tuple[int, ...], np.ndarray | None]] = []
    for name, shape, init in tensors:
        if init is _matrix and matmul == "q8_0":
            _add_q8_info(writer, name, shape[0], shape[1], base.QK8_0)
            stored.append((name, shape, None))
            continue
        array = init(rng, shape).astype(np.float16 if init is _matrix else np.float32)
        writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes)
        stored.append((name, shape, array))
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _name, rows in embeddings:
        writer.write_tensor_data(base.random_matrix(rng, rows, n_embd, "q8_0"))
    for _name, shape, maybe in stored:
        writer.write_tensor_data(
            maybe if maybe is not None else base.random_matrix(rng, shape[0], shape[1], "q8_0")
        )
    writer.close()
    return out


def main(argv: list[str]) -> int:
    """Command line: see the module's docs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", type=Path, help="GGUF to take the tokenizer from")
    args = parser.parse_args(argv)
    path = write_memory_model(
        args.out, kind=args.kind, seed=args.seed, tokenizer_from=args.tokenizer_from
    )
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
