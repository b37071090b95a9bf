"""A multimodal projector (``mmproj`` GGUF) loaded with llama.cpp's ``mtmd`` for a loaded
text model: it decodes image files, tokenizes prompts of text and images into chunks, and
encodes an image chunk into embeddings for the text model.

Threads: :meth:`Projector.decode_image` and :meth:`Projector.tokenize` read only the
projector's settings and the model's vocabulary, so any thread may call them while the
engine decodes (llama-server tokenizes in its HTTP threads too). :meth:`Projector.encode`
runs the vision encoder into the projector's one output buffer: one caller at a time
(the engine's loop, or one encoder thread); it never touches the text model's context.

Native lifetime: :meth:`Projector.close` frees the ``mtmd_context``, which reads the text
model, so its owner closes it before the model. Image chunks own their native memory and
may outlive the projector (:class:`~llamax.backend.vision.chunks.ImageChunk`).
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ...errors import ContextClosedError, ImageError, InvalidRequestError, ProjectorError
from ..gguf_file import read_header
from ..native import NativeModel, bindings, utf8
from .chunks import ImageChunk, MediaPrompt, RgbImage, TextChunk, pixel_id
from .decode_budget import DECODE_BUDGET, decode_bytes
from .image_file import ImageHeader, check_image

__all__ = ["MAX_IMAGE_PIXELS", "MAX_IMAGE_SIDE", "NativeChunk", "Projector", "mtmd_bindings"]

MAX_IMAGE_SIDE = 8192
"""Default limit on an image's width and height, in pixels."""
MAX_IMAGE_PIXELS = 4096 * 4096
"""Default limit on an image's area (48 MiB of RGB)."""
_CHUNK_TEXT, _CHUNK_IMAGE = 0, 1
# mtmd's helper hands bytes stb_image cannot read to ffprobe/ffmpeg as a video (this
# wheel is built with MTMD_VIDEO). The image header is checked first (image_file.py), and
# the helper's ffmpeg directory is the null device: "/dev/null/ffprobe" can never exist
# (a directory under /tmp could be planted by another user), so a body stb_image refuses
# fails there instead of reaching a subprocess.
_NO_FFMPEG_DIR = os.devnull


def mtmd_bindings() -> Any:
    """llama-cpp-python's ``mtmd`` bindings, with ``mtmd``'s log routed to ``logging``
    like llama.cpp's (:func:`~llamax.backend.native.bindings`).

    Raises:
        ProjectorError: the installed llama-cpp-python has no ``mtmd`` library.
    """
    C = bindings()
    try:
        import llama_cpp.mtmd_cpp as M
    except (ImportError, OSError) as exc:  # pragma: no cover - depends on the build
        raise ProjectorError(f"llama-cpp-python was built without mtmd: {exc}") from exc
    if not getattr(mtmd_bindings, "routed", False):
        M.mtmd_log_set(bindings.log_callback, ctypes.c_void_p(0))  # type: ignore[attr-defined]
        M.mtmd_helper_log_set(bindings.log_callback, ctypes.c_void_p(0))  # type: ignore[attr-defined]
        mtmd_bindings.routed = True  # type: ignore[attr-defined]
    del C
    return M


def _check_projector_file(path: Path, n_embd: int) -> None:
    """What llamax can tell from the header, with a clearer message than mtmd's log."""
    if not path.is_file():
        raise ProjectorError(f"projector file not found: {path}")
    try:
        header = read_header(path)
    except (OSError, ValueError) as exc:
        raise ProjectorError(f"{path} is not a GGUF projector file: {exc}") from None
    arch = header.metadata.get("general.architecture", (0, None))[1]
    if arch != "clip":
        raise ProjectorError(
            f"{path} is not a multimodal projector (its architecture is {arch!r}, not "
            "'clip'): pass the model's mmproj GGUF"
        )
    width = header.metadata.get("clip.vision.projection_dim", (0, None))[1]
    if isinstance(width, int) and width and width != n_embd:
        raise ProjectorError(
            f"the projector {path} writes embeddings {width} wide, but the model's are "
            f"{n_embd}: it belongs to another model"
        )


class NativeChunk:
    """An owned ``mtmd_input_chunk``: freed by :meth:`close`, or when collected."""

    __slots__ = ("__weakref__", "_free", "ptr")

    def __init__(self, M: Any, ptr: Any) -> None:
        if not ptr:
            raise ImageError("mtmd could not copy an image chunk")
        self.ptr = ptr
        self._free = weakref.finalize(self, M.mtmd_input_chunk_free, ptr)

    def close(self) -> None:
        """``mtmd_input_chunk_free``; idempotent."""
        self.ptr = None
        self._free()


