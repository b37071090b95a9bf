"""The vision seam (llamax.backend.vision) on the real SmolLM2 and the random projectors of
scripts/make_vision_model.py: loading, typed refusals, tokenizing a prompt with images,
encoding, and decoding image embeddings into a sequence before text."""

from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import vision_files
from vision_files import jpeg, pixels, png

from llamax.backend.native import NativeBatch, NativeContext, NativeModel, bindings, context_params
from llamax.backend.vision import (
    ImageChunk,
    NativeEmbdBatch,
    Projector,
    TextChunk,
    decode_image,
    read_image_header,
    rgb_image,
)
from llamax.errors import ImageError, InvalidRequestError, ProjectorError

pytestmark = pytest.mark.model
LIMITS = {"max_side": 4096, "max_pixels": 1 << 22}
N_UBATCH = 32  # below the embedding batch's 64 rows


@pytest.fixture(scope="module")
def script() -> Any:
    return vision_files.script()


@pytest.fixture(scope="module")
def native(model_path: Path) -> Iterator[tuple[NativeModel, NativeContext, NativeEmbdBatch]]:
    C = bindings()
    model = NativeModel(C, model_path, n_gpu_layers=0)
    cparams = context_params(C, n_ctx=512, n_batch=64, n_ubatch=N_UBATCH, n_seq_max=2,
                             n_threads=2, n_threads_batch=2)  # fmt: skip
    context = NativeContext.create(model, cparams)
    assert context is not None
    batch = NativeEmbdBatch(C, 64, model.n_embd())
    yield model, context, batch
    batch.close()
    context.close()
    model.close()


@pytest.fixture(scope="module", params=["gemma3", "janus_pro"])
def projector(request: Any, script: Any, native: Any) -> Iterator[Projector]:
    model = native[0]
    loaded = Projector.load(model, script.cached_vision_model(projector=request.param),
                            n_threads=2)  # fmt: skip
    yield loaded
    loaded.close()


def test_a_projector_for_the_model_loads(projector: Projector) -> None:
    assert projector.supports_vision and not projector.supports_audio
    assert projector.marker == "<__media__>"
    assert projector.n_embd == 576
    assert not projector.uses_mrope
    assert projector.uses_non_causal == ("gemma3" in projector.path.name)


def test_a_projector_of_another_width_is_a_typed_error(
    script: Any, native: Any, tmp_path: Path
) -> None:
    model = native[0]
    wrong = script.write_vision_model(tmp_path / "wide.gguf", n_embd_text=512)
    with pytest.raises(ProjectorError, match="512 wide, but the model's are 576"):
        Projector.load(model, wrong, n_threads=1)


def test_mtmd_refuses_the_width_when_the_header_does_not_say_it(
    script: Any, native: Any, tmp_path: Path
) -> None:
    """The header check is a courtesy: mtmd's own check on the tensors still holds."""
    import gguf

    source = script.write_vision_model(tmp_path / "wide.gguf", n_embd_text=512)
    reader = gguf.GGUFReader(str(source))
    out = tmp_path / "unlabelled.gguf"
    writer = gguf.GGUFWriter(str(out), "clip")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (
            "general.architecture",
            "clip.vision.projection_dim",
        ):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_uint32("clip.vision.projection_dim", 576)  # lies: the tensors are 512 wide
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ProjectorError, match="mtmd could not load"):
        Projector.load(native[0], out, n_threads=1)


def test_files_that_are_no_projector_are_typed_errors(
    native: Any, model_path: Path, tmp_path: Path
) -> None:
    model = native[0]
    with pytest.raises(ProjectorError, match="not found"):
        Projector.load(model, tmp_path / "missing.gguf", n_threads=1)
    (tmp_path / "text.gguf").write_text("not a gguf")
    with pytest.raises(ProjectorError, match="not a GGUF"):
        Projector.load(model, tmp_path / "text.gguf", n_threads=1)
    with pytest.raises(ProjectorError, match="architecture is 'llama'"):
        Projector.load(model, model_path, n_threads=1)  # the text model itself


