"""The `usage` a streamed completion reports: what `stream_options` asks for, and the counts.

Two writers make chunks of one stream: the worker (services/worker/responses.py) and, in P/D
mode, the router, which sends the prefill's first token itself before the decode answers
(services/router/first_token.py). Both count through `TokenCounts`, so a P/D stream reports
the usage a mixed worker's stream does, chunk for chunk.

`continuous_usage_stats` (vLLM's extension) puts the counts so far on every chunk that carries
choices; as in vLLM it takes effect only together with `include_usage` (alone, it is ignored
and those chunks keep `"usage": null`). The counts are the request's: the prompt tokens of
every prompt, and the tokens generated so far summed over every choice (vLLM reports the one
choice's own count on a chunk; the request's is what the final usage chunk totals, so the last
content chunk agrees with it for any n).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StreamUsage:
    """What a stream reports about usage: a last chunk with the totals (`include_usage`), and
    the counts so far on every chunk with choices (`continuous`, only with `include_usage`)."""

    include_usage: bool = False
    continuous: bool = False

    @classmethod
    def of(cls, include_usage: bool, continuous_usage_stats: bool) -> StreamUsage:
        """The options as requested; `continuous_usage_stats` alone is ignored (as vLLM)."""
        return cls(include_usage, include_usage and continuous_usage_stats)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> StreamUsage:
        """The options of a request body whose `stream_options` was checked (booleans or
        absent): the router reads them so its own chunks say what the worker's will."""
        options = body.get("stream_options")
        if not isinstance(options, dict):
            return cls()
        return cls.of(options.get("include_usage") is True,
                      options.get("continuous_usage_stats") is True)


@dataclass(frozen=True)
class TokenCounts:
    """A request's token counts, as its `usage` object reports them."""

    num_prompt_tokens: int
    num_completion_tokens: int

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.num_prompt_tokens,
                "completion_tokens": self.num_completion_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_completion_tokens}
