"""Functions and programs: Python functions in TorchScript's subset compiled for the cluster,
their gradients, and several calls traced into one program."""

from __future__ import annotations

import contextvars
import inspect
import textwrap
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _pathways as _ext
from .collectives import MESH
from .core import _TO_TORCH, Array, Client, P, Slice, _as_spec, _dtype_name
from .errors import Error, FailedPreconditionError, InvalidArgumentError

def _source_of(fn: Callable) -> Tuple[str, str]:
    """The function's source as TorchScript will compile it, padded so that its line numbers are
    the lines of the user's file, and the file's name."""
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError) as e:
        raise InvalidArgumentError(
            f"function '{getattr(fn, '__name__', fn)}': its source cannot be read ({e}); TorchScript compiles "
            "from source, so define it in a file (not at the interpreter's prompt, in `python -c` or "
            "through exec)") from None
    source = textwrap.dedent("".join(lines))
    body = source.splitlines(keepends=True)
    while body and body[0].lstrip().startswith("@"):  # decorators, possibly over several lines
        body.pop(0)
        first += 1
        while body and not body[0].lstrip().startswith(("def ", "@")):
            body.pop(0)
            first += 1
    return "\n" * (first - 1) + "".join(body), inspect.getsourcefile(fn) or "<unknown>"


def _with_pathways_names(source: str, fn: Callable) -> str:
    """``source`` with the names by which ``fn`` reaches this package written as TorchScript sees
    it (``pathways.<op>``): ``import pathways as pw`` then ``pw.all_reduce(...)``, and
    ``from pathways import all_reduce`` then ``all_reduce(...)``. Names the function binds itself
    (arguments, locals) shadow the module's and stay as they are. Only names change, within
    their lines, so line numbers in errors stay the user's."""
    import sys
    from . import collectives
    package = sys.modules.get(__package__)
    ops = {getattr(collectives, n) for n in dir(collectives) if not n.startswith("_")}
    ops = {f for f in ops if callable(f) and getattr(f, "__module__", None) == collectives.__name__}
    scope = dict(fn.__globals__)
    scope.update(inspect.getclosurevars(fn).nonlocals)
    local = set(fn.__code__.co_varnames) | set(fn.__code__.co_cellvars)
    modules = {n for n, v in scope.items() if n != "pathways" and n not in local and (v is package or v is collectives)}
    # By identity: a module's globals may hold unhashable callables (pytest's marks, say).
    op_ids = {id(f) for f in ops}
    functions = {n: v.__name__ for n, v in scope.items() if n not in local and id(v) in op_ids}
    if not modules and not functions:
        return source
    import io
    import tokenize
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    edits = []  # (line, start, end, text)
    for i, t in enumerate(tokens):
        if t.type != tokenize.NAME:
            continue
        before = tokens[i - 1].string if i > 0 else ""
        after = tokens[i + 1].string if i + 1 < len(tokens) else ""
        if before == "." or before == "def":
            continue
        if t.string in modules and after == ".":
            edits.append((t.start[0], t.start[1], t.end[1], "pathways"))
        elif t.string in functions and after == "(":
            edits.append((t.start[0], t.start[1], t.end[1], "pathways." + functions[t.string]))
    lines = source.splitlines(keepends=True)
    for row, start, end, text in sorted(edits, reverse=True):
        line = lines[row - 1]
        lines[row - 1] = line[:start] + text + line[end:]
    return "".join(lines)


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
    token = MESH.set(mesh)
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
                    where = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == fn.__code__.co_filename]
                    at = f" (File \"{where[-1].filename}\", line {where[-1].lineno})" if where else ""
                    raise InvalidArgumentError(f"function '{fn.__name__}' failed on its inputs' shapes{at}: {e}") from e
    finally:
        MESH.reset(token)
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
                 donate: Sequence[int],
                 vjp_of: Optional[Tuple["Function", Optional[List[int]], bool, bool]] = None) -> None:
        self._fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._in = [_as_spec(s) for s in in_shardings] if in_shardings is not None else None
        self._out = [_as_spec(s) for s in out_shardings] if out_shardings is not None else None
        self._donate = list(donate)
        self._vjp_of = vjp_of
        self._scalar_output = False  # set for grad: the primal must return one scalar
        self._compiled: Dict[Any, Any] = {}
        self._source, self._file = _source_of(fn) if vjp_of is None else (None, None)
        if self._source is not None:
            self._source = _with_pathways_names(self._source, fn)

    def _compile(self, client: Any, specs: List[Tuple[str, List[int]]], mesh: Slice) -> Any:
        key = (client.id(), tuple((d, tuple(s)) for d, s in specs), mesh.shape, mesh.axes)
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
        if self._scalar_output and (len(outputs) != 1 or outputs[0][1] != []
                                    or not _TO_TORCH[outputs[0][0]].is_floating_point):
            raise InvalidArgumentError(f"grad of '{primal.__name__}' needs a function with one scalar floating-point "
                                       f"output; it returns {', '.join(f'{d}{s}' for d, s in outputs)} (use vjp)")
        # The source's lines are the file's (see _source_of): TorchScript's errors and tracebacks,
        # at compile time and at run time, name the user's file and line.
        shardings = ([s._runtime() for s in in_specs], [s._runtime() for s in out_specs])
        if self._keeps_residuals():  # (forward half, backward half)
            compiled = client.compile_split_vjp(primal.__name__, primal._source, primal_inputs, outputs,
                                                *shardings, self._vjp_of[1] or [], source_file=primal._file)
        else:
            compiled = client.compile(primal.__name__, primal._source, primal_inputs, outputs, *shardings,
                                      primal._donate if self._vjp_of is None else [], source_file=primal._file,
                                      **kwargs)
        self._compiled[key] = compiled
        return compiled

    def __call__(self, *args: Any, slice: Optional[Slice] = None) -> Any:
        if any(isinstance(a, _Traced) for a in args):
            return _trace_call(self, args, slice)
        if not args or not all(isinstance(a, Array) for a in args):
            raise InvalidArgumentError(f"function '{self.__name__}' takes pathways Arrays (use client.put)")
        _check_slice(slice, f"function '{self.__name__}'")
        client = args[0]._native.client
        mesh = slice if slice is not None else Slice(args[0]._native.slice)
        compiled = self._compile(client, [a._native.spec for a in args], mesh)
        if self._keeps_residuals():
            forward, backward = compiled
            out = client.call(forward, mesh._native, [a._native for a in args])
            return tuple(Array(o) for o in out[:-1]) + (Residuals(Array(out[-1]), backward, mesh),)
        out = client.call(compiled, mesh._native, [a._native for a in args])
        arrays = tuple(Array(o) for o in out)
        return arrays[0] if len(arrays) == 1 else arrays

    def _keeps_residuals(self) -> bool:
        return self._vjp_of is not None and self._vjp_of[3]


