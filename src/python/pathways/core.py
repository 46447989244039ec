"""Clusters, clients, slices, arrays and partition specs: the parts of pathways that hold data."""

from __future__ import annotations

import asyncio
import numbers
import operator
from typing import Any, Generator, List, Optional, Sequence, Tuple, Union

import torch

from . import _pathways as _ext
from .errors import FailedPreconditionError, InvalidArgumentError

_TO_RUNTIME = {torch.float32: "f32", torch.float64: "f64", torch.int32: "i32", torch.int64: "i64", torch.bool: "bool"}
_TO_TORCH = {v: k for k, v in _TO_RUNTIME.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _TO_RUNTIME:
        raise InvalidArgumentError(f"dtype {dtype} is not one the runtime holds ({', '.join(map(str, _TO_RUNTIME))})")
    return _TO_RUNTIME[dtype]


# ---- Partition specs ----

class P(tuple):
    """A partition spec: one entry per array dimension, a mesh axis name, a tuple of axis names
    or None (not split). ``P("x", None)`` splits rows over axis x and replicates along every axis
    not named; ``P(("x", "y"), None)`` splits rows into |x|*|y| blocks, x major (the order in
    which a collective over ``"x,y"`` ranks its members)."""

    def __new__(cls, *entries: Union[str, Tuple[str, ...], None]) -> "P":
        for e in entries:
            if not (e is None or isinstance(e, str) or (isinstance(e, tuple) and all(isinstance(a, str) for a in e))):
                raise InvalidArgumentError(f"a partition spec entry is an axis name, a tuple of names or None, not {e!r}")
        return super().__new__(cls, tuple(e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in entries))

    def _runtime(self) -> List[str]:
        for e in self:
            if isinstance(e, tuple) and len(e) == 0:
                raise InvalidArgumentError(f"{self!r}: an empty tuple of axes; use None for a dimension not split")
        return ["" if e is None else ",".join(e) if isinstance(e, tuple) else e for e in self]

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"


def _spec_of(entries: Sequence[str]) -> P:
    return P(*[None if e == "" else tuple(e.split(",")) if "," in e else e for e in entries])


# ---- Clusters and clients ----

def _bytes(size: Union[int, str]) -> int:
    if isinstance(size, str):
        return _ext.parse_bytes(size)
    try:
        if isinstance(size, bool):
            raise TypeError
        return operator.index(size)  # an int, or an integer of numpy's
    except TypeError:
        raise InvalidArgumentError(f"a memory size is a number of bytes or a string such as '256MiB', "
                                   f"not {size!r}") from None


def _int(name: str, value: Any) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)  # an int, or an integer of numpy's
    except TypeError:
        raise InvalidArgumentError(f"{name} is a whole number, not {value!r}") from None
    if not -2**63 <= n < 2**63:
        raise InvalidArgumentError(f"{name} is out of range: {n}")
    return n


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} is a number, not {value!r}")
    return float(value)


class LocalCluster:
    """A whole cluster inside this process: a controller and workers on loopback, over the same
    code paths (gRPC included) as separate processes. Usable as a context manager."""

    def __init__(self, islands: int = 1, hosts_per_island: int = 2, devices_per_host: int = 4,
                 device_memory: Union[int, str] = "256MiB", dcn_latency_us: int = 0,
                 dcn_gbps: float = 0.0, function_ops: str = "vetted") -> None:
        """``dcn_latency_us`` and ``dcn_gbps`` (0: unlimited) give traffic between islands an
        emulated data-centre link: a one-way latency and a bandwidth. Traffic within an island is
        untouched. ``function_ops`` is what functions may call: ``"vetted"`` (the ops checked to stay
        within their tensors) or ``"public"`` (every public torch op, for tenants that trust each
        other)."""
        if not isinstance(function_ops, str):
            raise InvalidArgumentError(f"function_ops is 'vetted' or 'public', not {function_ops!r}")
        self._cluster: Optional[Any] = _ext.LocalCluster(islands=islands, hosts_per_island=hosts_per_island,
                                                         devices_per_host=devices_per_host,
                                                         device_memory=_bytes(device_memory),
                                                         dcn_latency_us=_int("dcn_latency_us", dcn_latency_us),
                                                         dcn_gbps=_float("dcn_gbps", dcn_gbps),
                                                         function_ops=function_ops)

    @property
    def address(self) -> str:
        """The controller's HOST:PORT, for ``pathways.connect`` from other processes."""
        return self._live().address

    def connect(self) -> "Client":
        """A new client of this cluster."""
        return Client(_ext.connect_local(self._live()))

    def close(self) -> None:
        """Stops the cluster once its clients are gone (clients keep it alive until then)."""
        self._cluster = None

    def _live(self) -> Any:
        if self._cluster is None:
            raise FailedPreconditionError("this LocalCluster is closed")
        return self._cluster

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(address: str, token: Optional[str] = None) -> "Client":
    """A client of the running cluster whose controller is at ``address`` (HOST:PORT).

    ``token`` is the cluster's token (its controller's and workers' ``--token``; ``""`` for none);
    without one, the client shows the environment's ``PATHWAYS_TOKEN``, if set. Clients of one
    process may show different tokens, each to its own cluster. A token that is not printable ASCII
    of at most 4096 bytes raises ``InvalidArgumentError``."""
    return Client(_ext.connect(address, token))


