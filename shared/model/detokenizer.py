"""Incremental detokenization: token ids in, append-only text out.

Uses the prefix_offset / read_offset scheme of vLLM's `detokenize_incrementally` (and of
`tokenizers.decoders.DecodeStream`): only the window `ids[prefix_offset:]` is decoded, and the
new text is what that window decodes to beyond `ids[prefix_offset:read_offset]`. Decoding a
window instead of the whole sequence keeps each step O(window), and decoding the window relative
to a prefix keeps decoder context (merged spaces, multi-byte characters) right.

A step whose window decodes to text ending in U+FFFD is an incomplete UTF-8 character (a byte-level
token carried only part of it): nothing is emitted and the offsets stay put, so the character is
emitted whole once its last byte arrives. Stop strings are applied on top by StopStringChecker.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.model.stop_strings import StopStringChecker
from shared.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class DetokenizedDelta:
    """Text that became final in one step; `stop_str` is set when a stop string matched in it
    (the sequence should then finish with reason "stop")."""

    text: str
    stop_str: str | None = None


class IncrementalDetokenizer:
    """Per-sequence streaming decoder for generated tokens (the prompt is not part of the text).

    `add` returns only new, final text: the concatenation of all returned text never shrinks and,
    without stop strings, equals `tokenizer.decode(token_ids)` once `finish` has been called.
    `text` is that concatenation so far. With stop strings, text is cut at the first stop (kept
    with include_stop_str_in_output) and tokens added after a stop are ignored.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stops = StopStringChecker(stop, include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start: decoder context already emitted
        self._read_offset = 0  # ids before this are emitted; ids after it are pending
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])

    @property
    def stop_str(self) -> str | None:
        return self.stops.stop_str

    def add(self, token_ids: int | Iterable[int]) -> DetokenizedDelta:
        """Feed one id or a few ids; returns the newly releasable text."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        pieces = []
        for token_id in ids:
            if self.stops.stopped:  # ids after a stop string are not part of the output
                break
            self.token_ids.append(int(token_id))
            pieces.append(self._release(self._step()).text)
        return DetokenizedDelta("".join(pieces), self.stops.stop_str)

    def finish(self) -> DetokenizedDelta:
        """End of sequence: emit whatever is still pending (an incomplete character decodes as
        U+FFFD, as a full decode would) and release text held back for stop strings."""
        pending = ""
        if self._read_offset < len(self.token_ids) and not self.stops.stopped:
            window = self._decode(self._prefix_offset, len(self.token_ids))
            pending = window[len(self._prefix_text):]
            self._advance(len(self.token_ids))
        delta = self._release(pending)
        tail = self.stops.flush()
        self.text += tail
        return DetokenizedDelta(delta.text + tail, delta.stop_str)

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _advance(self, read_offset: int) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, read_offset
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)

    def _step(self) -> str:
        """Decode the window after appending one id; '' while the tail is an incomplete char."""
        new_text = self._decode(self._prefix_offset, len(self.token_ids))
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(self._prefix_text):]
        self._advance(len(self.token_ids))
        return delta

    def _release(self, decoded: str) -> DetokenizedDelta:
        if not decoded and not self.stops.stopped:
            return DetokenizedDelta("")
        out = self.stops.feed(decoded)
        self.text += out.text
        return DetokenizedDelta(out.text, out.stop_str)
