"""Logits processors, the batch hook, grammars/JSON schemas and logprobs on the real model.

Everything goes through the public API. Greedy comparisons run the reference batch on the
same kind of context (``prefix_cache=False``, manual loop) so both sides compute the same
tokens in the same layout.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import numpy.typing as npt
import pytest
from openai.types import Completion as OpenAICompletion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import llamax

pytestmark = pytest.mark.model

MakeReal = Callable[..., llamax.Context]
Ids = npt.NDArray[np.int32]
Row = npt.NDArray[np.float32]

TIMEOUT = 240.0
NORMAL_FINISH = {llamax.FinishReason.STOP, llamax.FinishReason.LENGTH}

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
PERSON_REQUEST = [
    {"role": "user", "content": "Invent a person. Reply in JSON with a name, age and color."}
]


def chatml(user: str) -> str:
    """One user turn in ChatML (SmolLM2's format), ready for the assistant's reply."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def drive(ctx: llamax.Context) -> None:
    """Run a manual context until it has nothing left to do."""
    while ctx.has_work():
        ctx.process()


def log_softmax(row: Row) -> npt.NDArray[np.float64]:
    wide = row.astype(np.float64)
    peak = wide.max()
    return wide - (peak + np.log(np.exp(wide - peak).sum()))


@pytest.fixture(scope="module")
def vocab(shared_ctx: llamax.Context) -> list[str]:
    """The text of every token id (special tokens render as nothing)."""
    sizes: list[int] = []

    def measure(token_ids: Ids, logits: Row) -> None:
        sizes.append(logits.shape[0])

    params = llamax.SamplingParams(max_tokens=1, logits_processors=[measure])
    shared_ctx.add_request("Hi", params).result(TIMEOUT)
    return [shared_ctx.detokenize([t]) for t in range(sizes[0])]


# ---------------------------------------------------------------------- processors
def test_banned_tokens_are_never_sampled(real_ctx: llamax.Context, vocab: list[str]) -> None:
    banned = np.array([t for t, text in enumerate(vocab) if "e" in text], dtype=np.int64)
    banned_set = set(banned.tolist())
    assert len(banned) > 1000
    views: list[tuple[Any, ...]] = []

    def ban(token_ids: Ids, logits: Row) -> None:
        flags = logits.flags
        views.append((token_ids.dtype, logits.dtype, logits.shape, flags.writeable, flags.owndata))
        logits[banned] = -np.inf

    def recorder(rows: dict[int, Row]) -> llamax.LogitsProcessor:
        def record(token_ids: Ids, logits: Row) -> None:
            rows[len(token_ids)] = logits.copy()  # after ``ban``: processors run in order

        return record

    prompt = real_ctx.tokenize(chatml("Describe the weather where you live."))
    recorded: list[dict[int, Row]] = [{} for _ in range(4)]
    handles = [
        real_ctx.add_request(
            prompt,
            llamax.SamplingParams(
                max_tokens=16,
                temperature=0.8,
                seed=seed,
                ignore_eos=True,
                logprobs=3,
                logits_processors=[ban, recorder(recorded[seed])],
            ),
        )
        for seed in range(4)
    ]
    for handle, rows in zip(handles, recorded, strict=True):
        done = handle.result(TIMEOUT)
        assert done.finish_reason == "length" and len(done.token_ids) == 16
        assert not banned_set & set(done.token_ids), done.text
        assert "e" not in done.text
        logprobs = done.choices[0].logprobs
        assert logprobs is not None
        for i, (token, lp) in enumerate(zip(done.token_ids, logprobs, strict=True)):
            # logprobs are computed from the row after the processors ran
            expected = log_softmax(rows[len(prompt) + i])
            assert lp.logprob == pytest.approx(expected[token], abs=1e-4)
            assert not banned_set & {t.token_id for t in lp.top_logprobs}
    n_vocab = len(vocab)
    assert views and all(v == (np.int32, np.float32, (n_vocab,), True, False) for v in views), (
        "processors get an int32 history and a writable zero-copy float32 view"
    )


def test_forcing_processor_yields_exactly_its_text(real_ctx: llamax.Context) -> None:
    target_text = " The quick brown fox jumps over the lazy dog."
    target = real_ctx.tokenize(target_text, add_special=False)
    prompt = real_ctx.tokenize(chatml("Say anything."))

    def returning(token_ids: Ids, logits: Row) -> Row:
        out = np.full_like(logits, -np.inf)
        out[target[len(token_ids) - len(prompt)]] = 0.0
        return out

    def in_place(token_ids: Ids, logits: Row) -> None:
        wanted = target[len(token_ids) - len(prompt)]
        keep = logits[wanted]
        logits[:] = -np.inf
        logits[wanted] = keep

    handles = [
        real_ctx.add_request(
            prompt,
            llamax.SamplingParams(
                max_tokens=len(target), temperature=0.8, logprobs=1, logits_processors=[fn]
            ),
        )
        for fn in (returning, in_place)
    ]
    for handle in handles:
        done = handle.result(TIMEOUT)
        assert done.text == target_text
        assert list(done.token_ids) == target
        assert done.finish_reason == "length"
        logprobs = done.choices[0].logprobs
        assert logprobs is not None
        assert all(lp.logprob == pytest.approx(0.0, abs=1e-6) for lp in logprobs)


QUESTIONS = (
    "What is the capital of France?",
    "Name a color.",
    "How many legs does a cat have?",
    "What do bees make?",
    "Say hello in Spanish.",
    "What is two plus two?",
    "Name a planet.",
    "What is ice made of?",
    "Which animal barks?",
    "What color is the sky?",
    "Name a fruit.",
    "What do cows drink?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Name a musical instrument.",
)


def run_batch(
    ctx: llamax.Context, prompts: Sequence[str], *, extra: Any = None, at: int = 0
) -> tuple[list[llamax.Completion], llamax.RequestHandle | None]:
    """Submit ``prompts`` greedily with ``extra`` (prompt, params) inserted at ``at``, all
    before the first step, so they share every decode; return the completions in order."""
    greedy = llamax.SamplingParams(max_tokens=8, temperature=0)
    handles = [ctx.add_request(p, greedy) for p in prompts[:at]]
    other = ctx.add_request(*extra) if extra is not None else None
    handles += [ctx.add_request(p, greedy) for p in prompts[at:]]
    ctx.process()  # one step: every prompt is prefilled and sampled in the same batch
    if other is not None:
        assert other.done(), "the extra request ends at its first sample"
        assert ctx.stats().num_running == len(prompts)
    drive(ctx)
    return [h.result(0) for h in handles], other


@pytest.mark.integration
def test_raising_processor_fails_only_its_request(make_real: MakeReal) -> None:
    """A processor that raises fails its own request; its 7 batch neighbours finish normally.

    Neighbours are compared token for token with two references: the 7 prompts run
    without the faulty one (faulty request submitted last), and the same batch where the
    faulty request is replaced by a well-behaved one that stops at the same step (faulty
    request in the middle). The middle case cannot be compared with the run without it:
    once any neighbour leaves, llama.cpp puts later tokens into the cells it freed, which
    reorders the attention sums of the sequences after it and can flip near-tie tokens.
    Seven neighbours (the faulty row between three and four of them) force the same rows
    as fifteen did. Integration: four batches on a fresh context; the default run keeps
    the one-step form (test_wrong_shape_or_dtype_fails_the_request).
    """
    ctx = make_real(autostart=False, n_ctx=2048, n_seq_max=8, prefix_cache=False)
    prompts = [chatml(q) for q in QUESTIONS[:7]]
    boom = RuntimeError("bug in a user processor")
    calls: list[int] = []

    def explode(token_ids: Ids, logits: Row) -> None:
        calls.append(len(token_ids))
        raise boom

    faulty_prompt = ctx.tokenize(chatml("Tell me a joke."))
    faulty = (faulty_prompt, llamax.SamplingParams(temperature=0, logits_processors=[explode]))
    stops_at_once = (faulty_prompt, llamax.SamplingParams(max_tokens=1, temperature=0))

    alone, _ = run_batch(ctx, prompts)
    mid_reference, _ = run_batch(ctx, prompts, extra=stops_at_once, at=3)
    for at, reference in ((len(prompts), alone), (3, mid_reference)):
        calls.clear()
        neighbours, handle = run_batch(ctx, prompts, extra=faulty, at=at)
        assert handle is not None
        with pytest.raises(llamax.RequestFailedError, match="bug in a user processor") as info:
            handle.result(0)
        assert info.value.__cause__ is boom
        assert calls == [len(faulty_prompt)]
        with pytest.raises(llamax.RequestFailedError):
            list(handle)
        for done, expected in zip(neighbours, reference, strict=True):
            assert done.finish_reason in NORMAL_FINISH
            assert (done.text, done.token_ids) == (expected.text, expected.token_ids), at


BAD_RETURNS: dict[str, Callable[[Ids, Row], Any]] = {
    "shorter": lambda ids, logits: logits[:-1].copy(),
    "2-d": lambda ids, logits: logits.reshape(1, -1).copy(),
    "float64": lambda ids, logits: logits.astype(np.float64),
    "float16": lambda ids, logits: logits.astype(np.float16),
    "list": lambda ids, logits: logits.tolist(),
    "scalar": lambda ids, logits: 0.0,
}


@pytest.mark.parametrize("bad", BAD_RETURNS.values(), ids=BAD_RETURNS.keys())
def test_wrong_shape_or_dtype_fails_the_request(real_ctx: llamax.Context, bad: Any) -> None:
    prompt = chatml("Count to five.")
    params = llamax.SamplingParams(max_tokens=4, temperature=0)
    faulty = real_ctx.add_request(prompt, llamax.SamplingParams(logits_processors=[bad]))
    neighbour = real_ctx.add_request(prompt, params)
    with pytest.raises(llamax.RequestFailedError, match="must return None or a float32 array"):
        faulty.result(TIMEOUT)
    assert neighbour.result(TIMEOUT).finish_reason in NORMAL_FINISH


# ---------------------------------------------------------------------- batch hook
def test_batch_hook_sees_every_row_and_its_edits_apply(make_real: MakeReal) -> None:
    calls: list[tuple[Any, ...]] = []
    state: dict[str, Any] = {"ban": [], "force": {}}

    def hook(rows: Sequence[llamax.LogitsRow], logits: Row) -> None:
        described = [(r.request_id, len(r.token_ids)) for r in rows]
        flags = logits.flags
        calls.append((logits.shape, logits.dtype, flags.writeable, flags.owndata, described))
        logits[:, state["ban"]] = -np.inf  # vectorised: one edit for every sequence
        for i, row in enumerate(rows):
            if row.request_id in state["force"]:
                logits[i, state["force"][row.request_id]] = 1e4

    ctx = make_real(
        autostart=False, n_ctx=1024, n_seq_max=4, prefix_cache=False, batch_logits_processor=hook
    )
    greedy = llamax.SamplingParams(max_tokens=8, temperature=0)
    prompts = [chatml("What is the capital of France?"), chatml("Name three colors.")]
    prompt_lens = [len(ctx.tokenize(p)) for p in prompts]

    before = [ctx.add_request(p, greedy, request_id=f"before-{i}") for i, p in enumerate(prompts)]
    drive(ctx)
    assert calls, "the hook runs even when it changes nothing"
    n_vocab = calls[0][0][1]
    first_step = calls[0][4]
    assert first_step == [("before-0", prompt_lens[0]), ("before-1", prompt_lens[1])]
    for shape, dtype, writeable, owndata, rows in calls:
        assert shape == (len(rows), n_vocab) and dtype == np.float32
        assert writeable and not owndata, "a writable zero-copy view"
    produced = {t for h in before for t in h.result(0).token_ids}

    forced = ctx.tokenize(" llama", add_special=False)[-1]
    state["ban"] = sorted(produced)
    state["force"] = {"forced": forced}
    num_before = len(calls)
    free = [ctx.add_request(prompts[0], greedy, request_id="free-0")]
    pinned = ctx.add_request(prompts[0], greedy, request_id="forced")  # the middle row
    free.append(ctx.add_request(prompts[1], greedy, request_id="free-1"))
    drive(ctx)
    assert [r for r, _ in calls[num_before][4]] == ["free-0", "forced", "free-1"]
    for handle in free:
        assert not produced & set(handle.result(0).token_ids)
    assert pinned.result(0).token_ids == (forced,) * 8


# ---------------------------------------------------------------------- grammars
@pytest.mark.integration
def test_json_schema_output_matches_the_schema(real_ctx: llamax.Context) -> None:
    prompt = real_ctx.chat_prompt(PERSON_REQUEST)
    handles = [
        real_ctx.add_request(
            prompt,
            llamax.SamplingParams(
                max_tokens=96, temperature=0.8, seed=seed, json_schema=PERSON_SCHEMA
            ),
        )
        for seed in range(6)
    ]
    for handle in handles:
        done = handle.result(TIMEOUT)
        assert done.finish_reason == "stop", done.text
        jsonschema.validate(json.loads(done.text), PERSON_SCHEMA)


def test_json_schema_integer_bounds_are_enforced(real_ctx: llamax.Context) -> None:
    # Integer ranges become grammar rules, as in llama.cpp's converter (issue 44): every
    # sampled age is in range, however hot the sampling.
    bounded = {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "exclusiveMaximum": 31}},
        "required": ["age"],
    }
    prompt = real_ctx.chat_prompt([{"role": "user", "content": "Reply in JSON with an age."}])
    handles = [
        real_ctx.add_request(
            prompt,
            llamax.SamplingParams(max_tokens=24, temperature=1.5, seed=seed, json_schema=bounded),
        )
        for seed in range(6)
    ]
    for handle in handles:
        done = handle.result(TIMEOUT)
        assert done.finish_reason == "stop", done.text
        assert 18 <= json.loads(done.text)["age"] <= 30, done.text


