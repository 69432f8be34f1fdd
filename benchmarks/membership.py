"""Membership benchmark: what a late joiner and a straggler cost the other consumers.

Real processes (multiprocessing spawn; four worker processes started once and reused, each
run with a fresh Producer and Consumers), consumers that simulate a training step with a
sleep while holding the batch. The loader is synthetic and cheap: float32 batches of
32 x 3 x 64 x 64 (1.5 MiB) filled with ``epoch * 10000 + index``, labels that value + 0..31,
with a sleep per batch so its rate is known. Every consumer checks every batch against that
formula, and the order it got them in against what the producer published.

1. **Late joiner.** Two leaders (``--step-ms``) run ``--epochs`` epochs of ``--batches``
   batches; a third consumer joins when the first leader has taken ``--join-at`` batches of
   epoch 0. With ``late_join="replay"`` (the default) and a replay budget that holds the
   epoch it starts at batch 0, and the producer holds the leaders back while it lags more
   than the window (``slots``). Reported: how long the leaders were held back (the
   producer's ``catching_up`` flag, from status() polled every 10 ms), when the joiner's
   position in the stream reaches the leaders' (consumer-side timestamps), whether it saw
   epoch 0 from batch 0, and the leaders' samples/s in those windows vs before the join and
   vs a control run without a joiner. Also: a faster joiner (``--fast-joiner-ms``),
   ``next_epoch``, ``now``, and replay=0 variants. ``--repeats`` runs each; medians shown.
2. **Stragglers.** A fast (``--fast-ms``) and a slow (``--slow-ms``) consumer, one epoch of
   ``--straggler-batches`` batches from a loader faster than both, under
   ``stragglers="stall"`` and ``"skip"`` (the default max_lag and ``--max-lag``): each
   consumer's samples/s, ``Consumer.skipped``, and checks that seen + skipped == published
   for the slow one and that the fast one saw every batch exactly once.

    python3 -m benchmarks.membership   # writes benchmarks/results/membership-<host>-<date>.json
"""

from __future__ import annotations

import argparse
import bisect
import queue
import statistics
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import torch

from benchmarks.sharing import SPAWN, machine, write

STRIDE = 10_000  # batch value = epoch * STRIDE + index
BATCH_SIZE = 32
SHAPE = (BATCH_SIZE, 3, 64, 64)
MIB = 1 << 20


class EpochLoader:
    """A re-iterable loader of ``batches`` batches per epoch, ``sleep_s`` per batch."""

    def __init__(self, batches: int, sleep_s: float) -> None:
        self.batches = batches
        self.sleep_s = sleep_s
        self._epoch = -1

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Any:
        self._epoch += 1
        epoch = self._epoch
        for index in range(self.batches):
            time.sleep(self.sleep_s)
            value = epoch * STRIDE + index
            yield torch.full(SHAPE, float(value)), value + torch.arange(BATCH_SIZE)


def _check(images: torch.Tensor, labels: torch.Tensor) -> int | None:
    """The batch's value if it is exactly a published batch, else None."""
    if images.shape != SHAPE or images.dtype != torch.float32 or labels.shape != (BATCH_SIZE,):
        return None
    value = int(images[0, 0, 0, 0])
    if not bool((images == value).all()) or not torch.equal(labels, value + torch.arange(BATCH_SIZE)):
        return None
    return value


# ---------------------------------------------------------------------------- processes


