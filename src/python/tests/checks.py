"""Checks that every cluster must pass, embedded or of real processes: shared by the tests of both
(test_pathways.py, test_real_processes.py). Each takes a client; results are compared with torch
run locally, bad input with the exception class it must raise."""

import asyncio
import gc
import re
import threading
import time

import pytest
import torch

import pathways
from pathways import P


def expect_bad_puts_and_slices_refused(client: "pathways.Client", mesh: "pathways.Slice") -> None:
    """A float16 put, a slice of 1000 devices, rows that do not split over the mesh's 2 devices,
    an unknown axis in a sharding, a sharding given as a string and a put on no slice each raise
    their class."""
    with pytest.raises(pathways.InvalidArgumentError, match="dtype"):
        client.put(torch.zeros(2, dtype=torch.float16), mesh)
    with pytest.raises(pathways.ResourceExhaustedError, match="devices"):
        client.slice((1000,))
    with pytest.raises(pathways.InvalidArgumentError):
        client.put(torch.zeros(3), mesh, P("x"))  # 3 rows do not split over 2 devices
    with pytest.raises(pathways.InvalidArgumentError, match="nope"):
        client.put(torch.zeros(2), mesh, P("nope"))
    with pytest.raises(pathways.InvalidArgumentError, match="pathways.P"):
        client.put(torch.zeros(2, 2), mesh, "xy")  # not P('x', 'y')
    with pytest.raises(pathways.InvalidArgumentError, match="Slice"):
        client.put(torch.zeros(2), None)


def check_a_program_over_two_slices(client: "pathways.Client") -> None:
    """A program of two functions on two slices, traced once, matches torch; its IR names both."""
    left, right = client.slice((2,)), client.slice((2,))

    @pathways.function(in_shardings=[P("x", None), P()], out_shardings=[P("x", None)])
    def mm(a, b):
        return a @ b

    @pathways.function(in_shardings=[P(None, "x")], out_shardings=[P(None, "x")])
    def act(h):
        return torch.tanh(h)

    @pathways.program
    def two_stage(a, b):
        return act(mm(a, b), slice=right)

    a, b = torch.rand(8, 4), torch.rand(4, 8)
    fa, fb = client.put(a, left, P("x", None)), client.put(b, left)
    for _ in range(2):
        torch.testing.assert_close(two_stage(fa, fb).fetch(), torch.tanh(a @ b))
    assert len(two_stage._traced) == 1
    assert "mm" in two_stage.ir() and "act" in two_stage.ir()

    @pathways.program
    def returns_nothing(a, b):
        mm(a, b)

    with pytest.raises(pathways.InvalidArgumentError, match="returns_nothing.*NoneType"):
        returns_nothing(fa, fb)


def check_vjp_and_grad(client: "pathways.Client") -> None:
    """vjp and grad of sharded functions through all_reduce, all_gather and reduce_scatter match
    torch's autograd of the whole function on the whole arrays; grad of a function without a
    scalar output says so."""
    mesh = client.slice((2,))

    @pathways.function(in_shardings=[P("x", None), P()], out_shardings=[P()])
    def loss(x, w):
        return pathways.all_reduce(((x @ w) ** 2).sum(), "x")

    x, w = torch.rand(4, 3), torch.rand(3, 2)
    vjp = pathways.vjp(loss, wrt=[1], with_outputs=True)
    value, dw = vjp(client.put(x, mesh, P("x", None)), client.put(w, mesh), client.put(torch.tensor(1.0), mesh))
    w_local = w.clone().requires_grad_(True)
    expected = ((x @ w_local) ** 2).sum()
    expected.backward()
    torch.testing.assert_close(value.fetch(), expected.detach())
    torch.testing.assert_close(dw.fetch(), w_local.grad)

    @pathways.function(in_shardings=[P("x"), P()], out_shardings=[P()])
    def scalar(x, w):
        return pathways.all_reduce((x * w).pow(2).sum(), "x")

    x, w = torch.rand(4), torch.rand(())
    dx, dw = pathways.grad(scalar)(client.put(x, mesh, P("x")), client.put(w, mesh))
    torch.testing.assert_close(dx.fetch(), 2 * x * w * w)
    torch.testing.assert_close(dw.fetch(), (2 * x * x * w).sum())

    @pathways.function(in_shardings=[P("x", None), P()], out_shardings=[P()])
    def gathered(x, w):
        return ((pathways.all_gather(x, "x") @ w) ** 2).sum()  # every member sees the whole x

    @pathways.function(in_shardings=[P(), P()], out_shardings=[P()])
    def scattered(x, w):
        piece = pathways.reduce_scatter(x * w, "x")  # the two members' x * w summed, one row block each
        return pathways.all_reduce((piece ** 2).sum(), "x")

    # Each with its whole-array form, its inputs and x's layout.
    cases = [(gathered, lambda x, w: ((x @ w) ** 2).sum(), torch.rand(4, 3), torch.rand(3, 2), P("x", None)),
             (scattered, lambda x, w: ((2 * x * w) ** 2).sum(), torch.rand(4, 3), torch.rand(3), P())]
    for f, whole, x, w, layout in cases:
        dx, dw = pathways.grad(f)(client.put(x, mesh, layout), client.put(w, mesh))
        x_local, w_local = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        whole(x_local, w_local).backward()
        torch.testing.assert_close(dx.fetch(), x_local.grad, msg=f.__name__)
        torch.testing.assert_close(dw.fetch(), w_local.grad, msg=f.__name__)

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def squares(x):
        return x * x

    with pytest.raises(pathways.InvalidArgumentError, match="grad of 'squares' needs .* one scalar floating-point"):
        pathways.grad(squares)(client.put(torch.rand(4), mesh, P("x")))

    def count(tokens):  # an integer output takes no cotangent
        return tokens.sum()

    with pytest.raises(pathways.InvalidArgumentError, match="grad of 'count' needs .* floating-point output; it "
                                                            "returns i64"):
        pathways.grad(pathways.function(count))(client.put(torch.arange(4), mesh))


