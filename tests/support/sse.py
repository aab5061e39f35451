"""Server-sent events as the worker and the router write them, checked strictly."""

from __future__ import annotations


def split_events(raw: bytes) -> list[bytes]:
    """Every event is exactly b"data: <payload>\\n\\n"; nothing else is allowed in the body."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-60:]
    parts = raw.split(b"\n\n")
    assert parts[-1] == b""
    events = parts[:-1]
    for event in events:
        assert event.startswith(b"data: ") and b"\n" not in event, event
    assert b"".join(e + b"\n\n" for e in events) == raw
    return [e[len(b"data: "):] for e in events]
