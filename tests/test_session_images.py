"""Sessions with images, on the fake backend (issue 42): a session's turns keep an earlier
image (the same pixels, the same placeholder ids: reused, not decoded again) and compute
only what follows; a kept prefix never ends inside a non-causal image (and on a
sliding-window model stops at the first one, as the prefix cache does); rewind into an
image, fork (across streams too: a deferred copy), save and load (the file holds the
placeholder ids and the projector's identity), a history shift through an image refused,
cancel and faults in the middle of a session's image. Both KV layouts; the fake's
provenance check fails any read of a cell that is not the sequence's own."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from vision_files import pixels, png

import llamax
from llamax.backend.base import BatchItem
from llamax.errors import InvalidParameterError, RequestFailedError, SessionLoadError
from llamax.testing import FakeBackend, assert_idle

Make = Callable[..., tuple[llamax.Context, FakeBackend]]
GREEDY = llamax.SamplingParams(max_tokens=4, temperature=0.0)
N_IMAGE = 10


@pytest.fixture(params=["unified", "streams"])
def kv_layout(request: Any) -> str:
    return str(request.param)


@pytest.fixture(params=[False, True], ids=["causal", "non_causal"])
def non_causal(request: Any) -> bool:
    return bool(request.param)


def image(seed: int) -> llamax.Image:
    return llamax.Image(png(pixels(seed, 4, 5)))


def image_items(backend: FakeBackend, since: int = 0) -> list[BatchItem]:
    steps = backend.decode_log[since:]
    return [item for step in steps for item in step if item.embeddings is not None]


def ids(ctx: llamax.Context, text: str) -> list[int]:
    return ctx.tokenize(text)


def turn1(ctx: llamax.Context, picture: llamax.Image) -> list[int | llamax.Image]:
    return [*ids(ctx, "look: "), picture, *ids(ctx, " what?")]


def then(
    parts: list[int | llamax.Image], out: llamax.Completion, *more: int | llamax.Image
) -> list[int | llamax.Image]:
    """The next turn's whole prompt: the last one, its reply and ``more``."""
    return [*parts, *out.choices[0].token_ids, *more]


