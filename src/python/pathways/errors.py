"""Exceptions raised by pathways: one class per status code of the runtime."""

from __future__ import annotations


class Error(RuntimeError):
    """Any error of the runtime. ``code`` is the canonical status code (an int, as absl's)."""

    code: int = 2

    def __init__(self, message: str = "") -> None:
        super().__init__(message)


class CancelledError(Error):
    """The operation was cancelled (a client closed while it waited, say)."""

    code = 1


class InvalidArgumentError(Error, ValueError):
    """Bad input: a wrong shape or dtype, an unknown axis, a body outside TorchScript's subset."""

    code = 3


class DeadlineExceededError(Error, TimeoutError):
    """A wait ran out: a collective whose group did not meet in time."""

    code = 4


class NotFoundError(Error, LookupError):
    """Something named does not exist: an array, a file, a checkpoint shard."""

    code = 5


class AlreadyExistsError(Error):
    """Something to be made exists already."""

    code = 6


class PermissionDeniedError(Error, PermissionError):
    """Refused: a data file outside the workers' directories, a host without the client's slice."""

    code = 7


class ResourceExhaustedError(Error, MemoryError):
    """Not enough devices or device memory."""

    code = 8


class FailedPreconditionError(Error):
    """The call does not fit the state: a closed client, a worker without a checkpoint directory."""

    code = 9


class AbortedError(Error):
    """Gangs met out of order; the run was abandoned."""

    code = 10


class OutOfRangeError(Error, IndexError):
    """A value past the end of what it indexes (a step beyond a data set, a position past a file)."""

    code = 11


class UnimplementedError(Error, NotImplementedError):
    """Not offered by this runtime."""

    code = 12


class InternalError(Error):
    """A failure inside the runtime or a kernel."""

    code = 13


class UnavailableError(Error, ConnectionError):
    """A host, worker or controller is gone or unreachable."""

    code = 14


class DataLossError(Error):
    """Stored data is damaged (a checkpoint shard that fails its checksum)."""

    code = 15


class UnauthenticatedError(Error, PermissionError):
    """A token or client credential is missing or wrong."""

    code = 16


_BY_CODE = {cls.code: cls for cls in Error.__subclasses__()}


def from_code(code: int) -> type:
    """The exception class for a status code (Error for codes without one of their own)."""
    return _BY_CODE.get(code, Error)
