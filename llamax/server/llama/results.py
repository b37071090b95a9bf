"""llama-server's native results, as every native route (``/completion``, ``/infill``)
answers them: a streamed chunk (llama-server's ``server_task_result_cmpl_partial``) and the
last answer of a sequence (``server_task_result_cmpl_final``), with their ``timings``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llamax
from llamax.openai.requests import prompt_progress

from .request import NativeRequest

__all__ = ["Timings", "final_result", "partial_result", "probs_json", "stop_of"]


def stop_of(choice: llamax.Choice, full_text: str, stops: Sequence[str]) -> tuple[str, str]:
    """llama-server's ``stop_type`` and ``stopping_word`` of a finished choice: ``word``
    when a stop string cut the text (``full_text``, the detokenized tokens, goes on with it),
    ``eos`` for an end-of-generation token, ``limit`` for ``n_predict`` or the context."""
    if choice.finish_reason is llamax.FinishReason.LENGTH:
        return "limit", ""
    if choice.finish_reason is llamax.FinishReason.STOP:
        rest = full_text[len(choice.text) :]
        word = next((s for s in sorted(stops, key=len, reverse=True) if rest.startswith(s)), "")
        return ("word", word) if word else ("eos", "")
    return "none", ""


@dataclass(slots=True)
class Timings:
    """One sequence's clock and counts, for llama-server's ``timings`` object."""

    submitted: float
    first_token: float | None = None
    num_prompt: int = 0
    num_cached: int = 0
    """Prompt tokens served from the cache (``cache_n``)."""
    num_predicted: int = 0

    def to_json(self, now: float) -> dict[str, Any]:
        """``timings``: ``cache_n``, ``prompt_n`` (computed), ``predicted_n`` and their
        milliseconds and rates."""
        first = self.first_token if self.first_token is not None else now
        prompt_ms = (first - self.submitted) * 1e3
        predicted_ms = (now - first) * 1e3
        num_prompt = max(self.num_prompt - self.num_cached, 0)
        num_predicted = self.num_predicted
        return {
            "cache_n": self.num_cached,
            "prompt_n": num_prompt,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / num_prompt if num_prompt else 0.0,
            "prompt_per_second": 1e3 * num_prompt / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": self.num_predicted,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / num_predicted if num_predicted else 0.0,
            "predicted_per_second": 1e3 * num_predicted / predicted_ms if predicted_ms > 0 else 0.0,
        }  # fmt: skip


def probs_json(
    logprobs: Sequence[llamax.TokenLogprob], post_sampling: bool = False
) -> list[dict[str, Any]]:
    """``completion_probabilities``: llama-server's ``id``/``token``/``bytes``/``logprob`` and
    ``top_logprobs`` per generated token; with ``post_sampling`` (the probabilities of the
    distribution the sampler chain drew from) ``prob`` and ``top_probs``, as llama-server
    names them there."""
    if post_sampling:
        return [
            {"id": lp.token_id, "token": lp.token, "bytes": list(lp.bytes),
             "prob": math.exp(lp.logprob),
             "top_probs": [{"id": t.token_id, "token": t.token, "bytes": list(t.bytes),
                            "prob": math.exp(t.logprob)} for t in lp.top_logprobs]}
            for lp in logprobs
        ]  # fmt: skip
    return [
        {"id": lp.token_id, "token": lp.token, "bytes": list(lp.bytes), "logprob": lp.logprob,
         "top_logprobs": [{"id": t.token_id, "token": t.token, "bytes": list(t.bytes),
                           "logprob": t.logprob} for t in lp.top_logprobs]}
        for lp in logprobs
    ]  # fmt: skip


def partial_result(
    request: NativeRequest, event: llamax.TokenEvent, *, index: int, id_slot: int,
    timings: Timings, now: float,
) -> dict[str, Any]:  # fmt: skip
    """One streamed event of a sequence (``stop: false``): its text and tokens (always, as
    llama-server sends them), ``timings`` with ``timings_per_token``, its tokens'
    ``completion_probabilities`` with ``n_probs``, and for a progress event (``return_progress``:
    no text, no tokens) ``prompt_progress``."""
    chunk: dict[str, Any] = {
        "index": index, "content": event.text, "tokens": list(event.token_ids), "stop": False,
        "id_slot": id_slot, "tokens_predicted": timings.num_predicted,
        "tokens_evaluated": timings.num_prompt,
    }  # fmt: skip
    if request.timings_per_token:
        chunk["timings"] = timings.to_json(now)
    if event.progress is not None:
        chunk["prompt_progress"] = prompt_progress(event.progress, timings.submitted)
    if request.n_probs and event.logprobs:
        chunk["completion_probabilities"] = probs_json(event.logprobs, request.post_sampling_probs)
    return chunk


def final_result(
    request: NativeRequest, *, index: int, id_slot: int, text: str, token_ids: Sequence[int],
    prompt: str, stop: tuple[str, str], model: str, n_ctx: int, timings: Timings, now: float,
    logprobs: Sequence[llamax.TokenLogprob] | None,
) -> dict[str, Any]:  # fmt: skip
    """The last result of a sequence (``stop: true``); in a stream its ``content`` and
    ``tokens`` are empty (the events carried them). ``tokens_cached`` is what llama-server
    reports there: the tokens its slot holds afterwards (prompt and reply)."""
    stream = request.stream
    result: dict[str, Any] = {
        "index": index,
        "content": "" if stream else text,
        "tokens": list(token_ids) if request.return_tokens and not stream else [],
        "id_slot": id_slot,
        "stop": True,
        "model": model,
        "tokens_predicted": timings.num_predicted,
        "tokens_evaluated": timings.num_prompt,
        "generation_settings": {"n_ctx": n_ctx, "model": model, **request.settings},
        "prompt": prompt,
        "has_new_line": "\n" in text,
        "truncated": False,
        "stop_type": stop[0],
        "stopping_word": stop[1],
        "tokens_cached": timings.num_prompt + timings.num_predicted,
        "timings": timings.to_json(now),
    }
    if request.n_probs and logprobs and not stream:
        result["completion_probabilities"] = probs_json(logprobs, request.post_sampling_probs)
    return _pick(result, request.response_fields) if request.response_fields else result


def _pick(result: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """llama-server's ``response_fields``: the named fields only; ``a/b`` brings ``b`` of
    the object ``a`` up to the top (under the name ``a/b``), a missing one is left out."""
    out: dict[str, Any] = {}
    for name in names:
        value: Any = result
        for part in name.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            out[name] = value
    return out
