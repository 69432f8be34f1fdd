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
                assert flow._resident(seq), (cid, seq)
        if not c.catching_up:
            assert flow._within_limit(c, flow._leader_lag()), ("lags too far", cid, c, flow._leader_lag())
    if flow._replay_open and not flow.ended:
        for seq in range(flow._epoch_start, flow.next_seq):
            assert flow._resident(seq), ("replay window lost", seq)
    batches = sum(e.kind is EntryKind.BATCH for e in flow._log.values())
    assert batches <= len(flow._places), ("log holds non-resident batches", batches)
    assert set(flow._before) == set(flow._log)
    assert sorted(flow._free) == [i for i, x in enumerate(flow._places) if x.state is PlaceState.FREE]
    seqs = [flow._places[i].seq for i in flow._published]
    assert seqs == sorted(seqs) and len(set(flow._published)) == len(flow._published)
    assert set(flow._published) == {i for i, x in enumerate(flow._places) if x.state is PlaceState.PUBLISHED}
    for seq in range(flow._oldest_replayable(), flow.next_seq):
        assert flow._resident(seq), ("not resident", seq)
