"""Allocate a module built on the meta device, without torch's meta-tensor machinery.

`nn.Module.to_empty` calls `torch.empty_like` on every meta tensor, which runs through
torch._refs and imports torch.fx's symbolic shapes and sympy on first use: several hundred
modules and ~70 MB of resident memory in every worker, for tensors that are about to be
overwritten by the checkpoint anyway. `materialise` allocates each parameter and buffer with a
plain `torch.empty(shape, dtype)` on the CPU instead.
"""

from __future__ import annotations

import torch
from torch import nn


def materialise(module: nn.Module) -> None:
    """Replace every meta parameter and buffer of `module` (recursively) by an uninitialised CPU
    tensor of the same shape and dtype. Tensors already on the CPU are kept; a parameter shared
    by two modules (tied weights) stays shared; requires_grad is kept."""
    allocated: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is None or not param.is_meta:
                continue
            if id(param) not in allocated:
                allocated[id(param)] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype), requires_grad=param.requires_grad)
            sub._parameters[name] = allocated[id(param)]
        for name, buf in sub._buffers.items():
            if buf is not None and buf.is_meta:
                sub._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype)
