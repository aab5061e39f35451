"""Which tool-call and reasoning parsers a worker reads its chat output with (vLLM's flags).

    --enable-auto-tool-choice     tool_choice "auto" (the default with tools) is allowed
    --tool-call-parser NAME       how the model writes calls (hermes, llama3_json, ...)
    --reasoning-parser NAME       how the model writes its reasoning (think, qwen3, ...)
    --harmony-vocab PATH          o200k_base.tiktoken (or its directory) for gpt-oss's harmony

A gpt-oss model (model_type gpt_oss) with neither parser set reads its output in the harmony
format with tool calls on (`for_model`): its prompts are rendered in harmony too, which has
the tools built in. openai-harmony needs OpenAI's o200k vocabulary file; without
--harmony-vocab the worker derives it from the checkpoint's tokenizer.json into its cache
directory (shared/parsing/harmony_vocab.py).

Names are checked against `shared.parsing`'s registries where the flags are parsed (argparse
lists the valid ones), and again when the configuration is built, since the environment
(`PDMESH_TOOL_CALL_PARSER`, `PDMESH_REASONING_PARSER`, `PDMESH_ENABLE_AUTO_TOOL_CHOICE`,
`PDMESH_HARMONY_VOCAB`, which compose passes to every worker) is read there too. Flags win
over the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.parsing import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    get_reasoning_parser,
    get_tool_parser,
)

TOOL_CALL_PARSER_ENV = "PDMESH_TOOL_CALL_PARSER"
REASONING_PARSER_ENV = "PDMESH_REASONING_PARSER"
AUTO_TOOL_CHOICE_ENV = "PDMESH_ENABLE_AUTO_TOOL_CHOICE"
HARMONY_VOCAB_ENV = "PDMESH_HARMONY_VOCAB"
HARMONY_MODEL_TYPES = ("gpt_oss",)  # models whose chat format is harmony
# vLLM's names for gpt-oss's parsers (`--tool-call-parser openai --reasoning-parser openai_gptoss`)
HARMONY_TOOL_PARSER, HARMONY_REASONING_PARSER = "openai", "openai_gptoss"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class ParsersConfig:
    """The chat-output parsers of one worker; all None/False: chat text is returned verbatim.

    `enable_auto_tool_choice` needs a `tool_call_parser` (as vLLM refuses it without one). A
    reasoning parser that frames the whole turn (channel) reads tool calls itself, so the
    tool parser, if any, must be that same format.
    """

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    harmony_vocab: Path | None = None  # None: derived from a gpt-oss checkpoint's tokenizer

    def __post_init__(self) -> None:
        tools = get_tool_parser(self.tool_call_parser) if self.tool_call_parser else None
        if self.reasoning_parser:
            framing = get_reasoning_parser(self.reasoning_parser)(prompt=None).handles_reasoning
            if framing and tools is not None and not tools.handles_reasoning:
                raise ValueError(f"--reasoning-parser {self.reasoning_parser} frames the whole "
                                 f"turn: use --tool-call-parser {self.reasoning_parser} with it, "
                                 f"not {self.tool_call_parser}")
        if self.enable_auto_tool_choice and tools is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (one of "
                             f"{', '.join(sorted(TOOL_PARSERS))})")

    def for_model(self, model_type: str) -> ParsersConfig:
        """The parsers for this model: a harmony model with no parser configured gets the
        harmony parsers and auto tool choice; anything configured is kept as it is."""
        if model_type not in HARMONY_MODEL_TYPES or self.tool_call_parser or self.reasoning_parser:
            return self
        return dataclasses.replace(self, tool_call_parser=HARMONY_TOOL_PARSER,
                                   reasoning_parser=HARMONY_REASONING_PARSER,
                                   enable_auto_tool_choice=True)

    def describe(self) -> dict[str, Any]:
        """As /v1/metadata reports it: whose chat output gets parsed, and how."""
        return {"tool_call_parser": self.tool_call_parser,
                "reasoning_parser": self.reasoning_parser,
                "enable_auto_tool_choice": self.enable_auto_tool_choice}

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> ParsersConfig:
        """Flags win; each variable is read only when its flag is absent (empty: unset)."""
        auto = bool(getattr(args, "enable_auto_tool_choice", False))
        if not auto:
            auto = _env_flag(environ, AUTO_TOOL_CHOICE_ENV)
        return cls(
            tool_call_parser=(getattr(args, "tool_call_parser", None)
                              or environ.get(TOOL_CALL_PARSER_ENV) or None),
            reasoning_parser=(getattr(args, "reasoning_parser", None)
                              or environ.get(REASONING_PARSER_ENV) or None),
            enable_auto_tool_choice=auto,
            harmony_vocab=_path(getattr(args, "harmony_vocab", None)
                                or environ.get(HARMONY_VOCAB_ENV) or None),
        )


def _path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None


def _env_flag(environ: Mapping[str, str], name: str) -> bool:
    value = environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {', '.join(_TRUE + _FALSE[1:])}, got {value!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The three flags, as `pdmesh serve` and `pdmesh up` take them."""
    group = parser.add_argument_group("tool calls and reasoning")
    group.add_argument("--enable-auto-tool-choice", action="store_true", default=None,
                       help="allow tool_choice 'auto' (needs --tool-call-parser; default: "
                            f"${AUTO_TOOL_CHOICE_ENV})")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       metavar="NAME",
                       help=f"read tool calls in this format: {', '.join(sorted(TOOL_PARSERS))} "
                            f"(default: ${TOOL_CALL_PARSER_ENV})")
    group.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       metavar="NAME",
                       help="split reasoning out in this format: "
                            f"{', '.join(sorted(REASONING_PARSERS))} "
                            f"(default: ${REASONING_PARSER_ENV})")
    group.add_argument("--harmony-vocab", default=None, metavar="PATH",
                       help="OpenAI's o200k_base.tiktoken, or a directory holding it, for "
                            "gpt-oss's harmony format (default: $" + HARMONY_VOCAB_ENV + ", else "
                            "derived from the checkpoint's tokenizer.json into the cache)")


def forwarded_flags(args: argparse.Namespace) -> list[str]:
    """The flags again, for a child `pdmesh serve` (what `pdmesh up` passes every worker)."""
    flags: list[str] = []
    if getattr(args, "enable_auto_tool_choice", None):
        flags.append("--enable-auto-tool-choice")
    for name in ("tool_call_parser", "reasoning_parser", "harmony_vocab"):
        value = getattr(args, name, None)
        if value:
            flags += [f"--{name.replace('_', '-')}", value]
    return flags
