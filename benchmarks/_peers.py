"""The peers llamax is measured against: llama-cpp-python's ``Llama`` and llama.cpp's
``llama-server`` (over HTTP; build it with ``benchmarks/peers.sh``).

Both generate greedily with the end-of-generation tokens banned or ignored, so every
request makes exactly ``max_tokens`` tokens, as the llamax runs do.
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import llama_cpp
from _common import N_THREADS, log
from _loops import eog_token_ids
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

__all__ = [
    "LlamaCppPythonPeer",
    "LlamaServerPeer",
    "PeerCompletion",
    "PeerTokens",
    "default_llama_server",
]


@dataclass(frozen=True)
class PeerCompletion:
    """One completion of a peer."""

    ttft_s: float
    text: str
    prefill_tokens: int  # prompt tokens evaluated (Llama reuses its previous prompt's prefix)
    generated_tokens: int


@dataclass(frozen=True)
class PeerTokens:
    """One greedy generation of a peer, as token ids, and what its eval calls did."""

    token_ids: tuple[int, ...]
    first_token_at: float  # time.perf_counter() when the first token came
    drafted_tokens: int  # draft tokens evaluated for verification (0 without a draft model)
    accepted_tokens: int  # of those, the ones kept: generated tokens minus decode calls


class LlamaCppPythonPeer:
    """``llama_cpp.Llama``, one request after another; counts the tokens given to eval.

    ``draft_tokens`` attaches llama-cpp-python's prompt-lookup drafter
    (``LlamaPromptLookupDecoding(max_ngram_size=ngram_max, num_pred_tokens=draft_tokens)``);
    ``Llama`` then keeps the logits of every position, as its speculation needs (passing
    ``logits_all=True`` too: llama-cpp-python 0.3.36 sizes its ``scores`` array from that
    argument alone, and a draft past ``n_batch`` positions would not fit).
    """

    def __init__(
        self, model_path: Path, n_ctx: int, *, draft_tokens: int | None = None, ngram_max: int = 2
    ) -> None:
        draft = (
            None
            if draft_tokens is None
            else LlamaPromptLookupDecoding(max_ngram_size=ngram_max, num_pred_tokens=draft_tokens)
        )
        self.llm = llama_cpp.Llama(
            str(model_path),
            n_ctx=n_ctx,
            n_threads=N_THREADS,
            n_threads_batch=N_THREADS,
            draft_model=draft,
            logits_all=draft is not None,  # else its scores array has only n_batch rows
            verbose=False,
        )
        self.eog = frozenset(eog_token_ids(self.llm._model.vocab))
        self.logit_bias = dict.fromkeys(self.eog, float("-inf"))
        self.eval_calls: list[int] = []
        original = self.llm.eval

        def counting_eval(tokens: Sequence[int]) -> None:
            self.eval_calls.append(len(tokens))  # the prompt suffix first, then 1 per token
            original(tokens)

        self.llm.eval = counting_eval  # type: ignore[method-assign]

    def reset(self) -> None:
        """Forget the evaluated tokens (no prompt-prefix reuse with the next request)."""
        self.llm.reset()  # type: ignore[no-untyped-call]

    def complete(self, prompt: str, max_tokens: int, start: float) -> PeerCompletion:
        """One streamed greedy completion with the EOG tokens banned; TTFT from ``start``."""
        first_call = len(self.eval_calls)
        ttft: float | None = None
        pieces = []
        stream = self.llm.create_completion(
            prompt, max_tokens=max_tokens, temperature=0.0, logit_bias=self.logit_bias, stream=True
        )
        for chunk in cast(Iterator[Any], stream):  # stream=True: chunks, not one response
            if ttft is None:
                ttft = time.perf_counter() - start
            pieces.append(chunk["choices"][0]["text"])
        if ttft is None:
            raise RuntimeError("the completion produced no chunk")
        calls = self.eval_calls[first_call:]
        # The prompt's eval yields token 1, each later eval one more token.
        return PeerCompletion(ttft, "".join(pieces), calls[0] if calls else 0, len(calls))

    def generate_ids(self, prompt: str, max_tokens: int, *, ban_eog: bool = False) -> PeerTokens:
        """Greedy tokens of ``Llama.generate`` until an end-of-generation token (not kept)
        or ``max_tokens``, or exactly ``max_tokens`` with ``ban_eog``; the prompt is
        tokenized as llamax does (BOS, special tokens)."""
        self.reset()
        first_call = len(self.eval_calls)
        prompt_ids = self.llm.tokenize(prompt.encode(), add_bos=True, special=True)
        banned = sorted(self.eog)

        def ban(_ids: Any, scores: Any) -> Any:
            scores[banned] = float("-inf")
            return scores

        processors = llama_cpp.LogitsProcessorList([ban]) if ban_eog else None
        out: list[int] = []
        first_token_at = 0.0
        tokens = self.llm.generate(
            prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0, logits_processor=processors
        )
        for token in tokens:
            first_token_at = first_token_at or time.perf_counter()
            if token in self.eog:
                break
            out.append(token)
            if len(out) == max_tokens:
                break
        decodes = self.eval_calls[first_call + 1 :]  # after the prompt: [token, *draft] each
        drafted = sum(n - 1 for n in decodes)
        # Every decode yields its first token plus the accepted drafts (the last decode's
        # drafts may be cut off by the stop; they count as rejected here).
        accepted = max(0, len(out) - 1 - len(decodes))
        return PeerTokens(tuple(out), first_token_at, drafted, accepted)

    def close(self) -> None:
        """Free the model."""
        self.llm.set_cache(None)
        self.llm.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServerPeer:
    """A ``llama-server`` process on 127.0.0.1, driven over its native ``/completion``.

    Started with ``-m MODEL -np N -c N_CTX -t 2`` (so ``N`` slots of ``N_CTX / N`` cells in
    per-slot KV streams, llama-server's layout when ``-np`` is given) and ``extra_args``.
    Requests set ``ignore_eos`` and ``cache_prompt`` (default false: no reuse of a slot's
    previous prompt, nor of ``--cache-ram``'s stored prompts).
    """

    def __init__(
        self,
        binary: Path,
        model_path: Path,
        *,
        n_parallel: int,
        n_ctx: int = 8192,
        extra_args: Sequence[str] = (),
        cache_prompt: bool = False,
    ) -> None:
        self.port = free_port()
        self.cache_prompt = cache_prompt
        self.argv = [
            str(binary), "-m", str(model_path), "-np", str(n_parallel), "-c", str(n_ctx),
            "-t", str(N_THREADS), "--host", "127.0.0.1", "--port", str(self.port), *extra_args,
        ]  # fmt: skip
        self.log_file = tempfile.NamedTemporaryFile(  # noqa: SIM115  # closed in close()
            prefix="llama-server-", suffix=".log", delete=False
        )
        log(f"starting {' '.join(self.argv)} (log: {self.log_file.name})")
        self.process = subprocess.Popen(
            self.argv, stdout=self.log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            self._wait_healthy(timeout=120.0)
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.process.returncode}); see log")
            try:
                status, _ = self._request("GET", "/health", None)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("llama-server did not become healthy")

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request(method, path, json.dumps(body) if body else None)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def _body(
        self,
        prompt: str | dict[str, Any],
        max_tokens: int,
        stream: bool,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The request body: greedy unless ``extra`` sets the sampling fields."""
        return (
            {"temperature": 0.0}
            | (extra or {})
            | {
                "prompt": prompt,
                "n_predict": max_tokens,
                "ignore_eos": True,
                "cache_prompt": self.cache_prompt,
                "stream": stream,
            }
        )

    def props(self) -> dict[str, Any]:
        """``GET /props`` (``media_marker``: where a prompt string's images go)."""
        status, data = self._request("GET", "/props", None)
        if status != 200:
            raise RuntimeError(f"llama-server answered {status}: {data[:200]!r}")
        return dict(json.loads(data))

    def complete(self, prompt: str, max_tokens: int, extra: dict[str, Any] | None = None) -> int:
        """One completion, not streamed (greedy unless ``extra`` sets sampling fields);
        returns the number of generated tokens."""
        body = self._body(prompt, max_tokens, False, extra)
        status, data = self._request("POST", "/completion", body)
        if status != 200:
            raise RuntimeError(f"llama-server answered {status}: {data[:200]!r}")
        return int(json.loads(data)["tokens_predicted"])

    def stream(
        self,
        prompt: str,
        max_tokens: int,
        stop: threading.Event | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Iterator[str]:
        """One streamed greedy completion: yields each token's text as it arrives.

        Setting ``stop`` ends the stream at the next token and closes the connection, which
        makes llama-server cancel the request. ``extra`` adds body fields (``lora`` ...).
        llama-server sends no event for a token whose text it holds back (not whole UTF-8,
        or maybe a stop string), so count tokens with :meth:`stream_progress`.
        """
        for event in self._events(prompt, max_tokens, stop, extra):
            text = str(event.get("content", ""))
            if not event.get("stop") or text:  # a closing event may carry text
                yield text

    def stream_progress(
        self, prompt: str | dict[str, Any], max_tokens: int, extra: dict[str, Any] | None = None
    ) -> Iterator[int]:
        """One streamed greedy completion: yields, at each event, how many tokens it has
        generated so far (``tokens_predicted``), the last time at the closing event. The
        prompt may be one of llama-server's prompt objects (``multimodal_data``)."""
        for event in self._events(prompt, max_tokens, None, extra):
            yield int(event.get("tokens_predicted", 0))

    def _events(
        self,
        prompt: str | dict[str, Any],
        max_tokens: int,
        stop: threading.Event | None,
        extra: dict[str, Any] | None,
    ) -> Iterator[dict[str, Any]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            body = self._body(prompt, max_tokens, True, extra)
            conn.request("POST", "/completion", json.dumps(body))
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"llama-server answered {response.status}")
            for line in response:
                if stop is not None and stop.is_set():
                    return
                if line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    yield event
                    if event.get("stop"):
                        return
        finally:
            conn.close()

    def run_batch(
        self,
        prompts: Sequence[str],
        max_tokens: int,
        extra: Callable[[int], dict[str, Any]] | None = None,
    ) -> int:
        """Every prompt at once, one client thread each (prompt ``i`` with the body fields
        ``extra(i)``); returns the generated tokens."""
        counts = [0] * len(prompts)
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                counts[i] = self.complete(prompts[i], max_tokens, extra(i) if extra else None)
            except BaseException as exc:  # re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return sum(counts)

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and close its log."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log_file.close()


def default_llama_server() -> Path | None:
    """The binary peers.sh built for this machine, if any (or ``llama-server`` on PATH)."""
    cache = Path.home() / ".cache" / "llamax" / "llama-server"
    built = sorted(cache.glob("*/llama-server"))
    if built:
        return built[0]
    found = shutil.which("llama-server")
    return Path(found) if found else None
