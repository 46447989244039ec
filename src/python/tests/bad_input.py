"""Bad input that every cluster must refuse with its exception class: shared by the tests on an
embedded cluster and on real processes."""

import pytest
import torch

import pathways
from pathways import P


def expect_bad_puts_and_slices_refused(client: "pathways.Client", mesh: "pathways.Slice") -> None:
    """A float16 put, a slice of 1000 devices, rows that do not split over the mesh's 2 devices
    and an unknown axis in a sharding each raise their class."""
    with pytest.raises(pathways.InvalidArgumentError, match="dtype"):
        client.put(torch.zeros(2, dtype=torch.float16), mesh)
    with pytest.raises(pathways.ResourceExhaustedError, match="devices"):
        client.slice((1000,))
    with pytest.raises(pathways.InvalidArgumentError):
        client.put(torch.zeros(3), mesh, P("x"))  # 3 rows do not split over 2 devices
    with pytest.raises(pathways.InvalidArgumentError, match="nope"):
        client.put(torch.zeros(2), mesh, P("nope"))
