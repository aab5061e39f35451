"""Parsing of human-friendly quantities given on command lines ("256MiB", "4 MB", "1024")."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str | int) -> int:
    """Bytes from "256MiB", "1.5GiB", "4MB" (decimal), "4K"/"4KiB" (binary) or a plain integer.

    A bare letter (K, M, G) means the binary unit, as in most CLIs; "MB" is 10**6, "MiB" 2**20.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 256MiB, 1GB)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    if unit in ("", "b"):
        return int(number)
    letter = unit[0]
    decimal = unit.endswith("b") and "i" not in unit
    base = 1000 if decimal else 1024
    return int(number * base ** _POWERS[letter])