def read_file(path: Path) -> tuple[dict[str, Any], bytes]:
    """A session file's header and the KV state after it."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<I", raw[8:12])
    return json.loads(raw[12 : 12 + size]), raw[12 + size :]


def write_file(path: Path, header: dict[str, Any], state: bytes) -> None:
    body = json.dumps(header).encode()
    path.write_bytes(b"LLAMAXS1" + struct.pack("<I", len(body)) + body + state)


def cold(make_fake: Make, parts: list[int | llamax.Image], **options: Any) -> list[int]:
    """The greedy reply of a fresh context to ``parts``, computed whole."""
    ctx, _ = make_fake(**options)
    return ctx.add_request(parts, GREEDY).result().choices[0].token_ids


# ---------------------------------------------------------------------- turns
def test_a_sessions_next_turn_reuses_its_image_and_computes_only_the_rest(
    make_fake: Make, non_causal: bool
) -> None:
    options = {"image_tokens": N_IMAGE, "non_causal_images": non_causal}
    ctx, backend = make_fake(**options)
    picture = image(1)
    with ctx.session() as session:
        first = turn1(ctx, picture)
        out1 = session.add_request(first, GREEDY).result()
        assert out1.usage.prompt_tokens == 6 + N_IMAGE + 6
        assert len(image_items(backend)) == 1  # a non-causal image whole, a causal one too
        held = session.token_ids
        assert held[: len(first) - 1 + N_IMAGE] == tuple(ctx.prompt_token_ids(first))
        assert min(held) < 0  # the image's placeholder ids
        second = then(first, out1, *ids(ctx, " and now? "))
        steps = len(backend.decode_log)
        out2 = session.add_request(second, GREEDY).result()
        assert out2.usage.cached_tokens == len(held)  # the image and the reply kept
        assert not image_items(backend, steps)  # the image is not decoded again
        third = then(second, out2, picture, *ids(ctx, " again?"))  # the same image, later
        held = session.token_ids
        out3 = session.add_request(third, GREEDY).result()
        assert out3.usage.cached_tokens == len(held)
        assert ctx.audit() == []
    assert out3.choices[0].token_ids == cold(make_fake, third, **options)
    assert out2.choices[0].token_ids == cold(make_fake, second, **options)


def test_prompt_token_ids_count_what_a_session_holds(make_fake: Make) -> None:
    ctx, _ = make_fake(image_tokens=N_IMAGE)
    parts = turn1(ctx, image(2))
    assert len(ctx.prompt_token_ids(parts)) == ctx.prompt_positions(parts) == 12 + N_IMAGE
    assert ctx.prompt_token_ids([1, 2, 3]) == [1, 2, 3]
    plain, _ = make_fake()
    with pytest.raises(llamax.ImageError, match="no projector"):
        plain.prompt_token_ids(parts)


# ---------------------------------------------------------------------- rewind, fork
def test_rewind_into_an_image_then_the_next_turn(make_fake: Make, non_causal: bool) -> None:
    """A causal image cut short keeps its first rows (they saw only what came before); a
    non-causal one is computed again whole, from its first position."""
    ctx, backend = make_fake(image_tokens=N_IMAGE, non_causal_images=non_causal)
    picture = image(3)
    with ctx.session() as session:
        first = turn1(ctx, picture)
        session.add_request(first, GREEDY).result()
        session.rewind(len(session.token_ids) - (6 + 4))  # 4 of the image's 10 rows kept
        assert len(session.token_ids) == 10
        steps = len(backend.decode_log)
        out = session.add_request(first, GREEDY).result()
        rows = image_items(backend, steps)
        if non_causal:
            assert out.usage.cached_tokens == 6
            assert [(i.start_pos, len(i.token_ids)) for i in rows] == [(6, N_IMAGE)]
        else:
            assert out.usage.cached_tokens == 10
            assert [(i.start_pos, len(i.token_ids)) for i in rows] == [(10, N_IMAGE - 4)]
        assert ctx.audit() == []
    assert out.choices[0].token_ids == cold(
        make_fake, first, image_tokens=N_IMAGE, non_causal_images=non_causal
    )


def test_a_fork_copies_the_image_and_both_go_on(make_fake: Make, kv_layout: str) -> None:
    """In the streams layout the fork is a whole-stream copy that llama.cpp runs at the next
    decode: here that decode is the fork's own next image (an embeddings decode), and the
    fake fails any read of a stream whose copy has not run."""
    ctx, backend = make_fake(image_tokens=N_IMAGE, non_causal_images=True, n_seq_max=4)
    picture, other = image(4), image(5)
    with ctx.session() as session:
        first = turn1(ctx, picture)
        out1 = session.add_request(first, GREEDY).result()
        with session.fork() as fork:
            assert fork.token_ids == session.token_ids
            # the fork's next position is its new image (the reply's last token, never
            # decoded, left out): the first decode after the copy is an embeddings decode
            held = session.token_ids
            branch = [*first, *out1.choices[0].token_ids[:-1], other, *ids(ctx, " and this?")]
            trunk = then(first, out1, *ids(ctx, " more?"))
            steps = len(backend.decode_log)
            forked = fork.add_request(branch, GREEDY).result()
            (first_decode, *_) = backend.decode_log[steps:]
            assert [item.embeddings is not None for item in first_decode] == [True]
            kept = session.add_request(trunk, GREEDY).result()
            assert forked.usage.cached_tokens == kept.usage.cached_tokens == len(held)
            assert len(image_items(backend, steps)) == 1  # the fork's new image alone
            assert ctx.audit() == []
    assert forked.choices[0].token_ids == cold(
        make_fake, branch, image_tokens=N_IMAGE, non_causal_images=True
    )


# ---------------------------------------------------------------------- save, load
def test_save_and_load_a_session_holding_an_image(
    make_fake: Make, tmp_path: Path, non_causal: bool
) -> None:
    """The file lists the image's placeholder ids (negative: a 10-row image takes 20
    characters an id, more than a header of token ids was allowed) and the projector; a
    load gives the same cells back, and the same image in the next turn is a hit."""
    options = {"image_tokens": 200, "non_causal_images": non_causal, "n_ctx": 256}
    options["n_batch"] = options["n_ubatch"] = 256
    ctx, _ = make_fake(**options)
    picture = image(6)
    path = tmp_path / "s.llamax"
    first = turn1(ctx, picture)
    with ctx.session() as session:
        out1 = session.add_request(first, GREEDY).result()
        session.save(path)
        held = session.token_ids
    header, _ = read_file(path)
    assert header["tokens"] == list(held) and header["projector"] is not None
    second = then(first, out1, *ids(ctx, " and? "))
    fresh, backend = make_fake(**options)
    with fresh.load_session(path) as loaded:
        assert loaded.token_ids == held
        out2 = loaded.add_request(second, GREEDY).result()
        assert out2.usage.cached_tokens == len(held)
        assert not image_items(backend)  # its rows came from the file
        assert fresh.audit() == []
    assert out2.choices[0].token_ids == cold(make_fake, second, **options)


def test_a_session_with_images_loads_only_beside_its_projector(
    make_fake: Make, tmp_path: Path
) -> None:
    ctx, _ = make_fake(image_tokens=N_IMAGE)
    path = tmp_path / "s.llamax"
    with ctx.session() as session:
        session.add_request(turn1(ctx, image(7)), GREEDY).result()
        session.save(path)
    text_only, _ = make_fake()
    with pytest.raises(SessionLoadError, match="no projector"):
        text_only.load_session(path)
    other, _ = make_fake(image_tokens=N_IMAGE, non_causal_images=True)
    with pytest.raises(SessionLoadError, match="another projector"):
        other.load_session(path)
    header, state = read_file(path)
    for token in (header["tokens"][6 + 3], -(1 << 63)):  # mid-image first; not an id
        tokens = [*header["tokens"][:6], token, *header["tokens"][7:]]
        write_file(tmp_path / "bad.llamax", {**header, "tokens": tokens}, state)
        with pytest.raises(SessionLoadError, match="damaged"):
            ctx.load_session(tmp_path / "bad.llamax")
    for c in (ctx, text_only, other):
        assert_idle(c)


# ---------------------------------------------------------------------- shift
def test_a_shift_through_an_image_is_refused_and_a_whole_one_moves(
    make_fake: Make, non_causal: bool
) -> None:
    ctx, _ = make_fake(image_tokens=N_IMAGE, non_causal_images=non_causal)
    head = ids(ctx, "sys. ")
    first = [*head, image(8), *ids(ctx, " one. "), image(9), *ids(ctx, " two?")]
    with ctx.session() as session:
        out = session.add_request(first, GREEDY).result()
        held = session.token_ids
        image_start = len(head)
        for start, end in ((image_start + 2, image_start + 12), (0, image_start + 4)):
            with pytest.raises(InvalidParameterError, match="cuts through the image"):
                session.shift(start, end)
            assert session.token_ids == held  # nothing changed
        # the first image and the text after it, whole: the second image moves back
        removed = N_IMAGE + 6
        assert session.shift(image_start, image_start + removed)
        assert session.token_ids == held[:image_start] + held[image_start + removed :]
        shorter = [*head, *first[len(head) + 1 + 6 :], *out.choices[0].token_ids, *ids(ctx, "?")]
        again = session.add_request(shorter, GREEDY).result()
        assert again.usage.cached_tokens == len(held) - removed  # the moved image kept
        assert ctx.audit() == []
        assert session.shift(3, len(session.token_ids))  # a cut at the end: a rewind


# ---------------------------------------------------------------------- sliding window
def test_on_a_sliding_window_a_sessions_reuse_stops_at_a_non_causal_image(
    make_fake: Make,
) -> None:
    """As the prefix cache does (cut_reuse): its next turn computes the image again."""
    ctx, backend = make_fake(image_tokens=N_IMAGE, non_causal_images=True, sliding_window=64)
    with ctx.session() as session:
        first = turn1(ctx, image(10))
        out1 = session.add_request(first, GREEDY).result()
        steps = len(backend.decode_log)
        out2 = session.add_request(then(first, out1, *ids(ctx, " so?")), GREEDY).result()
        assert out2.usage.cached_tokens == 6
        assert [(i.start_pos, len(i.token_ids)) for i in image_items(backend, steps)] == [
            (6, N_IMAGE)
        ]
        assert ctx.audit() == []


# ---------------------------------------------------------------------- failures
def test_cancel_mid_image_in_a_session_then_go_on(make_fake: Make, non_causal: bool) -> None:
    n = 16 if non_causal else 40
    ctx, backend = make_fake(image_tokens=n, non_causal_images=non_causal, n_batch=16)
    with ctx.session() as session:
        prompt = [*ids(ctx, "x" * 30), *turn1(ctx, image(11))]
        handle = session.add_request(prompt, GREEDY)
        while not image_items(backend):
            ctx.process()
        handle.cancel()
        ctx.process()
        assert handle.result().choices[0].finish_reason == "cancelled"
        held = session.token_ids
        assert 36 < len(held) < 36 + n + 6  # some of the image: all of a non-causal one
        again = session.add_request(prompt, GREEDY)
        while not again.done():
            ctx.process()
        assert again.result().usage.cached_tokens == len(held)
        assert ctx.audit() == []
    assert_idle(ctx)
    assert again.result().choices[0].token_ids == cold(
        make_fake, prompt, image_tokens=n, non_causal_images=non_causal, n_batch=16
    )


@pytest.mark.parametrize("how", ["raise", "status"])
def test_a_failing_image_decode_in_a_session_fails_that_turn_alone(
    make_fake: Make, how: str
) -> None:
    ctx, backend = make_fake(image_tokens=N_IMAGE)

    def fault(where: str) -> object:
        if where == "decode_embeddings":
            backend.fault = None
            if how == "raise":
                raise RuntimeError("boom")
            return -3
        return None

    with ctx.session() as session:
        first = turn1(ctx, image(12))
        backend.fault = fault
        with pytest.raises(RequestFailedError, match="decoding the image failed"):
            session.add_request(first, GREEDY).result()
        assert all(t >= 0 for t in session.token_ids)  # no cell of the failed image kept
        out = session.add_request(first, GREEDY).result()
        assert out.choices[0].token_ids == cold(make_fake, first, image_tokens=N_IMAGE)
        assert ctx.audit() == []


def test_a_failing_encode_in_a_session_fails_at_add_request(make_fake: Make) -> None:
    ctx, backend = make_fake(image_tokens=N_IMAGE)

    def fault(where: str) -> object:
        if where == "encode_image":
            raise RuntimeError("encoder down")
        return None

    with ctx.session() as session:
        backend.fault = fault
        with pytest.raises(RequestFailedError, match="encoding the image failed"):
            session.add_request(turn1(ctx, image(13)), GREEDY)
        backend.fault = None
        assert session.add_request(turn1(ctx, image(13)), GREEDY).result().choices[0].text
