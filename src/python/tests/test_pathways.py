"""The Python front-end on an embedded cluster: clusters, slices, arrays, functions, programs,
gradients and errors, each result against torch run locally."""

import asyncio
import signal
import threading
import time
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import pathways
import pathways as pw
from pathways import all_reduce as summed_over
from pathways import P

import checks
from checks import expect_bad_puts_and_slices_refused, wait_for


@pytest.fixture(scope="module")
def cluster():
    with pathways.LocalCluster(islands=1, hosts_per_island=2, devices_per_host=4, device_memory="64MiB") as c:
        yield c


@pytest.fixture
def client(cluster):
    with cluster.connect() as c:
        yield c


def test_every_public_name_has_a_docstring():
    for name in pathways.__all__:
        assert getattr(pathways, name).__doc__, name
    assert "virtual slices" in pathways.__doc__


def test_describe_names_the_hosts(client, capsys):
    text = client.describe()
    assert "island 0" in text or "island" in text
    assert text in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.bool])
def test_put_and_fetch_round_trip(client, dtype):
    mesh = client.slice((4, 2), axes=("x", "y"))
    assert mesh.shape == (4, 2) and mesh.axes == ("x", "y") and mesh.num_devices == 8
    host = (torch.rand(8, 6) * 100).to(dtype)
    for spec in [P(), P("x", None), P("x", "y"), P(None, ("y",)), P(("x", "y"), None), P(("y", "x"), None)]:
        a = client.put(host, mesh, spec)
        assert a.shape == (8, 6) and a.dtype == dtype
        assert a.sharding == P(*spec, *[None] * (2 - len(spec)))  # one entry per dimension
        assert torch.equal(a.fetch(), host)
    with pytest.raises(pathways.InvalidArgumentError, match="does not divide evenly"):
        client.put(host, mesh, P(None, ("x", "y")))  # 6 columns over 8 blocks
    with pytest.raises(pathways.InvalidArgumentError, match="more than once"):
        client.put(host, mesh, P(("x", "y"), "x"))


def test_a_dimension_split_over_two_axes_is_ranked_as_their_collectives_rank(client):
    mesh = client.slice((4, 2), axes=("x", "y"))

    # Gathering the blocks over "x,y" in the collective's rank order gives the array back: block k
    # of the rows sits on the member of rank k.
    @pathways.function(in_shardings=[P(("x", "y"), None)], out_shardings=[P(None, None)])
    def gather(v):
        return pathways.all_gather(v, "x,y")

    host = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
    torch.testing.assert_close(gather(client.put(host, mesh, P(("x", "y"), None))).fetch(), host)


def test_a_function_with_a_collective_matches_torch(client):
    mesh = client.slice((4, 2), axes=("x", "y"))

    @pathways.function(in_shardings=[P("x", None)], out_shardings=[P("x", None)])
    def normalise(v):
        return v / pathways.all_reduce(v.sum(), "x")

    host = torch.rand(8, 3)
    out = normalise(client.put(host, mesh, P("x", None)))
    assert out.shape == (8, 3)
    torch.testing.assert_close(out.fetch(), host / host.sum())
    normalise(client.put(torch.rand(8, 3), mesh, P("x", None))).ready()
    assert len(normalise._compiled) == 1  # compiled once for these shapes
    normalise(client.put(torch.rand(16, 3), mesh, P("x", None))).ready()
    assert len(normalise._compiled) == 2


def test_outputs_shaped_by_collectives(client):
    mesh = client.slice((4,), axes=("x",))

    @pathways.function(in_shardings=[P("x")], out_shardings=[P(), P("x")])
    def gather_and_scatter(v):
        return pathways.all_gather(v, "x"), pathways.reduce_scatter(pathways.all_gather(v, "x"), "x")

    host = torch.arange(8, dtype=torch.float32)
    whole, piece = gather_and_scatter(client.put(host, mesh, P("x")))
    assert whole.shape == (8,) and piece.shape == (8,)
    torch.testing.assert_close(whole.fetch(), host)
    torch.testing.assert_close(piece.fetch(), host * 4)






