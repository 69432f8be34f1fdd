"""The invariants of :mod:`tensorsocket.flow` (its docstring lists them), asserted over a
flow's private state: the property tests call :func:`check_invariants` after every event."""

from __future__ import annotations

from .flow import EntryKind, Flow, PlaceState


def check_invariants(flow: Flow) -> None:
    """Assert every invariant of the module docstring (tests call it after every event)."""
    for i, s in enumerate(flow._places):
        if s.state is not PlaceState.PUBLISHED:
            assert s.seq is None and not s.holders, (i, s)
        for cid in s.holders:
            assert flow.consumers[cid].held.get(s.seq) == i, (i, s, cid)  # type: ignore[arg-type]
    for cid, c in flow.consumers.items():
        for seq, place in c.held.items():
            assert flow._places[place].seq == seq and cid in flow._places[place].holders
            assert c.broken or (c.cursor is not None and seq < c.cursor)
        assert len(c.held) <= c.prefetch <= flow.window
        if c.cursor is not None:
            for seq in range(c.cursor, flow.next_seq):
                assert seq in flow._log, (cid, seq)
                assert flow._available(seq), (cid, seq)
        if c.wants is not None:  # it waits at a kept batch in no place, with room to take it
            assert c.wants == c.cursor and c.wants in flow._kept_set and not flow._resident(c.wants), (cid, c)
            assert len(c.held) < c.prefetch, (cid, c)
        if not c.catching_up:  # stall: within the window of the newest; skip: max_lag of the leader
            limit = flow.window if flow.max_lag is None else flow._leader_lag() + flow.max_lag
            assert flow._lag(c) <= limit, ("lags too far", cid, c, flow._leader_lag())
    if flow._replay_open and not flow.ended:
        for seq in range(flow._epoch_start, flow.next_seq):
            assert flow._available(seq), ("replay window lost", seq)
    batches = sum(e.kind is EntryKind.BATCH for e in flow._log.values())
    assert batches <= len(flow._places) + len(flow._kept), ("log holds batches nobody can be sent", batches)
    assert set(flow._before) == set(flow._log)
    assert sorted(flow._free) == [i for i, x in enumerate(flow._places) if x.state is PlaceState.FREE]
    for seq in range(flow._oldest_replayable(), flow.next_seq):
        assert flow._available(seq), ("neither in its place nor kept", seq)
    kept = list(flow._kept)
    assert kept == sorted(set(kept)) and set(kept) == flow._kept_set
    assert all(flow._log[s].kind is EntryKind.BATCH for s in kept if s in flow._log)
    for place, seq in flow._restaging.items():
        assert flow._places[place].state is PlaceState.FILLING and seq in flow._kept_set, (place, seq)
