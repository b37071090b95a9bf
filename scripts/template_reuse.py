"""How much of the previous request's KV each chat template lets the next request reuse.

An agent (or any chat client) resends the whole conversation every turn. The KV cache of
the previous request holds its rendered prompt and the reply as the model wrote it; the
next request's prompt reuses that KV up to the first token that differs, and recomputes
everything after. A template that renders earlier turns differently from how they were
first rendered or written (thinking dropped from past assistant turns, a tool call
re-serialized, a generation prompt that history does not repeat) caps the reuse there.

This plays three conversations turn by turn on each template, with llamax's own template
engine and llamax's own tool rendering (:func:`llamax.tools.render_tool_prompt`, which
picks the template's native tool format or llamax's fallback, as ``chat_completion``
does), and prints, per turn, how much of the previous request's KV is a prefix of the next
prompt, where the first difference is and why:

* ``plain``: system, user, answer, user, answer, user (``enable_thinking=False``).
* ``think``: a reply with thinking (stored back as ``reasoning_content``, as llamax's
  ``Chat`` and its OpenAI replies do), then another user turn.
* ``tools``: a tool call, its result, an answer, another user turn; the call's
  ``arguments`` as SmolLM2-135M wrote them under llamax's tool grammar
  (``{ "location": "Paris", "unit": "celsius"}``: the grammar lets a space in).
* ``tools-canonical``: the same with ``arguments`` spaced as ``json.dumps`` writes them.
* ``think-tools``: ``tools`` with thinking before the call and before the answer (an
  agent's loop on a thinking model).

"The reply as the model wrote it" is an approximation, per family of generation format:

* every reply's answer is the plain text after the generation prompt; where the
  generation prompt leaves a ``<think>`` block open (QwQ, DeepSeek-R1 distills, Qwen3.5,
  MiniMax-M2...) the model first writes the thought (``R\\n</think>\\n\\nA``; in ``plain``
  an empty thought: ``</think>\\n\\nA``);
* a thinking reply on a template that knows ``<think>`` and does not open it is
  ``<think>\\nR\\n</think>\\n\\nA`` (Qwen3, SmolLM3, MiniCPM); on gpt-oss (Harmony)
  ``<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>final<|message|>A``;
  templates with neither get no ``think`` conversation;
* a tool call is llamax's Hermes markup, what its tool grammar forces on every model:
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``;
* the end-of-turn token the model samples last is not in the KV (it is sampled, never
  decoded), so a turn that reuses everything stops right before it.

Characters are always counted. Tokens are counted where a tokenizer of the family is at
hand: ``--vocab-dir`` (llama.cpp's ``models/`` folder, with its ``ggml-vocab-*.gguf``
vocabularies: qwen2, qwen35, llama-bpe, phi-3, gemma-4) and ``--smollm2-gguf`` (SmolLM2's
model, for its template). Qwen2's vocabulary lacks Qwen3's ``<think>`` tokens, so Qwen3's
counts are a few tokens off.

Usage::

    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/sdist
    tar xzf /tmp/sdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/sdist
    python scripts/template_reuse.py \\
        /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates \\
        --vocab-dir /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/models \\
        --smollm2-gguf "$(python -c 'import llamax; print(llamax.default_model_path())')"

``--all`` plays every ``*.jinja`` in the folder (default: a curated list of common ones),
``--json FILE`` writes every turn's numbers, ``--markdown`` prints the summary table the
docs carry (docs/kv-cache.md, "Templates that re-render earlier turns").
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llamax.templates import ChatTemplate, TemplateError, validate_messages
from llamax.templates.binding import END_OF_TURN_MARKERS
from llamax.tools import prepare_tools, template_supports_tools
from llamax.tools.prompt import fallback_messages, native_messages

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = REPO / "tests" / "data" / "smollm2_chat_template.jinja"

CURATED = (
    "Qwen-Qwen3-0.6B",
    "Qwen3.5-4B",
    "Qwen3-Coder",
    "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-QwQ-32B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-V3.1",
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "meta-llama-Llama-3.3-70B-Instruct",
    "mistralai-Mistral-Nemo-Instruct-2407",
    "Mistral-Small-3.2-24B-Instruct-2506",
    "unsloth-mistral-Devstral-Small-2507",
    "mistralai-Ministral-3-14B-Reasoning-2512",
    "google-gemma-2-2b-it",
    "google-gemma-4-31B-it",
    "openai-gpt-oss-120b",
    "HuggingFaceTB-SmolLM3-3B",
    "microsoft-Phi-3.5-mini-instruct",
    "ibm-granite-granite-3.3-2B-Instruct",
    "GLM-4.6",
    "moonshotai-Kimi-K2",
)
"""The templates played by default (file names without ``.jinja``), SmolLM2's besides."""

