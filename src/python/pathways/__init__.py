"""pathways: a single-controller runtime for a cluster of accelerators, from Python.

A client places torch tensors sharded over *virtual slices* of devices, calls *functions* written
in TorchScript's subset of Python on them (run SPMD on every device of the slice, collectives over
the slice's named axes) and gets arrays back at once: arrays are futures, computed on the workers.

    import torch, pathways

    with pathways.LocalCluster(islands=1, hosts_per_island=2, devices_per_host=4) as cluster:
        client = cluster.connect()
        mesh = client.slice((4, 2), axes=("x", "y"))

        @pathways.function(in_shardings=[pathways.P("x", None)], out_shardings=[pathways.P("x", None)])
        def normalise(v):
            return v / pathways.all_reduce(v.sum(), "x")

        a = client.put(torch.rand(8, 3), mesh, pathways.P("x", None))
        print(normalise(a).fetch().sum())   # 1.0

Functions compile on first call for their inputs' shapes and dtypes (cached), and ``@program``
traces several calls into one program run with one client call. Errors are exceptions of
``pathways.Error``'s hierarchy, carrying the runtime's status code.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import textwrap
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import _pathways as _ext
from .errors import (AbortedError, AlreadyExistsError, CancelledError, DataLossError, DeadlineExceededError, Error,
                     FailedPreconditionError, InternalError, InvalidArgumentError, NotFoundError,
                     PermissionDeniedError, ResourceExhaustedError, UnauthenticatedError, UnavailableError,
                     UnimplementedError)

__all__ = [
    "LocalCluster", "connect", "Client", "Slice", "Array", "P", "function", "Function", "program", "Program",
    "vjp", "grad", "Trainer", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "Error",
    "InvalidArgumentError", "NotFoundError", "UnavailableError", "ResourceExhaustedError", "DeadlineExceededError",
    "UnauthenticatedError", "PermissionDeniedError", "FailedPreconditionError", "AbortedError", "CancelledError",
    "AlreadyExistsError", "DataLossError", "InternalError", "UnimplementedError",
]

_TO_RUNTIME = {torch.float32: "f32", torch.float64: "f64", torch.int32: "i32", torch.int64: "i64", torch.bool: "bool"}
_TO_TORCH = {v: k for k, v in _TO_RUNTIME.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _TO_RUNTIME:
        raise InvalidArgumentError(f"dtype {dtype} is not one the runtime holds ({', '.join(map(str, _TO_RUNTIME))})")
    return _TO_RUNTIME[dtype]


# ---- Partition specs ----

class P(tuple):
    """A partition spec: one entry per array dimension, a mesh axis name or None (not split).
    ``P("x", None)`` splits rows over axis x and replicates along every axis not named. (A tuple
    of several axis names, one dimension split over all of them, is refused for now.)"""

    def __new__(cls, *entries: Union[str, Tuple[str, ...], None]) -> "P":
        for e in entries:
            if not (e is None or isinstance(e, str) or (isinstance(e, tuple) and all(isinstance(a, str) for a in e))):
                raise InvalidArgumentError(f"a partition spec entry is an axis name, a tuple of names or None, not {e!r}")
        return super().__new__(cls, tuple(e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in entries))

    def _runtime(self) -> List[str]:
        for e in self:
            if isinstance(e, tuple) and len(e) != 1:
                raise InvalidArgumentError(f"{self!r}: one dimension split over several mesh axes ({e!r}) is not "
                                           f"supported yet; split it over one axis")
        return ["" if e is None else e for e in self]

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"


def _spec_of(entries: Sequence[str]) -> P:
    return P(*[None if e == "" else tuple(e.split(",")) if "," in e else e for e in entries])


# ---- Clusters and clients ----

def _bytes(size: Union[int, str]) -> int:
    return size if isinstance(size, int) else _ext.parse_bytes(size)


class LocalCluster:
    """A whole cluster inside this process: a controller and workers on loopback, over the same
    code paths (gRPC included) as separate processes. Usable as a context manager."""

    def __init__(self, islands: int = 1, hosts_per_island: int = 2, devices_per_host: int = 4,
                 device_memory: Union[int, str] = "256MiB") -> None:
        self._cluster: Optional[Any] = _ext.LocalCluster(islands=islands, hosts_per_island=hosts_per_island,
                                                         devices_per_host=devices_per_host,
                                                         device_memory=_bytes(device_memory))

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


def connect(address: str) -> "Client":
    """A client of the running cluster whose controller is at ``address`` (HOST:PORT)."""
    return Client(_ext.connect(address))


class Slice:
    """A virtual slice of devices: a mesh with named axes, mapped by the controller to physical
    devices. Functions run on every device of it."""

    def __init__(self, native: Any) -> None:
        self._native = native

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self._native.mesh_shape)

    @property
    def axes(self) -> Tuple[str, ...]:
        return tuple(self._native.axes)

    @property
    def num_devices(self) -> int:
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
    """A connection to one cluster. Thread-safe. Usable as a context manager; ``close()`` lets go
    of everything the client holds on the workers."""

    def __init__(self, native: Any) -> None:
        self._native = native

    @property
    def id(self) -> str:
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
        self._native.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _as_spec(spec: Union[P, Sequence[Any], None]) -> P:
    if spec is None:
        return P()
    return spec if isinstance(spec, P) else P(*spec)


class Array:
    """One logical array whose shards live on the workers: a future. ``fetch()`` waits for it;
    dropping the last reference frees the shards."""

    def __init__(self, native: Any) -> None:
        self._native = native

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self._native.spec[1])

    @property
    def dtype(self) -> torch.dtype:
        return _TO_TORCH[self._native.spec[0]]

    @property
    def sharding(self) -> P:
        return _spec_of(self._native.sharding)

    def fetch(self) -> torch.Tensor:
        """The whole array as a tensor, once computed; raises the error that prevented it."""
        data = self._native.fetch()
        if not data:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype).reshape(self.shape)

    def ready(self) -> "Array":
        """Blocks until every shard is computed (or raises why it never will be)."""
        self._native.ready()
        return self

    def is_ready(self) -> bool:
        return self._native.is_ready()

    def __await__(self):
        return asyncio.get_event_loop().run_in_executor(None, self.ready).__await__()

    def __repr__(self) -> str:
        return f"Array({list(self.shape)}, {self.dtype}, {self.sharding})"


# ---- Collectives and random numbers inside functions ----
#
# In a function these name the runtime's ops (`pathways.all_reduce` compiles to the op on the
# workers). Called in Python, they only compute shapes: a function's output shapes are found by
# running it once on meta tensors of its shards' shapes, with the slice's mesh in _MESH.

_MESH: contextvars.ContextVar[Optional[Slice]] = contextvars.ContextVar("pathways_mesh", default=None)


def _group(axes: str) -> int:
    mesh = _MESH.get()
    if mesh is None:
        raise FailedPreconditionError("pathways collectives run inside a @pathways.function, on a slice")
    return mesh.axis_size(axes)


def all_reduce(x: torch.Tensor, axes: str = "", op: str = "sum") -> torch.Tensor:
    """Combines ``x`` over the devices along ``axes`` ('sum', 'max', 'min' or 'mean')."""
    _group(axes)
    return x.clone()


def all_gather(x: torch.Tensor, axes: str = "", dim: int = 0) -> torch.Tensor:
    """Concatenates every member's ``x`` along ``dim``."""
    shape = list(x.shape)
    shape[dim] *= _group(axes)
    return x.new_empty(shape)


