"""The reasoning split on plain text (llamax.reasoning): whole replies, every way a reply
can be cut into streamed pieces, and replies cut off inside their thinking."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import pytest

from llamax.errors import InvalidParameterError
from llamax.reasoning import (
    ReasoningSplitter,
    check_reasoning_format,
    opens_thinking,
    split_reasoning,
)

REPLIES = [
    # (reply, prompt opened the thinking, reasoning, content)
    (
        "<think>\nLet me add 2 and 2.\n</think>\n\nIt is 4.",
        False,
        "Let me add 2 and 2.",
        "It is 4.",
    ),
    (
        "  <think>a < b, so </thin is not a tag</think>b",
        False,
        "a < b, so </thin is not a tag",
        "b",
    ),
    ("<think></think>Just the answer.", False, "", "Just the answer."),
    (
        "\nHello <think>not at the start</think>",
        False,
        None,
        "\nHello <think>not at the start</think>",
    ),
    ("<thinking> is a word, not the tag", False, None, "<thinking> is a word, not the tag"),
    ("<thi", False, None, "<thi"),
    ("Opened by the prompt.\n</think>\n\nDone.", True, "Opened by the prompt.", "Done."),
    (
        "<think>\nCut off while still thinking about </thi",
        False,
        "Cut off while still thinking about </thi",
        "",
    ),
    ("<think>\n\n", False, "", ""),
    ("<think>x</think>\n\n", False, "x", ""),
    # gpt-oss (harmony) channels
    (
        "<|channel|>analysis<|message|>Think.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Answer.",
        False,
        "Think.",
        "Answer.",
    ),
    ("<|start|>assistant<|channel|>final<|message|> Only. ", False, None, "Only."),
    ("<|channel|>analysis<|message|> a <|en", False, "a <|en", ""),
    (
        "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary"
        "<|message|>Let me check.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
        False,
        "x",
        "Let me check.\nDone.",
    ),
    (
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}",
        False,
        None,
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    ),
    ("<|channel|>analysis", False, None, "<|channel|>analysis"),
    ("<|nope|>x", False, None, "<|nope|>x"),
]


@pytest.mark.parametrize(("reply", "inside", "reasoning", "content"), REPLIES)
def test_a_whole_reply_splits(
    reply: str, inside: bool, reasoning: str | None, content: str
) -> None:
    assert split_reasoning(reply, inside=inside) == (reasoning, content)


def streamed(pieces: list[str], inside: bool) -> tuple[str, str, ReasoningSplitter]:
    splitter = ReasoningSplitter(inside=inside)
    reasoning, content = [], []
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = splitter.flush()
    return "".join(reasoning) + r, "".join(content) + c, splitter


@pytest.mark.parametrize(("reply", "inside", "reasoning", "content"), REPLIES)
def test_every_cut_into_three_pieces_gives_the_whole_split(
    reply: str, inside: bool, reasoning: str | None, content: str
) -> None:
    """A tag cut at any position, in any piece, is held back and never leaks."""
    for i, j in itertools.combinations_with_replacement(range(len(reply) + 1), 2):
        pieces = [reply[:i], reply[i:j], reply[j:]]
        got_reasoning, got_content, splitter = streamed(pieces, inside)
        assert got_content == content, pieces
        assert got_reasoning == (reasoning or ""), pieces
        assert splitter.saw_reasoning == (reasoning is not None), pieces


@pytest.mark.parametrize(("reply", "inside", "reasoning", "content"), REPLIES)
def test_one_character_at_a_time_never_shows_a_tag(
    reply: str, inside: bool, reasoning: str | None, content: str
) -> None:
    splitter = ReasoningSplitter(inside=inside)
    emitted_content = ""
    for char in reply:
        _, c = splitter.feed(char)
        emitted_content += c
        if reasoning is not None:  # a split reply's content never shows a tag's start
            assert "<" not in c or "<" in content
    _, c = splitter.flush()
    assert emitted_content + c == content


def test_a_reply_cut_inside_its_thinking_says_so() -> None:
    splitter = ReasoningSplitter()
    assert splitter.feed("<think>\nstill") == ("still", "")
    assert splitter.in_reasoning and splitter.saw_reasoning
    assert splitter.feed(" going  ") == (" going", "")  # trailing spaces held
    assert splitter.flush() == ("", "")
    done = ReasoningSplitter()
    done.feed("<think>x</think>y")
    assert not done.in_reasoning


def test_a_prompt_that_opens_the_thinking() -> None:
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")


def test_reasoning_format_is_checked() -> None:
    for value in ("auto", "deepseek", "none"):
        assert check_reasoning_format(value) == value
    with pytest.raises(InvalidParameterError, match="reasoning_format must be one of"):
        check_reasoning_format("deepseek-legacy")


def test_a_gpt_oss_call_cut_off_is_left_open_for_the_parser_to_drop() -> None:
    call = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1'
    opened = '<tool_call>\n{"name": "f", "arguments": {"a": 1'
    assert split_reasoning(call, cut=True) == (None, opened)
    assert split_reasoning(call) == (None, opened + "}\n</tool_call>")


def test_a_gpt_oss_header_that_never_ends_is_content() -> None:
    header = "<|channel|>analysis" + " x" * 200
    assert split_reasoning(header + "<|message|>y") == (None, header + "<|message|>y")


@pytest.mark.parametrize(
    ("opening", "space", "closing", "expected"),
    [  # inside the thinking; leading the reply; in a gpt-oss (harmony) thinking body
        ("<think>Hmm", " ", "x</think>x", lambda ws: ("Hmm" + ws + "x", "x")),
        ("", " ", "x", lambda ws: ("", ws + "x")),
        ("<|channel|>analysis<|message|>Hmm", "\n", "x", lambda ws: ("Hmm" + ws + "x", "")),
    ],
    ids=["inside-think", "leading", "harmony-body"],
)
def test_a_long_run_of_whitespace_costs_linear_time(
    opening: str, space: str, closing: str, expected: Callable[[str], tuple[str, str]]
) -> None:
    """Regression (issue 36, item 9): each piece re-read all the whitespace held before it
    (40,000 whitespace tokens inside ``<think>``: 4.2 s). Sixteen times the pieces must cost
    about sixteen times the time, not 256 times: the bound is a ratio of this thread's CPU
    times with 2.5x slack, so it holds on a slow or busy machine."""

    def cost(num_pieces: int) -> float:
        best = float("inf")
        for _ in range(2):
            splitter = ReasoningSplitter()
            started = time.thread_time()
            said = [splitter.feed(opening)]
            said += [splitter.feed(space) for _ in range(num_pieces)]
            said += [splitter.feed(closing), splitter.flush()]
            best = min(best, time.thread_time() - started)
            joined = ("".join(r for r, _ in said), "".join(c for _, c in said))
            assert joined == expected(space * num_pieces)
        return max(best, 1e-6)

    small, large = cost(5_000), cost(80_000)
    assert large / small < 40, f"{large / small:.1f}x the time for 16x the whitespace"