def test_vjp_keeping_residuals_matches_the_recomputing_one(client):
    mesh = client.slice((2,))

    @pathways.function(in_shardings=[P("x", None), P()], out_shardings=[P("x", None)])
    def layer(x, w):
        return torch.tanh(x @ w) * pathways.all_reduce(x.sum(), "x")

    x, w, dy = torch.rand(4, 3), torch.rand(3, 2), torch.rand(4, 2)
    fx, fw, fdy = client.put(x, mesh, P("x", None)), client.put(w, mesh), client.put(dy, mesh, P("x", None))
    y, residuals = pathways.vjp(layer, keep_residuals=True)(fx, fw)
    assert isinstance(residuals, pathways.Residuals)
    assert residuals.handle.fetch().item() > 0  # bytes kept on each device
    whole = pathways.vjp(layer, with_outputs=True)(fx, fw, fdy)
    for _ in range(2):  # the kept graph serves more than one backward pass
        dx, dw = residuals.backward(fdy)
        for got, want in zip((y, dx, dw), whole):
            torch.testing.assert_close(got.fetch(), want.fetch())

    # Inside a program: the forward half, then the backward half, traced into one run.
    @pathways.program
    def step(a, b, cot):
        out, kept = pathways.vjp(layer, wrt=[1], keep_residuals=True)(a, b)
        return out, kept.backward(cot)

    out, dw_traced = step(fx, fw, fdy)
    torch.testing.assert_close(dw_traced.fetch(), whole[2].fetch())
    assert "vjp_forward(layer)" in step.ir() and "vjp_backward(layer)" in step.ir()
    with pytest.raises(pathways.InvalidArgumentError, match="drop with_outputs"):
        pathways.vjp(layer, with_outputs=True, keep_residuals=True)
    # The package's own errors for arguments of the wrong kind, not AttributeError.
    with pytest.raises(pathways.InvalidArgumentError, match="backward takes pathways Arrays"):
        residuals.backward(dy)
    with pytest.raises(pathways.InvalidArgumentError, match="runs on a Slice"):
        layer(fx, fw, slice="x")
    with pytest.raises(pathways.InvalidArgumentError, match="runs on a Slice"):
        pathways.grad(layer)(fx, fw, slice=3)

    # A handle put from the client carries no residuals: the backward half says so.
    fake = pathways.Residuals(client.put(torch.tensor(8), mesh), residuals._backward, mesh)
    with pytest.raises(pathways.FailedPreconditionError, match="carries no residuals"):
        fake.backward(fdy)[0].fetch()


class _Unhashable:
    """A callable that cannot be hashed, as pytest's marks are."""
    __hash__ = None  # type: ignore[assignment]

    def __call__(self) -> None:
        pass


UNHASHABLE_GLOBAL = _Unhashable()


def test_a_module_holding_an_unhashable_callable_may_define_functions(client):
    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def double(v):
        return summed_over(v, "x") * 0 + v * 2

    mesh = client.slice((2,))
    torch.testing.assert_close(double(client.put(torch.ones(2), mesh, P("x"))).fetch(), torch.full((2,), 2.0))


def test_a_function_whose_source_cannot_be_read_says_so():
    # As at the interpreter's prompt or in `python -c`: no file holds the function's lines.
    code = ("@pathways.function(in_shardings=[P('x')], out_shardings=[P('x')])\n"
            "def typed_in(v):\n"
            "    return v * 2\n")
    with pytest.raises(pathways.InvalidArgumentError, match="'typed_in': its source cannot be read"):
        exec(compile(code, "<stdin>", "exec"), {"pathways": pathways, "P": P})


def test_bodies_may_name_the_collectives_by_an_alias(client):
    mesh = client.slice((4,))

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def via_module_alias(v):
        return v / pw.all_reduce(v.sum(), "x")

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def via_function_alias(v):
        total = summed_over(v.sum(), "x")  # "summed_over(" in a comment or string stays as it is
        return v / total

    host = torch.rand(8)
    for f in (via_module_alias, via_function_alias):
        torch.testing.assert_close(f(client.put(host, mesh, P("x"))).fetch(), host / host.sum())


def test_axis_index_finds_a_shards_neighbours(client):
    mesh = client.slice((4,))

    # One step of a 1-D stencil: each shard averages its value with its two neighbours' (a ring).
    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def stencil(v):
        every = pathways.all_gather(v, "x")
        me = pathways.axis_index("x")
        return (every[(me + 3) % 4:(me + 3) % 4 + 1] + v + every[(me + 1) % 4:(me + 1) % 4 + 1]) / 3.0

    host = torch.tensor([0.0, 3.0, 6.0, 9.0])
    want = (torch.roll(host, 1) + host + torch.roll(host, -1)) / 3.0
    torch.testing.assert_close(stencil(client.put(host, mesh, P("x"))).fetch(), want)


