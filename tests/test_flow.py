"""Property and scenario tests for the pure flow state machine (tensorsocket.flow)."""

from __future__ import annotations

import copy
from collections.abc import Hashable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tensorsocket.flow import Deliver, Entry, EntryKind, Flow

BATCH, EPOCH_END, END = EntryKind.BATCH, EntryKind.EPOCH_END, EntryKind.END
CIDS = st.sampled_from(["a", "b", "c", "d"])
GARBAGE = -1  # what a slot holds after a reserved write was cancelled half-way


def batch_payload(seq: int) -> tuple[str, int]:
    return ("batch", seq)


@dataclass
class ConsumerModel:
    """What the test knows of one consumer: only what the Deliver actions told it."""

    prefetch: int
    received: list[Entry] = field(default_factory=list)
    held: dict[int, int] = field(default_factory=dict)  # seq -> slot
    finished: bool = False
    # Where its first entry must be, decided at join: ``start`` is its seq (the current epoch's
    # first entry, or END); if None, the consumer waits and starts right after the first
    # EPOCH_END at or past ``wait_from`` (or at END, if that comes first).
    start: int | None = None
    wait_from: int = 0


def check_next(prev: Entry | None, e: Entry, log: dict[int, Entry]) -> None:
    """``e`` may follow ``prev`` (None: e is the consumer's first entry) in what one consumer
    receives: contiguous, each once, in order, starting at an epoch's first entry (the whole
    epoch) or at END, nothing after END."""
    if prev is None:
        assert e.seq == 0 or e.kind is END or log[e.seq - 1].kind is EPOCH_END, (
            "first entry in the middle of an epoch",
            e,
        )
    else:
        assert prev.kind is not END, ("sent something after END", e)
        assert e.seq == prev.seq + 1, ("gap or repeat", prev, e)


def check_received(received: list[Entry], log: dict[int, Entry]) -> None:
    for i, e in enumerate(received):
        check_next(received[i - 1] if i else None, e, log)