def _consumer(
    name: str,
    role: str,
    step_s: float,
    late_join: str,
    wait_for_signal: bool,
    signal_at: int | None,
    signal: Any,
    out: Any,
) -> None:
    """Consume every epoch until the end of stream; report (loop, value, time) per batch.
    ``signal_at``: set ``signal`` after that many batches; ``wait_for_signal``: join only then."""
    from tensorsocket import Consumer

    report: dict[str, Any] = {"role": role, "late_join": late_join, "errors": []}
    if wait_for_signal and not signal.wait(timeout=60):
        report["errors"].append("the join signal never came")
        out.put(report)
        return
    records: list[tuple[int, int, float]] = []
    bad = 0
    t_construct = time.monotonic()
    consumer = None
    try:
        consumer = Consumer(name=name, timeout=30, late_join=late_join, label=role)
        report["t_joined"] = time.monotonic()
        loop = 0
        while True:
            for images, labels in consumer:
                t = time.monotonic()
                value = _check(images, labels)
                if value is None:
                    bad += 1
                    value = -1
                records.append((loop, value, t))
                pause = t + step_s - time.monotonic()
                if pause > 0:
                    time.sleep(pause)  # the training step, holding the batch
                del images, labels
                if len(records) == signal_at:
                    signal.set()
            if consumer.finished:
                break
            loop += 1
        report["skipped"] = consumer.skipped
    except Exception as exc:  # reported, not hidden: a failure is a finding
        report["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        if consumer is not None:
            consumer.close()
    report.update(t_construct=t_construct, records=records, bad_batches=bad)
    out.put(report)


def _producer(
    name: str,
    batches: int,
    epochs: int,
    loader_s: float,
    slots: int,
    replay: int,
    min_consumers: int,
    stragglers: str,
    max_lag: int | None,
    signal: Any,
    out: Any,
) -> None:
    """Serve ``epochs`` epochs. Polls status() every 10 ms for each consumer's last counts and
    for when a joiner's ``catching_up`` flag (it lags more than the window; the producer holds
    the others back for it) cleared."""
    from tensorsocket import Producer

    report: dict[str, Any] = {"role": "producer", "errors": []}
    kwargs: dict[str, Any] = {} if max_lag is None else {"max_lag": max_lag}
    last: dict[str, dict[str, Any]] = {}  # label -> its last status entry
    catching_up: dict[str, list[float | None]] = {}  # label -> [first seen catching up, cleared]
    stop = threading.Event()
    try:
        producer = Producer(
            EpochLoader(batches, loader_s),
            name=name,
            slots=slots,
            replay=replay,
            min_consumers=min_consumers,
            stragglers=stragglers,
            **kwargs,
        )

        def poll() -> None:
            while not stop.wait(0.01):
                now = time.monotonic()
                for c in producer.status()["consumers"]:
                    label = c["label"]
                    last[label] = c
                    if c["catching_up"] and label not in catching_up:
                        catching_up[label] = [now, None]
                    elif not c["catching_up"] and label in catching_up and catching_up[label][1] is None:
                        catching_up[label][1] = now

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            producer.serve(epochs=epochs)
        finally:
            stop.set()
            poller.join()
        status = producer.status()
        report.update(
            {k: status[k] for k in ("published", "places", "replay_batches", "max_lag", "slot_wait")},
            consumers_last_status={
                label: {k: c[k] for k in ("received", "skipped", "catching_up", "late_join")}
                for label, c in last.items()
            },
            catching_up=catching_up,
        )
    except Exception as exc:
        report["errors"].append(f"{type(exc).__name__}: {exc}")
    out.put(report)


_JOBS = {"producer": _producer, "consumer": _consumer}


def _worker(tasks: Any, signal: Any, out: Any) -> None:
    """A long-lived process: runs the jobs it is sent (one Producer or Consumer each) until None."""
    import tensorsocket  # noqa: F401  (imported before the first job, not during it)

    torch.set_num_threads(1)
    while (task := tasks.get()) is not None:
        job, args = task
        try:
            _JOBS[job](*args, signal, out)
        except Exception as exc:
            out.put(
                {"role": args[1] if job == "consumer" else job, "errors": [f"{type(exc).__name__}: {exc}"]}
            )


class Workers:
    """Four spawned processes, started once and reused for every run: starting four Python
    processes that import torch takes ~10 s on two cores, longer than most runs, and would
    compete for the CPU with the run itself. Each run gets a fresh Producer and Consumers."""

    def __init__(self, count: int = 4) -> None:
        self.count = count
        self._start()

    def _start(self) -> None:
        self.out = SPAWN.Queue()
        self.signal = SPAWN.Event()
        self.tasks = [SPAWN.Queue() for _ in range(self.count)]
        self.procs = [SPAWN.Process(target=_worker, args=(q, self.signal, self.out)) for q in self.tasks]
        for p in self.procs:
            p.start()

    def run(self, jobs: list[tuple[str, tuple[Any, ...]]], timeout: float) -> list[dict[str, Any]]:
        """One job per worker; each puts one report. A hang becomes a report (and the workers
        are replaced, so the next run starts clean)."""
        self.signal.clear()
        for q, job in zip(self.tasks, jobs, strict=False):
            q.put(job)
        reports = []
        deadline = time.monotonic() + timeout
        for _ in jobs:
            try:
                reports.append(self.out.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                roles = {r["role"] for r in reports}
                reports.append(
                    {"role": "?", "errors": [f"no report within {timeout:g} s (hang?); reported: {roles}"]}
                )
                self.close(force=True)
                self._start()
                break
        return reports

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if force else 15)
            if p.is_alive():
                p.kill()
                p.join()


# ---------------------------------------------------------------------------- analysis


def _stream(first: int, epochs: int, batches: int) -> list[int]:
    """Every batch value published from ``first`` to the end, in order."""
    values = [e * STRIDE + i for e in range(epochs) for i in range(batches)]
    return values[values.index(first) :] if first in values else []


def _pos(value: int, batches: int) -> int:
    """1-based position of a batch in the stream (batches taken once it is taken)."""
    epoch, index = divmod(value, STRIDE)
    return epoch * batches + index + 1


def _loops_aligned(records: list[tuple[int, int, float]]) -> bool:
    """Each ``for`` loop over the consumer yielded batches of exactly one producer epoch."""
    if not records:
        return True
    first_epoch = records[0][1] // STRIDE
    return all(value // STRIDE - first_epoch == loop for loop, value, _ in records)


def _rate(times: list[float], a: float, b: float | None, min_s: float) -> float | None:
    """samples/s of the batches taken in (a, b]; None for a window shorter than ``min_s``."""
    if b is None or b - a < min_s:
        return None
    n = bisect.bisect_right(times, b) - bisect.bisect_right(times, a)
    return n * BATCH_SIZE / (b - a)


def _whole_rate(times: list[float]) -> float:
    """samples/s from the first batch to the last (the clock starts at the first)."""
    return (len(times) - 1) * BATCH_SIZE / (times[-1] - times[0]) if len(times) > 1 else 0.0


def _longest_wait_ms(times: list[float], after: float) -> float:
    """The longest time between two batches, for batches taken after ``after``."""
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > after]
    return max(gaps, default=0.0) * 1e3


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def _loss(during: float | None, base: float | None) -> float | None:
    return _r(100 * (1 - during / base)) if during is not None and base else None


def _analyse_join(
    reports: list[dict[str, Any]],
    epochs: int,
    batches: int,
    join_at: int,
    step_s: float,
    control_rate: float | None,
) -> dict[str, Any]:
    by_role = {r["role"]: r for r in reports}
    errors = [f"{r['role']}: {e}" for r in reports for e in r.get("errors", [])]
    producer = by_role.get("producer", {})
    leaders = [by_role[k] for k in ("leader0", "leader1") if k in by_role]
    full = _stream(0, epochs, batches)
    res: dict[str, Any] = {"errors": errors, "producer": {k: v for k, v in producer.items() if k != "role"}}
    res["leaders_exact"] = len(leaders) == 2 and all(
        [v for _, v, _ in r.get("records", [])] == full
        and _loops_aligned(r["records"])
        and r.get("bad_batches") == 0
        for r in leaders
    )
    leader_times = [[t for _, _, t in r.get("records", [])] for r in leaders]
    if len(leaders) < 2 or not all(len(ts) > join_at for ts in leader_times):
        return res
    res["leaders_samples_per_s_whole_run"] = _r(_mean([_whole_rate(ts) for ts in leader_times]))
    res["leaders_run_ms"] = _r(_mean([(ts[-1] - ts[0]) * 1e3 for ts in leader_times]))
    joiner = by_role.get("joiner")
    # the join moment: the joiner's construction (control: when it would have been signalled)
    t_join = joiner["t_construct"] if joiner and "t_construct" in joiner else leader_times[0][join_at - 1]
    res["leaders_longest_wait_after_join_ms"] = _r(max(_longest_wait_ms(ts, t_join) for ts in leader_times))
    res["leaders_samples_per_s_before_join"] = _r(
        _mean([_rate(ts, ts[0], t_join, 5 * step_s) for ts in leader_times])
    )
    if joiner is None:
        return res
    recs = joiner.get("records") or []
    if not recs:
        res["joiner"] = {"errors": joiner.get("errors"), "batches": 0, "exact": False}
        return res
    values = [v for _, v, _ in recs]
    first = values[0]
    leaders_done = min(ts[-1] for ts in leader_times)
    j: dict[str, Any] = {
        "join_handshake_ms": _r((joiner["t_joined"] - t_join) * 1e3),
        "first_batch": [first // STRIDE, first % STRIDE],
        "time_to_first_batch_ms": _r((recs[0][2] - t_join) * 1e3),
        "batches_of_join_epoch_seen": sum(1 for v in values if v // STRIDE == 0),
        "saw_join_epoch_from_batch_0": bool(values[:batches] == full[:batches]),
        "batches": len(values),
        "skipped": joiner.get("skipped"),
        "leaders_position_at_join": max(bisect.bisect_right(ts, t_join) for ts in leader_times),
        # every batch from its first one to the end of stream, each once, in order, exact
        "exact": values == _stream(first, epochs, batches)
        and _loops_aligned(recs)
        and joiner.get("bad_batches") == 0,
    }
    # The producer's view: how long it held the leaders back for the joiner (its catching_up
    # flag: lag beyond the window), to the 10 ms of status polling.
    held = producer.get("catching_up", {}).get("joiner")
    j["producer_flagged_catching_up"] = held is not None
    t_held_end = held[1] if held is not None else None
    j["held_back_ms"] = _r((t_held_end - t_join) * 1e3) if t_held_end is not None else None
    # Consumer-side: the first batch at which its position reaches the furthest leader's.
    leader_pos = [[_pos(v, batches) for _, v, _ in r["records"]] for r in leaders]
    gaps = []
    caught = None
    for k, (_, value, t) in enumerate(recs):
        lead = 0
        for ts, ps in zip(leader_times, leader_pos, strict=True):
            i = bisect.bisect_right(ts, t)
            if i:
                lead = max(lead, ps[i - 1])
        if t < leaders_done:
            gaps.append(lead - _pos(value, batches))
        if caught is None and _pos(value, batches) >= lead:
            caught = (t, k + 1)
    j["gap_to_leaders_median_batches"] = statistics.median(gaps) if gaps else None
    t_caught = caught[0] if caught is not None else None
    j["catch_up_ms"] = _r((t_caught - t_join) * 1e3) if t_caught is not None else None
    j["catch_up_batches_taken"] = caught[1] if caught is not None else None
    j["caught_up_before_leaders_finished"] = t_caught is not None and t_caught < leaders_done
    before = res["leaders_samples_per_s_before_join"]
    during_held = _mean([_rate(ts, t_join, t_held_end, 2 * step_s) for ts in leader_times])
    during_catch_up = _mean([_rate(ts, t_join, t_caught, 5 * step_s) for ts in leader_times])
    j.update(
        leaders_samples_per_s_while_held=_r(during_held),
        leaders_loss_while_held_vs_before_pct=_loss(during_held, before),
        leaders_loss_while_held_vs_control_pct=_loss(during_held, control_rate),
        leaders_samples_per_s_until_catch_up=_r(during_catch_up),
        leaders_loss_until_catch_up_vs_before_pct=_loss(during_catch_up, before),
        leaders_loss_until_catch_up_vs_control_pct=_loss(during_catch_up, control_rate),
        errors=joiner.get("errors"),
    )
    res["joiner"] = j
    return res


def run_join(
    *,
    batches: int,
    epochs: int,
    join_at: int,
    step_ms: float,
    joiner_step_ms: float,
    fast_joiner_ms: float,
    loader_ms: float,
    slots: int,
    replay: int,
    repeats: int,
    workers: Workers,
    log: Any = print,
) -> dict[str, Any]:
    cases = [  # (case, late_join policy or None for no joiner, replay bytes, joiner step ms)
        ("control", None, replay, 0.0),
        ("replay", "replay", replay, joiner_step_ms),
        (f"replay, joiner {fast_joiner_ms:g} ms", "replay", replay, fast_joiner_ms),
        ("next_epoch", "next_epoch", replay, joiner_step_ms),
        ("now", "now", replay, joiner_step_ms),
        ("replay, replay=0", "replay", 0, joiner_step_ms),
        ("now, replay=0", "now", 0, joiner_step_ms),
    ]
    out: dict[str, Any] = {case: [] for case, _, _, _ in cases}
    for rep in range(repeats):
        control_rate = None
        for case, policy, budget, joiner_ms in cases:
            name = f"membership-{uuid.uuid4().hex[:8]}"
            jobs: list[tuple[str, tuple[Any, ...]]] = [
                ("producer", (name, batches, epochs, loader_ms / 1000, slots, budget, 2, "stall", None)),
                ("consumer", (name, "leader0", step_ms / 1000, "replay", False, join_at)),
                ("consumer", (name, "leader1", step_ms / 1000, "replay", False, None)),
            ]
            if policy is not None:
                jobs.append(("consumer", (name, "joiner", joiner_ms / 1000, policy, True, None)))
            t0 = time.perf_counter()
            reports = workers.run(jobs, timeout=120)
            res = _analyse_join(reports, epochs, batches, join_at, step_ms / 1000, control_rate)
            res["wall_s"] = round(time.perf_counter() - t0, 2)
            if case == "control":
                control_rate = res.get("leaders_samples_per_s_whole_run")
            out[case].append(res)
            j = res.get("joiner", {})
            log(
                f"  {rep + 1}/{repeats} {case:<22} first batch {j.get('first_batch')}, held back "
                f"{j.get('held_back_ms')} ms, position catch-up {j.get('catch_up_ms')} ms, exact: leaders "
                f"{res['leaders_exact']} joiner {j.get('exact')} ({res['wall_s']} s)"
                + (f"  ERRORS {res['errors']}" if res["errors"] else "")
            )
    return out


def _analyse_stragglers(reports: list[dict[str, Any]], batches: int) -> dict[str, Any]:
    by_role = {r["role"]: r for r in reports}
    errors = [f"{r['role']}: {e}" for r in reports for e in r.get("errors", [])]
    producer = by_role.get("producer", {})
    published = producer.get("published")
    res: dict[str, Any] = {"errors": errors, "producer": {k: v for k, v in producer.items() if k != "role"}}
    res["max_lag"] = producer.get("max_lag")
    full = _stream(0, 1, batches)
    for role in ("fast", "slow"):
        r = by_role.get(role)
        if r is None or not r.get("records"):
            res[role] = {"seen": 0}
            continue
        values = [v for _, v, _ in r["records"]]
        times = [t for _, _, t in r["records"]]
        seen, skipped = len(values), r.get("skipped")
        res[role] = {
            "samples_per_s": _r(_whole_rate(times)),
            "seconds": _r(times[-1] - times[0], 3),
            "seen": seen,
            "skipped": skipped,
            "seen_plus_skipped_eq_published": skipped is not None and seen + skipped == published,
            "every_batch_once": values == full,
            "in_order_no_repeats": all(a < b for a, b in zip(values, values[1:], strict=False))
            and set(values) <= set(full),
            "data_exact": r.get("bad_batches") == 0 and _loops_aligned(r["records"]),
            "producer_view": producer.get("consumers_last_status", {}).get(role),
        }
    return res


def run_stragglers(
    *,
    batches: int,
    fast_ms: float,
    slow_ms: float,
    loader_ms: float,
    slots: int,
    max_lag: int,
    repeats: int,
    workers: Workers,
    log: Any = print,
) -> dict[str, Any]:
    cases = [
        ("stall", "stall", None),
        ("skip, default max_lag", "skip", None),
        (f"skip, max_lag={max_lag}", "skip", max_lag),
    ]
    out: dict[str, Any] = {case: [] for case, _, _ in cases}
    for rep in range(repeats):
        for case, policy, lag in cases:
            name = f"membership-{uuid.uuid4().hex[:8]}"
            jobs: list[tuple[str, tuple[Any, ...]]] = [
                ("producer", (name, batches, 1, loader_ms / 1000, slots, 0, 2, policy, lag)),
                ("consumer", (name, "fast", fast_ms / 1000, "replay", False, None)),
                ("consumer", (name, "slow", slow_ms / 1000, "replay", False, None)),
            ]
            t0 = time.perf_counter()
            res = _analyse_stragglers(workers.run(jobs, timeout=120), batches)
            res["wall_s"] = round(time.perf_counter() - t0, 2)
            out[case].append(res)
            f, s = res["fast"], res["slow"]
            log(
                f"  {rep + 1}/{repeats} {case:<22} fast {f.get('samples_per_s')} samples/s "
                f"(skipped {f.get('skipped')}), slow {s.get('samples_per_s')} samples/s "
                f"(skipped {s.get('skipped')}) ({res['wall_s']} s)"
                + (f"  ERRORS {res['errors']}" if res["errors"] else "")
            )
    return out


# ---------------------------------------------------------------------------- report


def _get(r: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        r = r.get(key) if isinstance(r, dict) else None
    return r


def _median(runs: list[dict[str, Any]], *path: str) -> float | None:
    vals = [
        v for v in (_get(r, path) for r in runs) if isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    return round(statistics.median(vals), 1) if vals else None


def _count(runs: list[dict[str, Any]], *path: str) -> str:
    """'k/n': in how many of the n runs the flag was True."""
    return f"{sum(_get(r, path) is True for r in runs)}/{len(runs)}"


def summarise(join: dict[str, Any], stragglers: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {"late_join": {}, "stragglers": {}}
    control = join["control"]
    ctl_rate = _median(control, "leaders_samples_per_s_whole_run")
    ctl_run = _median(control, "leaders_run_ms")
    for case, runs in join.items():
        row: dict[str, Any] = {
            "runs": len(runs),
            "errors": [e for r in runs for e in r["errors"]],
            "leaders_exact": _count(runs, "leaders_exact"),
            "leaders_samples_per_s_whole_run": _median(runs, "leaders_samples_per_s_whole_run"),
            "leaders_samples_per_s_before_join": _median(runs, "leaders_samples_per_s_before_join"),
            "leaders_run_ms": _median(runs, "leaders_run_ms"),
            "leaders_longest_wait_after_join_ms": _median(runs, "leaders_longest_wait_after_join_ms"),
        }
        if case != "control":
            during_held = _median(runs, "joiner", "leaders_samples_per_s_while_held")
            during_catch = _median(runs, "joiner", "leaders_samples_per_s_until_catch_up")
            before = row["leaders_samples_per_s_before_join"]
            row.update(
                joiner_first_batch=sorted({tuple(_get(r, ("joiner", "first_batch")) or ()) for r in runs}),
                joiner_exact=_count(runs, "joiner", "exact"),
                joiner_saw_join_epoch_from_batch_0=_count(runs, "joiner", "saw_join_epoch_from_batch_0"),
                batches_of_join_epoch_seen=_median(runs, "joiner", "batches_of_join_epoch_seen"),
                join_handshake_ms=_median(runs, "joiner", "join_handshake_ms"),
                time_to_first_batch_ms=_median(runs, "joiner", "time_to_first_batch_ms"),
                held_back_ms=_median(runs, "joiner", "held_back_ms"),
                producer_flagged_catching_up=_count(runs, "joiner", "producer_flagged_catching_up"),
                catch_up_ms=_median(runs, "joiner", "catch_up_ms"),
                caught_up_before_leaders_finished=_count(runs, "joiner", "caught_up_before_leaders_finished"),
                gap_to_leaders_median_batches=_median(runs, "joiner", "gap_to_leaders_median_batches"),
                leaders_samples_per_s_while_held=during_held,
                leaders_loss_while_held_vs_before_pct=_loss(during_held, before),
                leaders_loss_while_held_vs_control_pct=_loss(during_held, ctl_rate),
                leaders_samples_per_s_until_catch_up=during_catch,
                leaders_loss_until_catch_up_vs_before_pct=_loss(during_catch, before),
                leaders_loss_until_catch_up_vs_control_pct=_loss(during_catch, ctl_rate),
                leaders_extra_run_ms_vs_control=_r(row["leaders_run_ms"] - ctl_run)
                if row["leaders_run_ms"] is not None and ctl_run is not None
                else None,
            )
        s["late_join"][case] = row
    bounds = {
        "fast": BATCH_SIZE / (config["fast_ms"] / 1000),
        "slow": BATCH_SIZE / (config["slow_ms"] / 1000),
    }
    for case, runs in stragglers.items():
        row = {
            "runs": len(runs),
            "errors": [e for r in runs for e in r["errors"]],
            "max_lag": runs[0].get("max_lag") if runs else None,
            "published": _median(runs, "producer", "published"),
        }
        for role in ("fast", "slow"):
            rate = _median(runs, role, "samples_per_s")
            row.update(
                {
                    f"{role}_samples_per_s": rate,
                    f"{role}_pct_of_step_bound": _r(100 * rate / bounds[role]) if rate else None,
                    f"{role}_seen": _median(runs, role, "seen"),
                    f"{role}_skipped": _median(runs, role, "skipped"),
                    f"{role}_skipped_each_run": [_get(r, (role, "skipped")) for r in runs],
                    f"{role}_seen_plus_skipped_eq_published": _count(
                        runs, role, "seen_plus_skipped_eq_published"
                    ),
                    f"{role}_every_batch_once": _count(runs, role, "every_batch_once"),
                    f"{role}_in_order_no_repeats": _count(runs, role, "in_order_no_repeats"),
                    f"{role}_data_exact": _count(runs, role, "data_exact"),
                }
            )
        s["stragglers"][case] = row
    stall = s["stragglers"].get("stall", {})
    ratios = {}
    for case, row in s["stragglers"].items():
        for role in ("fast", "slow"):
            key = f"{role}_samples_per_s"
            if case != "stall" and stall.get(key) and row.get(key):
                ratios[f"{role} consumer, {case} / stall"] = round(row[key] / stall[key], 2)
    s["straggler_ratios"] = ratios
    return s


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:g}" if isinstance(x, float) else str(x)


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print(" | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip())
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def print_tables(s: dict[str, Any], config: dict[str, Any]) -> None:
    c = config
    print(
        f"\nLATE JOINER: 2 leaders at {c['step_ms']:g} ms/step; a joiner ({c['joiner_step_ms']:g} ms/step unless "
        f"named) joins after {c['join_at']} leader batches of epoch 0; {c['batches']} batches x {c['epochs']} "
        f"epochs, loader {c['loader_ms']:g} ms/batch, slots {c['slots']}, replay {c['replay_bytes'] // MIB} MiB "
        f"unless named. Medians of {c['repeats']} runs; k/n = runs where it held."
    )
    rows = []
    for case, r in s["late_join"].items():
        if case == "control":
            continue
        first = ",".join(f"({e},{i})" for e, i in r["joiner_first_batch"]) or "-"
        catch = _fmt(r["catch_up_ms"])
        mid, n = (int(x) for x in r["caught_up_before_leaders_finished"].split("/"))
        if r["catch_up_ms"] is not None and mid < n:
            catch += f" (at end {n - mid}/{n})"
        rows.append(
            (
                case,
                first,
                _fmt(r["time_to_first_batch_ms"]),
                _fmt(r["batches_of_join_epoch_seen"]),
                r["joiner_saw_join_epoch_from_batch_0"],
                _fmt(r["held_back_ms"]),
                catch,
                _fmt(r["gap_to_leaders_median_batches"]),
                r["joiner_exact"],
            )
        )
    _table(
        (
            "joiner",
            "1st batch (ep,i)",
            "1st batch ms",
            "ep0 seen",
            "ep0 from 0",
            "held back ms",
            "position catch-up ms",
            "gap (batches)",
            "exact",
        ),
        rows,
    )
    print(
        "  held back: from the joiner's construction until the producer's catching_up flag cleared (it no "
        "longer\n  lags more than the window, so the leaders are no longer held for it). position catch-up: "
        "until the\n  joiner has taken as many batches as the furthest leader (consumer-side timestamps); "
        "'(at end k/n)': in k\n  runs only once the leaders had finished the stream. gap: median batches it trailed the "
        "leaders by\n  (negative: ahead of them)."
    )
    rows = []
    for case, r in s["late_join"].items():
        rows.append(
            (
                case,
                _fmt(r["leaders_samples_per_s_before_join"]),
                _fmt(r.get("leaders_samples_per_s_while_held")),
                _fmt(r.get("leaders_loss_while_held_vs_before_pct")),
                _fmt(r.get("leaders_loss_while_held_vs_control_pct")),
                _fmt(r.get("leaders_samples_per_s_until_catch_up")),
                _fmt(r.get("leaders_loss_until_catch_up_vs_before_pct")),
                _fmt(r.get("leaders_loss_until_catch_up_vs_control_pct")),
                _fmt(r["leaders_longest_wait_after_join_ms"]),
                _fmt(r["leaders_samples_per_s_whole_run"]),
                _fmt(r.get("leaders_extra_run_ms_vs_control")),
                r["leaders_exact"],
            )
        )
    print()
    _table(
        (
            "leaders (per leader)",
            "before/s",
            "held/s",
            "loss %",
            "vs ctl %",
            "to catch-up/s",
            "loss %",
            "vs ctl %",
            "longest wait ms",
            "whole run/s",
            "+run ms vs ctl",
            "exact",
        ),
        rows,
    )
    print(
        "  samples/s per leader: before the join; while held back; from the join until the position catch-up "
        "(windows\n  under 2 resp. 5 steps give '-'); loss % vs before the join and vs the control's whole-run "
        "rate;\n  longest wait between two batches after the join."
    )
    print(
        f"\nSTRAGGLERS: fast {c['fast_ms']:g} ms/step, slow {c['slow_ms']:g} ms/step, one epoch of "
        f"{c['straggler_batches']} batches, loader {c['loader_ms']:g} ms/batch (faster than both), slots "
        f"{c['slots']}, replay 0. Medians of {c['straggler_repeats']} runs."
    )
    rows = []
    for case, r in s["stragglers"].items():
        rows.append(
            (
                case,
                _fmt(r["max_lag"]),
                _fmt(r["fast_samples_per_s"]),
                _fmt(r["fast_pct_of_step_bound"]),
                ",".join(_fmt(x) for x in r["fast_skipped_each_run"]),
                r["fast_every_batch_once"],
                _fmt(r["slow_samples_per_s"]),
                _fmt(r["slow_pct_of_step_bound"]),
                _fmt(r["slow_seen"]),
                ",".join(_fmt(x) for x in r["slow_skipped_each_run"]),
                f"{r['slow_seen_plus_skipped_eq_published']} ({_fmt(r['published'])})",
                f"{r['fast_data_exact']} {r['slow_data_exact']}",
            )
        )
    _table(
        (
            "policy",
            "max_lag",
            "fast/s",
            "% bound",
            "fast skipped",
            "fast all once",
            "slow/s",
            "% bound",
            "slow seen",
            "slow skipped",
            "seen+skipped=pub",
            "exact f s",
        ),
        rows,
    )
    print("  % bound: of the consumer's own step-bound rate (32 samples / step); skipped: per run")
    for k, v in s["straggler_ratios"].items():
        print(f"  {k}: {v:.2f}x")
    errors = [e for part in ("late_join", "stragglers") for r in s[part].values() for e in r["errors"]]
    if errors:
        print("\nERRORS:")
        for e in errors:
            print("  ", e)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=60, help="batches per epoch (late joiner)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--join-at", type=int, default=20, help="leader batches before the join")
    parser.add_argument("--step-ms", type=float, default=10.0, help="leaders' step")
    parser.add_argument("--joiner-step-ms", type=float, default=10.0)
    parser.add_argument("--fast-joiner-ms", type=float, default=5.0, help="the extra, faster joiner")
    parser.add_argument("--loader-ms", type=float, default=2.0, help="the loader's sleep per batch")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--replay-mib", type=int, default=128, help="must hold a whole epoch")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each late-joiner case")
    parser.add_argument("--straggler-batches", type=int, default=200)
    parser.add_argument("--fast-ms", type=float, default=10.0)
    parser.add_argument("--slow-ms", type=float, default=40.0)
    parser.add_argument("--max-lag", type=int, default=2)
    parser.add_argument("--straggler-repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be 2 or more: the next_epoch joiner starts at the second epoch")
    config = {
        "batch_shape": list(SHAPE),
        "batch_dtype": "float32",
        "batch_bytes": 4 * SHAPE[0] * SHAPE[1] * SHAPE[2] * SHAPE[3] + 8 * BATCH_SIZE,
        "batches": args.batches,
        "epochs": args.epochs,
        "join_at": args.join_at,
        "step_ms": args.step_ms,
        "joiner_step_ms": args.joiner_step_ms,
        "fast_joiner_ms": args.fast_joiner_ms,
        "loader_ms": args.loader_ms,
        "slots": args.slots,
        "replay_bytes": args.replay_mib * MIB,
        "repeats": args.repeats,
        "straggler_batches": args.straggler_batches,
        "fast_ms": args.fast_ms,
        "slow_ms": args.slow_ms,
        "max_lag": args.max_lag,
        "straggler_repeats": args.straggler_repeats,
        "consumer_prefetch": "default (the producer's slots)",
        "consumer_timeout_s": 30,
        "step": "sleep until next() returned + step, holding the batch; checks run inside the step",
        "timestamps": "time.monotonic() in each consumer when next() returned; status() polled every 10 ms",
    }
    t0 = time.perf_counter()
    print("starting 4 worker processes ...")
    workers = Workers()
    try:
        # warm-up, discarded: the first Producer / Consumer in a process sets up zmq and maps
        name = f"membership-{uuid.uuid4().hex[:8]}"
        workers.run(
            [
                ("producer", (name, 10, 1, 0.0, args.slots, 0, 3, "stall", None)),
                ("consumer", (name, "w0", 0.0, "replay", False, None)),
                ("consumer", (name, "w1", 0.0, "replay", False, None)),
                ("consumer", (name, "w2", 0.0, "replay", False, None)),
            ],
            timeout=120,
        )
        print(f"workers ready after {time.perf_counter() - t0:.1f} s\nlate joiner ...")
        join = run_join(
            batches=args.batches,
            epochs=args.epochs,
            join_at=args.join_at,
            step_ms=args.step_ms,
            joiner_step_ms=args.joiner_step_ms,
            fast_joiner_ms=args.fast_joiner_ms,
            loader_ms=args.loader_ms,
            slots=args.slots,
            replay=args.replay_mib * MIB,
            repeats=args.repeats,
            workers=workers,
        )
        print("stragglers ...")
        stragglers = run_stragglers(
            batches=args.straggler_batches,
            fast_ms=args.fast_ms,
            slow_ms=args.slow_ms,
            loader_ms=args.loader_ms,
            slots=args.slots,
            max_lag=args.max_lag,
            repeats=args.straggler_repeats,
            workers=workers,
        )
    finally:
        workers.close()
    summary = summarise(join, stragglers, config)
    print_tables(summary, config)
    result = {
        "benchmark": "membership",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": config,
        "summary": summary,
        "runs": {"late_join": join, "stragglers": stragglers},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(f"\nwall {result['wall_s']} s")
    if not args.no_write:
        print("wrote", write(result, "membership"))


if __name__ == "__main__":
    main()