def reduce_scatter(x: torch.Tensor, axes: str = "", op: str = "sum", dim: int = 0) -> torch.Tensor:
    """Sums over the members and keeps this member's piece along ``dim``."""
    shape = list(x.shape)
    shape[dim] //= _group(axes)
    return x.new_empty(shape)


def all_to_all(x: torch.Tensor, axes: str = "", dim: int = 0) -> torch.Tensor:
    """Sends piece i of ``x`` along ``dim`` to member i."""
    _group(axes)
    return x.clone()


def broadcast(x: torch.Tensor, axes: str = "", root: int = 0) -> torch.Tensor:
    """Every member gets the root's ``x``."""
    _group(axes)
    return x.clone()


def uniform(shape: List[int], spec: List[str], seed: int, step: int) -> torch.Tensor:
    """Counter-based uniform numbers in [0, 1) for this shard's block of one global array."""
    return torch.empty(shape)


def normal(shape: List[int], spec: List[str], seed: int, step: int) -> torch.Tensor:
    """Counter-based standard normal numbers for this shard's block of one global array."""
    return torch.empty(shape)


# ---- Functions ----

def _source_of(fn: Callable) -> Tuple[str, str]:
    """The function's source as TorchScript will compile it, padded so that its line numbers are
    the lines of the user's file, and the file's name."""
    lines, first = inspect.getsourcelines(fn)
    source = textwrap.dedent("".join(lines))
    body = source.splitlines(keepends=True)
    while body and body[0].lstrip().startswith("@"):  # decorators, possibly over several lines
        body.pop(0)
        first += 1
        while body and not body[0].lstrip().startswith(("def ", "@")):
            body.pop(0)
            first += 1
    return "\n" * (first - 1) + "".join(body), inspect.getsourcefile(fn) or "<unknown>"