def test_json_schema_number_bounds_and_multiples_are_enforced(real_ctx: llamax.Context) -> None:
    # Bounds on a number and multipleOf become grammar rules too (issue 44): pydantic's
    # Field(gt=0, lt=1), Field(ge=-2.5, le=1e3) and a multiple of 0.5 under hot sampling.
    bounded = {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            "offset": {"type": "number", "minimum": -2.5, "maximum": 1e3},
            "step": {"type": "number", "multipleOf": 0.5, "minimum": -3, "exclusiveMaximum": 7},
        },
        "required": ["ratio", "offset", "step"],
    }
    prompt = real_ctx.chat_prompt(
        [{"role": "user", "content": "Reply in JSON with a ratio, an offset and a step."}]
    )
    handles = [
        real_ctx.add_request(
            prompt,
            llamax.SamplingParams(max_tokens=80, temperature=1.2, seed=seed, json_schema=bounded),
        )
        for seed in range(3)
    ]
    for handle in handles:
        done = handle.result(TIMEOUT)
        assert done.finish_reason == "stop", done.text
        value = json.loads(done.text, parse_float=Decimal)
        assert 0 < value["ratio"] < 1 and -2.5 <= value["offset"] <= 1000, done.text
        assert -3 <= value["step"] < 7 and value["step"] % Decimal("0.5") == 0, done.text
        plain = json.loads(done.text)  # as a client reading doubles sees them
        assert 0 < plain["ratio"] < 1 and -2.5 <= plain["offset"] <= 1000, done.text


