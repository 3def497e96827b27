"""Incremental detokenization with stop strings: emit only text that can no longer become part of a stop."""

from __future__ import annotations


class TextStream:
    """Feeds generated token ids, returns the newly safe text each time, and finds stop strings.

    Text that could still be the start of a stop string, or tokens that end inside a UTF-8 character (decoded
    as U+FFFD), are held back until the next token decides them.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = 0  # characters of `text` already handed out
        self.text = ""
        self.stopped = False
        # Decode only a short tail each step (O(1) per token): text of ids[prefix:read] is already in `text`.
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        """Add a token; return the text that became safe to show. Sets `stopped` when a stop string appears."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):  # else: wait for the rest of a character
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
        if self.stopped:
            return self._take(len(self.text))
        safe = len(self.text)
        for s in self.stop:  # hold back a suffix that is a prefix of a stop string
            for cut in range(min(len(s) - 1, safe), 0, -1):
                if self.text[safe - cut : safe] == s[:cut]:
                    safe = min(safe, len(self.text) - cut)
                    break
        return self._take(safe)

    def flush(self) -> str:
        """At the end of generation everything left is final (a held-back prefix did not become a stop)."""
        if not self.stopped and self._read < len(self.ids):  # a character cut off by max_tokens
            before = self.tokenizer.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
            after = self.tokenizer.decode(self.ids[self._prefix :], skip_special_tokens=True)
            self.text += after[len(before) :]
            self._read = len(self.ids)
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