def _local_shape(shape: Sequence[int], spec: P, mesh: Slice) -> List[int]:
    local = list(shape)
    for d, axes in enumerate(spec._runtime()):
        if axes and d < len(local):
            local[d] //= mesh.axis_size(axes)
    return local


def _global_shape(local: Sequence[int], spec: P, mesh: Slice) -> List[int]:
    shape = list(local)
    for d, axes in enumerate(spec._runtime()):
        if axes and d < len(shape):
            shape[d] *= mesh.axis_size(axes)
    return shape


def _output_shapes(fn: Callable, inputs: Sequence[Tuple[torch.dtype, List[int]]], in_specs: Sequence[P],
                   out_specs: Sequence[P], mesh: Slice) -> List[Tuple[str, List[int]]]:
    """Runs ``fn`` on its shards' shapes (meta tensors, else zeros) to find its outputs' global
    shapes and dtypes."""
    token = _MESH.set(mesh)
    try:
        results = None
        for device in ("meta", "cpu"):
            args = [torch.zeros(_local_shape(shape, spec, mesh), dtype=dtype, device=device)
                    for (dtype, shape), spec in zip(inputs, in_specs)]
            try:
                results = fn(*args)
                break
            except Error:
                raise
            except Exception as e:  # an op without a meta kernel: try real (zero) tensors
                if device == "cpu":
                    raise InvalidArgumentError(f"function '{fn.__name__}' failed on its inputs' shapes: {e}") from e
    finally:
        _MESH.reset(token)
    results = results if isinstance(results, tuple) else (results,)
    if not all(isinstance(r, torch.Tensor) for r in results):
        raise InvalidArgumentError(f"function '{fn.__name__}' must return a tensor or a tuple of tensors")
    specs = list(out_specs) if out_specs else [P()] * len(results)
    if len(specs) != len(results):
        raise InvalidArgumentError(f"function '{fn.__name__}' returns {len(results)} values but has "
                                   f"{len(specs)} output shardings")
    return [(_dtype_name(r.dtype), _global_shape(r.shape, spec, mesh)) for r, spec in zip(results, specs)]


