"""What /proc/self/smaps says about a mapping, read independently of kernels/huge_pages.py."""

from __future__ import annotations

from pathlib import Path

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


def mapping_flags(address: int) -> list[str]:
    """VmFlags of the /proc/self/smaps mapping that holds `address` (`hg`: MADV_HUGEPAGE)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        first = line.split(maxsplit=1)[0] if line.strip() else ""
        if "-" in first and not first.endswith(":"):
            lo, hi = (int(part, 16) for part in first.split("-"))
            inside = lo <= address < hi
        elif inside and first == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
