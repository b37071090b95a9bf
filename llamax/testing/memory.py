"""The fake backend's KV memory: the tokens each sequence holds by position, the cells they
sit in, and what each cell's K/V was computed from (its provenance), in either layout.

Unified: one buffer, cells shared between sequences by reference count. Streams: a buffer
per sequence, by position; a copy between streams updates the destination's cells at once
and its buffer only at the next :meth:`FakeMemory.run_queue`, as llama.cpp does.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ..adapters import NO_ADAPTERS, AdapterSet
from ..backend.base import SharedPrefix
from ..errors import RequestFailedError

__all__ = ["F16_KV", "Computed", "FakeMemory"]

F16_KV = "F16/F16"
"""The default K/V cache types, as a model's identity names them."""


@dataclass(frozen=True, slots=True)
class Computed:
    """What a cell's K/V came from (its data): the hash chain of the tokens at positions
    ``0..p`` when it was computed, the model's weights and the adapter set."""

    chain: int
    model: str
    adapters: AdapterSet


def _chain(previous: int, token: int) -> int:
    return hash((previous, token))


def _chain_of(tokens: Sequence[int | None]) -> list[int | None]:
    chains: list[int | None] = []
    previous = 0
    for token in tokens:
        if token is None:
            chains.append(None)
            continue
        previous = _chain(previous, token)
        chains.append(previous)
    return chains


