"""Write a GGUF's weights in another type (Q8_0, F16, Q4_K_M, Q6_K ...) with llama.cpp's own
quantizer (``llama_model_quantize``, through llama-cpp-python's bindings).

Only SmolLM2 Q4_1 ships; the checks that must hold for every weight type (the reproducible
mode, issue 60) write the other types from it. A quantized source is dequantized first
(``allow_requantize``), so the new file's values carry the source's rounding: right for
exercising the new type's kernels, not for judging its quality.

Usage: ``python scripts/requantize.py SRC.gguf OUT.gguf --type q8_0``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TYPES = {"f16": 1, "bf16": 32, "q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "q4_0": 2}
"""The ``--type`` names, as llama.cpp's ``LLAMA_FTYPE_MOSTLY_*`` numbers."""


def requantize(src: Path, out: Path, kind: str, *, threads: int = 1) -> Path:
    """Write ``src``'s weights as ``kind`` (a key of :data:`TYPES`) to ``out``; every tensor
    in that type where llama.cpp's quantizer allows it (``pure``).

    Raises:
        ValueError: an unknown type.
        RuntimeError: llama.cpp's quantizer failed.
    """
    import llama_cpp

    if kind not in TYPES:
        raise ValueError(f"type must be one of {sorted(TYPES)}, got {kind!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = TYPES[kind]
    params.allow_requantize = True
    params.pure = kind in ("f16", "bf16", "q8_0")  # one type throughout; K-quants mix as usual
    out.parent.mkdir(parents=True, exist_ok=True)
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize failed ({status}) on {src} -> {kind}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", choices=sorted(TYPES), required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    requantize(args.src, args.out, args.type, threads=args.threads)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