class Projector:
    """An ``mtmd_context``: one projector for one loaded text model."""

    __slots__ = ("M", "n_embd", "path", "ptr")

    def __init__(self, M: Any, ptr: Any, path: Path, n_embd: int) -> None:
        self.M, self.ptr, self.path, self.n_embd = M, ptr, path, n_embd

    @classmethod
    def load(
        cls,
        model: NativeModel,
        path: str | os.PathLike[str],
        *,
        n_threads: int,
        use_gpu: bool = False,
        warmup: bool = True,
    ) -> Projector:
        """``mtmd_init_from_file`` for ``model``; ``warmup`` runs one image through the
        encoder now, so the first request does not pay for the graph's allocation.

        Raises:
            ProjectorError: the file is missing, not a projector, unfit for ``model`` (its
                width, or M-RoPE positions, which llamax does not lay out yet), or ``mtmd``
                refused it (``verbose=True`` shows llama.cpp's reason).
        """
        path = Path(path)
        n_embd = model.n_embd()
        _check_projector_file(path, n_embd)
        M = mtmd_bindings()
        params = M.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = warmup
        ptr = M.mtmd_init_from_file(os.fsencode(path), model.ptr, params)
        if not ptr:
            raise ProjectorError(
                f"llama.cpp's mtmd could not load the projector {path} for this model "
                "(another model's projector, or an unsupported one; verbose=True shows why)"
            )
        projector = cls(M, ptr, path, n_embd)
        if projector.uses_mrope:
            projector.close()
            raise ProjectorError(
                f"the projector {path} needs M-RoPE positions, which llamax does not support yet"
            )
        return projector

    def close(self) -> None:
        """``mtmd_free``; idempotent. Before the model is freed."""
        ptr, self.ptr = self.ptr, None
        if ptr is not None:
            self.M.mtmd_free(ptr)

    def _live(self) -> Any:
        if self.ptr is None:
            raise ContextClosedError("the projector has been freed")
        return self.ptr

    @property
    def supports_vision(self) -> bool:
        """Whether it encodes images."""
        return bool(self.M.mtmd_support_vision(self._live()))

    @property
    def supports_audio(self) -> bool:
        """Whether it encodes audio (llamax sends it none yet)."""
        return bool(self.M.mtmd_support_audio(self._live()))

    @property
    def marker(self) -> str:
        """The text that stands for one image in a prompt given to :meth:`tokenize`."""
        return bytes(self.M.mtmd_get_marker(self._live())).decode()

    @property
    def uses_non_causal(self) -> bool:
        """Whether image embeddings are decoded with non-causal attention (Gemma 3)."""
        return bool(self.M.mtmd_decode_use_non_causal(self._live(), None))

    @property
    def uses_mrope(self) -> bool:
        """Whether image positions are M-RoPE's 2-D ones (Qwen-VL); :meth:`load` refuses."""
        return bool(self.M.mtmd_decode_use_mrope(self._live()))

    def decode_image(
        self,
        data: bytes,
        *,
        max_side: int = MAX_IMAGE_SIDE,
        max_pixels: int = MAX_IMAGE_PIXELS,
    ) -> RgbImage:
        """Decode a PNG, JPEG, GIF or BMP file's bytes with ``mtmd``'s decoder (stb_image),
        after its header and pixel data are checked
        (:func:`~llamax.backend.vision.image_file.check_image`), holding its peak bytes
        from the process's decode budget (:mod:`~llamax.backend.vision.decode_budget`).

        Raises:
            ImageError: not such a file, a damaged or truncated one, or over the limits.
        """
        header = check_image(data, max_side=max_side, max_pixels=max_pixels)
        with DECODE_BUDGET.held(decode_bytes(header)):
            return self._decode_checked(data, header)

    def _decode_checked(self, data: bytes, header: ImageHeader) -> RgbImage:
        M = self.M
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        opt = M.mtmd_helper_init_opt_default()
        opt.video_params.ffmpeg_bin_dir = _NO_FFMPEG_DIR.encode()
        wrapper = M.mtmd_helper_bitmap_init_from_buf_wrapper(
            self._live(), buf, len(data), False, opt
        )
        if wrapper.video_ctx:
            M.mtmd_helper_video_free(wrapper.video_ctx)
        bitmap = wrapper.bitmap
        if not bitmap:
            raise ImageError(f"the {header.format} image could not be decoded (damaged?)")
        try:
            if M.mtmd_bitmap_is_audio(bitmap):
                raise ImageError("the bytes are audio, not an image")
            width, height = M.mtmd_bitmap_get_nx(bitmap), M.mtmd_bitmap_get_ny(bitmap)
            if (width, height) != (header.width, header.height):
                raise ImageError(
                    f"the {header.format} header says {header.width}x{header.height}, "
                    f"its pixels are {width}x{height}"
                )
            pixels = ctypes.string_at(M.mtmd_bitmap_get_data(bitmap), width * height * 3)
        finally:
            M.mtmd_bitmap_free(bitmap)
        return RgbImage(width, height, pixels, pixel_id(width, height, pixels))

    def tokenize(
        self,
        text: str,
        images: Sequence[RgbImage],
        *,
        add_special: bool = True,
        parse_special: bool = True,
    ) -> MediaPrompt:
        """Split ``text`` at each :attr:`marker` and put ``images`` there, in order:
        ``mtmd_tokenize`` into text chunks (token ids) and image chunks (preprocessed,
        ready for :meth:`encode`).

        Raises:
            InvalidRequestError: the markers and the images differ in number, or ``text``
                is not valid Unicode.
            ImageError: ``mtmd`` could not preprocess an image.
        """
        M, ctx = self.M, self._live()
        data = utf8(text)
        n_markers = text.count(self.marker)  # mtmd says 1 for this, and returns 2 (0.3.36)
        if n_markers != len(images):
            raise InvalidRequestError(
                f"the prompt has {n_markers} image markers ({self.marker!r}) "
                f"for {len(images)} images"
            )
        bitmaps = (M.mtmd_bitmap_p_ctypes * max(1, len(images)))()
        try:
            for i, image in enumerate(images):
                pixels = (ctypes.c_uint8 * len(image.pixels)).from_buffer_copy(image.pixels)
                bitmaps[i] = M.mtmd_bitmap_init(image.width, image.height, pixels)
                M.mtmd_bitmap_set_id(bitmaps[i], image.image_id.encode())
            inp = M.mtmd_input_text()
            inp.text, inp.text_len = data, len(data)
            inp.add_special, inp.parse_special = add_special, parse_special
            chunks = M.mtmd_input_chunks_init()
            try:
                status = M.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), bitmaps, len(images))
                if status != 0:
                    raise ImageError(f"mtmd could not preprocess the images (status {status})")
                return tuple(self._chunk(M.mtmd_input_chunks_get(chunks, i))
                             for i in range(M.mtmd_input_chunks_size(chunks)))  # fmt: skip
            finally:
                M.mtmd_input_chunks_free(chunks)
        finally:
            for bitmap in bitmaps:
                if bitmap:
                    M.mtmd_bitmap_free(bitmap)

    def _chunk(self, ptr: Any) -> TextChunk | ImageChunk:
        M = self.M
        kind = M.mtmd_input_chunk_get_type(ptr)
        if kind == _CHUNK_TEXT:
            n = ctypes.c_size_t()
            tokens = M.mtmd_input_chunk_get_tokens_text(ptr, ctypes.byref(n))
            return TextChunk(tuple(tokens[: n.value]))
        if kind != _CHUNK_IMAGE:
            raise ImageError(f"mtmd made a chunk of type {kind}, not text or image")
        return ImageChunk(
            image_id=bytes(M.mtmd_input_chunk_get_id(ptr) or b"").decode(),
            n_tokens=int(M.mtmd_input_chunk_get_n_tokens(ptr)),
            n_pos=int(M.mtmd_input_chunk_get_n_pos(ptr)),
            is_non_causal=bool(M.mtmd_decode_use_non_causal(self._live(), ptr)),
            native=NativeChunk(M, M.mtmd_input_chunk_copy(ptr)),
        )

    def encode(self, chunk: ImageChunk) -> npt.NDArray[np.float32]:
        """Run the vision encoder and projector on ``chunk``: its embeddings, a new
        ``(n_tokens, n_embd)`` float32 array. One caller at a time.

        Raises:
            ImageError: the chunk has been released.
            RuntimeError: ``mtmd_encode_chunk`` failed (the message has its status).
        """
        M, ctx = self.M, self._live()
        native = chunk.native.ptr if chunk.native is not None else None
        if not native:
            raise ImageError("the image chunk has been released; tokenize the prompt again")
        status = M.mtmd_encode_chunk(ctx, native)
        if status != 0:
            raise RuntimeError(f"mtmd_encode_chunk failed with status {status}")
        out = M.mtmd_get_output_embd(ctx)
        return np.ctypeslib.as_array(out, shape=(chunk.n_tokens, self.n_embd)).copy()
