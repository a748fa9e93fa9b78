"""Parameter fragments: how a model's named tensors are described and grouped."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorSpec:
    """One named parameter tensor of a model.

    Attributes:
        name: stable tensor name, e.g. ``"block0.attn.wqkv"``.
        shape: the tensor's shape.
        is_embedding: True for token/position embedding tables (merged by plain
            averaging rather than RDA).
    """

    name: str
    shape: tuple[int, ...]
    is_embedding: bool = False

    @property
    def numel(self) -> int:
        """Number of elements in the tensor."""
        return math.prod(self.shape)