class FakeMemory:
    """The cells of every sequence id, with their provenance. New cells are computed by
    :attr:`model` under :attr:`adapters`; the backend checks every decode against both.

    With ``recurrent``, each sequence also has a state holding every token it consumed, as
    llama.cpp's recurrent memory: a cut before it is refused, a copy shares it whatever the
    range, a partial state (a checkpoint) sets it back, and every decode checks that it is
    the state the sequence's own cells lead to."""

    def __init__(
        self,
        n_seq_max: int,
        *,
        is_unified: bool,
        model: str,
        recurrent: bool = False,
        kv_cache: str = F16_KV,
    ) -> None:
        self.is_unified = is_unified
        self.recurrent = recurrent
        self.kv_cache = kv_cache
        """The K/V cache's types (``"F16/F16"``): a state of other types is refused."""
        self._states: dict[int, tuple[int, Computed] | None] = dict.fromkeys(range(n_seq_max))
        # recurrent: each sequence's state, as (tokens it consumed, what it came from)
        self.model = model
        """The weights new cells are computed by."""
        self.adapters: AdapterSet = NO_ADAPTERS
        """The adapter set new cells are computed under."""
        self.cells: dict[int, list[int | None]] = {i: [] for i in range(n_seq_max)}
        """Tokens each sequence id holds, by position (None: a removed cell)."""
        self._cell_ids: dict[int, list[int | None]] = {i: [] for i in range(n_seq_max)}
        self._chains: dict[int, list[int | None]] = {i: [] for i in range(n_seq_max)}
        # what each cell's data should come from: the chain over the sequence's tokens
        self._data: dict[int, Computed | None] = {}  # unified: cell id -> its data
        self._buffers: dict[int, dict[int, Computed | None]] = {i: {} for i in range(n_seq_max)}
        # streams: each sequence's buffer by position; it outlives seq_rm, as llama.cpp's
        self._queued: list[tuple[int, int]] = []  # stream copies the next decode runs
        self._refs: dict[int, int] = {}
        self._next_cell = 0
        self.num_copies = 0
        self.num_shifts = 0

    @property
    def num_cells_used(self) -> int:
        """Distinct cells held by any sequence (copied prefixes share cells)."""
        return len(self._refs)

    def run_queue(self) -> None:
        """Copy each queued source stream's buffer, as it is now, into its destination."""
        for src, dst in self._queued:
            self._buffers[dst] = dict(self._buffers[src])
        self._queued.clear()

    def read(self, seq_id: int, pos: int) -> Computed | None:
        """The data the memory holds for ``seq_id``'s cell at ``pos`` (None: garbage)."""
        if self.is_unified:
            cell = self._cell_ids[seq_id][pos]
            return None if cell is None else self._data.get(cell)
        return self._buffers[seq_id].get(pos)

    def _read_all(self, seq_id: int) -> list[Computed | None]:
        return [self.read(seq_id, p) for p, t in enumerate(self.cells[seq_id]) if t is not None]

    def history(self, seq_id: int, start_pos: int) -> list[int]:
        """The tokens a decode at ``start_pos`` continues, once checked: no hole, the next
        position, and every cell computed from the sequence's own tokens, by :attr:`model`
        under :attr:`adapters`."""
        cells = self.cells[seq_id]
        if None in cells:
            raise AssertionError(f"seq {seq_id}: decode over a hole left by seq_rm")
        if start_pos != len(cells):
            raise AssertionError(f"seq {seq_id}: decode at {start_pos}, KV holds {len(cells)}")
        for pos, expected in enumerate(self._chains[seq_id]):
            if expected is None:
                continue
            data = self.read(seq_id, pos)
            if data is None or data.chain != expected:
                raise AssertionError(
                    f"seq {seq_id} reads KV at position {pos} that was not computed from its "
                    f"own tokens ({'garbage' if data is None else 'another history'})"
                )
            if data.model != self.model:
                raise AssertionError(
                    f"seq {seq_id}: KV at position {pos} was computed by model {data.model!r}, "
                    f"read by {self.model!r}"
                )
            if data.adapters != self.adapters:
                raise AssertionError(
                    f"seq {seq_id}: KV computed under adapters {data.adapters} is read under "
                    f"{self.adapters}"
                )
        self._check_state(seq_id)
        return [t for t in cells if t is not None]

    def _check_state(self, seq_id: int) -> None:
        """Recurrent: the sequence's state is the one its cells' tokens lead to (a state left
        at another position, or from other tokens, would answer from the wrong history)."""
        if not self.recurrent:
            return
        state, chains = self._states[seq_id], self._chains[seq_id]
        if not chains:
            if state is not None:
                raise AssertionError(f"seq {seq_id} holds no cells but a recurrent state")
            return
        if state is None or state[0] != len(chains):
            at = None if state is None else state[0]
            raise AssertionError(
                f"seq {seq_id} holds {len(chains)} cells but its recurrent state is at {at}"
            )
        if (state[1].chain, state[1].model, state[1].adapters) != (
            chains[-1],
            self.model,
            self.adapters,
        ):
            raise AssertionError(f"seq {seq_id}'s recurrent state came from another history")

    def can_remove(self, seq_id: int, p0: int, p1: int) -> bool:
        """Recurrent: whether :meth:`remove` may drop ``[p0, p1)``, as llama.cpp's recurrent
        memory answers: not a range that starts inside the state's tokens and ends past
        them (a cut before the state); anything else, even a range in the middle, which
        leaves the state as it is (so a history shift keeps the dropped tokens in it). A
        range from 0 through the state clears it."""
        if not self.recurrent:
            return True
        state = self._states[seq_id]
        last = -1 if state is None else state[0] - 1
        p0, end = max(p0, 0), p1 if p1 >= 0 else sys.maxsize
        if 0 < p0 <= last < end:
            return False
        if p0 <= last < end:
            self._states[seq_id] = None
        return True

    def position_bounds(self, seq_id: int) -> tuple[int, int] | None:
        """Recurrent: the first and last position the state holds (llama.cpp's hybrid memory
        answers the later first and the earlier last of its two parts); None: no state."""
        state = self._states[seq_id] if self.recurrent else None
        return None if state is None else (state[0] - 1, state[0] - 1)

    def partial_state(self, seq_id: int) -> bytes:
        """A checkpoint: the sequence's recurrent state only."""
        state = self._states[seq_id]
        held = None if state is None else [state[0], *_computed_json(state[1])]
        return json.dumps({"r": held}).encode()

    def set_partial_state(self, seq_id: int, data: bytes) -> bool:
        """Set a :meth:`partial_state` back (the cells stay); False if it is not one."""
        try:
            held = json.loads(data)
            return self.recurrent and isinstance(held, dict) and self._set_state(seq_id, held["r"])
        except (ValueError, TypeError, KeyError):
            return False

    def _set_state(self, seq_id: int, held: object) -> bool:
        if held is None:
            self._states[seq_id] = None
            return True
        if not isinstance(held, list) or len(held) != 4:
            return False
        length, chain, model, adapters = held
        self._states[seq_id] = (
            int(length),
            Computed(int(chain), str(model), _adapter_set(adapters)),
        )
        return True

    def relayout(
        self, unified: bool, limit: int, n_ctx: int, shared: Sequence[SharedPrefix] = ()
    ) -> None:
        """Give every sequence cells of its own in the other layout, each state read as it
        is now (a queued copy never runs there); ``limit`` cells per sequence. Each of
        ``shared`` (to unified only) is tagged on its source's first cells instead, once
        checked: it holds exactly that many cells, each computed as its source's was.

        Raises:
            RequestFailedError: the sequences hold more than the ``n_ctx`` cells of the
                unified layout.
            AssertionError: a share that would let a sequence read KV it did not compute.
        """
        sharers = {share.seq_id: share for share in shared}
        for share in shared:
            mine, theirs = self._read_all(share.seq_id), self._read_all(share.source)
            if (
                share.source in sharers
                or len(mine) != share.num_tokens
                or theirs[: share.num_tokens] != mine
                or self.cells[share.source][: share.num_tokens] != self.cells[share.seq_id]
            ):
                raise AssertionError(f"{share} is not a prefix of its source")
        held_cells = 0
        for seq_id, cells in self.cells.items():
            if None in cells:
                raise AssertionError(f"relayout of seq {seq_id} with a hole")
            if len(cells) > limit:
                raise AssertionError(f"seq {seq_id} holds {len(cells)} cells, a stream {limit}")
            held_cells += 0 if seq_id in sharers else len(cells)
            if unified and held_cells > n_ctx:
                raise RequestFailedError(f"the new KV layout refused sequence {seq_id}")
        held = {
            seq_id: (list(held), self._read_all(seq_id))
            for seq_id, held in self.cells.items()
            if seq_id not in sharers
        }
        self._refs.clear()
        self._data.clear()
        self._queued.clear()
        for seq_id in held:
            self._buffers[seq_id] = {}
            self.cells[seq_id], self._cell_ids[seq_id], self._chains[seq_id] = [], [], []
        for seq_id in sharers:
            self._buffers[seq_id] = {}
            self.cells[seq_id], self._cell_ids[seq_id], self._chains[seq_id] = [], [], []
        self.is_unified = unified
        for seq_id, (tokens, data) in held.items():
            self.store(seq_id, [t for t in tokens if t is not None], data)
        for share in shared:
            self.copy(share.source, share.seq_id, 0, share.num_tokens)

    def remove(self, seq_id: int, p0: int, p1: int) -> None:
        """Drop positions ``[p0, p1)``; one inside the sequence leaves a hole."""
        cells, ids = self.cells[seq_id], self._cell_ids[seq_id]
        p0 = max(p0, 0)
        p1 = len(cells) if p1 < 0 else min(p1, len(cells))
        chains = self._chains[seq_id]
        for cell in ids[p0:p1]:
            if cell is None:
                continue
            self._refs[cell] -= 1
            if not self._refs[cell]:
                del self._refs[cell]
                self._data.pop(cell, None)
        if p1 == len(cells):
            del cells[p0:], ids[p0:], chains[p0:]
        else:
            cells[p0:p1] = [None] * (p1 - p0)
            ids[p0:p1] = [None] * (p1 - p0)
            chains[p0:p1] = [None] * (p1 - p0)

    def shift(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Shift ``[p0, end)`` left by ``-delta`` into a hole left by :meth:`remove`."""
        cells, ids = self.cells[seq_id], self._cell_ids[seq_id]
        if p1 >= 0 and p1 != len(cells):
            raise AssertionError("the fake only shifts whole tails")
        if delta > 0 or any(c is not None for c in cells[p0 + delta : p0]):
            raise AssertionError(f"seq_add {seq_id} [{p0}, end) by {delta} overwrites cells")
        if self.is_unified and any(c is not None and self._refs[c] > 1 for c in ids[p0:]):
            raise AssertionError(f"seq_add {seq_id} moves cells another sequence holds too")
        # the moved cells keep their K/V, re-rotated: a shift is a deliberate approximation,
        # so cells that were right before stand for the shifted history after
        moved = [
            (data, data is not None and data.chain == chain)
            for data, chain in zip(
                [self.read(seq_id, p) for p in range(p0, len(cells))],
                self._chains[seq_id][p0:],
                strict=True,
            )
        ]
        del cells[p0 + delta : p0], ids[p0 + delta : p0]
        self._chains[seq_id] = _chain_of(cells)
        if not self.is_unified:
            kept = {p: d for p, d in self._buffers[seq_id].items() if p < p0 + delta}
            self._buffers[seq_id] = kept
        for offset, (data, was_right) in enumerate(moved):
            pos = p0 + delta + offset
            if data is not None and was_right:
                chain = self._chains[seq_id][pos]
                assert chain is not None
                data = Computed(chain, data.model, data.adapters)
            self._write(seq_id, pos, data)
        self.num_shifts += 1

    def copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        """:meth:`FakeBackend.seq_cp <llamax.testing.FakeBackend.seq_cp>`."""
        if not self.is_unified:
            if p0 != -1 or p1 != -1 or self.cells[dst]:
                raise AssertionError(f"partial seq_cp {src}->{dst} between streams aborts")
            if None in self.cells[src]:
                raise AssertionError(f"seq_cp {src}->{dst} copies a hole")
            # the cells now, the buffer at the next decode (whatever the source holds then)
            tokens = [t for t in self.cells[src] if t is not None]
            self.cells[dst].extend(tokens)
            self._chains[dst] = list(self._chains[src])
            for _ in tokens:
                self._refs[self._next_cell] = 1
                self._cell_ids[dst].append(self._next_cell)
                self._next_cell += 1
            self._queued.append((src, dst))
            self._states[dst] = self._states[src]
            self.num_copies += 1
            return
        p0 = max(p0, 0)
        p1 = len(self.cells[src]) if p1 < 0 else p1
        if len(self.cells[dst]) != p0 or p1 > len(self.cells[src]):
            raise AssertionError(f"seq_cp {src}->{dst} [{p0}, {p1}) does not continue {dst}")
        if None in self.cells[src][p0:p1]:
            raise AssertionError(f"seq_cp {src}->{dst} copies a hole")
        self.cells[dst].extend(self.cells[src][p0:p1])
        for cell in self._cell_ids[src][p0:p1]:
            assert cell is not None
            self._refs[cell] += 1
            self._cell_ids[dst].append(cell)
        self._chains[dst].extend(self._chains[src][p0:p1])
        self._states[dst] = self._states[src]  # recurrent: shared whatever the range
        self.num_copies += 1

    def state(self, seq_id: int) -> bytes:
        """:meth:`FakeBackend.state_seq_get <llamax.testing.FakeBackend.state_seq_get>`."""
        tokens = self.cells[seq_id]
        found = [d for p, t in enumerate(tokens) if t is not None and (d := self.read(seq_id, p))]
        model, adapters = (found[0].model, found[0].adapters) if found else (self.model, ())
        expected = _chain_of(tokens)
        odd: list[object] = []
        for pos, token in enumerate(tokens):
            if token is None:
                continue
            data = self.read(seq_id, pos)
            if data is None:
                odd.append([pos, None, None, []])
            elif (data.chain, data.model, data.adapters) != (expected[pos], model, adapters):
                odd.append([pos, data.chain, data.model, [list(a) for a in data.adapters]])
        header: dict[str, object] = {"m": model, "a": [list(a) for a in adapters], "x": odd}
        if self.kv_cache != F16_KV:  # an f16 state's header says nothing (as before)
            header["k"] = self.kv_cache
        if self.recurrent:
            state = self._states[seq_id]
            header["r"] = None if state is None else [state[0], *_computed_json(state[1])]
        return json.dumps([header, *tokens]).encode()

    def load(self, seq_id: int, data: bytes, *, n_ctx: int, n_ctx_stream: int) -> bool:
        """Load a :meth:`state` into an empty sequence; False (nothing loaded) for one that
        is not a list of tokens at positions ``0 .. n-1``, does not fit, or holds K/V of
        other types than :attr:`kv_cache` (as llama.cpp refuses one)."""
        try:
            loaded = json.loads(data)
            parsed = _parse_state(loaded)
        except (ValueError, TypeError, KeyError, IndexError):
            return False
        if parsed is None:
            return False
        header = loaded[0] if loaded and isinstance(loaded[0], dict) else {}
        if header.get("k", F16_KV) != self.kv_cache:  # llama.cpp: "mismatched key type"
            return False
        tokens, computed = parsed
        if (
            self.cells[seq_id]
            or self.num_cells_used + len(tokens) > n_ctx
            or len(tokens) > n_ctx_stream
        ):
            return False
        computed = [  # a hand-written cell (no model named): this model's
            Computed(c.chain, self.model, NO_ADAPTERS) if c is not None and not c.model else c
            for c in computed
        ]
        if self.recurrent:  # its state must come with its cells
            header = loaded[0] if loaded and isinstance(loaded[0], dict) else {}
            if "r" not in header or not self._set_state(seq_id, header["r"]):
                return False
        self.store(seq_id, tokens, computed)
        return True

    def fill(self, seq_id: int, num_cells: int, *, n_ctx: int, n_ctx_stream: int) -> bool:
        """Grow ``seq_id`` to ``num_cells`` cells, its tokens repeated; False: no room."""
        held = self.cells[seq_id]
        more = num_cells - len(held)
        if (
            not held
            or None in held
            or more < 0
            or num_cells > n_ctx_stream
            or self.num_cells_used + more > n_ctx
        ):
            return False
        tokens = [t for t in held if t is not None]
        self.store(seq_id, [tokens[i % len(tokens)] for i in range(len(held), num_cells)])
        return True

    def store(
        self,
        seq_id: int,
        tokens: Sequence[int],
        data: Sequence[Computed | None] | None = None,
    ) -> None:
        """Append ``tokens`` in new cells holding ``data`` (None: computed now, from the
        sequence's own history, by :attr:`model` under :attr:`adapters`)."""
        chains = self._chains[seq_id]
        previous = chains[-1] if chains and chains[-1] is not None else 0
        for i, token in enumerate(tokens):
            previous = _chain(previous, token)
            chains.append(previous)
            cell = self._next_cell
            self._next_cell += 1
            self._refs[cell] = 1
            self.cells[seq_id].append(token)
            self._cell_ids[seq_id].append(cell)
            computed = Computed(previous, self.model, self.adapters) if data is None else data[i]
            self._write(seq_id, len(self.cells[seq_id]) - 1, computed)
        if self.recurrent and data is None and tokens:  # computed now: the state moves on
            now = Computed(previous, self.model, self.adapters)
            self._states[seq_id] = (len(self.cells[seq_id]), now)

    def store_embedded(self, seq_id: int, tokens: Sequence[int], inputs: Sequence[int]) -> None:
        """Append ``tokens`` (an image's placeholder ids, as the engine records them) in new
        cells computed from ``inputs`` (the ids its embeddings encode): a cell's provenance
        is what was decoded there, so rows of another image make cells that no read of
        this sequence accepts."""
        chains = self._chains[seq_id]
        previous = chains[-1] if chains and chains[-1] is not None else 0
        data = []
        for token in inputs:
            previous = _chain(previous, token)
            data.append(Computed(previous, self.model, self.adapters))
        self.store(seq_id, tokens, data)

    def _write(self, seq_id: int, pos: int, data: Computed | None) -> None:
        if self.is_unified:
            cell = self._cell_ids[seq_id][pos]
            assert cell is not None
            self._data[cell] = data
        else:
            self._buffers[seq_id][pos] = data


def _computed_json(data: Computed) -> list[object]:
    return [data.chain, data.model, [list(a) for a in data.adapters]]


def _adapter_set(raw: object) -> AdapterSet:
    if not isinstance(raw, list):
        raise TypeError("not an adapter set")
    return AdapterSet((str(name), float(scale)) for name, scale in raw)


def _parse_state(held: object) -> tuple[list[int], list[Computed | None]] | None:
    """A state from :meth:`FakeMemory.state`: its tokens and cell data. A bare list of
    tokens (a hand-written state) stands for cells computed from those tokens under no
    adapters by the model that loads it (model ``""``). None: not a state (a removed cell,
    a wrong type)."""
    if not isinstance(held, list):
        return None
    model: str = ""
    adapters: AdapterSet = NO_ADAPTERS
    odd: dict[int, Computed | None] = {}
    if held and isinstance(held[0], dict):
        header, *held = held
        model, adapters = str(header["m"]), _adapter_set(header["a"])
        for pos, chain, other, other_adapters in header["x"]:
            odd[int(pos)] = (
                None
                if chain is None
                else Computed(int(chain), str(other), _adapter_set(other_adapters))
            )
    if not all(type(t) is int for t in held):
        return None
    tokens = [int(t) for t in held]
    computed: list[Computed | None] = []
    previous = 0
    for pos, token in enumerate(tokens):
        previous = _chain(previous, token)
        computed.append(odd[pos] if pos in odd else Computed(previous, model, adapters))
    return tokens, computed