class Function:
    """A Python function compiled for the cluster: ``f(*arrays, slice=None)`` runs it on every
    device of the slice its first input is on (or ``slice``), compiling it on first use for those
    shapes and dtypes, and returns arrays at once."""

    def __init__(self, fn: Callable, in_shardings: Optional[Sequence[P]], out_shardings: Optional[Sequence[P]],
                 donate: Sequence[int], vjp_of: Optional[Tuple["Function", Optional[List[int]], bool]] = None) -> None:
        self._fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._in = [_as_spec(s) for s in in_shardings] if in_shardings is not None else None
        self._out = [_as_spec(s) for s in out_shardings] if out_shardings is not None else None
        self._donate = list(donate)
        self._vjp_of = vjp_of
        self._compiled: Dict[Any, Any] = {}
        self._source = _source_of(fn)[0] if vjp_of is None else None

    def _compile(self, client: Any, specs: List[Tuple[str, List[int]]], mesh: Slice) -> Any:
        key = (id(client), tuple((d, tuple(s)) for d, s in specs), mesh.shape, mesh.axes)
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        primal = self if self._vjp_of is None else self._vjp_of[0]
        n = len(primal._fn.__code__.co_varnames[:primal._fn.__code__.co_argcount])
        in_specs = primal._in if primal._in is not None else [P()] * n
        primal_inputs = specs[:n]
        if len(primal_inputs) != n or len(in_specs) != n:
            raise InvalidArgumentError(f"function '{primal.__name__}' takes {n} inputs and {len(in_specs)} input "
                                       f"shardings; it was given {len(specs)} arrays")
        outputs = _output_shapes(primal._fn, [(_TO_TORCH[d], s) for d, s in primal_inputs], in_specs,
                                 primal._out or [], mesh)
        out_specs = primal._out or [P()] * len(outputs)
        kwargs = {}
        if self._vjp_of is not None:
            kwargs = {"vjp_wrt": self._vjp_of[1] or [], "vjp_with_outputs": self._vjp_of[2]}
        compiled = client.compile(primal.__name__, primal._source, primal_inputs, outputs,
                                  [s._runtime() for s in in_specs], [s._runtime() for s in out_specs],
                                  primal._donate if self._vjp_of is None else [], **kwargs)
        self._compiled[key] = compiled
        return compiled

    def __call__(self, *args: Any, slice: Optional[Slice] = None) -> Any:
        if any(isinstance(a, _Traced) for a in args):
            return _trace_call(self, args, slice)
        if not args or not all(isinstance(a, Array) for a in args):
            raise InvalidArgumentError(f"function '{self.__name__}' takes pathways Arrays (use client.put)")
        client = args[0]._native.client
        mesh = slice if slice is not None else Slice(args[0]._native.slice)
        compiled = self._compile(client, [a._native.spec for a in args], mesh)
        out = client.call(compiled, mesh._native, [a._native for a in args])
        arrays = tuple(Array(o) for o in out)
        return arrays[0] if len(arrays) == 1 else arrays


def function(fn: Optional[Callable] = None, *, in_shardings: Optional[Sequence[P]] = None,
             out_shardings: Optional[Sequence[P]] = None, donate: Sequence[int] = ()) -> Any:
    """Makes a Python function written in TorchScript's subset a function of the cluster.

    ``in_shardings``/``out_shardings`` give one partition spec per input/output (default:
    replicated); the body sees each device's shards and may call ``pathways.all_reduce(x, "x")``
    and the other collectives over the slice's axes. ``donate`` names inputs whose buffers the
    outputs take (an optimizer's in-place update); their arrays cannot be used afterwards."""

    def wrap(f: Callable) -> Function:
        return Function(f, in_shardings, out_shardings, donate)

    return wrap(fn) if fn is not None else wrap


def vjp(f: Function, wrt: Optional[Sequence[int]] = None, with_outputs: bool = False) -> Function:
    """The vector-Jacobian product of ``f``: called with f's inputs and then one cotangent per
    floating-point output, it returns f's outputs when ``with_outputs``, then the cotangents of the
    inputs ``wrt`` (default: every floating-point input). The body runs f's forward again under
    autograd (rematerialisation); collectives carry their transposes."""
    return Function(f._fn, None, None, (), vjp_of=(f, list(wrt) if wrt is not None else None, with_outputs))


def grad(f: Function, argnums: Optional[Sequence[int]] = None) -> Callable[..., Any]:
    """The gradient of ``f``, a function with one scalar floating-point output: ``grad(f)(*arrays)``
    returns the cotangents of inputs ``argnums`` (default: every floating-point input), one array
    each (a single array for one input), each laid out as its input."""
    g = vjp(f, wrt=argnums)
    ones: Dict[Any, Array] = {}

    def gradient(*args: Array, slice: Optional[Slice] = None) -> Any:
        if not args or not all(isinstance(a, Array) for a in args):
            raise InvalidArgumentError(f"grad of '{f.__name__}' takes pathways Arrays")
        mesh = slice if slice is not None else Slice(args[0]._native.slice)
        key = (id(args[0]._native.client), mesh._native.id)
        if key not in ones:  # the output's cotangent: 1, made once per slice
            ones[key] = Client(args[0]._native.client).put(torch.ones(()), mesh)
        return g(*args, ones[key], slice=mesh)

    gradient.__name__ = f"grad({f.__name__})"
    gradient.__doc__ = grad.__doc__
    return gradient


