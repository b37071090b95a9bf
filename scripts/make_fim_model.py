"""Write a copy of a GGUF whose metadata names three of its special tokens as its
fill-in-the-middle tokens, for the tests of ``/infill`` (issue 41).

SmolLM2-135M-Instruct, the default model, has no FIM tokens (llama-server refuses
``/infill`` on it, and so does llamax). Its vocabulary does hold unused control tokens
(StarCoder's ``<issue_start>``, ``<issue_comment>``, ``<issue_closed>``, ``<file_sep>``);
the copy declares them as FIM prefix, suffix, middle and file separator through the GGUF
keys llama.cpp reads (``tokenizer.ggml.fim_pre_token_id`` ...). The weights are the same,
so what the model writes is no real infill: the copy exercises the protocol, the prompt's
layout, batching and prefix sharing, not the quality of a completion.

    python scripts/make_fim_model.py OUT.gguf [--source MODEL.gguf]
"""

from __future__ import annotations

import argparse
from pathlib import Path

FIM_KEYS = {
    "tokenizer.ggml.fim_pre_token_id": "<issue_start>",
    "tokenizer.ggml.fim_suf_token_id": "<issue_comment>",
    "tokenizer.ggml.fim_mid_token_id": "<issue_closed>",
    "tokenizer.ggml.fim_sep_token_id": "<file_sep>",
}
"""The metadata key -> the text of the special token it names."""


def write_fim_model(out: Path, source: Path | None = None) -> Path:
    """Copy ``source`` (default: llamax's default model) to ``out`` with :data:`FIM_KEYS`.

    Raises:
        LookupError: ``source``'s vocabulary lacks one of the tokens.
    """
    import gguf

    from llamax.models import default_model_path

    reader = gguf.GGUFReader(str(source or default_model_path()))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    ids = {key: tokens.index(text) for key, text in FIM_KEYS.items()}
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for key, token in ids.items():
        writer.add_uint32(key, token)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype,
                               tensor.data.nbytes, tensor.tensor_type)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return out


def main() -> None:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--source", type=Path, default=None)
    args = parser.parse_args()
    print(write_fim_model(args.out, args.source))


if __name__ == "__main__":
    main()
