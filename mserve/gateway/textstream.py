"""Token ids to text, a piece at a time, and stop strings: what the gateway adds on top of the token stream.

``Detokenizer`` turns ids into text deltas the way streaming servers do: decode a short window of
recent ids, and hold a delta back while it ends in an incomplete UTF-8 sequence (U+FFFD), so a
multi-byte character split across tokens never reaches the client half-made. ``StopMatcher``
holds back as many characters as the longest stop string less one, so a stop string split across
deltas is never partly sent; text after the stop string is never sent.
"""

from __future__ import annotations

from typing import Any, Sequence

from mserve.common.prompt import detokenize

__all__ = ["Detokenizer", "StopMatcher"]


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # ids up to here have been turned into text already
        self.text = ""  # everything handed out so far

    def _decode(self, ids: Sequence[int]) -> str:
        return detokenize(self._tok, ids)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete (possibly '')."""
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def finish(self, final_text: str | None = None) -> str:
        """The text not handed out yet: the rest of ``final_text`` (the server's own decode) when given."""
        full = final_text if final_text is not None else self._decode(self.ids)
        rest = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += rest
        return rest


class StopMatcher:
    """Feed text deltas; get back what may be sent, and whether a stop string ended the text."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return text[:min(hits)]
        cut = max(0, len(text) - self._hold)
        self._pending = text[cut:]
        return text[:cut]

    def flush(self) -> str:
        """At the end of generation: what was held back (it did not turn into a stop string)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
