"""The checks a LoRA adapter GGUF passes before llama.cpp loads it (issue 36, item 4), on
small adapters written with the ``gguf`` package (no model needed): tensor types llama.cpp
cannot multiply, NaN or infinite weights and alphas, metadata of another type than
llama.cpp reads, and headers that lie. tests/test_model_lora.py loads the same kinds of
file into a real context."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from llamax.backend.gguf_file import read_header
from llamax.backend.lora_file import check_lora_file

gguf = pytest.importorskip("gguf")

Writer = Callable[..., Path]


@pytest.fixture
def write(tmp_path: Path) -> Writer:
    """Write an adapter with two lora pairs (``blk.0.attn_q`` f32, ``blk.0.attn_v`` as
    given) and return its path."""

    def write_adapter(
        v_a: npt.NDArray[np.generic] | None = None,
        *,
        alpha: object = 16.0,
        raw_dtype: object = None,
        extra: Callable[[object], None] | None = None,
    ) -> Path:
        path = tmp_path / "adapter.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_string("general.type", "adapter")
        writer.add_string("adapter.type", "lora")
        if isinstance(alpha, float):
            writer.add_float32("adapter.lora.alpha", alpha)
        elif alpha is not None:
            writer.add_uint32("adapter.lora.alpha", alpha)  # type: ignore[arg-type]
        if extra is not None:
            extra(writer)
        rng = np.random.default_rng(0)
        writer.add_tensor("blk.0.attn_q.weight.lora_a", rng.standard_normal((8, 64)).astype("f4"))
        writer.add_tensor("blk.0.attn_q.weight.lora_b", rng.standard_normal((64, 8)).astype("f4"))
        if v_a is None:
            v_a = rng.standard_normal((8, 64)).astype("f4")
        writer.add_tensor("blk.0.attn_v.weight.lora_a", v_a, raw_dtype=raw_dtype)
        writer.add_tensor("blk.0.attn_v.weight.lora_b", rng.standard_normal((64, 8)).astype("f2"))
        writer.add_tensor("blk.0.attn_norm.weight", np.full(64, np.nan, "f4"))  # not read
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    return write_adapter


def _with_nan(dtype: str) -> npt.NDArray[np.generic]:
    values = np.ones((8, 64), dtype)
    values[3, 5] = np.nan
    return values


def test_a_well_formed_adapter_passes(write: Writer) -> None:
    path = write()
    check_lora_file(path)
    header = read_header(path)
    assert [t.type_name for t in header.tensors] == ["F32", "F32", "F32", "F16", "F32"]
    assert header.tensors[0].shape == (64, 8)  # ggml order: the fastest dimension first
    assert header.metadata["adapter.lora.alpha"] == (6, 16.0)


@pytest.mark.parametrize(
    ("values", "type_name"),
    [
        (np.ones((8, 64), np.int8), "I8"),
        (np.ones((8, 64), np.int16), "I16"),
        (np.ones((8, 64), np.int32), "I32"),
        (np.ones((8, 64), np.float64), "F64"),
    ],
)
def test_a_tensor_type_llama_cpp_cannot_multiply_is_refused(
    write: Writer, values: npt.NDArray[np.generic], type_name: str
) -> None:
    path = write(values)
    with pytest.raises(ValueError, match=rf"'blk.0.attn_v.weight.lora_a' is {type_name}; a LoRA"):
        check_lora_file(path)


@pytest.mark.parametrize("dtype", ["f4", "f2"])
def test_nan_and_infinite_weights_are_refused(write: Writer, dtype: str) -> None:
    with pytest.raises(ValueError, match=r"'blk.0.attn_v.weight.lora_a' holds NaN"):
        check_lora_file(write(_with_nan(dtype)))
    values = np.ones((8, 64), dtype)
    values[-1, -1] = -np.inf
    with pytest.raises(ValueError, match=r"'blk.0.attn_v.weight.lora_a' holds NaN or infinite"):
        check_lora_file(write(values))


def test_bf16_weights_are_scanned(write: Writer) -> None:
    bf16 = gguf.GGMLQuantizationType.BF16
    check_lora_file(write(gguf.quants.quantize(np.ones((8, 64), "f4"), bf16), raw_dtype=bf16))
    with pytest.raises(ValueError, match="holds NaN"):
        check_lora_file(write(gguf.quants.quantize(_with_nan("f4"), bf16), raw_dtype=bf16))


# (type, bytes of a block, offset of an f16 scale in it): see ggml-common.h
BLOCKS = [("Q4_0", 18, 0), ("Q4_1", 20, 2), ("Q5_0", 22, 0), ("Q5_1", 24, 2), ("Q8_0", 34, 0)]
K_BLOCKS = [("Q2_K", 84, 82), ("Q3_K", 110, 108), ("Q4_K", 144, 0), ("Q5_K", 176, 2)]


@pytest.mark.parametrize(("name", "size", "scale"), [*BLOCKS, *K_BLOCKS, ("Q6_K", 210, 208)])
def test_quantized_weights_have_every_block_scale_scanned(
    write: Writer, name: str, size: int, scale: int
) -> None:
    kind = getattr(gguf.GGMLQuantizationType, name)
    values = np.random.default_rng(1).standard_normal((8, 512)).astype("f4")
    try:
        blocks = gguf.quants.quantize(values, kind)
    except NotImplementedError:  # gguf-py quantizes only some K types: write the bytes
        blocks = np.zeros((8, 2 * size), np.uint8)
    check_lora_file(write(blocks, raw_dtype=kind))
    nan = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    blocks[5, size + scale : size + scale + 2] = nan  # the second block of row 5
    with pytest.raises(ValueError, match=r"'blk.0.attn_v.weight.lora_a' holds NaN"):
        check_lora_file(write(blocks, raw_dtype=kind))


def test_a_type_whose_values_are_not_checked_is_refused(write: Writer) -> None:
    iq4_nl = gguf.GGMLQuantizationType.IQ4_NL
    path = write(np.zeros((8, 18 * 8), np.uint8), raw_dtype=iq4_nl)
    with pytest.raises(ValueError, match="is IQ4_NL; a LoRA tensor must be one of F32, F16, BF16"):
        check_lora_file(path)


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_alpha_is_refused(write: Writer, alpha: float) -> None:
    with pytest.raises(ValueError, match=r"'adapter.lora.alpha' is -?(nan|inf)"):
        check_lora_file(write(alpha=alpha))


def test_metadata_of_another_type_than_llama_cpp_reads_is_refused(write: Writer) -> None:
    # llama.cpp asserts the type it reads (GGML_ASSERT): the process would abort
    with pytest.raises(ValueError, match=r"'adapter.lora.alpha' is not an f32"):
        check_lora_file(write(alpha=16))
    check_lora_file(write(alpha=None))  # absent: llama.cpp reads 0 (the scale alone)

    def general_type_is_an_int(writer: object) -> None:
        writer.add_uint32("general.type", 3)  # type: ignore[attr-defined]

    path = write(extra=general_type_is_an_int)
    with pytest.raises(ValueError, match=r"'general.type' is not a string"):
        check_lora_file(path)


def test_headers_that_lie_are_refused_without_reading_past_the_end(
    write: Writer, tmp_path: Path
) -> None:
    path = write()
    data = path.read_bytes()
    header = read_header(path)
    v_b = header.data_offset + header.tensors[3].offset  # blk.0.attn_v.weight.lora_b
    lying = tmp_path / "lying.gguf"
    cases = {
        b"GGUF" + b"\0" * 64: "GGUF version 0",
        b"not gguf": "no GGUF magic",
        data[:100]: "truncated",
        data[:8] + (1 << 60).to_bytes(8, "little") + data[16:]: "tensor count",
        data[: v_b + 10]: "'blk.0.attn_v.weight.lora_b' runs past the end of the file",
    }
    for content, match in cases.items():
        lying.write_bytes(content)
        with pytest.raises(ValueError, match=match):
            check_lora_file(lying)