def test_roll_moves_each_shard_to_its_neighbour(client):
    mesh = client.slice((4,))

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def stencil(v):
        return (pathways.roll(v, "x", 1) + v + pathways.roll(v, "x", -1)) / 3.0

    host = torch.tensor([0.0, 3.0, 6.0, 9.0, 1.0, 2.0, 4.0, 8.0])  # two elements per shard
    want = (torch.roll(host, 2) + host + torch.roll(host, -2)) / 3.0
    torch.testing.assert_close(stencil(client.put(host, mesh, P("x"))).fetch(), want)




def test_all_to_all_and_broadcast_match_torch(client):
    mesh = client.slice((4,), axes=("x",))

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x"), P("x")])
    def exchange(v):
        return pathways.all_to_all(v, "x"), pathways.broadcast(v, "x", root=2)

    host = torch.arange(16, dtype=torch.float32)
    swapped, rooted = exchange(client.put(host, mesh, P("x")))
    # Member m's piece i goes to member i: the 4x4 blocks of the shards come back transposed.
    torch.testing.assert_close(swapped.fetch(), host.reshape(4, 4).t().reshape(16))
    torch.testing.assert_close(rooted.fetch(), host[8:12].repeat(4))


def test_a_function_runs_on_the_slice_it_is_given(client):
    mesh = client.slice((2,), axes=("x",))

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def double(v):
        return v * 2

    x = client.put(torch.arange(4, dtype=torch.float32), mesh, P("x"))
    torch.testing.assert_close(double(x, slice=mesh).fetch(), torch.arange(4, dtype=torch.float32) * 2)
    # Other devices: the input moves there (as between a program's slices), and so does the work.
    elsewhere = client.slice((2,), axes=("x",))
    torch.testing.assert_close(double(x, slice=elsewhere).fetch(), torch.arange(4, dtype=torch.float32) * 2)


def test_bad_functions_and_calls_raise_at_the_first_call_naming_the_function(client):
    mesh = client.slice((2,), axes=("x",))
    x = client.put(torch.zeros(4), mesh, P("x"))

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def over_nothing(v):
        return pathways.all_reduce(v, "nope")

    with pytest.raises(pathways.InvalidArgumentError, match="nope"):
        over_nothing(x).fetch()

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def mistyped(v):
        return v + "one"  # a type error in TorchScript

    line = next(i for i, l in enumerate(open(__file__), 1) if "a type error in TorchScript" in l)
    with pytest.raises(pathways.InvalidArgumentError, match="mistyped") as e:
        mistyped(x)
    assert f"line {line}" in str(e.value), str(e.value)

    @pathways.function(in_shardings=[P("x"), P("x")], out_shardings=[P("x")])
    def add(a, b):
        return a + b

    with pytest.raises((pathways.InvalidArgumentError, TypeError)):
        add(x)  # one input of two
    with pytest.raises(pathways.InvalidArgumentError):
        add(x, client.put(torch.zeros(6), mesh, P("x"))).fetch()  # shapes that do not add
    # Each class has its code, OutOfRangeError's too.
    assert pathways.OutOfRangeError.code == 11 and issubclass(pathways.OutOfRangeError, IndexError)
    # The cluster serves on.
    torch.testing.assert_close(add(x, x).fetch(), torch.zeros(4))


def test_errors_raise_the_class_of_their_code(cluster, client):
    mesh = client.slice((2,))
    expect_bad_puts_and_slices_refused(client, mesh)

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def lam(v):
        f = lambda u: u + 1  # noqa: E731 - not in TorchScript's subset
        return f(v)

    line = next(i for i, l in enumerate(open(__file__), 1) if "not in TorchScript's subset" in l)
    with pytest.raises(pathways.InvalidArgumentError, match="lam") as e:
        lam(client.put(torch.zeros(2), mesh, P("x")))
    assert f"line {line}" in str(e.value), str(e.value)
    assert e.value.code == 3

    other = cluster.connect()
    theirs = other.put(torch.zeros(2), other.slice((2,)), P("x"))

    @pathways.function(in_shardings=[P("x"), P("x")], out_shardings=[P("x")])
    def add(a, b):
        return a + b

    with pytest.raises(pathways.InvalidArgumentError):
        add(client.put(torch.zeros(2), mesh, P("x")), theirs)
    other.close()
    with pytest.raises(pathways.FailedPreconditionError, match="closed"):
        theirs.fetch()
    # The cluster still serves.
    assert torch.equal(client.put(torch.ones(2), mesh, P("x")).fetch(), torch.ones(2))


