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

from .collectives import (all_gather, all_reduce, all_to_all, axis_index, broadcast, normal,  # noqa: F401
                          reduce_scatter, roll, uniform)
from .core import Array, Client, LocalCluster, P, Slice, Trainer, connect  # noqa: F401
from .errors import (AbortedError, AlreadyExistsError, CancelledError, DataLossError,  # noqa: F401
                     DeadlineExceededError, Error, FailedPreconditionError, InternalError, InvalidArgumentError,
                     NotFoundError, OutOfRangeError, PermissionDeniedError, ResourceExhaustedError,
                     UnauthenticatedError, UnavailableError, UnimplementedError)
from .functions import Function, Program, Residuals, function, grad, program, vjp  # noqa: F401

__all__ = [
    "LocalCluster", "connect", "Client", "Slice", "Array", "P", "function", "Function", "program", "Program",
    "vjp", "Residuals", "grad", "Trainer", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "roll",
    "axis_index", "Error", "InvalidArgumentError", "NotFoundError", "UnavailableError",
    "ResourceExhaustedError", "DeadlineExceededError", "UnauthenticatedError", "PermissionDeniedError",
    "FailedPreconditionError", "AbortedError", "CancelledError", "AlreadyExistsError", "DataLossError",
    "InternalError", "UnimplementedError", "OutOfRangeError",
]
