"""The server's API dialects on plain values: stream framing, error shapes, usage counts."""

from __future__ import annotations

import json
from typing import Any

from llamax.server.dialects import ANTHROPIC, OPENAI, RESPONSES, StreamMeter
from llamax.server.errors import APIError
from llamax.server.metrics import ServerMetrics, TokenClock


class Recorder(ServerMetrics):
    """Metrics that also keep every usage they were asked to record."""

    def __init__(self) -> None:
        super().__init__(lambda: None)
        self.usages: list[Any] = []

    def record_usage(self, usage: Any) -> None:
        self.usages.append(usage)
        super().record_usage(usage)


def meter(include_usage: bool = False) -> tuple[StreamMeter, Recorder]:
    metrics = Recorder()
    return StreamMeter(metrics, TokenClock(metrics, 0.0), include_usage), metrics


def parsed(frame: bytes | None) -> tuple[str | None, Any]:
    assert frame is not None
    lines = frame.decode().strip().split("\n")
    event = lines[0].removeprefix("event: ") if lines[0].startswith("event: ") else None
    return event, json.loads(lines[-1].removeprefix("data: "))


def test_openai_sends_data_chunks_ends_with_done_and_hides_an_unasked_usage_chunk() -> None:
    m, metrics = meter(include_usage=False)
    chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    assert parsed(OPENAI.frame(chunk, m)) == (None, chunk)
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    assert OPENAI.frame({"choices": [], "usage": usage}, m) is None  # counted, not sent
    assert metrics.usages == [usage]
    shown, _ = meter(include_usage=True)
    assert OPENAI.frame({"choices": [], "usage": usage}, shown) is not None
    assert OPENAI.done == b"data: [DONE]\n\n"


def test_anthropic_and_responses_send_named_events_without_done() -> None:
    m, metrics = meter()
    event = {"type": "message_delta", "usage": {"input_tokens": 2, "output_tokens": 5,
                                                "cache_read_input_tokens": 4}}  # fmt: skip
    assert parsed(ANTHROPIC.frame(event, m)) == ("message_delta", event)
    done = {"type": "response.completed", "sequence_number": 6,
            "response": {"usage": {"input_tokens": 6, "output_tokens": 5,
                                   "input_tokens_details": {"cached_tokens": 4}}}}  # fmt: skip
    assert parsed(RESPONSES.frame(done, m))[0] == "response.completed"
    assert m.num_events == 7
    # both count the same six prompt tokens, four of them cached: Anthropic's input_tokens
    # leave the cached ones out, the Responses API's count them
    expected = {"prompt_tokens": 6, "completion_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    assert metrics.usages == [expected, expected]
    assert ANTHROPIC.done == RESPONSES.done == b""


def test_each_dialect_shapes_its_errors() -> None:
    error = APIError(400, "bad field", param="x", code="invalid_value")
    assert OPENAI.error_body(error) == RESPONSES.error_body(error) == error.body()
    body = ANTHROPIC.error_body(error)
    assert body == {"type": "error", "error": {"type": "invalid_request_error",
                                               "message": "bad field"}}  # fmt: skip
    assert ANTHROPIC.error_response(error).status_code == 400
    m, _ = meter()
    m.num_events = 9
    assert parsed(OPENAI.error_event(error, m)) == (None, error.body())
    assert parsed(ANTHROPIC.error_event(error, m)) == ("error", body)
    event, data = parsed(RESPONSES.error_event(error, m))
    assert event == "error" and data["sequence_number"] == 9 and data["code"] == "invalid_value"