def _check_slice(slice: Any, what: str) -> None:
    if slice is not None and not isinstance(slice, Slice):
        raise InvalidArgumentError(f"{what} runs on a Slice (client.slice), not {type(slice).__name__}")


class Residuals:
    """What the forward half of ``vjp(f, keep_residuals=True)`` kept on the devices of its slice
    for the backward pass, until this object (and its ``handle``) goes. ``backward(*cotangents)``
    takes one cotangent per floating-point output of ``f`` and returns the cotangents of the
    inputs differentiated; it may be called more than once. ``handle`` is an i64 scalar array:
    the bytes the residuals take on each device. The residuals stay on those devices: call
    ``backward`` on the same slice."""

    def __init__(self, handle: Any, backward: Any, mesh: Slice) -> None:
        self.handle = handle
        self._backward = backward
        self._slice = mesh

    def backward(self, *cotangents: Any) -> Any:
        """The cotangents of the differentiated inputs, one array each (a single array for one)."""
        if not isinstance(self.handle, _Traced) and not all(isinstance(c, Array) for c in cotangents):
            raise InvalidArgumentError("backward takes pathways Arrays (use client.put)")
        natives = [self.handle._native] + [c._native for c in cotangents]
        if isinstance(self.handle, _Traced):
            state = _BUILDER.get()
            if state is None:
                raise FailedPreconditionError("traced residuals are used only inside the @pathways.program being traced")
            values = tuple(_Traced(o, self._slice) for o in state[0].call(self._backward, self._slice._native, natives))
        else:
            client = self.handle._native.client
            values = tuple(Array(o) for o in client.call(self._backward, self._slice._native, natives))
        return values[0] if len(values) == 1 else values


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


def vjp(f: Function, wrt: Optional[Sequence[int]] = None, with_outputs: bool = False,
        keep_residuals: bool = False) -> Function:
    """The vector-Jacobian product of ``f``: called with f's inputs and then one cotangent per
    floating-point output, it returns f's outputs when ``with_outputs``, then the cotangents of the
    inputs ``wrt`` (default: every floating-point input). The body runs f's forward again under
    autograd (rematerialisation); collectives carry their transposes.

    With ``keep_residuals``, as ``jax.vjp``: called with f's inputs only, it runs the forward pass
    once, keeping what the backward pass needs on the devices, and returns f's outputs and then a
    :class:`Residuals`, whose ``backward(*cotangents)`` returns the cotangents (one forward pass
    less, for the memory of the residuals until they go)."""
    if keep_residuals and with_outputs:
        raise InvalidArgumentError("vjp with keep_residuals returns f's outputs already: drop with_outputs")
    return Function(f._fn, None, None, (),
                    vjp_of=(f, list(wrt) if wrt is not None else None, with_outputs, keep_residuals))


def grad(f: Function, argnums: Optional[Sequence[int]] = None) -> Callable[..., Any]:
    """The gradient of ``f``, a function with one scalar floating-point output: ``grad(f)(*arrays)``
    returns the cotangents of inputs ``argnums`` (default: every floating-point input), one array
    each (a single array for one input), each laid out as its input."""
    g = vjp(f, wrt=argnums)
    g._scalar_output = True

    def gradient(*args: Array, slice: Optional[Slice] = None) -> Any:
        if not args or not all(isinstance(a, Array) for a in args):
            raise InvalidArgumentError(f"grad of '{f.__name__}' takes pathways Arrays")
        _check_slice(slice, f"grad of '{f.__name__}'")
        mesh = slice if slice is not None else Slice(args[0]._native.slice)
        one = Client(args[0]._native.client).put(torch.ones(()), mesh)  # the output's cotangent
        return g(*args, one, slice=mesh)

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
    if f._keeps_residuals():
        forward, backward = compiled
        out = builder.call(forward, mesh._native, [a._native for a in args])
        return tuple(_Traced(o, mesh) for o in out[:-1]) + (Residuals(_Traced(out[-1], mesh), backward, mesh),)
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
        key = (client.id(), tuple((tuple(a._native.spec[1]), a._native.spec[0], a._native.slice.id,
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
            wrong = [type(r).__name__ for r in results if not isinstance(r, _Traced)]
            if wrong or not results:
                raise InvalidArgumentError(f"program '{self.__name__}' must return what its function calls returned "
                                           f"(one value or a tuple), not {', '.join(wrong) or 'an empty tuple'}")
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