def test_the_training_example_reports_the_losses_of_pathways_train(tmp_path):
    binary = os.environ.get("PATHWAYS_BINARY")
    if not binary:
        pytest.skip("PATHWAYS_BINARY is not set (ctest sets it)")
    flags = ["--steps", "12", "--batch", "8", "--data-parallel", "2", "--tensor-parallel", "2",
             "--pipeline-stages", "2", "--microbatches", "2", "--seed", "3", "--device-memory", "64MiB"]
    example = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "train_lm.py")
    subprocess.run([sys.executable, example, *flags, "--metrics-jsonl", str(tmp_path / "py.jsonl")], check=True,
                   env=os.environ, timeout=240)
    subprocess.run([binary, "train", *flags, "--metrics-jsonl", str(tmp_path / "cli.jsonl")], check=True, timeout=240)
    read = lambda name: [json.loads(l)["loss"] for l in open(tmp_path / name)]  # noqa: E731
    python_losses, cli_losses = read("py.jsonl"), read("cli.jsonl")
    assert len(python_losses) == len(cli_losses) == 12
    for a, b in zip(python_losses, cli_losses):
        assert abs(a - b) <= 1e-5 * b, (python_losses, cli_losses)
    assert python_losses[-1] < python_losses[0]


def test_the_readmes_example_runs_and_prints_what_it_says(tmp_path):
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md")).read()
    example = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "example.py").write_text(example)  # TorchScript reads the functions' source from a file
    out = subprocess.run([sys.executable, str(tmp_path / "example.py")], check=True, env=os.environ, timeout=240,
                         capture_output=True, text=True).stdout
    # The line its comment promises: shape, dtype, sharding, and a sum of 1 (normalised).
    shape, dtype, sharding, total = re.search(r"^(\(8, 3\)) (torch\.float32) (P\('x', None\)) tensor\(([0-9.]+)\)",
                                              out, re.M).groups()
    assert abs(float(total) - 1.0) < 1e-4, out
    assert "%1 = normalise(%0) on slice" in out, out  # the program's IR: two calls






