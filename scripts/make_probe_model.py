"""Write the sampling-cost probe: a 1-block, 64-wide llama GGUF with SmolLM2's tokenizer.

Its decode costs almost nothing (one block of width 64; the tied output matrix is 64 x
49,152), so a benchmark on it measures what surrounds ``llama_decode``: sampling, the batch
and the Python engine. The weights are random (seeded), so its text is noise; the tokenizer,
vocabulary, chat template and special tokens are SmolLM2's own, read from its GGUF.

Usage: ``python scripts/make_probe_model.py [OUT.gguf]`` (default:
``benchmarks/fixtures/probe-1x64.gguf``). Needs the ``gguf`` package (the ``bench`` and
``dev`` extras: ``pip install -e .[bench]``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

WIDTH = 64
FFN = 128
SEED = 0


def main(argv: list[str]) -> int:
    """Write the probe model next to the benchmarks (or to ``argv[0]``)."""
    import gguf

    from llamax.models import default_model_path

    out = Path(argv[0]) if argv else Path("benchmarks/fixtures/probe-1x64.gguf")
    source = gguf.GGUFReader(str(default_model_path()))

    def value(key: str) -> object:
        return source.fields[key].contents()

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("llamax sampling-cost probe (1 block, 64 wide, SmolLM2 tokenizer)")
    writer.add_block_count(1)
    writer.add_context_length(int(value("llama.context_length")))  # type: ignore[arg-type]
    writer.add_embedding_length(WIDTH)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(WIDTH)
    writer.add_rope_freq_base(float(value("llama.rope.freq_base")))  # type: ignore[arg-type]
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(int(value("llama.vocab_size")))  # type: ignore[arg-type]
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model(str(value("tokenizer.ggml.model")))
    writer.add_tokenizer_pre(str(value("tokenizer.ggml.pre")))
    writer.add_token_list(value("tokenizer.ggml.tokens"))  # type: ignore[arg-type]
    writer.add_token_types(value("tokenizer.ggml.token_type"))  # type: ignore[arg-type]
    writer.add_token_merges(value("tokenizer.ggml.merges"))  # type: ignore[arg-type]
    writer.add_bos_token_id(int(value("tokenizer.ggml.bos_token_id")))  # type: ignore[arg-type]
    writer.add_eos_token_id(int(value("tokenizer.ggml.eos_token_id")))  # type: ignore[arg-type]
    writer.add_unk_token_id(int(value("tokenizer.ggml.unknown_token_id")))  # type: ignore[arg-type]
    writer.add_pad_token_id(int(value("tokenizer.ggml.padding_token_id")))  # type: ignore[arg-type]
    writer.add_add_bos_token(bool(value("tokenizer.ggml.add_bos_token")))
    writer.add_add_space_prefix(bool(value("tokenizer.ggml.add_space_prefix")))
    writer.add_chat_template(str(value("tokenizer.chat_template")))

    rng = np.random.default_rng(SEED)
    n_vocab = int(value("llama.vocab_size"))  # type: ignore[arg-type]

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    # numpy shapes are ggml's dimensions reversed: token_embd is ne = [WIDTH, n_vocab]
    writer.add_tensor("token_embd.weight", weight(n_vocab, WIDTH))
    writer.add_tensor("output_norm.weight", np.ones(WIDTH, dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(WIDTH, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(WIDTH, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        writer.add_tensor(f"blk.0.{name}.weight", weight(WIDTH, WIDTH))
    writer.add_tensor("blk.0.ffn_gate.weight", weight(FFN, WIDTH))
    writer.add_tensor("blk.0.ffn_up.weight", weight(FFN, WIDTH))
    writer.add_tensor("blk.0.ffn_down.weight", weight(WIDTH, FFN))

    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
