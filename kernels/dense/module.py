"""DenseLinear, the drop-in for nn.Linear, and accelerate_linears, which swaps it in.

The swap keeps the very same Parameter objects: nothing is copied or repacked, so a weight
shared between modules (a tied lm_head is the embedding matrix [vocab, hidden]) stays shared,
and a later in-place weight update is seen by both. The C++ op has no backward: calls autograd
must record run torch's F.linear.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.dense.backend import MAX_ROWS, X_DTYPES, KernelPath, needs_grad


class DenseLinear(nn.Module):
    """y = x @ weight.T + bias through a resolved KernelPath (the dense decode kernels).

    Holds the Linear's own weight [out, in] and bias Parameters (shared, not copied) and the
    KernelPath chosen when it was built. Batches over MAX_ROWS rows, non-bf16 weights and other
    dtypes run torch's F.linear (see KernelPath). forward() has a fast path for the decode case
    (2-D x): the weight was vetted here once, and a call costs the C++ op's dispatch only.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, path: KernelPath) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"DenseLinear: weight must be [out, in], got {tuple(weight.shape)}")
        self.weight = weight
        self.bias = bias
        self.path = path
        self.out_features, self.in_features = weight.shape
        # The C++ path id, None when the kernels cannot take this weight: the fast path.
        self._path_id: int | None = (path.backend.path_id if path.takes_weight(weight, bias)
                                     else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, path: KernelPath) -> DenseLinear:
        weight = linear.weight  # torch annotates it as a Tensor; a Linear holds a Parameter
        if not isinstance(weight, nn.Parameter):
            raise TypeError(f"DenseLinear: the Linear's weight is a {type(weight).__name__}, "
                            "not a Parameter")
        return cls(weight, linear.bias, path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self._path_id is not None and x.dtype in X_DTYPES and x.dim() == 2
                and x.shape[0] <= MAX_ROWS and not needs_grad(x, self.weight, self.bias)):
            return self.path.op(x, self.weight, self.bias, self._path_id)
        return self.path.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, backend={self.path.backend}")


def swap_linears(model: nn.Module, path: KernelPath,
                 dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> int:
    """Replace every nn.Linear on the CPU whose weight dtype is in dtypes; returns the count.

    Walks a snapshot of named_modules (the tree is edited during the walk); each replacement
    reuses the Linear's Parameters, so tied and shared weights stay tied.
    """
    swapped = 0
    for _name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.dtype in dtypes
                    and child.weight.device.type == "cpu"):
                setattr(parent, child_name, DenseLinear.from_linear(child, path))
                swapped += 1
    return swapped
