"""Sessions that yield (issue 54, finding 5): ``ctx.session(yields=True)`` gives its
sequence id and cells back while idle whenever another request lacks them, least recently
used first; its KV becomes a retained prefix its next request reuses if it survived.
Manual contexts on the fake backend, stepped by hand (no wall clock)."""

from __future__ import annotations

import llamax
from llamax.testing import FakeBackend, assert_idle


def greedy(max_tokens: int = 1) -> llamax.SamplingParams:
    return llamax.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def drive(ctx: llamax.Context, handles: list[llamax.RequestHandle], bound: int = 500) -> None:
    """Step a manual context until every handle settles (at most ``bound`` steps)."""
    for _ in range(bound):
        if all(h.done() for h in handles):
            return
        ctx.process()
    raise AssertionError(f"{sum(not h.done() for h in handles)} requests unsettled")


def run(ctx: llamax.Context, session: llamax.Session, prompt: str) -> llamax.Completion:
    handle = session.add_request(prompt, greedy())
    drive(ctx, [handle])
    return handle.result()


def manual(n_ctx: int = 512) -> llamax.Context:
    return llamax.Context(
        backend=FakeBackend(n_ctx=n_ctx, n_seq_max=4), autostart=False, max_step_ms=None
    )


def test_idle_sessions_that_yield_never_hold_every_sequence_id() -> None:
    """Four idle yielding sessions on n_seq_max=4: a plain request runs (before: it failed
    with "every one of the 4 sequence ids is held by an open session"); the least recently
    used session gave its slot, and its next request reuses that slot's prefix."""
    ctx = manual()
    with ctx:
        sessions = [ctx.session(yields=True) for _ in range(4)]
        prompts = [f"conversation number {i} " * 4 for i in range(4)]
        for session, prompt in zip(sessions, prompts, strict=True):
            run(ctx, session, prompt)
        plain = ctx.add_request("someone else entirely", greedy(2))
        drive(ctx, [plain])
        assert plain.result().finish_reason == "length"
        assert sessions[0].token_ids == ()  # the least recently used yielded
        assert all(s.token_ids for s in sessions[1:])
        again = run(ctx, sessions[0], prompts[0] + "and more")
        assert again.usage.cached_tokens == len(ctx.tokenize(prompts[0]))  # its old prefix
        assert sessions[0].token_ids  # pinned again
        for session in sessions:
            session.close()
        assert_idle(ctx)


def test_sessions_that_yield_give_their_cells_to_a_request_that_needs_them() -> None:
    """A request that needs cells the idle yielding sessions hold runs (before: it failed
    with KVCapacityError naming the sessions); a pinned session is never taken."""
    ctx = manual(n_ctx=256)
    with ctx:
        pinned = ctx.session()
        run(ctx, pinned, "p" * 40)
        soft = ctx.session(yields=True)
        run(ctx, soft, "s" * 150)
        big = ctx.add_request("b" * 100, greedy(4))
        drive(ctx, [big])
        assert big.result().finish_reason == "length"
        assert soft.token_ids == () and len(pinned.token_ids) == 40
        pinned.close()
        soft.close()
        assert_idle(ctx)


def test_a_session_that_yields_opens_without_a_free_id_and_waits_for_one() -> None:
    """Opening a yielding session takes no id when none is free (before: SessionError);
    its request waits as any request does, and a pinned session's open takes an idle
    yielding session's id."""
    ctx = manual()
    with ctx:
        running = [ctx.add_request(f"busy {i}", greedy(3)) for i in range(4)]
        ctx.process()
        late = ctx.session(yields=True)
        assert late.token_ids == ()
        handle = late.add_request("late", greedy())
        drive(ctx, [*running, handle])
        assert handle.result().finish_reason == "length" and late.token_ids
        others = [ctx.session(yields=True) for _ in range(3)]
        for i, session in enumerate(others):
            run(ctx, session, f"other {i}")
        firm = ctx.session()  # every id was held by an idle yielding session
        assert late.token_ids == () and firm.token_ids == ()
        for session in [late, *others, firm]:
            session.close()
        assert_idle(ctx)


def test_a_yielded_session_rewinds_and_closes_as_an_empty_one() -> None:
    ctx = manual()
    with ctx:
        sessions = [ctx.session(yields=True) for _ in range(4)]
        for i, session in enumerate(sessions):
            run(ctx, session, f"turn {i}")
        drive(ctx, [ctx.add_request("plain", greedy())])
        assert sessions[0].token_ids == ()
        sessions[0].rewind(0)  # pins an empty slot: the operations see an empty session
        assert sessions[0].token_ids == ()
        for session in sessions:
            session.close()
        assert_idle(ctx)
