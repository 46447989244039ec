"""tools/round_trip_hops.py against a trace written as `perf sched timehist -w` prints it."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
import round_trip_hops  # noqa: E402

HEADER = """           time    cpu  task name                       wait time  sch delay   run time
                        [tid/pid]                          (msec)     (msec)     (msec)
--------------- ------  ------------------------------  ---------  ---------  ---------
"""


def wake(t, waker, wakee):
    return f"   {t:.6f} [0000]  {waker:<50}awakened: {wakee}\n"


def trip(t0, hops_us):
    """One round trip starting at t0 (s) whose six hops take hops_us microseconds."""
    names = [("opbyop_bench[100]", "stream-conn[201/200]"),        # client sends the run
             ("stream-conn[201/200]", "stream-conn[301/300]"),     # controller to worker
             ("stream-conn[301/300]", "127.0.0.1:45-0[302/300]"),  # reader to I/O pool
             ("127.0.0.1:45-0[302/300]", "stream-conn[303/300]"),  # apply, to the fetch's connection
             ("stream-conn[303/300]", "rpc-done-1[101/100]"),      # answer to the client's reader
             ("rpc-done-1[101/100]", "opbyop_bench[100]")]         # reader to the caller
    lines, t = [], t0
    for i, ((waker, wakee), us) in enumerate(zip(names, hops_us)):
        t += us * 1e-6
        lines.append(wake(t, waker, wakee))
        if i == 1:
            # Between the run reaching the worker and its apply, the worker answers an earlier op
            # (a free's batch) to the client: not this trip's answer, which comes after the apply.
            lines.append(wake(t + 1e-6, "stream-conn[305/300]", "client-frees-0[102/100]"))
        if i == 2:
            # The I/O thread reports the run done to the controller, over a connection whose
            # thread is named as the fetch's is: not the wake-up of the fetch's connection.
            lines.append(wake(t + 1e-6, "127.0.0.1:45-0[302/300]", "stream-conn[201/200]"))
    return "".join(lines), t


def test_hops_are_the_gaps_between_the_hand_overs(tmp_path):
    # The client wakes (its previous trip ends) as the first trip begins.
    text = HEADER + wake(0.6, "sched-answers[110/100]", "cpu-dev-0[111/100]")  # the embedded cluster's
    text += wake(1.0, "rpc-done-1[101/100]", "opbyop_bench[100]")
    # After "next:" a thread id stands alone: it must not be taken for a process.
    text += "   0.550000 [0001]  <idle>                             0.0 0.0 0.0  next: cpu-dev-0[50]\n"
    t = 1.0
    for hops in ([10, 20, 30, 40, 50, 60], [12, 22, 32, 42, 52, 62], [14, 24, 34, 44, 54, 64]):
        body, t = trip(t, hops)
        text += body
    text += wake(9.0, "sched-answers[205/200]", "cpu-dev-0[305/300]")
    path = tmp_path / "timehist.txt"
    path.write_text(text)

    assert round_trip_hops.first_pid(str(path), "opbyop_bench") == 100
    assert round_trip_hops.first_pid(str(path), "sched-answers", besides=100) == 200
    assert round_trip_hops.first_pid(str(path), "cpu-dev-0", besides=100) == 300
    rows = round_trip_hops.hops(round_trip_hops.parse(str(path)), 100, 200, 300)
    # A trip runs from one wake-up of the client to the next.
    assert len(rows) == 3
    assert [round(x) for x in rows[1]] == [12, 22, 32, 42, 52, 62]

    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "round_trip_hops.py"), str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert "3 round trips (client 100, controller 200, worker 300)" in out
    assert "| controller: read, schedule, send to the worker | 22 | 20 | 24 |" in out
    assert "| whole round trip | 222 | 210 | 234 |" in out


def test_a_trace_without_the_processes_is_an_error(tmp_path):
    path = tmp_path / "timehist.txt"
    path.write_text(HEADER)
    result = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "round_trip_hops.py"), str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "no opbyop_bench" in result.stderr