def check_donation(client: "pathways.Client") -> None:
    """A donated array is updated in place and its handle is spent."""
    mesh = client.slice((2,))

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")], donate=(0,))
    def increment(p):
        p.add_(1.0)
        return p

    p = client.put(torch.zeros(4), mesh, P("x"))
    q = increment(p)
    torch.testing.assert_close(q.fetch(), torch.ones(4))
    with pytest.raises(pathways.InvalidArgumentError, match="donated"):
        p.fetch()


def check_awaiting_arrays(client: "pathways.Client") -> None:
    """Arrays are awaitable, many at once without a thread each, and a failed one raises; a
    waited-for array is ready at the first poll."""
    mesh = client.slice((2,))

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def double(v):
        return v * 2

    async def main():
        a = await double(client.put(torch.ones(4), mesh, P("x")))
        return a.fetch()

    torch.testing.assert_close(asyncio.run(main()), torch.full((4,), 2.0))

    threads = threading.active_count()

    async def many():
        arrays = [double(client.put(torch.full((4,), float(i)), mesh, P("x"))) for i in range(32)]
        done = await asyncio.gather(*arrays)
        assert threading.active_count() == threads
        return [a.fetch() for a in done]

    for i, got in enumerate(asyncio.run(many())):
        torch.testing.assert_close(got, torch.full((4,), 2.0 * i))

    @pathways.function(in_shardings=[P("x")], out_shardings=[P("x")])
    def out_of_range(v):
        return v + v[torch.tensor([10])]

    async def failing():
        await out_of_range(client.put(torch.ones(4), mesh, P("x")))

    with pytest.raises(pathways.InvalidArgumentError, match="out_of_range"):
        asyncio.run(failing())

    waited, fetched = double(client.put(torch.ones(4), mesh, P("x"))), double(client.put(torch.ones(4), mesh, P("x")))
    waited.ready()
    fetched.fetch()
    assert waited.is_ready() and fetched.is_ready()  # the first poll, after the wait


def device_memory_used(client: "pathways.Client") -> int:
    """Bytes in use over the cluster's devices, as the controller last heard from the hosts."""
    return sum(int(m) for m in re.findall(r"memory (\d+) /", client._native.describe()))


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # bounded poll: heartbeats carry the workers' memory
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def check_dropping_the_last_reference_frees_the_shards(client: "pathways.Client") -> None:
    """A 16 MiB array's shards are freed on the workers once its last reference goes."""
    gc.collect()
    mesh = client.slice((2,))
    before = device_memory_used(client)
    a = client.put(torch.zeros(1 << 22), mesh, P("x"))  # 16 MiB over two devices
    a.ready()
    assert wait_for(lambda: device_memory_used(client) >= before + (16 << 20)), (before, device_memory_used(client))
    # Other arrays of the cluster may come and go meanwhile (earlier tests' frees, as heartbeats
    # report them): what must go is this array's 16 MiB.
    held = device_memory_used(client)
    del a
    gc.collect()
    assert wait_for(lambda: device_memory_used(client) <= held - (16 << 20)), (held, device_memory_used(client))


def check_a_function_failing_at_run_time_names_the_line(client: "pathways.Client") -> None:
    """A body that raises while it runs (a dtype it did not expect) fails its arrays with
    InvalidArgumentError naming the function, this file and the line; the next call runs."""
    mesh = client.slice((2,))

    @pathways.function(in_shardings=[P("x", None)], out_shardings=[P("x", None)])
    def mixed(v):
        return torch.mm(v, v.double().t())  # f32 @ f64: fails as it runs

    with open(__file__) as source:
        line = next(i for i, l in enumerate(source, 1) if "f32 @ f64: fails as it runs" in l)
    x = client.put(torch.ones(4, 4), mesh, P("x", None))
    with pytest.raises(pathways.InvalidArgumentError, match="mixed") as e:
        mixed(x).fetch()
    assert f'File "{__file__}", line {line}' in str(e.value), str(e.value)

    @pathways.function(in_shardings=[P("x", None)], out_shardings=[P("x", None)])
    def fine(v):
        return v + 1.0

    torch.testing.assert_close(fine(x).fetch(), torch.full((4, 4), 2.0))


def train_losses(client: "pathways.Client", steps: int = 3) -> list:
    """The first losses of a small model, data 2 x pipeline 2, on the client's cluster."""
    trainer = pathways.Trainer(client, batch=8, seq_len=16, vocab=32, data_parallel=2, pipeline_stages=2,
                               microbatches=2, seed=7)
    return [trainer.step().result() for _ in range(steps)]


# What both test files run on a shared client of their cluster, one test each (parametrized).
ON_EVERY_CLUSTER = [check_a_program_over_two_slices, check_vjp_and_grad, check_donation, check_awaiting_arrays,
                    check_a_function_failing_at_run_time_names_the_line]