def test_json_schema_keeps_the_property_order(real_ctx: llamax.Context) -> None:
    schema = {**PERSON_SCHEMA, "properties": dict(reversed(PERSON_SCHEMA["properties"].items()))}
    params = llamax.SamplingParams(max_tokens=96, temperature=0, json_schema=schema)
    done = real_ctx.add_request(real_ctx.chat_prompt(PERSON_REQUEST), params).result(TIMEOUT)
    assert list(json.loads(done.text)) == ["color", "age", "name"], done.text


@pytest.mark.integration
def test_chat_response_format_gives_json(real_ctx: llamax.Context) -> None:
    formats: list[dict[str, Any]] = [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": PERSON_SCHEMA}},
        {"type": "json_object"},
    ]
    for response_format in formats:
        response = real_ctx.chat_completion(
            PERSON_REQUEST, response_format=response_format, temperature=0, max_tokens=96
        )
        choice = ChatCompletion.model_validate(response).choices[0]
        assert choice.finish_reason == "stop"
        value = json.loads(choice.message.content or "")
        assert isinstance(value, dict)
        if response_format["type"] == "json_schema":
            jsonschema.validate(value, PERSON_SCHEMA)


BAD_GRAMMARS = (
    'root ::= "unterminated',
    "root ::= undefined-rule",
    'item ::= "no root rule"',
    'root ::= root "a"',
    "root ::= [a-",
    'root ::= ("a"',
    'root := "a"',
    'root ::= "\\q"',
    'root ::= "a"{999999999999}',
)