class FlowMachine(RuleBasedStateMachine):
    """Drives a Flow with random events while a model tracks slot contents and deliveries."""

    def __init__(self) -> None:
        super().__init__()
        self.flow: Flow | None = None

    @initialize(k=st.integers(1, 4))
    def setup(self, k: int) -> None:
        self.k = k
        self.flow = Flow(slots=k)
        self.memory: dict[int, int] = {}  # slot -> seq last written into it
        self.log: dict[int, Entry] = {}  # the whole stream as published, never trimmed
        self.next_seq = 0
        self.epoch = 0
        self.epoch_start = 0
        self.ended = False
        self.consumers: dict[Hashable, ConsumerModel] = {}

    # ------------------------------------------------------------------ helpers

    def _append(self, kind: EntryKind, slot: int | None, payload: object) -> Entry:
        entry = Entry(self.next_seq, kind, slot, payload)
        self.log[entry.seq] = entry
        self.next_seq += 1
        return entry

    def _replayable(self) -> bool:
        """Every batch of the current epoch is still in its slot."""
        return all(
            e.kind is not BATCH or self.memory.get(e.slot) == e.seq  # type: ignore[arg-type]
            for e in (self.log[s] for s in range(self.epoch_start, self.next_seq))
        )

    def _expected_first(self, m: ConsumerModel) -> int | None:
        """The seq of the first entry ``m`` must receive, if already published; else None."""
        if m.start is not None:
            return m.start if m.start < self.next_seq else None
        for seq in range(m.wait_from, self.next_seq):
            if self.log[seq].kind is EPOCH_END:
                return seq + 1 if seq + 1 < self.next_seq else None
            if self.log[seq].kind is END:
                return seq
        return None

    def _handle(self, out: list[Deliver], only: Hashable | None = None) -> None:
        for d in out:
            assert isinstance(d, Deliver)
            if only is not None:
                assert d.consumer == only, ("delivery to a consumer not involved", d)
            m = self.consumers[d.consumer]
            e = d.entry
            assert not m.finished, ("delivery after END", d)
            assert self.log.get(e.seq) == e, ("entry differs from what was published", e)
            check_next(m.received[-1] if m.received else None, e, self.log)
            if not m.received:
                assert e.seq == self._expected_first(m), ("joiner started at the wrong entry", m, e)
                if m.start is None:
                    event("a waiting joiner started after the boundary")
            m.received.append(e)
            if e.kind is BATCH:
                assert e.slot is not None
                assert self.memory.get(e.slot) == e.seq, ("sent an overwritten batch", e)
                m.held[e.seq] = e.slot
                assert len(m.held) <= m.prefetch, ("prefetch exceeded", d.consumer, m)
            elif e.kind is END:
                m.finished = True

    def _free(self, slot: int) -> bool:
        """Never written, or its write was cancelled."""
        return self.memory.get(slot, GARBAGE) == GARBAGE

    def _needed(self, slot: int) -> bool:
        """Some consumer holds the slot's batch or has not been sent it yet (docstring rule)."""
        assert self.flow is not None
        seq = self.memory[slot]
        cursors = [self.flow.consumers[cid].cursor for cid in self.consumers]
        return any(seq in m.held for m in self.consumers.values()) or any(
            c is not None and c <= seq for c in cursors
        )

    def _check_reserved(self, slot: int) -> None:
        """reserve() gave ``slot``, which the producer is about to write: nobody may hold or
        still need what it contains, and it is a free slot if any, else the oldest batch."""
        assert 0 <= slot < self.k
        free = [i for i in range(self.k) if self._free(i)]
        if free:
            assert slot in free, ("reserved a used slot while a free one exists", slot, free)
            return
        old = self.memory[slot]
        for cid, m in self.consumers.items():
            assert old not in m.held, ("reserved a held batch", slot, old, cid)
        assert not self._needed(slot), ("reserved a batch not yet sent to all", slot, old)
        oldest = min(self.memory[i] for i in range(self.k) if not self._needed(i))
        assert old == oldest, ("did not reuse the oldest batch's slot", slot, old, oldest)
        if old >= self.epoch_start:
            event("reserve: overwrites a batch of the current epoch")

    def _check_stall_justified(self) -> None:
        """reserve() said None: every slot is still needed by some consumer."""
        for i in range(self.k):
            assert not self._free(i), ("free slot refused", i)
            assert self._needed(i), ("stalled on a slot nobody needs", i, self.memory[i])

    def _assert_ended_refuses(self) -> None:
        assert self.flow is not None
        with pytest.raises(RuntimeError):
            self.flow.reserve()
        for slot in range(self.k):
            with pytest.raises(RuntimeError):
                self.flow.publish(slot, batch_payload(self.next_seq))

    # ------------------------------------------------------------------ membership

    @rule(cid=CIDS, prefetch=st.integers(1, 4))
    def join(self, cid: str, prefetch: int) -> None:
        assert self.flow is not None
        if cid in self.consumers:
            with pytest.raises(ValueError):
                self.flow.join(cid, prefetch)
            return
        m = self.consumers[cid] = ConsumerModel(prefetch, wait_from=self.next_seq)
        if self.ended:
            m.start = self.next_seq - 1
            event("join: after END")
        elif self._replayable():
            m.start = self.epoch_start
            if self.epoch_start < self.next_seq:
                event("join: replays the resident epoch")
        else:
            event("join: waits for the next epoch")
        out = self.flow.join(cid, prefetch)
        if self.ended:
            assert [d.entry for d in out] == [self.log[self.next_seq - 1]], out
        elif m.start is not None and m.start < self.next_seq:
            assert out and out[0].entry.seq == m.start, ("joiner not sent the epoch at once", out)
        else:
            assert out == [], out
        self._handle(out, only=cid)

    @rule(cid=CIDS)
    def leave(self, cid: str) -> None:
        assert self.flow is not None
        self.consumers.pop(cid, None)
        assert self.flow.leave(cid) is None  # idempotent, also for unknown consumers

    @precondition(lambda self: self.flow is not None and self.consumers)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        assert self.flow is not None
        cid = data.draw(st.sampled_from(sorted(self.consumers)), label="cid")
        m = self.consumers[cid]
        held = sorted(m.held)
        chosen = data.draw(st.lists(st.sampled_from(held), unique=True), label="chosen") if held else []
        noise = data.draw(st.lists(st.integers(-2, self.next_seq + 2), max_size=3), label="noise")
        dups = data.draw(st.lists(st.sampled_from(chosen), max_size=2), label="dups") if chosen else []
        seqs = data.draw(st.permutations(chosen + noise + dups), label="seqs")
        for seq in {s for s in seqs if s in m.held}:
            slot = m.held.pop(seq)
            assert self.memory.get(slot) == seq, ("a held batch was overwritten", slot, seq)
        out = self.flow.release(cid, iter(seqs))
        self._handle(out, only=cid)

    @precondition(lambda self: self.flow is not None and self.consumers)
    @rule(data=st.data())
    def release_all(self, data: st.DataObject) -> None:
        """A consumer that keeps up: everything it holds, in one message."""
        assert self.flow is not None
        cid = data.draw(st.sampled_from(sorted(self.consumers)), label="cid")
        m = self.consumers[cid]
        for seq, slot in m.held.items():
            assert self.memory.get(slot) == seq, ("a held batch was overwritten", slot, seq)
        seqs = list(m.held)
        m.held.clear()
        self._handle(self.flow.release(cid, seqs), only=cid)

    @rule(cid=st.sampled_from(["x", "y"]), seqs=st.lists(st.integers(-1, 10), max_size=3))
    def release_unknown_consumer(self, cid: str, seqs: list[int]) -> None:
        assert self.flow is not None
        assert self.flow.release(cid, seqs) == []

    # ------------------------------------------------------------------ producer

    @rule(n=st.integers(1, 3))
    def publish(self, n: int) -> None:
        """Up to ``n`` batches in a row, as a producer does until it stalls."""
        assert self.flow is not None
        if self.ended:
            self._assert_ended_refuses()
            return
        for _ in range(n):
            slot = self.flow.reserve()
            if slot is None:
                event("reserve: stalled")
                self._check_stall_justified()
                return
            self._check_reserved(slot)
            self.memory[slot] = self.next_seq  # the producer writes the batch, then publishes
            entry = self._append(BATCH, slot, batch_payload(self.next_seq))
            out = self.flow.publish(slot, entry.payload)
            assert self.flow.next_seq == self.next_seq
            self._handle(out)
            self.flow.check()

    @rule()
    def reserve_then_cancel(self) -> None:
        assert self.flow is not None
        if self.ended:
            self._assert_ended_refuses()
            return
        slot = self.flow.reserve()
        if slot is None:
            self._check_stall_justified()
            return
        self._check_reserved(slot)
        self.memory[slot] = GARBAGE  # a failed write leaves the slot's bytes undefined
        self.flow.cancel(slot)
        with pytest.raises(RuntimeError):
            self.flow.cancel(slot)
        with pytest.raises(RuntimeError):
            self.flow.publish(slot, batch_payload(self.next_seq))

    @rule(gate=st.integers(0, 3))
    def end_epoch(self, gate: int) -> None:
        assert self.flow is not None
        # Act on a middle value: hypothesis favours the bounds, so ``if gate:`` would not do.
        if gate != 2:  # keep epochs several batches long on average
            return
        if self.ended:
            with pytest.raises(RuntimeError):
                self.flow.end_epoch(("epoch_end", self.epoch))
            return
        entry = self._append(EPOCH_END, None, ("epoch_end", self.epoch))
        self.epoch += 1
        self.epoch_start = self.next_seq
        out = self.flow.end_epoch(entry.payload)
        assert self.flow.epoch == self.epoch
        self._handle(out)

    @rule(gate=st.integers(0, 9))
    def end_stream(self, gate: int) -> None:
        assert self.flow is not None
        if gate != 6:  # rarely, so that most runs do a lot before the end
            return
        if self.ended:  # at most once
            with pytest.raises(RuntimeError):
                self.flow.end_stream(("end",))
            return
        entry = self._append(END, None, ("end",))
        out = self.flow.end_stream(entry.payload)
        self.ended = True
        assert self.flow.ended
        self._handle(out)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def flow_invariants(self) -> None:
        if self.flow is not None:
            self.flow.check()

    @invariant()
    def model_agrees(self) -> None:
        if self.flow is None:
            return
        assert set(self.flow.consumers) == set(self.consumers)
        for cid, m in self.consumers.items():
            state = self.flow.consumers[cid]
            assert state.held == m.held, (cid, state, m)
            assert len(m.held) <= m.prefetch
            assert state.finished == m.finished
            assert state.received == sum(e.kind is BATCH for e in m.received)
            check_received(m.received, self.log)
            for seq, slot in m.held.items():
                assert self.memory.get(slot) == seq, ("a held batch was overwritten", slot, seq)
        for i in range(self.k):
            expected = {cid for cid, m in self.consumers.items() if m.held.get(self.memory.get(i)) == i}
            assert self.flow.holders(i) == expected, (i, self.flow.holders(i), expected)

    @invariant()
    def no_deadlock(self) -> None:
        """On a copy: everyone releases everything until nothing new comes; then the producer
        can reserve a slot, or, after END, every consumer has been sent END."""
        if self.flow is None:
            return
        flow = copy.deepcopy(self.flow)
        last = {cid: (m.received[-1] if m.received else None) for cid, m in self.consumers.items()}
        progress = True
        while progress:
            progress = False
            for cid in list(flow.consumers):
                out = flow.release(cid, list(flow.consumers[cid].held))
                for d in out:
                    e = d.entry
                    assert self.log.get(e.seq) == e
                    check_next(last[d.consumer], e, self.log)
                    if last[d.consumer] is None:
                        assert e.seq == self._expected_first(self.consumers[d.consumer]), e
                    if e.kind is BATCH:
                        assert self.memory.get(e.slot) == e.seq  # type: ignore[arg-type]
                    last[d.consumer] = e
                    progress = True
            flow.check()
        for cid, state in flow.consumers.items():
            if last[cid] is None:  # nothing sent yet: its start must not have been published
                assert self._expected_first(self.consumers[cid]) is None, (cid, state)
            assert not state.held
            assert state.cursor is None or state.cursor == flow.next_seq, (cid, state)
        if flow.ended:
            assert flow.finished(), "a consumer was never sent END"
        else:
            slot = flow.reserve()
            assert slot is not None, "deadlock: everyone released, yet no slot is reservable"
            flow.check()


FlowMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFlowMachine = FlowMachine.TestCase


# ---------------------------------------------------------------------- scenarios


def publish(flow: Flow, tag: object = None) -> tuple[int, list[Deliver]]:
    slot = flow.reserve()
    assert slot is not None
    seq = flow.next_seq
    return slot, flow.publish(slot, tag if tag is not None else batch_payload(seq))


def sent(out: list[Deliver], cid: Hashable | None = None) -> list[int]:
    return [d.entry.seq for d in out if cid is None or d.consumer == cid]


def test_late_joiner_replays_resident_epoch_and_leaders_wait() -> None:
    flow = Flow(slots=4)
    assert sent(flow.join("a", prefetch=4)) == []
    for seq in (0, 1):
        _, out = publish(flow)
        assert sent(out, "a") == [seq]
    flow.release("a", [0, 1])
    assert sent(flow.end_epoch("e0"), "a") == [2]
    for seq in (3, 4):  # epoch 1 goes into the two never-used slots
        _, out = publish(flow)
        assert sent(out, "a") == [seq]
    flow.release("a", [3, 4])
    flow.check()

    out = flow.join("b", prefetch=1)  # epoch 1 (seqs 3, 4) is fully resident
    assert [(d.consumer, d.entry.seq, d.entry.kind) for d in out] == [("b", 3, BATCH)]
    flow.check()

    # The producer may reuse the slots of epoch 0 but not those of epoch 1, which b still needs.
    for seq in (5, 6):
        _, out = publish(flow)
        assert [(d.consumer, d.entry.seq) for d in out] == [("a", seq)]  # a is not re-sent 3, 4
    assert flow.reserve() is None
    flow.check()

    assert sent(flow.release("b", [3])) == [4]
    assert sent(flow.release("b", [4])) == [5]
    assert flow.consumers["b"].held == {5: flow.consumers["a"].held[5]}
    flow.release("a", [5, 6])
    slot = flow.reserve()  # batch 3's slot, the oldest no one needs any more
    assert slot == 2
    flow.cancel(slot)
    flow.check()


