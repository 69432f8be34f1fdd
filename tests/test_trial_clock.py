"""The sweep's --trial-timeout clock (tensorsocket.cli.sweep.trial_clock): which waits are
another trial's doing. Pure logic; test_sweep runs it against a real producer."""

from __future__ import annotations

from tensorsocket.cli.sweep.trial_clock import WaveClock


def _run(clock: WaveClock, seconds: int, waits_per_s: dict[str, float | None], running: set[str]) -> None:
    """Poll once a second for ``seconds`` s; each trial's consumer waits ``waits_per_s`` of
    every second (None: the trial has no consumer)."""
    totals = dict.fromkeys(waits_per_s, 0.0)
    for t in range(seconds + 1):
        waits = []
        for name, share in waits_per_s.items():
            if share is not None:
                waits.append((name, totals[name]))
                totals[name] += share
        clock.poll(waits, running, float(t))


def test_a_trial_held_up_behind_a_busy_one_is_excused_its_wait() -> None:
    clock = WaveClock(["hung", "held"])
    _run(clock, 10, {"hung": 0.0, "held": 1.0}, {"hung", "held"})
    assert clock.excused == {"hung": 0.0, "held": 10.0}
    assert clock.charged("hung", 0.0, 10.0) == 10.0
    assert clock.charged("held", 0.0, 10.0) == 0.0


def test_when_every_trial_waits_no_one_is_excused() -> None:
    """The producer or its loader stuck: no trial is to blame, each reaches its limit."""
    clock = WaveClock(["a", "b"])
    _run(clock, 10, {"a": 1.0, "b": 0.9}, {"a", "b"})
    assert clock.excused == {"a": 0.0, "b": 0.0}


def test_a_lone_trial_is_never_excused() -> None:
    clock = WaveClock(["a"])
    _run(clock, 5, {"a": 1.0}, {"a"})
    assert clock.charged("a", 0.0, 5.0) == 5.0


def test_a_trial_with_no_consumer_yet_is_busy() -> None:
    """One still starting (importing, building its model) holds up the wave's first batch."""
    clock = WaveClock(["slow", "ready"])
    _run(clock, 4, {"slow": None, "ready": 1.0}, {"slow", "ready"})
    assert clock.excused == {"slow": 0.0, "ready": 4.0}


def test_a_consumer_that_left_takes_its_total_with_it_and_nothing_is_counted_twice() -> None:
    clock = WaveClock(["a", "b"])
    clock.poll([("a", 5.0), ("a", 3.0), ("b", 0.0)], {"a", "b"}, 0.0)
    clock.poll([("a", 5.5), ("b", 0.0)], {"a", "b"}, 1.0)  # one of a's consumers left
    assert clock.excused == {"a": 0.0, "b": 0.0}
    clock.poll([("a", 6.5), ("b", 0.0), ("x", 9.0), (None, 9.0)], {"a", "b"}, 2.0)  # others: not ours
    assert clock.excused == {"a": 1.0, "b": 0.0}


def test_a_wait_is_excused_at_most_the_interval_and_only_while_running() -> None:
    clock = WaveClock(["a", "b"])
    clock.poll([("a", 0.0), ("b", 0.0)], {"a", "b"}, 0.0)
    clock.poll([("a", 4.0), ("b", 0.0)], {"a", "b"}, 1.0)  # (a's STATS came late: 4 s at once)
    assert clock.excused["a"] == 1.0
    clock.poll([("a", 5.0)], {"a"}, 2.0)  # b ended: a waited with nobody else running
    assert clock.excused["a"] == 1.0
