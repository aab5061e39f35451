"""How one chat request's output is read: which parsers, and what that changes in its sampling.

`plan_chat_output` decides it from the worker's `ParsersConfig` and the request's tools, as
vLLM does:

- tools with tool_choice "auto" (the default with tools) are read with the configured tool
  parser; without `--enable-auto-tool-choice` and `--tool-call-parser` that is a 400;
- "none" reads no calls (the tools are not in the prompt either: ChatTools.for_template);
- "required" or a named function: the grammar (tool_constraints.py) makes the answer a JSON
  text, read back into calls once the choice finished (`ParsedChoice`);
- a configured reasoning parser reads every chat request, tools or not.

With a reasoning parser, a structured-output constraint (response_format, tool_choice...)
applies after the reasoning: the spec gets `reasoning_first` and the token ids of the end
marker (`</think>`), which the engine matches at the exact token, unless the rendered prompt
already closed the reasoning (a template that switches thinking off writes `<think></think>`).
A marker the tokenizer splits differently in context never matches, and the output is then
unconstrained; a format without a fixed end marker (channel) keeps the grammar from the first
token. Where a parser needs the special tokens in the text, the request's
`skip_special_tokens` is forced off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from services.common.errors import BadRequestError
from services.worker.chat_messages import ChatTools
from services.worker.engine_client import TokenizerLike
from services.worker.openai_protocol import SamplingFields
from services.worker.parsers_config import ParsersConfig
from services.worker.tool_constraints import enforces_tool_call
from shared.engine.structured_spec import StructuredOutputSpec
from shared.parsing import (
    ChatStreamParser,
    ReasoningParserFactory,
    ThinkParser,
    ToolParser,
    get_reasoning_parser,
    get_tool_parser,
)
from shared.parsing.think import THINK_CLOSE

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    '--tool-call-parser to be set')


@dataclass(frozen=True)
class ChatOutputPlan:
    """How a chat request's generated text is read; not `active`: returned verbatim.

    `tool_parser` reads calls (tool_choice "auto"); `reasoning` splits reasoning out;
    `constrained` is a tool_choice "required" / named function whose grammar-made JSON is
    read back into calls at the end. `prompt` is the rendered prompt the parsers look at.
    """

    prompt: str = ""
    tools: tuple[dict[str, Any], ...] = ()
    tool_parser: type[ToolParser] | None = None
    reasoning: ReasoningParserFactory | None = None
    constrained: str | dict[str, Any] | None = None
    parallel_calls: bool = True  # false: calls after the first are dropped (tool_choice auto)

    @property
    def active(self) -> bool:
        return (self.tool_parser is not None or self.reasoning is not None
                or self.constrained is not None)

    @property
    def takes_calls(self) -> bool:
        """Whether calls the parsers find are the request's (tool_choice "auto")."""
        return self.tool_parser is not None

    def new_parser(self) -> ChatStreamParser:
        """A fresh parser for one choice."""
        reasoning = self.reasoning(prompt=self.prompt) if self.reasoning is not None else None
        tools = (self.tool_parser(self.tools, prompt=self.prompt)
                 if self.tool_parser is not None else None)
        return ChatStreamParser(reasoning, tools)

    def sampling(self, sampling: SamplingFields, tokenizer: TokenizerLike) -> SamplingFields:
        """The request's sampling fields as its parsers need them (see the module docstring)."""
        if not self.active:
            return sampling
        changes: dict[str, Any] = {}
        if sampling.skip_special_tokens and self.new_parser().requires_special_tokens:
            changes["skip_special_tokens"] = False
        spec = self._structured(sampling.structured, tokenizer)
        if spec is not sampling.structured:
            changes["structured"] = spec
        return dataclasses.replace(sampling, **changes) if changes else sampling

    def _structured(self, spec: StructuredOutputSpec | None,
                    tokenizer: TokenizerLike) -> StructuredOutputSpec | None:
        if spec is None or self.reasoning is None or spec.reasoning_first:
            return spec
        if not isinstance(self.reasoning(prompt=self.prompt), ThinkParser):
            return spec  # no fixed end marker to switch the grammar on at
        if self.prompt.rstrip().endswith(THINK_CLOSE):
            return spec  # the template closed the reasoning: the answer comes first
        end = tuple(tokenizer.encode(THINK_CLOSE, add_special_tokens=False))
        return dataclasses.replace(spec, reasoning_first=True, reasoning_end_ids=end)


def plan_chat_output(parsers: ParsersConfig, tools: ChatTools, prompt: str) -> ChatOutputPlan:
    """The plan of one chat request; a 400 for tool_choice "auto" on a worker not set up for
    it (vLLM's rule and message)."""
    tool_parser = None
    constrained = None
    if tools.tools is not None:
        if tools.tool_choice == "auto":
            if not (parsers.enable_auto_tool_choice and parsers.tool_call_parser):
                raise BadRequestError(AUTO_NEEDS_FLAGS, param="tool_choice")
            tool_parser = get_tool_parser(parsers.tool_call_parser)
        elif enforces_tool_call(tools.tool_choice):
            constrained = tools.tool_choice
    reasoning = (get_reasoning_parser(parsers.reasoning_parser)
                 if parsers.reasoning_parser else None)
    return ChatOutputPlan(prompt=prompt, tools=tools.tools or (), tool_parser=tool_parser,
                          reasoning=reasoning, constrained=constrained,
                          parallel_calls=tools.parallel)
