"""``Context.audit()`` reads what a backend can show through the ``Inspectable`` protocol."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

import llamax
from llamax.backend import Inspectable
from llamax.testing import FakeBackend

MakeFake = Callable[..., tuple[llamax.Context, FakeBackend]]
P = llamax.SamplingParams


class OpaqueBackend(FakeBackend):
    """A backend that shows nothing beyond the ``Backend`` protocol, as a third-party one
    may: it is not ``Inspectable``, so it is audited on ``seq_pos_max`` alone."""

    @property
    def num_live_samplers(self) -> int:
        raise AttributeError("num_live_samplers")

    def __getattribute__(self, name: str) -> object:
        if name == "seq_tokens":
            raise AttributeError(name)
        return super().__getattribute__(name)


class SilentBackend(FakeBackend):
    """``Inspectable``, but cannot tell a sequence's tokens (as llama.cpp's backend)."""

    def seq_tokens(self, seq_id: int) -> Sequence[int | None] | None:  # type: ignore[override]
        return None


def _retained_seq(ctx: llamax.Context, backend: FakeBackend) -> int:
    ctx.add_request("abcdef", P(max_tokens=2, temperature=0)).result(60)
    held = [seq_id for seq_id, cells in backend.cells.items() if cells]
    assert held, "the prefix cache retained nothing"
    return held[0]


def test_audit_reports_other_tokens_in_the_kv(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(autostart=True)
    seq_id = _retained_seq(ctx, backend)
    first = backend.cells[seq_id][0]
    backend.cells[seq_id][0] = 250
    assert any("KV holds other tokens" in p for p in ctx.audit())
    backend.cells[seq_id][0] = first
    assert ctx.audit() == []


def test_audit_reports_a_leaked_sampler(make_fake: MakeFake) -> None:
    ctx, backend = make_fake(autostart=True)
    backend.live_samplers.add(-1)
    assert ctx.audit() == ["backend holds 1 samplers, sequences hold 0"]
    backend.live_samplers.discard(-1)


def test_an_opaque_backend_is_audited_on_extents_alone() -> None:
    backend = OpaqueBackend()
    assert not isinstance(backend, Inspectable)
    with llamax.Context(backend=backend) as ctx:
        seq_id = _retained_seq(ctx, backend)
        backend.cells[seq_id][0] = 250  # invisible without seq_tokens
        backend.live_samplers.add(-1)  # invisible without num_live_samplers
        assert ctx.audit() == []
        backend.cells[seq_id].append(7)  # an extent it can see
        assert any("KV holds positions up to" in p for p in ctx.audit())
        backend.cells[seq_id].pop()
        backend.live_samplers.discard(-1)


def test_an_inspectable_backend_may_answer_none(make_fake: MakeFake) -> None:
    backend = SilentBackend()
    assert isinstance(backend, Inspectable)
    with llamax.Context(backend=backend) as ctx:
        seq_id = _retained_seq(ctx, backend)
        backend.cells[seq_id][0] = 250
        assert ctx.audit() == []
        backend.live_samplers.add(-1)
        assert ctx.audit() == ["backend holds 1 samplers, sequences hold 0"]
        backend.live_samplers.discard(-1)


@pytest.mark.parametrize("backend_type", [FakeBackend, SilentBackend])
def test_fake_backends_implement_the_protocol(backend_type: type[FakeBackend]) -> None:
    assert isinstance(backend_type(), Inspectable)
