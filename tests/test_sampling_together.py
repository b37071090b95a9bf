"""Rows sampled together (``Backend.sample_rows``): when that call fails, only the request
whose own row fails fails; its batch neighbours get their tokens (fake backend)."""

from __future__ import annotations

import pytest

import llamax
from llamax.errors import RequestFailedError
from llamax.testing import FakeBackend, assert_idle


def test_a_failing_row_fails_only_its_own_request(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = FakeBackend(n_ctx=1024, n_seq_max=4, n_batch=64)
    sample = backend.sample

    def faulty(sampler: object, row: int) -> int:
        if getattr(sampler, "params", None) is not None and sampler.params.temperature == 0.7:
            raise RuntimeError("this row's sampler broke")
        return sample(sampler, row)  # type: ignore[arg-type]

    monkeypatch.setattr(backend, "sample", faulty)
    ctx = llamax.Context(backend=backend, autostart=False)
    try:
        params = [
            llamax.SamplingParams(max_tokens=6, temperature=t, seed=1) for t in (0.9, 0.7, 0.8)
        ]
        handles = [ctx.add_request(f"prompt {i}", p) for i, p in enumerate(params)]
        while ctx.has_work():
            ctx.process()
        assert handles[0].result(0).usage.completion_tokens == 6
        assert handles[2].result(0).usage.completion_tokens == 6
        with pytest.raises(RequestFailedError, match="broke"):
            handles[1].result(0)
        assert_idle(ctx)
    finally:
        ctx.close()
