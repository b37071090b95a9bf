"""RequestHandle as a state machine, without an engine: events in, future settled,
streams consumed once, cancel wiring, and the waits that must raise instead of hanging."""

from __future__ import annotations

import asyncio
import threading

import pytest

import llamax
from llamax.results import Choice, Completion, FinishReason, TokenEvent, Usage


def completion(text: str = "ab") -> Completion:
    choice = Choice(0, text, (1, 2), FinishReason.STOP)
    return Completion("req-1", (choice,), Usage(3, 2))


def bound(*, check_wait: object = None) -> tuple[llamax.RequestHandle, list[str]]:
    handle = llamax.RequestHandle("req-1")
    calls: list[str] = []

    def refuse() -> None:
        raise llamax.DeadlockError("on the loop thread")

    handle._bind(
        lambda: calls.append("cancel"), check_wait=refuse if check_wait else (lambda: None)
    )
    return handle, calls


def test_events_then_result_and_the_stream_ends() -> None:
    handle, _ = bound()
    handle._publish([TokenEvent("a", (1,)), TokenEvent("b", (2,), 0, FinishReason.STOP)])
    handle.future.set_result(completion())
    assert handle.done() and handle.result(0).text == "ab"
    assert "".join(e.text for e in handle) == "ab"
    with pytest.raises(RuntimeError, match="already being consumed"):
        iter(handle)
    assert not handle.cancel()  # over already


def test_cancel_goes_to_the_engine_until_the_request_is_done() -> None:
    handle, calls = bound()
    assert handle.cancel() and calls == ["cancel"]
    assert handle.future.cancel()  # cancelling the future itself also reaches the engine
    assert calls == ["cancel", "cancel"]
    with pytest.raises(Exception, match="cancelled"):
        list(handle)


def test_a_failed_request_raises_from_result_and_stream() -> None:
    handle, _ = bound()
    handle._publish([TokenEvent("x", (5,))])
    handle.future.set_exception(llamax.RequestFailedError("boom"))
    with pytest.raises(llamax.RequestFailedError):
        handle.result(0)
    events = []
    with pytest.raises(llamax.RequestFailedError):
        for event in handle:
            events.append(event.text)
    assert events == ["x"]


def test_waits_that_can_never_end_raise_but_finished_requests_read_fine() -> None:
    handle, _ = bound(check_wait=True)
    with pytest.raises(llamax.DeadlockError):
        handle.result()
    with pytest.raises(llamax.DeadlockError):
        list(handle)
    other, _ = bound(check_wait=True)
    other.future.set_result(completion())
    assert other.result().text == "ab" and [e.text for e in other] == []


def test_late_async_consumer_gets_buffered_events_from_another_thread() -> None:
    handle, _ = bound()
    handle._publish([TokenEvent("a", (1,))])

    async def consume() -> str:
        texts = []
        producer = threading.Timer(
            0.01,
            lambda: (
                handle._publish([TokenEvent("b", (2,), 0, FinishReason.STOP)]),
                handle.future.set_result(completion()),
            ),
        )
        producer.start()
        async for event in handle:
            texts.append(event.text)
        return "".join(texts) + "|" + (await handle).text

    assert asyncio.run(consume()) == "ab|ab"


def test_manual_driving_runs_steps_until_done() -> None:
    handle = llamax.RequestHandle("req-1")
    steps = []

    def drive() -> bool:
        steps.append(1)
        if len(steps) == 3:
            handle._publish([TokenEvent("ab", (1, 2), 0, FinishReason.STOP)])
            handle.future.set_result(completion())
        return True

    handle._bind(lambda: None, check_wait=lambda: None, drive=drive)
    assert handle.result(60).text == "ab" and len(steps) == 3
