"""The Python front-end against clusters of real processes: a controller and workers started from
the `pathways` binary, with a token. Results against torch (functions, programs, gradients,
donation, awaiting, freeing, training against an embedded cluster), every bad input raising its
class with the processes serving on, a stranger without the token, a tenant kept out of another's
arrays, and a worker that dies under a client."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

# The token is the process's, read by its first call: set before any.
TOKEN = "python-real-processes-token"
os.environ["PATHWAYS_TOKEN"] = TOKEN

import pathways  # noqa: E402
from pathways import P  # noqa: E402

import checks  # noqa: E402
from checks import expect_bad_puts_and_slices_refused  # noqa: E402

BINARY = os.environ.get("PATHWAYS_BINARY")
pytestmark = pytest.mark.skipif(not BINARY, reason="PATHWAYS_BINARY is not set (ctest sets it)")


class Processes:
    """A controller and `workers` workers of two devices each, ended (by their process ids) on close."""

    def __init__(self, workers: int, heartbeat_timeout_ms: int = 10000) -> None:
        self.controller = subprocess.Popen(
            [BINARY, "controller", "--listen", "127.0.0.1:0", "--heartbeat-timeout-ms", str(heartbeat_timeout_ms),
             "--token", TOKEN], stdout=subprocess.PIPE, text=True)
        self.workers = []
        try:
            line = self.controller.stdout.readline()
            self.address = re.search(r"(127\.0\.0\.1:\d+)", line).group(1)
            self.workers = [subprocess.Popen([BINARY, "worker", "--controller", self.address, "--devices", "2",
                                              "--device-memory", "64MiB", "--token", TOKEN],
                                             stdout=subprocess.PIPE, text=True)
                            for _ in range(workers)]
            self.worker_addresses = []
            for w in self.workers:
                line = w.stdout.readline()  # "worker HOST:PORT registered as host ..."
                self.worker_addresses.append(re.search(r"(127\.0\.0\.1:\d+)", line).group(1))
        except BaseException:
            self.close()
            raise

    def wait_until_declared_gone(self, worker: int, seconds: float = 60) -> None:
        """Asks the controller (`pathways status --json`) until it no longer counts the worker alive."""
        address = self.worker_addresses[worker]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            out = subprocess.run([BINARY, "status", "--controller", self.address, "--json"], capture_output=True,
                                 text=True, timeout=30)
            hosts = json.loads(out.stdout).get("hosts", [])
            if not any(h["address"] == address and h["alive"] for h in hosts):
                return
            time.sleep(0.2)  # between questions; the answer is what is waited for
        raise AssertionError(f"the controller still counts {address} alive after {seconds} s")

    def close(self) -> None:
        for p in self.workers + [self.controller]:
            if p.poll() is None:
                p.terminate()
            p.wait(timeout=60)


@pytest.fixture(scope="module")
def processes():
    p = Processes(workers=2)
    yield p
    p.close()


@pytest.fixture
def client(processes):
    with pathways.connect(processes.address) as c:
        yield c


def test_a_function_with_a_collective_matches_torch(client):
    mesh = client.slice((4,))

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def total(v):
        return pathways.all_reduce(v, "x")

    host = torch.arange(8, dtype=torch.float32)
    torch.testing.assert_close(total(client.put(host, mesh, P("x"))).fetch(), host.view(4, 2).sum(0).repeat(4))


def test_bad_input_raises_its_class_and_the_processes_serve_on(processes, client):
    mesh = client.slice((2,))
    expect_bad_puts_and_slices_refused(client, mesh)

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def lam(v):
        f = lambda u: u + 1  # noqa: E731 - not in TorchScript's subset
        return f(v)

    with pytest.raises(pathways.InvalidArgumentError, match="lam"):
        lam(client.put(torch.zeros(2), mesh, P("x")))

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def over_unknown_axis(v):
        return pathways.all_reduce(v, "nope")

    with pytest.raises(pathways.InvalidArgumentError, match="nope"):
        over_unknown_axis(client.put(torch.zeros(2), mesh, P("x"))).fetch()

    @pathways.function(in_shardings=[P("x"), P("x")], out_shardings=[P("x")])
    def add(a, b):
        return a + b

    with pytest.raises(pathways.InvalidArgumentError):  # shapes that do not broadcast
        add(client.put(torch.zeros(4), mesh, P("x")), client.put(torch.zeros(6), mesh, P("x"))).fetch()

    # The workers serve on, this client and a new one.
    torch.testing.assert_close(add(client.put(torch.ones(2), mesh, P("x")), client.put(torch.ones(2), mesh, P("x")))
                               .fetch(), torch.full((2,), 2.0))
    with pathways.connect(processes.address) as other:
        assert torch.equal(other.put(torch.ones(2), other.slice((2,)), P("x")).fetch(), torch.ones(2))


def test_another_tenants_arrays_and_a_closed_client(processes, client):
    other = pathways.connect(processes.address)
    try:
        theirs = other.put(torch.arange(2, dtype=torch.float32), other.slice((2,)), P("x"))
        mesh = client.slice((2,))

        @pathways.function(in_shardings=[P("x"), P("x")], out_shardings=[P("x")])
        def add(a, b):
            return a + b

        with pytest.raises(pathways.InvalidArgumentError):
            add(client.put(torch.zeros(2), mesh, P("x")), theirs)
    finally:
        other.close()
    with pytest.raises(pathways.FailedPreconditionError, match="closed"):
        theirs.fetch()
    with pytest.raises(pathways.FailedPreconditionError, match="closed"):
        other.slice((2,))
    assert torch.equal(client.put(torch.ones(2), mesh, P("x")).fetch(), torch.ones(2))


def test_a_process_without_the_token_is_unauthenticated(processes):
    script = ("import pathways\n"
              "try:\n"
              f"    pathways.connect('{processes.address}')\n"
              "except pathways.UnauthenticatedError as e:\n"
              "    print('unauthenticated:', e.code)\n")
    env = dict(os.environ, PATHWAYS_TOKEN="not-the-token")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "unauthenticated: 16" in out.stdout, out.stdout + out.stderr
    env.pop("PATHWAYS_TOKEN")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "unauthenticated: 16" in out.stdout, out.stdout + out.stderr


def test_connecting_to_a_workers_address_says_it_is_not_a_controller(processes):
    with pytest.raises(pathways.UnimplementedError, match="is not a controller"):
        pathways.connect(processes.worker_addresses[0], token=TOKEN)


def test_a_token_given_to_connect_is_the_one_shown(processes, tmp_path):
    # The argument wins over a wrong PATHWAYS_TOKEN: the client puts, runs a function and fetches;
    # beside it, a client given a wrong token is refused, and one that gRPC could not carry is bad
    # input, in the same process.
    script = ("import pathways, torch\n"
              "@pathways.function(in_shardings=[pathways.P('x')], out_shardings=[pathways.P('x')])\n"
              "def double(x: torch.Tensor) -> torch.Tensor:\n"
              "    return x * 2.0\n"
              f"with pathways.connect('{processes.address}', token='{TOKEN}') as c:\n"
              "    a = double(c.put(torch.ones(2), c.slice((2,)), pathways.P('x')))\n"
              "    try:\n"
              f"        pathways.connect('{processes.address}', token='not-the-token')\n"
              "    except pathways.UnauthenticatedError as e:\n"
              "        print('wrong token:', e.code)\n"
              "    try:\n"
              f"        pathways.connect('{processes.address}', token='{TOKEN}\\n')\n"
              "    except pathways.InvalidArgumentError as e:\n"
              "        print('bad token:', e.code)\n"
              "    print('fetched:', a.fetch().tolist())\n")
    env = dict(os.environ, PATHWAYS_TOKEN="not-the-token")
    path = tmp_path / "tenant.py"  # a function's source is read from its file
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert "wrong token: 16" in out.stdout, out.stdout + out.stderr
    assert "bad token: 3" in out.stdout, out.stdout + out.stderr
    assert "fetched: [2.0, 2.0]" in out.stdout, out.stdout + out.stderr


def test_an_interpreter_exits_cleanly_while_a_daemon_thread_is_in_a_call(processes, tmp_path):
    # A daemon thread inside a native call (a 16 MiB put, the GIL released) when the main thread
    # returns: the call comes back while the interpreter shuts down, and must not abort the
    # process (it did every time: a forced unwind through pybind11's gil_scoped_release). The
    # thread calls the native put directly, so that no torch op of its own is in the loop.
    script = ("import threading, time, torch, pathways\n"
              "from pathways.core import _dtype_name\n"
              f"c = pathways.connect('{processes.address}', token='{TOKEN}')\n"
              "s = c.slice((1,))\n"
              "x = torch.zeros(4 << 20)\n"
              "buf = x.view(torch.uint8).numpy()\n"
              "def loop():\n"
              "    for _ in range(200):\n"
              "        c._native.put(buf, _dtype_name(x.dtype), [4 << 20], s._native, pathways.P()._runtime())\n"
              "threading.Thread(target=loop, daemon=True).start()\n"
              "time.sleep(0.3)\n"
              "print('main returns', flush=True)\n")
    path = tmp_path / "daemon.py"
    path.write_text(script)
    for _ in range(3):
        out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "main returns" in out.stdout, (out.returncode, out.stdout + out.stderr)


def test_a_worker_that_dies_fails_its_arrays_unavailable_and_the_other_serves_on():
    cluster = Processes(workers=2, heartbeat_timeout_ms=2000)
    try:
        with pathways.connect(cluster.address) as client:
            mesh = client.slice((4,))  # both workers' devices
            placed = client.put(torch.arange(4, dtype=torch.float32), mesh, P("x"))
            assert torch.equal(placed.fetch(), torch.arange(4, dtype=torch.float32))
            dead = cluster.workers[1]
            dead.send_signal(signal.SIGKILL)
            dead.wait(timeout=30)
            with pytest.raises(pathways.UnavailableError) as e:
                placed.fetch()
            assert e.value.code == 14
            # Once the controller has declared it gone, a slice lands on the worker left.
            cluster.wait_until_declared_gone(1)
            two = client.slice((2,))
            torch.testing.assert_close(client.put(torch.ones(2), two, P("x")).fetch(), torch.ones(2))
            with pytest.raises(pathways.ResourceExhaustedError):
                client.slice((4,))
    finally:
        cluster.close()


# The checks every cluster must pass (checks.py), here on real processes.

@pytest.mark.parametrize("check", checks.ON_EVERY_CLUSTER, ids=lambda c: c.__name__)
def test_what_every_cluster_must_do(client, check):
    check(client)


def test_dropping_the_last_reference_frees_the_shards():
    # Processes of its own, beating often: the memory a client sees comes with the workers'
    # heartbeats, which would otherwise also bring the frees of earlier tests' arrays.
    cluster = Processes(workers=1, heartbeat_timeout_ms=1000)
    try:
        with pathways.connect(cluster.address) as client:
            checks.check_dropping_the_last_reference_frees_the_shards(client)
    finally:
        cluster.close()


def test_training_has_the_losses_of_an_embedded_cluster(client):
    # Two workers of two devices each, as the embedded cluster beside it.
    on_processes = checks.train_losses(client)
    with pathways.LocalCluster(islands=1, hosts_per_island=2, devices_per_host=2, device_memory="64MiB") as cluster:
        with cluster.connect() as embedded:
            in_process = checks.train_losses(embedded)
    assert len(on_processes) == 3
    for a, b in zip(on_processes, in_process):
        assert abs(a - b) <= 1e-5 * b, (on_processes, in_process)
    assert on_processes[-1] < on_processes[0]