VOCABS = (  # (substring of the template's name, vocabulary file in --vocab-dir)
    ("Qwen3.5", "ggml-vocab-qwen35.gguf"),
    ("Qwen", "ggml-vocab-qwen2.gguf"),
    ("QwQ", "ggml-vocab-qwen2.gguf"),
    ("R1-Distill-Qwen", "ggml-vocab-qwen2.gguf"),
    ("R1-Distill-Llama", "ggml-vocab-llama-bpe.gguf"),
    ("meta-llama", "ggml-vocab-llama-bpe.gguf"),
    ("Hermes", "ggml-vocab-llama-bpe.gguf"),
    ("SmolLM3", "ggml-vocab-llama-bpe.gguf"),
    ("Phi-3", "ggml-vocab-phi-3.gguf"),
    ("gemma-4", "ggml-vocab-gemma-4.gguf"),
)

BOS_EOS = (  # (substring of the source, bos_token, eos_token) the template sees
    ("<|begin_of_text|>", "<|begin_of_text|>", "<|eot_id|>"),
    # DeepSeek's markers, written with fullwidth bars (U+FF5C) and U+2581
    (
        "<\uff5cAssistant\uff5c>",
        "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
    ),
    ("<start_of_turn>", "<bos>", "<eos>"),
    ("<|turn>", "<bos>", "<eos>"),
    ("<|im_start|>", "", "<|im_end|>"),
    ("[INST]", "<s>", "</s>"),
)

SYSTEM = "You are a concise assistant. Answer in one sentence."
USERS = ("What is the capital of France?", "And of Italy?", "Thanks. And of Spain?")
ANSWERS = ("Paris.", "Rome.", "Madrid.")
THOUGHTS = ("The user asks for France's capital.", "Now Italy's capital.", "Spain's.")
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location", "unit"],
        },
    },
}
ARGUMENTS_AS_WRITTEN = '{ "location": "Paris", "unit": "celsius"}'
"""What SmolLM2-135M wrote greedily under llamax's tool grammar for the weather question."""
ARGUMENTS_CANONICAL = '{"location": "Paris", "unit": "celsius"}'
TOOL_RESULT = '{"temperature": 21, "sky": "clear"}'


@dataclass
class Reply:
    """One assistant reply: what the model wrote, and the message a client sends back."""

    raw: str
    message: dict[str, Any]


@dataclass
class Turn:
    """How much of one request's KV the next request reuses."""

    turn: int
    kv_chars: int
    next_chars: int
    reused_chars: int
    kv_tokens: int | None = None
    next_tokens: int | None = None
    reused_tokens: int | None = None
    reason: str = ""
    kv_at: str = ""
    next_at: str = ""


@dataclass
class Played:
    """One conversation on one template."""

    template: str
    conversation: str
    turns: list[Turn] = field(default_factory=list)
    error: str | None = None


Tokenizer = Callable[[str], list[int]]