class Slice:
    """A virtual slice of devices: a mesh with named axes, mapped by the controller to physical
    devices. Functions run on every device of it."""

    def __init__(self, native: Any) -> None:
        self._native = native

    @property
    def shape(self) -> Tuple[int, ...]:
        """The mesh's extent along each axis."""
        return tuple(self._native.mesh_shape)

    @property
    def axes(self) -> Tuple[str, ...]:
        """The mesh's axis names."""
        return tuple(self._native.axes)

    @property
    def num_devices(self) -> int:
        """The number of devices of the slice."""
        return self._native.num_devices

    def axis_size(self, axes: str) -> int:
        """The number of devices along comma-separated ``axes`` ('' for all)."""
        names = [a.strip() for a in axes.split(",") if a.strip()] or list(self.axes)
        size = 1
        for name in names:
            if name not in self.axes:
                raise InvalidArgumentError(f"the slice has no axis '{name}' (its axes: {', '.join(self.axes)})")
            size *= self.shape[self.axes.index(name)]
        return size

    def __repr__(self) -> str:
        return repr(self._native)


class Client:
    """A connection to one cluster. Thread-safe. Usable as a context manager (``close()`` at
    the end)."""

    def __init__(self, native: Any) -> None:
        self._native = native

    @property
    def id(self) -> str:
        """This client's id (the hash of a secret only it holds)."""
        return self._native.id()

    def describe(self) -> str:
        """Prints (and returns) a table of the cluster's islands, hosts and devices."""
        text = self._native.describe()
        print(text)
        return text

    def slice(self, shape: Sequence[int], axes: Optional[Sequence[str]] = None, island: Optional[int] = None,
              span_islands: bool = False) -> Slice:
        """A virtual slice of ``prod(shape)`` devices laid out as a mesh with ``axes`` (default x, y,
        z), within one island unless ``island`` pins it or ``span_islands`` lets it span several."""
        return Slice(self._native.create_slice(list(shape), list(axes or []), island, span_islands))

    def put(self, tensor: torch.Tensor, slice: Slice, spec: P = P()) -> "Array":
        """Places ``tensor`` on ``slice`` laid out by ``spec`` (copied once, before returning)."""
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"put takes a torch.Tensor, not {type(tensor).__name__}")
        if not isinstance(slice, Slice):
            raise InvalidArgumentError(f"put places a tensor on a Slice (client.slice), not {type(slice).__name__}")
        data = tensor.detach().to("cpu").contiguous()
        dtype = _dtype_name(data.dtype)
        # Bytes through a uint8 view: numpy knows no bfloat16, and booleans need no conversion.
        buffer = data.reshape(-1).view(torch.uint8).numpy() if data.numel() > 0 else b""
        return Array(self._native.put(buffer, dtype, list(data.shape), slice._native, _as_spec(spec)._runtime()))

    def run(self, program: "Program", *args: "Array") -> Union["Array", Tuple["Array", ...]]:
        """Runs a traced program with one client call; see ``@program``."""
        return program(*args)

    def write_trace(self, path: str) -> None:
        """Writes what the devices ran for this client as Chrome trace-event JSON."""
        self._native.write_trace(path)

    def close(self) -> None:
        """Ends this client: later calls raise FailedPreconditionError. Its arrays' shards are freed
        as their last references go (and by the controller once the client's lease lapses)."""
        self._native.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _as_spec(spec: Union[P, Sequence[Any], None]) -> P:
    if spec is None:
        return P()
    if isinstance(spec, P):
        return spec
    if isinstance(spec, (list, tuple)):
        return P(*spec)
    # A string is a sequence too, but "xy" as P('x', 'y') would split two dimensions unasked.
    raise InvalidArgumentError(f"a sharding is a pathways.P (one entry per dimension, e.g. P('x', None)), "
                               f"not {spec!r}")


