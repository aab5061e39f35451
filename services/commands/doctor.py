"""`pdmesh doctor`: report the environment and print the fix when torch does not fit the host."""

from __future__ import annotations

import argparse
import os

HELP = "Report Python/torch builds, accelerators, kernels and the embedded model."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kernels.tier import TIER_CHOICES

    parser.add_argument("--skip-components", action="store_true",
                        help="skip the kernels build and model checks (fast)")
    parser.add_argument("--model", default=None,
                        help="also say which architecture this model (name or path) would run "
                             "as, or why it is refused")
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
        architecture_status,
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
    rows = architecture_status(args.model, args.revision)
    if not args.skip_components:
        rows = [*component_status(), *rows]
    for name, state in rows:
        print(f"{name:<12} {state}")
    return 0 if advice.ok else 1