class Family:
    """A template's generation format (see the module docstring)."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self.source = template.source
        self.harmony = "<|channel|>" in self.source
        self.knows_think = "<think>" in self.source
        self.glm = "<|assistant|>" in self.source and "<|observation|>" in self.source

    def opens_think(self, prompt: str) -> bool:
        """Whether the prompt ends inside an open ``<think>`` block."""
        tail = prompt[-40:]
        return tail.rfind("<think>") > tail.rfind("</think>")

    def answer(self, prompt: str, text: str) -> str:
        """The raw reply of a plain answer after ``prompt``."""
        if self.opens_think(prompt):
            return f"</think>\n\n{text}"
        if self.harmony:
            return f"<|channel|>final<|message|>{text}"
        if self.glm:
            return f"\n{text}"
        return text

    def thinking(self, prompt: str, thought: str, text: str) -> str | None:
        """The raw reply of a thought then an answer (None: the template has no format)."""
        if self.opens_think(prompt):
            return f"{thought}\n</think>\n\n{text}"
        if self.harmony:
            return (
                f"<|channel|>analysis<|message|>{thought}<|end|>"
                f"<|start|>assistant<|channel|>final<|message|>{text}"
            )
        if self.glm:
            return f"\n<think>{thought}</think>\n{text}"
        if self.knows_think:
            return f"<think>\n{thought}\n</think>\n\n{text}"
        return None


def load(path: Path) -> ChatTemplate:
    source = path.read_text()
    bos, eos = "<s>", "</s>"
    for marker, b, e in BOS_EOS:
        if marker in source:
            bos, eos = b, e
            break
    return ChatTemplate(source, bos_token=bos, eos_token=eos)


def render(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tools: bool,
    add_generation_prompt: bool = True,
    **kw: Any,
) -> str:
    """The prompt llamax renders for ``messages`` (with the weather tool if ``tools``)."""
    kw["add_generation_prompt"] = add_generation_prompt
    if not tools:
        return template.render(validate_messages(messages), **kw)
    # render_tool_prompt's two paths, with the template variables chat_completion passes
    plan = prepare_tools([WEATHER], "auto")
    if template_supports_tools(template):
        functions = [f.as_openai() for f in plan.callable_functions]
        return template.render(native_messages(messages), tools=functions, **kw)
    return template.render(validate_messages(fallback_messages(messages, plan)), **kw)


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def classify(prompt: str, raw: str, generation: str, at: int, thought: str | None) -> str:
    """Why the next prompt leaves the previous KV at character ``at``."""
    kv = prompt + raw
    if at >= len(kv):
        return "all reused"
    if "<think>" in kv[max(0, at - 8) : at + 8] and at < len(prompt) - len(generation):
        return "thinking of an earlier turn dropped"
    if at >= len(prompt):
        into = at - len(prompt)
        if thought and thought in raw and into <= raw.find(thought) + len(thought):
            return "past thinking dropped"
        call = raw.find("<tool_call>")
        if call >= 0 and into >= call:
            return "tool call re-serialized"
        if into == 0:
            return "reply rendered differently from its start"
        return "reply rendered differently"
    if generation and at >= len(prompt) - len(generation):
        return "generation prompt not kept in history"
    return "earlier text changed"


def play(
    name: str,
    template: ChatTemplate,
    conversation: str,
    tokenize: Tokenizer | None,
) -> Played:
    """Play ``conversation`` on ``template``: three requests, two reuse measurements."""
    played = Played(name, conversation)
    family = Family(template)
    tools = "tools" in conversation
    kw: dict[str, Any] = {"enable_thinking": conversation.startswith("think")}
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    try:
        render(template, [*messages, {"role": "user", "content": USERS[0]}], tools, **kw)
    except TemplateError:
        messages = []  # a template that refuses a system turn (none since llamax merges it)
    messages.append({"role": "user", "content": USERS[0]})
    try:
        for turn in range(2):
            prompt = render(template, messages, tools, **kw)
            generation = _generation_suffix(template, messages, tools, prompt, kw)
            reply = next_reply(family, conversation, turn, prompt)
            if reply is None:
                played.error = "no thinking format"
                return played
            messages.append(reply.message)
            if tools and turn == 0:
                messages.append({"role": "tool", "tool_call_id": "call_1", "content": TOOL_RESULT})
            else:
                messages.append({"role": "user", "content": USERS[min(turn + 1, 2)]})
            following = render(template, messages, tools, **kw)
            played.turns.append(measure(turn + 1, prompt, generation, reply, following, tokenize))
    except TemplateError as exc:
        played.error = str(exc)[:200]
    return played


def next_reply(family: Family, conversation: str, turn: int, prompt: str) -> Reply | None:
    """The model's reply after ``prompt`` and the message a client sends back for it."""
    thinks = conversation.startswith("think")
    if "tools" in conversation and turn == 0:
        canonical = conversation.endswith("canonical")
        arguments = ARGUMENTS_CANONICAL if canonical else ARGUMENTS_AS_WRITTEN
        text = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
        function = {"name": "get_weather", "arguments": arguments}
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": function}],
        }
    else:
        text = "It is 21 °C and clear in Paris." if "tools" in conversation else ANSWERS[turn]
        message = {"role": "assistant", "content": text}
    if not thinks:
        return Reply(family.answer(prompt, text), message)
    raw = family.thinking(prompt, THOUGHTS[turn], text)
    if raw is None:
        return None
    return Reply(raw, {**message, "reasoning_content": THOUGHTS[turn]})


def measure(
    number: int,
    prompt: str,
    generation: str,
    reply: Reply,
    following: str,
    tokenize: Tokenizer | None,
) -> Turn:
    kv = prompt + reply.raw
    at = common_prefix(kv, following)
    thought = reply.message.get("reasoning_content")
    turn = Turn(number, len(kv), len(following), at)
    turn.reason = classify(prompt, reply.raw, generation, at, thought)
    turn.kv_at = kv[max(0, at - 20) : at] + "|" + kv[at : at + 40]
    turn.next_at = following[max(0, at - 20) : at] + "|" + following[at : at + 40]
    if tokenize is not None:
        kv_ids = tokenize(prompt) + tokenize(reply.raw)
        next_ids = tokenize(following)
        turn.kv_tokens, turn.next_tokens = len(kv_ids), len(next_ids)
        turn.reused_tokens = common_prefix(kv_ids, next_ids)
    return turn


