"""A chat session that outgrows its context: the oldest turns are dropped by shifting the
KV cache (``seq_rm`` + ``seq_add``), so each turn still computes only the new message.

``chat.last_turn`` says what a turn cost: prompt tokens, how many were reused from the
cache, how many were computed, and how many messages / cells the history shift removed.
"""

import llamax

QUESTIONS = [
    "What is the tallest mountain on Earth?",
    "Which ocean is the largest?",
    "What is the longest river in Africa?",
    "Which planet is closest to the Sun?",
    "What gas do plants take in from the air?",
    "How many legs does a spider have?",
    "What is the freezing point of water in Celsius?",
    "Which animal is known as the king of the jungle?",
    "What is the capital city of Japan?",
    "How many continents are there?",
]


def main() -> None:
    params = llamax.SamplingParams(max_tokens=40, temperature=0)
    system = "You are a helpful assistant. Answer in one sentence."
    with llamax.Context(n_ctx=256, n_seq_max=2) as ctx, ctx.chat(system=system) as chat:
        for question in QUESTIONS:
            reply = chat.send(question, params)
            t = chat.last_turn
            assert t is not None
            print(f"user: {question}\nassistant: {reply.text.strip()}")
            print(
                f"  prompt={t.prompt_tokens} reused={t.reused_tokens} "
                f"computed={t.computed_tokens} dropped_messages={t.dropped_messages} "
                f"shifted_tokens={t.shifted_tokens}"
            )
        print(f"{len(chat.messages)} messages kept of {1 + 2 * len(QUESTIONS)}")


if __name__ == "__main__":
    main()
