"""Pythonic tool calls: `[get_weather(city="Paris", days=3), get_time()]`.

The format of Llama 3.2's and Llama 4's model cards ("[func_name1(param1=value1, ...),
func_name2(...)]"; Llama 4 wraps it in `<|python_start|>…<|python_end|>`). The list is parsed
with `ast` and only literals are accepted (strings, numbers, booleans, None, lists, dicts;
`true`/`false`/`null` too): nothing is ever evaluated. A reply that opens with the list has its
calls taken from it (text after the list is content); any other reply is content.
"""

from __future__ import annotations

import ast
import logging
import re
from enum import Enum
from typing import Any

from shared.parsing.base import Emission, ToolParser
from shared.parsing.brackets import BracketScanner
from shared.parsing.markers import dropped_at_end
from shared.parsing.tools import ToolsArg
from shared.parsing.trimmed_text import TrimmedText

logger = logging.getLogger(__name__)

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_HEAD_YES = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")  # the list opens with a call
_HEAD_MAYBE = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")  # ... or may still do so
_HEAD_LEN = 64  # a function name longer than this is not taken for one
_NAMED = {"true": True, "false": False, "null": None}


class _Phase(Enum):
    START = "start"  # whitespace or part of `<|python_start|>` so far
    LIST = "list"  # inside the bracketed list
    AFTER = "after"  # after the list: whitespace and `<|python_end|>` are skipped
    CONTENT = "content"  # everything else passes through


def parse_call_list(source: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The (name, arguments) of each call in a `[f(a=1), g()]` source, or None if it is not a
    non-empty list of calls with keyword arguments whose values are literals."""
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        name = _dotted_name(node.func) if isinstance(node, ast.Call) else None
        if name is None or not isinstance(node, ast.Call) or node.args:
            return None
        try:
            arguments = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg}
        except ValueError:
            return None
        if len(arguments) != len(node.keywords):  # a `**kwargs` has no name
            return None
        calls.append((name, arguments))
    return calls


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _literal(node: ast.expr) -> Any:
    """A JSON-compatible value of a literal node; ValueError for anything else (calls, names,
    operators, sets...): the source is never evaluated."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float | None):
        return node.value  # bool is an int
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("a ** in a dict literal")
        return {str(_literal(k)): _literal(v) for k, v in zip(node.keys, node.values, strict=True)
                if k is not None}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("a sign on a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.Name) and node.id in _NAMED:
        return _NAMED[node.id]
    raise ValueError(f"not a literal: {type(node).__name__}")


class PythonicToolParser(ToolParser):
    """A leading Python list of calls; registered as pythonic.

    Per step O(len(delta)): the list is tracked by a BracketScanner (Python string quotes)
    and parsed once, when it closes. Its first characters settle early whether it can be a call
    list (`[Note: ...` is released as content at once); a closed list that is not a call list
    is content, verbatim. The python_start/end tags are optional (skip_special_tokens may drop
    them), so special tokens need not be kept.
    """

    def __init__(self, tools: ToolsArg = (), *, prompt: str | None = None) -> None:
        super().__init__(tools, prompt=prompt)
        self._phase = _Phase.START
        self._held = ""
        self._list: list[str] = []
        self._head_ok = False  # the list's opening is known to be `[name(`
        self._scanner = BracketScanner(quotes="\"'")
        self._content = TrimmedText()

    def _feed(self, delta: str, out: Emission) -> None:
        buf = delta
        while buf:
            if self._phase in (_Phase.START, _Phase.AFTER):
                buf = self._skip(buf)
            elif self._phase is _Phase.LIST:
                buf = self._in_list(buf, out)
            else:
                out.content.append(self._content.push(buf))
                buf = ""

    def _skip(self, buf: str) -> str:
        """START: optional `<|python_start|>`, then a `[` opens the list; AFTER: an optional
        `<|python_end|>`. Anything else makes the rest content."""
        tag = PYTHON_START if self._phase is _Phase.START else PYTHON_END
        self._held += buf
        head = self._held.lstrip()
        if not head or (tag.startswith(head) and head != tag):
            return ""
        self._held = ""
        if head.startswith(tag):
            return head[len(tag):]  # same phase: whitespace, then the list / the end
        if self._phase is _Phase.START and head.startswith("["):
            self._phase = _Phase.LIST
        else:
            self._phase = _Phase.CONTENT
        return head

    def _in_list(self, buf: str, out: Emission) -> str:
        end = self._scanner.feed(buf)
        self._list.append(buf if end < 0 else buf[:end])
        if not self._head_ok:  # decided within _HEAD_LEN chars, so this join stays short
            head = "".join(self._list)[:_HEAD_LEN]
            self._head_ok = _HEAD_YES.match(head) is not None
            undecided = len(head) < _HEAD_LEN and _HEAD_MAYBE.fullmatch(head) is not None
            if not self._head_ok and (end >= 0 or not undecided):
                self._phase = _Phase.CONTENT  # e.g. `[Note: ...]`: prose, not calls
                return "".join(self._list) + ("" if end < 0 else buf[end:])
        if end < 0:
            return ""
        source = "".join(self._list)
        calls = parse_call_list(source)
        if calls is None:
            logger.warning("pythonic: a leading list is not a list of calls; kept as content")
            out.content.append(self._content.push(source))
            self._phase = _Phase.CONTENT
        else:
            for name, arguments in calls:
                self._emit_call(out, name, arguments)
            self._phase = _Phase.AFTER
        return buf[end:]

    def _finish(self, out: Emission) -> None:
        held, self._held = self._held, ""
        if self._phase is _Phase.LIST:
            self._drop_unfinished("".join(self._list))
        elif held.strip() and not dropped_at_end(held.strip()):
            out.content.append(self._content.push(held))