def _generation_suffix(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tools: bool,
    prompt: str,
    kw: dict[str, Any],
) -> str:
    """The text the generation prompt adds at the end of ``prompt`` ("" if not a suffix)."""
    bare = render(template, messages, tools, add_generation_prompt=False, **kw)
    return prompt[len(bare) :] if prompt.startswith(bare) else ""


def tokenizer_for(name: str, vocab_dir: Path | None, smollm2: Path | None) -> Tokenizer | None:
    """A tokenizer of the template's family, if one is at hand (special tokens parsed)."""
    path = None
    if name == "smollm2" and smollm2 is not None:
        path = smollm2
    elif vocab_dir is not None:
        for part, file in VOCABS:
            if part in name and (vocab_dir / file).exists():
                path = vocab_dir / file
                break
    if path is None:
        return None
    return _vocab(str(path))


def fits(tokenize: Tokenizer | None, template: ChatTemplate) -> Tokenizer | None:
    """``tokenize`` if every turn marker the template writes is one token of it: a
    stand-in vocabulary without them would count merges across the reply's end."""
    if tokenize is None:
        return None
    markers = [m for m in (*END_OF_TURN_MARKERS, "<|im_start|>") if m in template.source]
    return tokenize if all(len(tokenize(m)) == 1 for m in markers) else None


_VOCABS: dict[str, Any] = {}


def _vocab(path: str) -> Tokenizer:
    import llama_cpp  # the vocabulary alone: no weights, no context worth the name

    if path not in _VOCABS:
        _VOCABS[path] = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    model = _VOCABS[path]

    def tokenize(text: str) -> list[int]:
        return list(model.tokenize(text.encode(), add_bos=False, special=True))

    return tokenize


CONVERSATIONS = ("plain", "think", "tools", "tools-canonical", "think-tools")


def summary_cell(played: Played) -> str:
    if played.error:
        return "n/a" if played.error == "no thinking format" else "error"
    cells = []
    for turn in played.turns:
        if turn.reused_tokens is not None and turn.kv_tokens is not None:
            cells.append(f"{turn.reused_tokens}/{turn.kv_tokens} tok")
        else:
            cells.append(f"{turn.reused_chars}/{turn.kv_chars} ch")
    return ", ".join(cells)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("templates", type=Path, help="a folder of *.jinja chat templates")
    parser.add_argument("--all", action="store_true", help="every *.jinja in the folder")
    parser.add_argument("--only", nargs="*", default=None, help="these template names")
    parser.add_argument("--vocab-dir", type=Path, default=None)
    parser.add_argument("--smollm2-gguf", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write every turn here")
    parser.add_argument("--markdown", action="store_true", help="print the summary table")
    args = parser.parse_args(argv)
    if args.only:
        names = list(args.only)
    elif args.all:
        names = sorted(p.stem for p in args.templates.glob("*.jinja"))
    else:
        names = [n for n in CURATED if (args.templates / f"{n}.jinja").exists()]
    paths = {n: args.templates / f"{n}.jinja" for n in names}
    paths["smollm2"] = SMOLLM2
    results: list[Played] = []
    for name, path in paths.items():
        try:
            template = load(path)
        except TemplateError as exc:
            print(f"{name}: does not compile: {exc}", file=sys.stderr)
            continue
        tokenize = fits(tokenizer_for(name, args.vocab_dir, args.smollm2_gguf), template)
        native = template_supports_tools(template)
        for conversation in CONVERSATIONS:
            played = play(name, template, conversation, tokenize)
            results.append(played)
            tools = ("native" if native else "fallback") if "tools" in conversation else ""
            head = f"{name} [{conversation}{' ' + tools if tools else ''}]"
            if played.error:
                print(f"{head}: {played.error}")
                continue
            for turn in played.turns:
                tokens = (
                    f" = {turn.reused_tokens}/{turn.kv_tokens} tokens"
                    if turn.reused_tokens is not None
                    else ""
                )
                print(
                    f"{head} turn {turn.turn}->{turn.turn + 1}: "
                    f"{turn.reused_chars}/{turn.kv_chars} chars{tokens}: {turn.reason}"
                )
                if turn.reason != "all reused":
                    print(f"    kv:   {turn.kv_at!r}\n    next: {turn.next_at!r}")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(p) for p in results], indent=1))
    if args.markdown:
        print("\n| template | " + " | ".join(CONVERSATIONS) + " |")
        print("|---" * (len(CONVERSATIONS) + 1) + "|")
        for name in paths:
            row = [p for p in results if p.template == name]
            if row:
                print(f"| {name} | " + " | ".join(summary_cell(p) for p in row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