# ---- Programs ----

class _Traced:
    """A value inside a program being traced."""

    def __init__(self, native: Any, slice_: Optional[Slice]) -> None:
        self._native = native
        self._slice = slice_


_BUILDER: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("pathways_builder", default=None)


def _trace_call(f: Function, args: Sequence[Any], slice: Optional[Slice]) -> Any:
    state = _BUILDER.get()
    if state is None:
        raise FailedPreconditionError("traced values are used only inside the @pathways.program being traced")
    builder, client = state
    mesh = slice if slice is not None else args[0]._slice
    compiled = f._compile(client, [a._native.spec for a in args], mesh)
    out = builder.call(compiled, mesh._native, [a._native for a in args])
    values = tuple(_Traced(o, mesh) for o in out)
    return values[0] if len(values) == 1 else values


class Program:
    """Several function calls traced into one program, run with one client call. Traced once
    per placement of its inputs; ``ir()`` is the readable IR of the last trace."""

    def __init__(self, fn: Callable) -> None:
        self._fn = fn
        self.__name__ = fn.__name__
        self._traced: Dict[Any, Any] = {}
        self._last: Optional[Any] = None

    def __call__(self, *args: Array) -> Any:
        if not args or not all(isinstance(a, Array) for a in args):
            raise InvalidArgumentError(f"program '{self.__name__}' takes pathways Arrays")
        client = args[0]._native.client
        key = (id(client), tuple((tuple(a._native.spec[1]), a._native.spec[0], a._native.slice.id,
                                  tuple(a._native.sharding)) for a in args))
        program = self._traced.get(key)
        if program is None:
            builder = _ext.ProgramBuilder(self.__name__)
            traced = [_Traced(builder.arg(*a._native.spec), Slice(a._native.slice)) for a in args]
            token = _BUILDER.set((builder, client))
            try:
                results = self._fn(*traced)
            finally:
                _BUILDER.reset(token)
            results = results if isinstance(results, tuple) else (results,)
            program = builder.build([r._native for r in results])
            self._traced[key] = program
        self._last = program
        arrays = tuple(Array(o) for o in client.run(program, [a._native for a in args]))
        return arrays[0] if len(arrays) == 1 else arrays

    def ir(self) -> str:
        """The readable IR of the program as last traced (call it first)."""
        if self._last is None:
            raise FailedPreconditionError(f"program '{self.__name__}' has not been traced yet: call it first")
        return self._last.ir()


def program(fn: Callable) -> Program:
    """Traces a Python function that calls pathways functions (on one or several slices) into
    one program, run with one client call, as the C++ ProgramBuilder does."""
    return Program(fn)


# ---- Training the built-in Transformer ----

class Trainer:
    """Trains the built-in decoder-only Transformer (``pathways train``'s) on a client's cluster:
    data, tensor and pipeline parallelism composed in one traced step, parameters and data made on
    the devices. ``step()`` issues a step and returns its loss's future (``.result()`` waits)."""

    def __init__(self, client: Client, model: str = "tiny", batch: int = 16, seq_len: int = 0, vocab: int = 0,
                 data_parallel: int = 1, tensor_parallel: int = 1, pipeline_stages: int = 1, microbatches: int = 1,
                 islands: int = 1, seed: int = 0, learning_rate: float = 3e-3, data: str = "markov",
                 resume: str = "") -> None:
        self._native = _ext.Trainer(client._native, model=model, batch=batch, seq_len=seq_len, vocab=vocab,
                                    data_parallel=data_parallel, tensor_parallel=tensor_parallel,
                                    pipeline_stages=pipeline_stages, microbatches=microbatches, islands=islands,
                                    seed=seed, learning_rate=learning_rate,
                                    text_file="" if data == "markov" else data, resume_from=resume)

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
        return self._native.tokens_per_step

    def __repr__(self) -> str:
        return f"Trainer({self._native.description})"
