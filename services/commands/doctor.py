"""`pdmesh doctor`: report the environment and print the fix when torch does not fit the host."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

HELP = "Report Python/torch builds, accelerators, kernels and the embedded model."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kernels.tier import TIER_CHOICES

    parser.add_argument("--skip-components", action="store_true",
                        help="skip the kernels build and model checks (fast)")
    parser.add_argument("--model", default=None,
                        help="also say which architecture this model (name, path or GGUF file) "
                             "would run as, or why it is refused")
    parser.add_argument("--revision", default=None,
                        help="with an org/name --model: branch, tag or commit hash in the local "
                             "Hugging Face cache (default: main)")
    parser.add_argument("--kernel-tier", default=None, choices=TIER_CHOICES,
                        help="report as a worker with this cap would run (default: "
                             "$PDMESH_KERNEL_TIER, else auto)")


def run(args: argparse.Namespace) -> int:
    from kernels.tier import set_max_tier
    from services.doctor import (
        OverrideRefused,
        advise,
        component_status,
        gather_facts,
    )
    from shared.config import auto_dtype, kernel_tier_from_env
    from shared.kernel_tiers import kernel_tiers

    facts = gather_facts()
    print(f"python       {facts.python} ({facts.system}/{facts.machine})")
    variant = facts.torch_variant.value if facts.torch_variant else "-"
    print(f"torch        {facts.torch_version or 'not importable'} (build: {variant})")
    accels = ", ".join(a.value for a in facts.accelerators) or "none"
    print(f"accelerators {accels}")
    for line in facts.evidence:
        print(f"             {line}")
    try:
        advice = advise(facts, os.environ.get("PDMESH_TORCH_VARIANT"))
    except OverrideRefused as exc:
        print(f"override     REFUSED: {exc}")
        return 2
    print(f"torch fit    {'ok' if advice.ok else 'MISMATCH'}: {advice.reason}")
    for cmd in advice.commands:
        print(f"  fix: {cmd}")
    try:
        requested = args.kernel_tier or kernel_tier_from_env(os.environ)
    except ValueError as exc:
        print(f"kernel tier  REFUSED: {exc}")
        return 2
    set_max_tier(requested)  # as an engine would, before anything resolves a kernel path
    tiers = kernel_tiers(libraries=not args.skip_components, build=True)
    print(f"kernel tier  {tiers} (requested: {requested})")
    print(f"dtype auto   {auto_dtype(requested)} (what serve, up and generate default to here)")
    rows = _architecture_rows(args.model, args.revision)
    if not args.skip_components:
        rows = [*component_status(), *rows]
    for name, state in rows:
        print(f"{name:<12} {state}")
    return 0 if advice.ok else 1


def _architecture_rows(model: str | None, revision: str | None) -> list[tuple[str, str]]:
    """services.doctor.architecture_status, except that a GGUF file is only inspected (its
    header: architecture, tensor types and shapes, tokenizer), never converted."""
    from services.doctor import architecture_status
    from shared.model.registry import is_gguf_file

    if model is None or not is_gguf_file(Path(model).expanduser()):
        return architecture_status(model, revision)
    rows = architecture_status(None)
    try:
        if revision is not None:
            raise ValueError("--revision applies to org/name models, not to a GGUF file")
        state = _gguf_state(Path(model).expanduser())
    except Exception as exc:  # noqa: BLE001 - the refusal is the answer
        return [*rows, ("model arch", f"{model}: REFUSED: {exc}")]
    return [*rows, ("model arch", f"{model}: {state}")]


def _gguf_state(path: Path) -> str:
    from collections import Counter

    from gguf import GGUFReader

    from shared.model.config import ModelConfig
    from shared.model.gguf_import import inspect_gguf

    reader = GGUFReader(str(path))
    config = ModelConfig.from_hf(inspect_gguf(reader)[0])
    types = Counter(t.tensor_type.name for t in reader.tensors)
    kinds = ", ".join(f"{n} {name}" for name, n in types.most_common())
    return (f"{config.architecture} ({config.model_type}), {config.num_layers} layers, "
            f"head_dim {config.head_dim}; GGUF tensors: {kinds} (dequantised once on first use)")