def test_ctrl_c_stops_a_wait_and_the_cluster_serves_on(client):
    mesh = client.slice((1,))

    @pathways.function(in_shardings=[P()], out_shardings=[P()])
    def slow(m):
        for _ in range(3000):
            m = torch.tanh(m @ m)
        return m

    busy = slow(client.put(torch.rand(256, 256), mesh))
    main = threading.get_ident()
    threading.Timer(0.2, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        busy.fetch()
    assert time.monotonic() - start < 5
    assert busy.fetch().shape == (256, 256)  # the work went on; waiting again gets it
    assert torch.equal(client.put(torch.ones(2), mesh).fetch(), torch.ones(2))









def test_closing_a_client_while_other_threads_call_it(cluster):
    client = cluster.connect()
    mesh = client.slice((2,))

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def inc(v):
        return v + 1.0

    x = client.put(torch.zeros(2), mesh, P("x"))
    outcomes = []

    def caller():
        try:
            for _ in range(200):
                inc(x)
            outcomes.append("done")
        except pathways.FailedPreconditionError:
            outcomes.append("closed")

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for t in threads:
        t.start()
    client.close()  # while they call: each call either completes or says the client is closed
    for t in threads:
        t.join(timeout=60)
    assert sorted(set(outcomes)) <= ["closed", "done"] and len(outcomes) == 2, outcomes
    with pytest.raises(pathways.FailedPreconditionError, match="closed"):
        inc(x)


def test_a_function_follows_its_arrays_to_a_new_client_and_is_ready_turns_true(cluster):
    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def twice(v):
        return v * 2.0

    for _ in range(3):  # each new client compiles for itself, never reuses a closed one's function
        with cluster.connect() as client:
            mesh = client.slice((2,))
            y = twice(client.put(torch.ones(2), mesh, P("x")))
            torch.testing.assert_close(y.fetch(), torch.full((2,), 2.0))
            assert wait_for(y.is_ready)
    assert len(twice._compiled) == 3


def test_a_trainer_refuses_to_step_once_its_client_is_closed(cluster):
    client = cluster.connect()
    trainer = pathways.Trainer(client, batch=8, seq_len=8, vocab=16)
    assert trainer.step().result() > 0
    client.close()
    with pytest.raises(pathways.FailedPreconditionError, match="closed"):
        trainer.step()


def test_a_trainer_refuses_bad_sizes_and_rates_by_name(client):
    # A negative size is refused, not taken for the preset's; a rate that is no step size is
    # refused before it reaches the optimizer's source.
    for kwargs in [dict(vocab=-3), dict(seq_len=-1)]:
        with pytest.raises(pathways.InvalidArgumentError, match="vocabulary of 2 to|must be 1 to 2"):
            pathways.Trainer(client, batch=8, **kwargs)
    for rate in [float("inf"), float("nan"), 0.0]:
        with pytest.raises(pathways.InvalidArgumentError, match="learning rate"):
            pathways.Trainer(client, batch=8, learning_rate=rate)


# The checks every cluster must pass (checks.py), here on an embedded one.

@pytest.mark.parametrize("check", checks.ON_EVERY_CLUSTER, ids=lambda c: c.__name__)
def test_what_every_cluster_must_do(client, check):
    check(client)


def test_dropping_the_last_reference_frees_the_shards():
    # A cluster of its own: no other test's arrays come and go on its devices meanwhile.
    with pathways.LocalCluster(islands=1, hosts_per_island=1, devices_per_host=2, device_memory="64MiB") as cluster:
        with cluster.connect() as client:
            checks.check_dropping_the_last_reference_frees_the_shards(client)


def test_bad_cluster_shapes_and_sizes_are_refused():
    for shape in [dict(islands=0), dict(islands=-1), dict(hosts_per_island=0), dict(devices_per_host=0)]:
        with pytest.raises(pathways.InvalidArgumentError, match="at least one"):
            pathways.LocalCluster(**shape)
    # Every host is served in this process: a million islands is refused, not started.
    for shape in [dict(islands=10**6), dict(islands=64, hosts_per_island=65), dict(devices_per_host=4097)]:
        with pytest.raises(pathways.InvalidArgumentError, match="at most 4096 hosts"):
            pathways.LocalCluster(**shape)
    with pytest.raises(pathways.InvalidArgumentError, match="memory size"):
        pathways.LocalCluster(device_memory=1.5)
    with pytest.raises(pathways.InvalidArgumentError, match="latency must be 0 to 10 s"):
        pathways.LocalCluster(dcn_latency_us=-1)
    with pytest.raises(pathways.InvalidArgumentError, match="dcn_latency_us is a whole number"):
        pathways.LocalCluster(dcn_latency_us=2.5)
    with pytest.raises(pathways.InvalidArgumentError, match="out of range"):
        pathways.LocalCluster(dcn_latency_us=2**70)
    with pytest.raises(pathways.InvalidArgumentError, match="bandwidth must be 0"):
        pathways.LocalCluster(dcn_gbps=float("nan"))
    with pytest.raises(pathways.InvalidArgumentError, match="dcn_gbps is a number"):
        pathways.LocalCluster(dcn_gbps="10")


def test_functions_call_the_vetted_ops_unless_the_cluster_allows_every_public_one(client):
    def windowed(v):
        return v + torch.kaiser_window(3, False)

    mesh = client.slice((1,))
    host = torch.zeros(3)
    with pytest.raises(pathways.InvalidArgumentError, match=r"aten::kaiser_window .*--function-ops public"):
        pathways.function(windowed)(client.put(host, mesh, P()))
    with pathways.LocalCluster(hosts_per_island=1, devices_per_host=1, function_ops="public") as cluster:
        with cluster.connect() as trusting:
            got = pathways.function(windowed)(trusting.put(host, trusting.slice((1,)), P())).fetch()
            torch.testing.assert_close(got, torch.kaiser_window(3, False))
    for bad in ["all", 3]:
        with pytest.raises(pathways.InvalidArgumentError, match="'vetted' or 'public'|known: vetted"):
            pathways.LocalCluster(function_ops=bad)


def test_an_emulated_link_between_islands_delays_collectives_across_them():
    # Two islands of one single-device host, 30 ms one way between them.
    with pathways.LocalCluster(islands=2, hosts_per_island=1, devices_per_host=1, device_memory="64MiB",
                               dcn_latency_us=30000) as cluster:
        with cluster.connect() as client:
            across = client.slice((2,), axes=("x",), span_islands=True)
            within = client.slice((1,), axes=("x",), island=0)

            @pathways.function(in_shardings=[P("x")], out_shardings=[P()])
            def total(v):
                return pathways.all_reduce(v, "x")

            for mesh, n in [(across, 2), (within, 1)]:
                x = client.put(torch.ones(n), mesh, P("x"))
                total(x).fetch()  # compiled, and the links made
                start = time.monotonic()
                out = total(x).fetch()
                took = time.monotonic() - start
                torch.testing.assert_close(out, torch.tensor([float(n)]))
                if mesh is across:
                    assert took >= 0.03, took  # at least one message each way crossed the link