class Array:
    """One logical array whose shards live on the workers: a future. ``fetch()`` waits for it;
    dropping the last reference frees the shards."""

    def __init__(self, native: Any) -> None:
        self._native = native

    @property
    def shape(self) -> Tuple[int, ...]:
        """The global shape."""
        return tuple(self._native.spec[1])

    @property
    def dtype(self) -> torch.dtype:
        """The element type, as a torch dtype."""
        return _TO_TORCH[self._native.spec[0]]

    @property
    def sharding(self) -> P:
        """How the array is laid over its slice: one entry per dimension."""
        return _spec_of(self._native.sharding)

    def fetch(self) -> torch.Tensor:
        """The whole array as a tensor, once computed; raises the error that prevented it."""
        data = self._native.fetch()  # the fetched bytes, shared with the tensor (no copy)
        if len(data) == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(self.dtype).reshape(self.shape)

    def ready(self) -> "Array":
        """Blocks until every shard is computed (or raises why it never will be)."""
        self._native.ready()
        return self

    def is_ready(self) -> bool:
        """Whether every shard is computed (or failed), without waiting."""
        return self._native.is_ready()

    def __await__(self) -> Generator[Any, None, "Array"]:
        # No thread waits: the runtime wakes the event loop once every shard is computed (or
        # failed), and ready() then returns at once, or raises why.
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def wake() -> None:
            def settle() -> None:
                if not done.done():
                    done.set_result(None)
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                pass

        self._native.on_ready(wake)
        yield from done.__await__()
        return self.ready()

    def __repr__(self) -> str:
        return f"Array({list(self.shape)}, {self.dtype}, {self.sharding})"


# ---- Training the built-in Transformer ----

class Trainer:
    """Trains the built-in decoder-only Transformer (``pathways train``'s) on a client's cluster:
    data, tensor and pipeline parallelism composed in one traced step, parameters and data made on
    the devices. ``step()`` issues a step and returns its loss's future (``.result()`` waits).
    Pipeline stages keep their forward passes' residuals on their devices for the backward pass;
    ``recompute=True`` recomputes them instead (less memory, a third more work per stage)."""

    def __init__(self, client: Client, model: str = "tiny", batch: int = 16, seq_len: int = 0, vocab: int = 0,
                 data_parallel: int = 1, tensor_parallel: int = 1, pipeline_stages: int = 1, microbatches: int = 1,
                 islands: int = 1, seed: int = 0, learning_rate: float = 3e-3, data: str = "markov",
                 resume: str = "", recompute: bool = False) -> None:
        self._native = _ext.Trainer(client._native, model=model, batch=batch, seq_len=seq_len, vocab=vocab,
                                    data_parallel=data_parallel, tensor_parallel=tensor_parallel,
                                    pipeline_stages=pipeline_stages, microbatches=microbatches, islands=islands,
                                    seed=seed, learning_rate=learning_rate,
                                    text_file="" if data == "markov" else data, resume_from=resume,
                                    recompute=recompute)

    def step(self) -> Any:
        """Issues the next step with one client call; returns the future of its mean loss (nats)."""
        return self._native.step()

    def save(self, path: str) -> None:
        """Checkpoints parameters and optimizer state (each host writes its own shards)."""
        self._native.save(path)

    @property
    def entropy(self) -> float:
        """The data's entropy rate, the best mean loss possible (NaN for a text file)."""
        return self._native.entropy

    @property
    def tokens_per_step(self) -> int:
        """Tokens each step trains on: batch x context."""
        return self._native.tokens_per_step

    def __repr__(self) -> str:
        return f"Trainer({self._native.description})"
