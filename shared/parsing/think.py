"""`<think>…</think>` reasoning (DeepSeek-R1, Qwen3, QwQ and their distillations).

The model writes `<think>`, its reasoning, `</think>`, then the answer. Some chat templates
write the `<think>` into the prompt themselves (DeepSeek-R1's since 0528, Qwen3's *-Thinking
models), so the generation starts inside reasoning and only `</think>` appears; the parser
must be told which (`starts_in_reasoning`, or `prompt_opens_reasoning(prompt)`), because a
stream cannot wait for the end to find out. Text after `</think>` is content, verbatim.
"""

from __future__ import annotations

from enum import Enum

from shared.parsing.base import Emission, StreamParser
from shared.parsing.markers import dropped_at_end, partial_suffix_len
from shared.parsing.trimmed_text import TrimmedText

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open `<think>` (its template opened it)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class _Phase(Enum):
    START = "start"  # only whitespace or a possible `<think>` / `</think>` seen so far
    REASONING = "reasoning"
    CONTENT = "content"


class ThinkParser(StreamParser):
    """Splits `<think>reasoning</think>content`; registered as think, qwen3 and deepseek_r1.

    Each step costs O(len(delta)): inside reasoning only the held tail (a possible partial
    `</think>` plus trailing whitespace) is rescanned with the new delta, never the whole text,
    and after `</think>` text passes straight through. A leading `<think>` is dropped; with
    `starts_in_reasoning` the text is reasoning until `</think>` (all of it if none comes),
    without it the text is content unless it opens with `<think>` (or with `</think>`: an
    empty reasoning the template opened). Markers after the reasoning ended are content.
    """

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        super().__init__()
        self.starts_in_reasoning = starts_in_reasoning
        self._phase = _Phase.START
        self._held = ""  # START: the undecided head; REASONING: a possible partial `</think>`
        self._reasoning = TrimmedText()
        self._content = TrimmedText()

    def fresh(self) -> ThinkParser:
        return ThinkParser(starts_in_reasoning=self.starts_in_reasoning)

    @property
    def reasoning_ended(self) -> bool:
        if self._phase is _Phase.START:
            return not self.starts_in_reasoning
        return self._phase is _Phase.CONTENT

    def _feed(self, delta: str, out: Emission) -> None:
        if self._phase is _Phase.START:
            delta = self._decide(delta)
        if self._phase is _Phase.REASONING:
            delta = self._reason(delta, out)
        if self._phase is _Phase.CONTENT and delta:
            out.content.append(self._content.push(delta))

    def _decide(self, delta: str) -> str:
        """In START: enter a phase once the head can no longer become a marker; returns the
        text that belongs to the phase entered ("" while still undecided)."""
        self._held += delta
        head = self._held.lstrip()
        if not head or any(m.startswith(head) and m != head for m in (THINK_OPEN, THINK_CLOSE)):
            return ""
        self._held = ""
        if head.startswith(THINK_OPEN):
            self._phase = _Phase.REASONING
            return head[len(THINK_OPEN):]
        opened = self.starts_in_reasoning or head.startswith(THINK_CLOSE)
        self._phase = _Phase.REASONING if opened else _Phase.CONTENT
        return head

    def _reason(self, delta: str, out: Emission) -> str:
        """Inside reasoning: release reasoning up to `</think>`; returns the content after it."""
        buf = self._held + delta
        end = buf.find(THINK_CLOSE)
        if end >= 0:
            self._held = ""
            out.reasoning.append(self._reasoning.push(buf[:end]))
            self._phase = _Phase.CONTENT
            return buf[end + len(THINK_CLOSE):]
        keep = partial_suffix_len(buf, (THINK_CLOSE,))
        self._held = buf[len(buf) - keep:]
        out.reasoning.append(self._reasoning.push(buf[:len(buf) - keep]))
        return ""

    def _finish(self, out: Emission) -> None:
        held, self._held = self._held, ""
        if self._phase is _Phase.START:
            head = held.lstrip()
            if head and not dropped_at_end(head):  # a lone `<`: the text's own character
                if self.starts_in_reasoning:
                    out.reasoning.append(self._reasoning.push(head))
                else:
                    out.content.append(self._content.push(head))
        elif self._phase is _Phase.REASONING and not dropped_at_end(held):
            out.reasoning.append(self._reasoning.push(held))
