"""shared.model.materialise: a meta-built model is allocated without torch's meta machinery.

`to_empty` (and nn.Embedding's own init on meta) import torch._dynamo and sympy, ~70 MB of
resident memory in every worker; loading a checkpoint must import neither. The check runs in a
fresh interpreter, since this test process has long imported both (transformers does).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from shared.model.materialise import materialise

LOAD_AND_REPORT = """
import sys, torch
from shared.model.loader import load_model
model, _ = load_model(sys.argv[1], torch.bfloat16, quantization=sys.argv[2] or None)
assert all(not t.is_meta for t in [*model.parameters(), *model.buffers()])
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""


@pytest.mark.parametrize("quantization", ["", "mxfp4"])
def test_loading_a_checkpoint_imports_neither_dynamo_nor_sympy(
        make_checkpoint: Callable[..., Path], quantization: str) -> None:
    ckpt = make_checkpoint(preset="tiny", seed=0)
    out = subprocess.run([sys.executable, "-c", LOAD_AND_REPORT, str(ckpt), quantization],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.a = nn.Linear(4, 3, bias=True, dtype=torch.bfloat16)
            self.b = nn.Linear(4, 3, bias=False)
            self.register_buffer("table", torch.zeros(5, dtype=torch.int64))
        self.b.weight = self.a.weight  # tied, as an LM head and its embedding
        self.register_buffer("cpu_buf", torch.arange(3))
        self.a.bias.requires_grad_(False)


def test_materialise_keeps_shapes_dtypes_ties_and_cpu_tensors() -> None:
    m = _Tied()
    cpu_buf = m.cpu_buf
    materialise(m)
    assert m.a.weight.device.type == "cpu" and m.a.weight.shape == (3, 4)
    assert m.a.weight.dtype == torch.bfloat16 and m.a.bias.dtype == torch.bfloat16
    assert m.b.weight is m.a.weight  # still one tensor
    assert [n for n, _ in m.named_parameters()] == ["a.weight", "a.bias"]
    assert m.a.weight.requires_grad and not m.a.bias.requires_grad
    assert m.table.device.type == "cpu" and m.table.dtype == torch.int64 and m.table.shape == (5,)
    assert m.cpu_buf is cpu_buf  # already allocated: untouched