def test_invalid_grammar_is_refused_at_submission(real_ctx: llamax.Context) -> None:
    prompt = chatml("Answer yes or no: is water wet?")
    for grammar in BAD_GRAMMARS:
        with pytest.raises(llamax.GrammarError):
            real_ctx.add_request(prompt, llamax.SamplingParams(grammar=grammar))
    for schema in ({"type": "no-such-type"}, {"$ref": "#/definitions/missing"}):
        with pytest.raises(llamax.GrammarError):
            real_ctx.add_request(prompt, llamax.SamplingParams(json_schema=schema))
    with pytest.raises(llamax.GrammarError):
        real_ctx.chat_completion(
            [{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
        )
    params = llamax.SamplingParams(max_tokens=8, temperature=0.8, grammar='root ::= "yes" | "no"')
    answers = [real_ctx.add_request(prompt, params) for _ in range(2)]
    assert all(h.result(TIMEOUT).text in ("yes", "no") for h in answers)


_DEAD_END_SCRIPT = """
import resource
import sys
import numpy as np
import llamax

model, case, memory_cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (memory_cap, memory_cap))
prompt = "<|im_start|>user\\nSay yes.<|im_end|>\\n<|im_start|>assistant\\n"

def ban_all(token_ids, logits):
    logits[:] = -np.inf

params = {
    "control": dict(grammar='root ::= "yes" | "no"'),
    "unsatisfiable": dict(grammar="root ::= [b-a]"),
    "min-above-max": dict(grammar='root ::= "a"{2,1}'),
    "ignore-eos": dict(grammar='root ::= "yes"', ignore_eos=True),
    "processor-bans-all": dict(grammar='root ::= "yes"', logits_processors=[ban_all]),
}[case]
with llamax.Context(model, n_ctx=256, n_seq_max=2, autostart=False) as ctx:
    try:
        handle = ctx.add_request(prompt, llamax.SamplingParams(max_tokens=6, **params))
        while ctx.has_work():
            ctx.process()
        print("OUTCOME", handle.result(0).finish_reason)
    except llamax.LlamaxError as exc:
        print("OUTCOME", type(exc).__name__)
    handle = ctx.add_request(prompt, llamax.SamplingParams(max_tokens=2, temperature=0))
    while ctx.has_work():
        ctx.process()
    print("SERVING", len(handle.result(0).token_ids))
# VmHWM belongs to this process's own address space; ru_maxrss can carry the parent's peak
# across fork and exec, which made this check measure pytest instead of the child.
with open("/proc/self/status") as status:
    hwm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
print("PEAK_MIB", hwm_kib // 1024)
"""


@pytest.mark.integration
@pytest.mark.parametrize(
    "case", ["control", "unsatisfiable", "min-above-max", "ignore-eos", "processor-bans-all"]
)
def test_grammar_dead_ends_never_crash_or_hang(model_path: Path, case: str) -> None:
    """A grammar that admits no token must end in a Python error, never a native abort.

    Each case runs in a child process (address space capped at 1 GiB) so that an abort, a
    hang or a runaway allocation cannot take pytest or the machine down. ``control`` is a
    well-formed grammar that checks the harness itself. Integration: each case is a process
    that loads its own model.
    """
    script = textwrap.dedent(_DEAD_END_SCRIPT)
    try:
        child = subprocess.run(
            [sys.executable, "-c", script, str(model_path), case, str(1 << 30)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: the process hung")
    tail = child.stderr.strip().splitlines()[-3:]
    assert child.returncode == 0, f"{case}: exit status {child.returncode}: {tail}"
    assert "OUTCOME" in child.stdout and "SERVING 2" in child.stdout, child.stdout
    peak_mib = int(child.stdout.split("PEAK_MIB")[1])
    assert peak_mib < 512, f"{case}: the child grew to {peak_mib} MiB"


# ---------------------------------------------------------------------- logprobs
def check_greedy_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[llamax.TokenLogprob]
) -> None:
    assert len(logprobs) == len(token_ids)
    for token, lp in zip(token_ids, logprobs, strict=True):
        assert lp.token_id == token == lp.top_logprobs[0].token_id
        assert lp.logprob == pytest.approx(lp.top_logprobs[0].logprob, abs=1e-6)
        values = [t.logprob for t in lp.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-6
        assert all(v <= 0 for v in values)


def test_greedy_logprobs_and_streamed_events(real_ctx: llamax.Context) -> None:
    params = llamax.SamplingParams(max_tokens=16, temperature=0, logprobs=5)
    handle = real_ctx.add_request(chatml("Name three fruits."), params)
    events = list(handle)
    done = handle.result(TIMEOUT)
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and len(done.token_ids) > 0
    check_greedy_logprobs(done.token_ids, logprobs)
    assert real_ctx.detokenize(done.token_ids) == "".join(lp.token for lp in logprobs)
    for event in events:
        assert len(event.logprobs) == len(event.token_ids)
    assert [lp for e in events for lp in e.logprobs] == list(logprobs)


def test_logprobs_after_sampling_are_the_native_chains_distribution(
    real_ctx: llamax.Context,
) -> None:
    """``logprobs_after_sampling`` reads back the candidates llama.cpp's chain kept and the
    probabilities its ``dist`` sampler gave them: top-k 3 leaves at most 3, summing to 1;
    the tokens drawn are those the plain chain draws with the same seed; greedy is the
    token alone with probability 1."""
    prompt = chatml("Name a colour.")

    def sample(after: bool, **options: Any) -> llamax.Completion:
        params = llamax.SamplingParams(max_tokens=12, logprobs=10, seed=11,
                                       logprobs_after_sampling=after, **options)  # fmt: skip
        return real_ctx.add_request(prompt, params).result(TIMEOUT)

    plain, after = sample(False, temperature=1.0), sample(True, temperature=1.0)
    assert after.token_ids == plain.token_ids and after.logprobs is not None
    for token, lp in zip(after.token_ids, after.logprobs, strict=True):
        assert lp.token_id == token and -math.inf < lp.logprob <= 0
        probs = [math.exp(t.logprob) for t in lp.top_logprobs]
        assert probs == sorted(probs, reverse=True) and all(0 < p <= 1 for p in probs)
        assert sum(probs) <= 1 + 1e-5
        if len(probs) < 10:  # fewer than asked only when they are all the chain kept
            assert sum(probs) == pytest.approx(1.0, abs=1e-4)
    top3 = sample(True, temperature=1.0, top_k=3)
    assert top3.logprobs is not None
    for lp in top3.logprobs:
        assert 1 <= len(lp.top_logprobs) <= 3
        total = sum(math.exp(t.logprob) for t in lp.top_logprobs)
        assert total == pytest.approx(1.0, abs=1e-4)
        assert lp.token_id in [t.token_id for t in lp.top_logprobs]
    greedy = sample(True, temperature=0, repeat_penalty=1.1)  # greedy through a chain
    assert greedy.logprobs is not None
    assert all(lp.logprob == 0.0 and len(lp.top_logprobs) == 1 for lp in greedy.logprobs)


def test_openai_logprobs_validate(real_ctx: llamax.Context) -> None:
    messages = [{"role": "user", "content": "Name three fruits."}]
    response = real_ctx.chat_completion(
        messages, logprobs=True, top_logprobs=3, temperature=0, max_tokens=12
    )
    chat = ChatCompletion.model_validate(response)
    content = chat.choices[0].logprobs and chat.choices[0].logprobs.content
    assert chat.usage is not None and content is not None
    assert len(content) == chat.usage.completion_tokens > 0
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.token == entry.top_logprobs[0].token

    text = OpenAICompletion.model_validate(
        real_ctx.completion(chatml("Name a fruit."), logprobs=3, temperature=0, max_tokens=8)
    )
    lp = text.choices[0].logprobs
    assert text.usage is not None and lp is not None and lp.tokens and lp.top_logprobs
    assert len(lp.tokens) == text.usage.completion_tokens
    assert all(len(alternatives) == 3 for alternatives in lp.top_logprobs)


def test_chat_stream_carries_every_token_logprob(real_ctx: llamax.Context) -> None:
    """Tokens that end inside a multi-byte character have no text yet; their logprobs must
    still reach the stream (emoji are split over several byte tokens)."""
    chunks = [
        ChatCompletionChunk.model_validate(c)
        for c in real_ctx.chat_completion(
            [{"role": "user", "content": "Reply with three emoji."}],
            logprobs=True,
            top_logprobs=1,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    ]
    streamed = [
        t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content or ()
    ]
    assert chunks[-1].usage is not None
    assert len(streamed) == chunks[-1].usage.completion_tokens
