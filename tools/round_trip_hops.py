#!/usr/bin/python3
"""Where a round trip's time goes, hop by hop, from the scheduler's wake-ups.

A round trip of `opbyop_bench` (call, then wait for the result) crosses six threads in three
processes: the benchmark's thread sends the run to the controller, the controller's stream thread
sends it on to the worker, the worker's stream reader hands it to the worker's I/O pool, which
applies it (the device runs it meanwhile) and wakes the connection thread holding the fetch, which
answers the client, whose reader wakes the benchmark. Each hand-over is a wake-up the kernel
records, so the gaps between them say how long each hop took, with no probe in the code.

    perf sched record -o /tmp/sched.data -- build/bin/opbyop_bench --calls 2000 --repeats 1
    perf sched timehist -i /tmp/sched.data -w > /tmp/timehist.txt
    tools/round_trip_hops.py /tmp/timehist.txt

The processes are found by their threads' names: the client is `opbyop_bench`, the controller
the first other process with a `sched-answers` thread, the worker the first other one with a
`cpu-dev-0` thread (the benchmark starts the cluster with plain control streams first). Times are inflated by the
tracing itself; compare the hops with each other, not with untraced runs.
"""

import argparse
import re
import statistics
import sys
from typing import List, NamedTuple, Optional


class Wakeup(NamedTuple):
    time: float
    waker: str
    waker_tid: int
    waker_pid: int
    wakee: str
    wakee_tid: int
    wakee_pid: int


_WAKEUP = re.compile(r"\s*([\d.]+)\s+\[\d+\]\s+(.+?)\[(\d+)(?:/(\d+))?\]\s+awakened: (.+?)\[(\d+)(?:/(\d+))?\]")
_THREAD = re.compile(r"(\S+?)\[(\d+)(?:/(\d+))?\]")  # a process's main thread: no "/pid"

HOPS = ["client: wake, call, send the run to the controller", "controller: read, schedule, send to the worker",
        "worker: stream reader wakes, hands to the I/O pool", "worker: apply the run, device, wake the fetch's connection",
        "worker: answer the fetch; client's reader wakes", "client: reader to the caller"]


def parse(path: str) -> List[Wakeup]:
    events = []
    with open(path) as f:
        for line in f:
            m = _WAKEUP.match(line)
            if m:
                g = m.groups()
                events.append(Wakeup(float(g[0]), g[1], int(g[2]), int(g[3] or g[2]), g[4], int(g[5]),
                                     int(g[6] or g[5])))
    return events


def first_pid(path: str, thread_name: str, besides: Optional[int] = None) -> Optional[int]:
    """The lowest process id with a thread of that name, other than `besides`."""
    pids = set()
    with open(path) as f:
        for line in f:
            # After "next:" perf prints a thread id alone, which is not its process's.
            for name, tid, pid in _THREAD.findall(line.split("next:")[0]):
                pid = int(pid or tid)
                if name == thread_name and pid != besides:
                    pids.add(pid)
    return min(pids) if pids else None


def hops(events: List[Wakeup], client: int, controller: int, worker: int) -> List[List[float]]:
    """The six hops of each round trip, in microseconds."""
    rows = []
    start: Optional[float] = None
    trip: List[Wakeup] = []
    for e in events:
        trip.append(e)
        if e.wakee_tid != client:
            continue
        if start is not None:
            row = one_trip(trip, start, client, controller, worker)
            if row is not None:
                rows.append(row)
        start, trip = e.time, []
    return rows


def one_trip(trip: List[Wakeup], start: float, client: int, controller: int, worker: int) -> Optional[List[float]]:
    def after(t: float, cond) -> Optional[Wakeup]:
        return next((e for e in trip if e.time >= t and cond(e)), None)

    # The calling thread writes the run, or the schedule stream's reader does, when the previous
    # batch's answer comes after the call (one batch in flight).
    sent = after(start, lambda e: e.waker_pid == client and e.wakee_pid == controller)
    if sent is None:
        return None
    forwarded = after(sent.time, lambda e: e.waker_pid == controller and e.wakee_pid == worker)
    if forwarded is None:
        return None
    handed = after(forwarded.time, lambda e: e.waker_tid == forwarded.wakee_tid and e.wakee_pid == worker and
                   not e.wakee.startswith("stream-conn"))
    if handed is None:
        return None
    applied = after(handed.time, lambda e: e.waker_tid == handed.wakee_tid and e.wakee_pid == worker and
                    e.wakee.startswith("stream-conn"))
    if applied is None:
        return None
    answered = after(applied.time, lambda e: e.waker_pid == worker and e.wakee_pid == client)
    if answered is None:
        return None
    end = trip[-1].time
    marks = [start, sent.time, forwarded.time, handed.time, applied.time, answered.time, end]
    return [(b - a) * 1e6 for a, b in zip(marks, marks[1:])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("timehist", help="output of `perf sched timehist -w`")
    args = parser.parse_args()
    client = first_pid(args.timehist, "opbyop_bench")
    # The embedded cluster's threads are in the benchmark's own process.
    controller = first_pid(args.timehist, "sched-answers", besides=client)
    worker = first_pid(args.timehist, "cpu-dev-0", besides=client)
    if None in (client, controller, worker):
        print("the trace has no opbyop_bench, controller or worker threads", file=sys.stderr)
        return 1
    rows = hops(parse(args.timehist), client, controller, worker)
    if not rows:
        print("no round trip found in the trace", file=sys.stderr)
        return 1
    print(f"{len(rows)} round trips (client {client}, controller {controller}, worker {worker}), us\n")
    print("| hop (µs) | median | p25 | p75 |\n|---|---|---|---|")
    for i, name in enumerate(HOPS + ["whole round trip"]):
        col = sorted(sum(r) if i == len(HOPS) else r[i] for r in rows)
        print(f"| {name} | {statistics.median(col):.0f} | {col[len(col) // 4]:.0f} | {col[3 * len(col) // 4]:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
