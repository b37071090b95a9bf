"""Write a small random-weight ``mmproj`` GGUF (a vision projector) for llama.cpp's ``mtmd``,
whose output width fits SmolLM2-135M (576), for the tests of images in prompts (issue 42).

No vision GGUF ships on the package index, so the tests write their own. Random weights
are a fair test: the output is deterministic, and two different images give different
embeddings (and so different logits). Both kinds are a SigLIP-style ViT (patch
convolution, learned positions, pre-norm blocks with GELU, a final LayerNorm: the
``clip_graph_siglip`` graph in ``tools/mtmd/models/siglip.cpp``) with one of two heads:

``gemma3``     Gemma 3's projector: 2x2 average pooling of the 8x8 patch grid, RMS norm,
               one matrix. ``mtmd`` wraps the image in ``<start_of_image>`` ...
               ``<end_of_image>`` (plain text to SmolLM2) and says its 16 embeddings are
               decoded with **non-causal** attention (``mtmd_decode_use_non_causal``).
``janus_pro``  Janus-Pro's projector: a two-layer GELU MLP over the 4x4 patch grid;
               no marker text, **causal** attention, like most vision models.

Each kind takes a 64x64 image (``mtmd`` resizes any input to it) and gives 16 embeddings;
the encoder is 2 blocks 64 wide, ~0.5 MB in F32. The same arguments write the same bytes.
:func:`cached_vision_model` keeps one copy per arguments under ``~/.cache/llamax/vision``.

Usage: ``python scripts/make_vision_model.py [OUT.gguf] [--projector gemma3] [--seed N]
[--n-embd-text 576]`` (no OUT: the cached copy's path). Needs the ``gguf`` package (the
``bench`` and ``dev`` extras).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import struct
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

PROJECTORS = ("gemma3", "janus_pro")
IMAGE_SIZE = 64
N_EMBD = 64
N_HEAD = 4
N_FF = 256
N_LAYER = 2
N_EMBD_TEXT = 576  # SmolLM2-135M
PATCH_SIZE = {"gemma3": 8, "janus_pro": 16}  # 8x8 patches pooled 2x2, or 4x4 patches
GEMMA3_MERGE = 2
FORMAT_VERSION = 1
"""Bumped when the layout or the weights change, so cached copies are written again."""


def _matrix(rng: np.random.Generator, n_out: int, n_in: int) -> np.ndarray:
    """numpy ``(n_out, n_in)``, i.e. ggml ``ne = [n_in, n_out]``: ``y = W x``."""
    return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)


def _vector(rng: np.random.Generator, n: int, *, around: float = 0.0) -> np.ndarray:
    return (around + 0.02 * rng.standard_normal(n)).astype(np.float32)


def _encoder_tensors(rng: np.random.Generator, patch: int) -> dict[str, np.ndarray]:
    """The SigLIP ViT: tensor name -> numpy array (ggml's ``ne`` reversed)."""
    n_patches = (IMAGE_SIZE // patch) ** 2
    fan_in = 3 * patch * patch
    tensors = {
        "v.patch_embd.weight": (
            rng.standard_normal((N_EMBD, 3, patch, patch)) / np.sqrt(fan_in)
        ).astype(np.float32),
        "v.patch_embd.bias": _vector(rng, N_EMBD),
        "v.position_embd.weight": (0.1 * rng.standard_normal((n_patches, N_EMBD))).astype(
            np.float32
        ),
        "v.post_ln.weight": _vector(rng, N_EMBD, around=1.0),
        "v.post_ln.bias": _vector(rng, N_EMBD),
    }
    for i in range(N_LAYER):
        blk = f"v.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors[f"{blk}.{name}.weight"] = _matrix(rng, N_EMBD, N_EMBD)
            tensors[f"{blk}.{name}.bias"] = _vector(rng, N_EMBD)
        for name in ("ln1", "ln2"):
            tensors[f"{blk}.{name}.weight"] = _vector(rng, N_EMBD, around=1.0)
            tensors[f"{blk}.{name}.bias"] = _vector(rng, N_EMBD)
        tensors[f"{blk}.ffn_up.weight"] = _matrix(rng, N_FF, N_EMBD)
        tensors[f"{blk}.ffn_up.bias"] = _vector(rng, N_FF)
        tensors[f"{blk}.ffn_down.weight"] = _matrix(rng, N_EMBD, N_FF)
        tensors[f"{blk}.ffn_down.bias"] = _vector(rng, N_EMBD)
    return tensors


def _head_tensors(
    rng: np.random.Generator, projector: str, n_embd_text: int
) -> dict[str, np.ndarray]:
    """The projector: vision width -> ``n_embd_text``."""
    if projector == "gemma3":
        # siglip.cpp multiplies by mm_input_projection's transpose: ggml ne = [n_text, n_embd]
        return {
            "mm.soft_emb_norm.weight": _vector(rng, N_EMBD, around=1.0),
            "mm.input_projection.weight": (
                rng.standard_normal((N_EMBD, n_embd_text)) / np.sqrt(N_EMBD)
            ).astype(np.float32),
        }
    return {
        "mm.0.weight": _matrix(rng, n_embd_text, N_EMBD),
        "mm.0.bias": _vector(rng, n_embd_text),
        "mm.1.weight": _matrix(rng, n_embd_text, n_embd_text),
        "mm.1.bias": _vector(rng, n_embd_text),
    }


def write_vision_model(
    out: Path,
    *,
    projector: str = "gemma3",
    seed: int = 0,
    n_embd_text: int = N_EMBD_TEXT,
) -> Path:
    """Write the projector to ``out`` (see the module's docs); ``n_embd_text`` is its output
    width, which must be the text model's ``n_embd`` (tests write a wrong one on purpose).

    Raises:
        ValueError: an unknown ``projector``.
    """
    import gguf

    if projector not in PROJECTORS:
        raise ValueError(f"projector must be one of {PROJECTORS}, got {projector!r}")
    rng = np.random.default_rng(seed)
    patch = PATCH_SIZE[projector]
    writer = gguf.GGUFWriter(str(out), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(f"llamax test projector ({projector}, seed {seed})")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(projector)
    writer.add_vision_projection_dim(n_embd_text)
    writer.add_vision_image_size(IMAGE_SIZE)
    writer.add_vision_patch_size(patch)
    writer.add_vision_embedding_length(N_EMBD)
    writer.add_vision_feed_forward_length(N_FF)
    writer.add_vision_block_count(N_LAYER)
    writer.add_vision_head_count(N_HEAD)
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_vision_image_mean([0.5, 0.5, 0.5])
    writer.add_vision_image_std([0.5, 0.5, 0.5])
    writer.add_vision_use_gelu(True)
    if projector == "gemma3":
        writer.add_vision_projector_scale_factor(GEMMA3_MERGE)
    tensors = _encoder_tensors(rng, patch) | _head_tensors(rng, projector, n_embd_text)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def cached_vision_model(
    *,
    projector: str = "gemma3",
    seed: int = 0,
    n_embd_text: int = N_EMBD_TEXT,
    cache_dir: Path | None = None,
) -> Path:
    """The projector for these arguments, written once under ``cache_dir`` (default
    ``~/.cache/llamax/vision``) and reused; written to a temporary file and renamed, so
    processes that race each other each see a whole file."""
    key = f"{FORMAT_VERSION}-{projector}-{seed}-{n_embd_text}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    folder = cache_dir or Path.home() / ".cache" / "llamax" / "vision"
    path = folder / f"mmproj-{projector}-{n_embd_text}-s{seed}-{digest}.gguf"
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".part")
    os.close(fd)
    try:
        write_vision_model(Path(tmp), projector=projector, seed=seed, n_embd_text=n_embd_text)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def pixels(seed: int, height: int = 40, width: int = 50) -> np.ndarray:
    """Random RGB pixels (``uint8``, height x width x 3): a test image."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))


def png(rgb: np.ndarray, *, width: int | None = None, height: int | None = None) -> bytes:
    """An RGB PNG of ``rgb`` (pure Python: zlib); ``width``/``height`` override what the
    header declares (a file that lies, for the tests)."""
    h, w = rgb.shape[:2]
    declared = (w if width is None else width, h if height is None else height)
    ihdr = struct.pack(">IIBBBBB", *declared, 8, 2, 0, 0, 0)
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(raw))
        + _chunk(b"IEND", b"")
    )


def main(argv: list[str]) -> int:
    """Command line: see the module's docs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", help="where to write (default: the cache)")
    parser.add_argument("--projector", choices=PROJECTORS, default="gemma3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-embd-text", type=int, default=N_EMBD_TEXT)
    args = parser.parse_args(argv)
    options = {"projector": args.projector, "seed": args.seed, "n_embd_text": args.n_embd_text}
    path = write_vision_model(args.out, **options) if args.out else cached_vision_model(**options)
    print(f"{path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
