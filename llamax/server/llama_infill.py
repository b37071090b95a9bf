"""llama-server's ``POST /infill``: fill-in-the-middle code completion, as editor plugins
(llama.vim, llama.vscode) send it.

The prompt is built as llama-server's ``format_prompt_infill`` builds it (the
repository-level pattern of Qwen2.5-Coder, arXiv 2409.12186)::

    [FIM_REP]myproject\\n [FIM_SEP]name\\n extra text ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

with the same budget: at most ``3/4 n_batch`` prefix tokens (the last ones), ``n_batch/4
- 2 - len(prompt)`` suffix tokens (the first ones), and the extra chunks' last tokens
in what is left of the sequence after ``n_batch + 2 n_predict`` (llamax's ``n_batch`` and
the request's ``n_predict``; llama-server takes its own ``-b`` and ``--n-predict``). The
files an editor sends before the cursor come first, so requests over one project share
their prefix, which llamax computes once and copies (``timings.cache_n``), and batches in
the same steps.

A model without FIM prefix, suffix and middle tokens is refused with llama-server's 501.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from typing import Any

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import llamax

from .dialects import sse
from .errors import APIError, llama_body
from .llama_jobs import (
    LlamaError,
    NativeTimings,
    as_llama_error,
    final_json,
    leased,
    llama_error_response,
    partial_json,
    sampling_params,
)
from .llama_slots import Slot, SlotTable, table_of
from .responses import outcome_of
from .schemas import parse_object
from .state import ServerState, read_body

__all__ = ["NativeJob", "infill_routes", "infill_tokens"]

_SNIPPET = "\n\n--- snippet ---\n\n"
"""What separates extra chunks on a model without a file separator token (llama-server's)."""


def _check_body(body: dict[str, Any]) -> None:
    """llama-server's checks of an ``/infill`` body.

    Raises:
        LlamaError: 400 naming the field at fault.
    """
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise LlamaError(400, '"prompt" must be a string')
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise LlamaError(400, f'"{name}" is required')
        if not _is_mixed(body[name]):
            raise LlamaError(400, f'"{name}" must be a string or a list of token ids and strings')
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise LlamaError(400, '"input_extra" must be an array of {"filename": string, "text": '
                         "string}")  # fmt: skip
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise LlamaError(400, 'extra_context chunk must contain a "text" field with a '
                             "string value")  # fmt: skip
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise LlamaError(400, 'extra_context chunk\'s "filename" field must be a string')
    for name in ("stream", "cache_prompt", "return_tokens"):
        if name in body and not isinstance(body[name], bool):
            raise LlamaError(400, f'"{name}" must be a boolean')


def _is_mixed(value: object) -> bool:
    """A string, or a list of token ids and strings (llama-server's "mixed" prompt)."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and all(
        isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)) for v in value
    )


def infill_tokens(
    ctx: llamax.Context,
    prefix: str | Sequence[int | str],
    suffix: str | Sequence[int | str],
    extra: Sequence[dict[str, str]],
    prompt: str,
    *,
    n_predict: int,
) -> list[int]:
    """The FIM prompt's tokens, as llama-server's ``format_prompt_infill`` lays them out
    (see the module's docstring).

    Raises:
        LlamaError: 501 when the model lacks a FIM prefix, suffix or middle token.
        InvalidRequestError: a token id outside the vocabulary.
    """
    fim = ctx.fim_tokens
    if not fim.can_infill:
        missing = "".join(f"{name} token is missing. " for name, t in
                          (("prefix", fim.prefix), ("suffix", fim.suffix),
                           ("middle", fim.middle)) if t is None)  # fmt: skip
        raise LlamaError(501, f"Infill is not supported by this model: {missing}")
    assert fim.prefix is not None and fim.suffix is not None and fim.middle is not None

    def plain(text: str) -> list[int]:
        return ctx.tokenize(text, add_special=False, parse_special=False)

    def mixed(value: str | Sequence[int | str]) -> list[int]:
        parts = [value] if isinstance(value, str) else value
        ids: list[int] = []
        for part in parts:
            ids += plain(part) if isinstance(part, str) else [part]
        bad = [t for t in ids if not 0 <= t < ctx.n_vocab]
        if bad:
            raise llamax.InvalidRequestError(f"token ids outside the vocabulary: {bad[:8]}")
        return ids

    extra_ids: list[int] = []
    if fim.repo is not None:
        extra_ids += [fim.repo, *plain("myproject\n")]
    for chunk in extra:
        if fim.separator is not None:
            extra_ids += [fim.separator, *plain(chunk.get("filename", "tmp") + "\n")]
        else:
            extra_ids += plain(_SNIPPET)
        extra_ids += plain(chunk["text"])
    if fim.separator is not None:
        extra_ids += [fim.separator, *plain("filename\n")]
    prompt_ids = ctx.tokenize(prompt, add_special=False, parse_special=True)
    prefix_ids, suffix_ids = mixed(prefix), mixed(suffix)
    n_batch, n_ctx = ctx.config.n_batch, ctx.n_ctx_seq
    take_prefix = min(len(prefix_ids), 3 * (n_batch // 4))
    take_suffix = min(len(suffix_ids), max(0, n_batch // 4 - (2 + len(prompt_ids))))
    take_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_ids))
    head = ctx.tokenize("", add_special=True)  # BOS, when the vocabulary adds one
    return [
        *extra_ids[len(extra_ids) - take_extra :],
        *head,
        fim.prefix,
        *prefix_ids[len(prefix_ids) - take_prefix :],
        *prompt_ids,
        fim.suffix,
        *suffix_ids[:take_suffix],
        fim.middle,
    ]


def _settings(body: dict[str, Any], params: llamax.SamplingParams) -> dict[str, Any]:
    """llama-server's ``generation_settings`` / a slot's ``params``, from what llamax runs."""
    return {
        "n_predict": -1 if params.max_tokens is None else params.max_tokens,
        "seed": 0xFFFFFFFF if params.seed is None else params.seed,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "typical_p": params.typical_p,
        "repeat_last_n": params.penalty_last_n,
        "repeat_penalty": params.repeat_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "ignore_eos": params.ignore_eos,
        "stop": list(params.stop),
        "stream": bool(body.get("stream", False)),
        "n_probs": 0,
        "cache_prompt": bool(body.get("cache_prompt", True)),
    }


def infill_routes(
    state: ServerState, tables: weakref.WeakKeyDictionary[llamax.Context, SlotTable]
) -> APIRouter:
    """``POST /infill``."""

    def require_key(request: Request) -> None:  # 401 in OpenAI's shape, as every route
        state.check_api_key(request)

    router = APIRouter(dependencies=[Depends(require_key)])

    @router.post("/infill")
    async def infill(request: Request) -> Response:
        stack = AsyncExitStack()
        try:
            raw = await read_body(request, state.max_body_bytes)
            body, params = await run_in_threadpool(_parse, raw, state)
            ctx = await stack.enter_async_context(leased(state, body.get("model")))
            n_predict = -1 if params.max_tokens is None else params.max_tokens
            tokens = await run_in_threadpool(
                infill_tokens, ctx, body["input_prefix"], body["input_suffix"],
                body.get("input_extra", []), body.get("prompt", ""), n_predict=n_predict,
            )  # fmt: skip
            job = await NativeJob.start(
                ctx,
                table_of(tables, ctx),
                body,
                params,
                tokens,
                stack,
                model=body.get("model") or state.model_name(ctx),
            )
        except Exception as exc:
            await stack.aclose()
            error = as_llama_error(exc)
            state.metrics.requests.labels("infill", outcome_of(error.status)).inc()
            return llama_error_response(error)
        state.metrics.requests.labels("infill", "success").inc()
        if body.get("stream"):
            return StreamingResponse(job.stream(), media_type="text/event-stream")
        try:
            return JSONResponse(await job.whole())
        except Exception as exc:
            return llama_error_response(as_llama_error(exc))

    return router


def _parse(raw: bytes, state: ServerState) -> tuple[dict[str, Any], llamax.SamplingParams]:
    body = parse_object(raw)
    _check_body(body)
    params = sampling_params(
        body, default_n_predict=state.default_max_tokens, default_seed=state.default_seed
    )
    return body, params


class NativeJob:
    """One request of llama-server's native API once admitted: its slot, handle and clock,
    and its answer in ``/completion``'s shape (whole or streamed). ``/infill`` builds one;
    ``/completion`` with ``id_slot`` can build one the same way."""

    def __init__(
        self, ctx: llamax.Context, slots: SlotTable, slot: Slot | None, body: dict[str, Any],
        settings: dict[str, Any], tokens: list[int], handle: llamax.RequestHandle,
        stack: AsyncExitStack, model: str,
    ) -> None:  # fmt: skip
        self.ctx, self.slots, self.slot, self.body, self.model = ctx, slots, slot, body, model
        self.settings, self.tokens, self.handle, self.stack = settings, tokens, handle, stack
        self.timings = NativeTimings(start=time.perf_counter())
        self.id_slot = -1 if slot is None else slot.id

    @classmethod
    async def start(
        cls, ctx: llamax.Context, slots: SlotTable, body: dict[str, Any],
        params: llamax.SamplingParams, tokens: list[int], stack: AsyncExitStack, *,
        model: str,
    ) -> NativeJob:  # fmt: skip
        """Take the slot ``body["id_slot"]`` names (waiting while another request holds
        it; ``-1`` or none: any sequence) and submit ``tokens``. What ``stack`` holds (the
        lease on the model, the slot) is given back when the job ends; ``model`` is the
        name the answer gives the model.

        Raises:
            LlamaError: 400 for a bad ``id_slot``, 503 when the slot cannot open its
                sequence; llamax's errors for a prompt it refuses, before anything reaches
                the engine.
        """
        id_slot = body.get("id_slot")
        id_slot = -1 if id_slot is None else id_slot  # null: llama-server's default
        session, slot = None, None
        if id_slot != -1:
            slot = slots.get(id_slot)
            await slot.lock.acquire()
            stack.callback(slot.lock.release)
            try:
                session = slots.session_of(slot)
            except llamax.SessionError as exc:
                raise LlamaError(503, f"slot {slot.id} cannot open its sequence: {exc}") from exc
        else:
            slot = slots.idle()
        settings = _settings(body, params)
        slots.begin(slot, settings, len(tokens))
        stack.callback(SlotTable.end, slot)
        if session is not None:
            handle = session.add_request(tokens, params)
        else:
            handle = ctx.add_request(tokens, params)
        stack.callback(handle.cancel)  # a no-op once it has finished
        return cls(ctx, slots, slot, body, settings, tokens, handle, stack, model)

    async def _events(self) -> AsyncIterator[llamax.TokenEvent]:
        async for event in self.handle:
            if self.timings.first_token is None:
                self.timings.first_token = time.perf_counter()
            self.timings.num_decoded += len(event.token_ids)
            if self.slot is not None and self.slot.task is not None:
                self.slot.task["n_decoded"] = self.timings.num_decoded
            yield event

    async def _final(self, content: str) -> dict[str, Any]:
        result = await self.handle
        self.timings.end = time.perf_counter()
        if self.slot is not None and self.slot.task is not None:
            usage = result.usage
            self.slot.task["n_prompt_tokens_cache"] = usage.cached_tokens
            self.slot.task["n_prompt_tokens_processed"] = usage.prompt_tokens - usage.cached_tokens
        choice = result.choices[0]
        full_text, prompt = await run_in_threadpool(
            lambda: (self.ctx.detokenize(choice.token_ids), self.ctx.detokenize(self.tokens))
        )
        return final_json(
            result, content=content, model=self.model,
            prompt=prompt, id_slot=self.id_slot, settings=self.settings,
            stop_words=tuple(self.settings["stop"]), full_text=full_text,
            timings=self.timings, return_tokens=bool(self.body.get("return_tokens")),
        )  # fmt: skip

    async def whole(self) -> dict[str, Any]:
        """The non-streamed answer."""
        try:
            async for _ in self._events():
                pass
            return await self._final((await self.handle).text)
        finally:
            await self.stack.aclose()

    async def stream(self) -> AsyncIterator[bytes]:
        """``data:`` chunks, one per event, then the final answer (no ``[DONE]``, as
        llama-server's native stream); an error after the start ends it with an
        ``{"error": ...}`` chunk."""
        try:
            num_prompt = len(self.tokens)
            async for event in self._events():
                if event.text or event.token_ids:
                    yield sse(partial_json(
                        event.text, event.token_ids, id_slot=self.id_slot,
                        num_decoded=self.timings.num_decoded, num_prompt=num_prompt,
                        return_tokens=bool(self.body.get("return_tokens")),
                    ))  # fmt: skip
            yield sse(await self._final(""))
        except Exception as exc:
            error: APIError = as_llama_error(exc)
            yield sse(llama_body(error))
        finally:
            await self.stack.aclose()