def test_a_prompt_with_an_image_tokenizes_into_text_and_image_chunks(
    projector: Projector,
) -> None:
    image = rgb_image(pixels(0), **LIMITS)
    prompt = f"Look: {projector.marker} What is it?"
    chunks = projector.tokenize(prompt, [image])
    assert [type(c) for c in chunks] == [TextChunk, ImageChunk, TextChunk]
    first, middle, last = chunks
    assert isinstance(first, TextChunk) and isinstance(last, TextChunk)
    assert isinstance(middle, ImageChunk)
    assert (middle.n_tokens, middle.n_pos) == (16, 16)
    assert middle.image_id == image.image_id  # the pixels' hash: the prefix cache's key
    assert middle.is_non_causal == projector.uses_non_causal
    assert first.token_ids[:2] == tuple(projector_text(projector, "Look:"))[:2]
    middle.release()
    middle.release()  # idempotent


def projector_text(projector: Projector, text: str) -> list[int]:
    chunks = projector.tokenize(text, [])
    assert len(chunks) == 1 and isinstance(chunks[0], TextChunk)
    return list(chunks[0].token_ids)


def test_markers_and_images_must_agree_in_number(projector: Projector) -> None:
    image = rgb_image(pixels(0), **LIMITS)
    with pytest.raises(InvalidRequestError, match="1 image markers"):
        projector.tokenize(f"{projector.marker} and", [image, image])
    with pytest.raises(InvalidRequestError, match="2 image markers"):
        projector.tokenize(f"{projector.marker} {projector.marker}", [image])


def test_png_and_jpeg_files_decode_to_the_pixels(projector: Projector) -> None:
    rgb = pixels(1)
    from_png = projector.decode_image(png(rgb))
    assert (from_png.width, from_png.height) == (50, 40)
    assert from_png.pixels == rgb.tobytes()
    assert from_png.image_id == rgb_image(rgb, **LIMITS).image_id  # one key, any container
    from_jpeg = projector.decode_image(jpeg(rgb))
    assert (from_jpeg.width, from_jpeg.height) == (50, 40)  # lossy: other pixels


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"GIF89a not really", "truncated GIF"),
        (b"hello", "not an image"),
        (png(pixels(2))[:-30], "truncated PNG"),
        (png(pixels(2, 2, 2), width=60_000, height=60_000), "60000x60000"),
    ],
)
def test_bad_image_files_are_typed_errors(projector: Projector, data: bytes, says: str) -> None:
    with pytest.raises(ImageError, match=says):
        projector.decode_image(data, **LIMITS)


def _with_idat(good: bytes, body: bytes) -> bytes:
    """``good`` (a PNG of one IDAT chunk) with that chunk's data replaced by ``body``."""
    idat = good.index(b"IDAT") - 4
    (length,) = struct.unpack(">I", good[idat : idat + 4])
    chunk = struct.pack(">I", len(body)) + b"IDAT" + body
    crc = struct.pack(">I", zlib.crc32(b"IDAT" + body))
    return good[:idat] + chunk + crc + good[idat + 12 + length :]


def test_pixels_stb_cannot_read_fail_in_the_decoder_not_in_ffmpeg(
    projector: Projector, caplog: pytest.LogCaptureFixture
) -> None:
    """A whole PNG (CRCs right) whose IDAT is no zlib stream is refused by llamax's own
    inflate check (issue 54: what IDAT inflates to is bounded before stb_image runs). One
    whose rows inflate to the right size but name a filter PNG does not have (5) passes
    that check: stb_image refuses it and mtmd's helper tries it as a video, with an ffmpeg
    directory that holds none."""
    good = png(pixels(3))
    idat = good.index(b"IDAT") - 4
    (length,) = struct.unpack(">I", good[idat : idat + 4])
    garbage = _with_idat(good, b"\x00" * length)
    with pytest.raises(ImageError, match="does not inflate"):
        projector.decode_image(garbage)
    rows = bytearray(zlib.decompress(good[idat + 8 : idat + 8 + length]))
    (height,) = struct.unpack(">I", good[20:24])  # IHDR: width, then height
    row_bytes = len(rows) // height  # each row: a filter byte, then its RGB
    for row in range(height):
        rows[row * row_bytes] = 5
    data = _with_idat(good, zlib.compress(bytes(rows)))
    assert read_image_header(data).format == "png"
    with (
        caplog.at_level(logging.DEBUG, logger="llamax.llama_cpp"),
        pytest.raises(ImageError, match="could not be decoded"),
    ):
        projector.decode_image(data)
    if "launching" in caplog.text:  # a build with MTMD_VIDEO, as 0.3.36's wheel is
        assert f"{os.devnull}/ffprobe" in caplog.text
        assert "failed to launch ffprobe" in caplog.text


