"""The adapter contract, and the plain numpy adapter used by tests and simulations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from ..records import TensorSpec


class Adapter(Protocol):
    def schema(self) -> list[TensorSpec]:
        """Trainable parameters in a stable order: name, dtype (F32/F16/BF16), shape."""
        ...

    def read(self, names: Sequence[str]) -> Mapping[str, np.ndarray]:
        """Host float32 copies of the named parameters (the caller may keep them). The copies
        may still be in flight from a device: the mapping waits for them when first read."""
        ...

    def write(self, values: Mapping[str, np.ndarray], mixing: float = 0.0) -> None:
        """Set the named parameters in place to ``mixing*current + (1-mixing)*value``."""
        ...


class NumpyAdapter:
    """A model that is a ``dict`` of float32 numpy arrays (updated in place)."""

    def __init__(self, params: dict[str, np.ndarray]) -> None:
        for name, a in params.items():
            if not isinstance(a, np.ndarray) or a.dtype != np.float32:
                raise TypeError(f"parameter {name!r} must be a float32 numpy array, found {type(a).__name__}")
        self.params = params

    def schema(self) -> list[TensorSpec]:
        return [TensorSpec(name=n, dtype="F32", shape=list(a.shape)) for n, a in self.params.items()]

    def read(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return {n: self.params[n].copy() for n in names}

    def write(self, values: Mapping[str, np.ndarray], mixing: float = 0.0) -> None:
        for n, v in values.items():
            p = self.params[n]
            if mixing:
                p[...] = np.float32(mixing) * p + np.float32(1.0 - mixing) * v
            else:
                p[...] = v