def test_late_joiner_after_overwrite_waits_for_next_epoch() -> None:
    flow = Flow(slots=2)
    flow.join("a", prefetch=1)
    for seq in (0, 1, 2):  # seq 2 overwrites seq 0's slot: epoch 0 is no longer replayable
        _, out = publish(flow)
        assert sent(out) == [seq]
        assert sent(flow.release("a", [seq])) == []
    assert flow.join("b", prefetch=2) == []
    assert flow.consumers["b"].cursor is None
    _, out = publish(flow)  # seq 3
    assert sent(out, "b") == [] and sent(out, "a") == [3]
    flow.release("a", [3])
    out = flow.end_epoch("e0")  # seq 4
    assert sent(out, "a") == [4] and sent(out, "b") == []
    _, out = publish(flow)  # seq 5, epoch 1's first batch
    assert sent(out, "a") == [5] and sent(out, "b") == [5]
    flow.check()


def test_joiner_after_end_stream_gets_only_end() -> None:
    flow = Flow(slots=2)
    flow.join("a", prefetch=2)
    publish(flow)
    flow.release("a", [0])
    flow.end_epoch("e0")
    out = flow.end_stream("end")
    assert [(d.consumer, d.entry.kind) for d in out] == [("a", END)]
    out = flow.join("late", prefetch=3)
    assert [(d.consumer, d.entry.seq, d.entry.kind, d.entry.payload) for d in out] == [
        ("late", 2, END, "end")
    ]
    assert flow.consumers["late"].finished and not flow.consumers["late"].held
    assert flow.release("late", [0, 1, 2]) == []
    assert flow.finished()
    with pytest.raises(RuntimeError):
        flow.reserve()
    with pytest.raises(RuntimeError):
        flow.end_epoch("e1")
    with pytest.raises(RuntimeError):
        flow.end_stream("end")
    flow.check()