def test_a_damaged_png_body_is_refused_by_its_crc(projector: Projector) -> None:
    data = bytearray(png(pixels(3)))
    data[60:80] = b"\xff" * 20  # stb_image would decode this into other pixels
    with pytest.raises(ImageError, match="CRC of the b'IDAT' chunk"):
        projector.decode_image(bytes(data))


def encode(projector: Projector, seed: int) -> npt.NDArray[np.float32]:
    (image,) = [c for c in projector.tokenize(projector.marker, [rgb_image(pixels(seed), **LIMITS)])
                if isinstance(c, ImageChunk)]  # fmt: skip
    try:
        return projector.encode(image)
    finally:
        image.release()


def test_different_images_encode_differently_and_the_same_alike(projector: Projector) -> None:
    one, two, again = encode(projector, 1), encode(projector, 2), encode(projector, 1)
    assert one.shape == (16, 576) and one.dtype == np.float32
    assert np.isfinite(one).all()
    assert np.abs(one - two).max() > 0.1
    assert np.array_equal(one, again)


def test_a_released_chunk_cannot_be_encoded(projector: Projector) -> None:
    chunks = projector.tokenize(projector.marker, [rgb_image(pixels(0), **LIMITS)])
    (image,) = [c for c in chunks if isinstance(c, ImageChunk)]
    image.release()
    with pytest.raises(ImageError, match="released"):
        projector.encode(image)


def test_encode_time(projector: Projector, record_property: Any) -> None:
    encode(projector, 0)  # warm
    start = time.perf_counter()
    for seed in range(5):
        encode(projector, seed)
    ms = (time.perf_counter() - start) / 5 * 1e3
    record_property("encode_ms", ms)
    print(f"{projector.path.name}: {ms:.2f} ms per image (tokenize + encode)")


def image_then_text(
    native: Any, projector: Projector, seed: int, *, non_causal: bool | None = None
) -> npt.NDArray[np.float32]:
    """Sequence 1 := "Look:" + image + " What is it?"; the last token's logits."""
    model, context, embd_batch = native
    context.clear()
    C = bindings()
    chunks = projector.tokenize(f"Look: {projector.marker} What is it?",
                                [rgb_image(pixels(seed), **LIMITS)])  # fmt: skip
    batch = NativeBatch(C, 64)
    try:
        pos = 0
        for chunk in chunks:
            if isinstance(chunk, TextChunk):
                n = chunk.n_tokens
                batch.tokens[:n] = chunk.token_ids
                batch.pos[:n] = range(pos, pos + n)
                for i in range(n):
                    batch.seq_rows[i][0] = 1
                batch.logits[:n] = 0
                batch.logits[n - 1] = 1
                batch.set_n_tokens(n)
                assert context.decode(batch) == 0
            else:
                embeddings = projector.encode(chunk)
                causal = chunk.is_non_causal if non_causal is None else non_causal
                status = decode_image(context, embd_batch, 1, embeddings, pos, non_causal=causal)
                assert status == 0
                assert C.llama_get_causal_attn(context.ptr)  # restored after a non-causal decode
                chunk.release()
            pos += chunk.n_pos
        assert context.seq_pos_max(1) == pos - 1
        return context.logits(n - 1, model.n_vocab()).copy()
    finally:
        batch.close()


def test_image_embeddings_then_text_give_logits_that_follow_the_image(
    native: Any, projector: Projector
) -> None:
    one = image_then_text(native, projector, 1)
    two = image_then_text(native, projector, 2)
    again = image_then_text(native, projector, 1)
    assert np.isfinite(one).all()
    assert np.abs(one - two).max() > 1e-3
    assert np.array_equal(one, again)


def test_non_causal_attention_changes_what_the_image_computes(
    native: Any, projector: Projector
) -> None:
    causal = image_then_text(native, projector, 1, non_causal=False)
    non_causal = image_then_text(native, projector, 1, non_causal=True)
    assert np.abs(causal - non_causal).max() > 1e-3


def test_a_non_causal_image_larger_than_a_micro_batch_is_refused(native: Any) -> None:
    """llama.cpp would abort the process (GGML_ASSERT n_ubatch >= n_tokens)."""
    _, context, embd_batch = native
    rows = np.zeros((N_UBATCH + 1, 576), np.float32)
    with pytest.raises(ValueError, match="one micro-batch"):
        decode_image(context, embd_batch, 0, rows, 0, non_causal=True)
    with pytest.raises(ValueError, match="float32"):
        decode_image(context, embd_batch, 0, rows[:4, :100], 0)
