"""Collectives and random numbers inside functions.

In a ``@pathways.function`` these name the runtime's ops (``pathways.all_reduce`` compiles to the op
on the workers). Called in Python they only compute shapes: a function's output shapes are found by
running it once on meta tensors of its shards' shapes, with the slice's mesh in ``MESH``.
"""

from __future__ import annotations

import contextvars
from typing import List, Optional

import torch

from .core import Slice
from .errors import FailedPreconditionError

MESH: contextvars.ContextVar[Optional[Slice]] = contextvars.ContextVar("pathways_mesh", default=None)


def _group(axes: str) -> int:
    mesh = MESH.get()
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


def roll(x: torch.Tensor, axes: str = "", shift: int = 1) -> torch.Tensor:
    """Member r gets member (r - shift)'s ``x`` along ``axes``, as ``torch.roll`` moves elements:
    a stencil's halo, or a pipeline's next stage."""
    _group(axes)
    return x.clone()


def axis_index(axes: str = "") -> int:
    """This device's position along ``axes`` (row-major over several), from 0: to find neighbours.

    While output shapes are found (on meta tensors, before the first call) it is 0 on every
    shard, so an output's shape must not depend on it."""
    _group(axes)
    return 0


def uniform(shape: List[int], spec: List[str], seed: int, step: int) -> torch.Tensor:
    """Counter-based uniform numbers in [0, 1) for this shard's block of one global array."""
    return torch.empty(shape, device="meta")


def normal(shape: List[int], spec: List[str], seed: int, step: int) -> torch.Tensor:
    """Counter-based standard normal numbers for this shard's block of one global array."""
    return torch.empty(shape, device="meta")