@pytest.mark.parametrize("behind", [False, True])
def test_leave_frees_held_slots(behind: bool) -> None:
    flow = Flow(slots=2)
    flow.join("a", prefetch=2)
    flow.join("b", prefetch=1 if behind else 2)
    _, out0 = publish(flow)
    _, out1 = publish(flow)
    assert sent(out0 + out1, "a") == [0, 1]
    assert sent(out0 + out1, "b") == ([0] if behind else [0, 1])
    flow.release("a", [0, 1])
    assert flow.reserve() is None  # b holds (or has not yet been sent) both batches
    flow.leave("b")
    flow.check()
    assert all(not flow.holders(i) for i in range(2))
    slot = flow.reserve()
    assert slot is not None
    flow.publish(slot, batch_payload(2))
    assert flow.reserve() is not None
    flow.leave("b")  # idempotent
    flow.leave("never-joined")
    flow.check()


@pytest.mark.parametrize("slots", [0, -1, 1.0, "2", None, True])
def test_bad_slot_count(slots: object) -> None:
    with pytest.raises(ValueError):
        Flow(slots=slots)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefetch", [0, -3, 1.5, "1", None, False])
def test_bad_prefetch(prefetch: object) -> None:
    flow = Flow(slots=1)
    with pytest.raises(ValueError):
        flow.join("a", prefetch)  # type: ignore[arg-type]
    assert "a" not in flow.consumers


def test_duplicate_join() -> None:
    flow = Flow(slots=1)
    flow.join("a", prefetch=1)
    publish(flow)
    with pytest.raises(ValueError):
        flow.join("a", prefetch=2)
    assert flow.consumers["a"].prefetch == 1 and list(flow.consumers["a"].held) == [0]
    flow.check()


def test_publish_and_cancel_need_a_reservation() -> None:
    flow = Flow(slots=2)
    with pytest.raises(RuntimeError):
        flow.publish(0, "x")
    with pytest.raises(RuntimeError):
        flow.cancel(1)
    slot = flow.reserve()
    assert slot is not None
    flow.cancel(slot)
    with pytest.raises(RuntimeError):
        flow.publish(slot, "x")
    flow.check()
