"""Incremental detokenization with stop strings: emit only text that can no longer become part of a stop.

Two ways to turn one new token into new text, with the same result:

- fast (Rust-backed) tokenizers: `tokenizers.decoders.DecodeStream`, one Python call per token. It runs the
  prefix/read-offset algorithm below inside Rust (no transformers `decode` wrapper, no Python lists sliced).
- anything else (slow tokenizers, or a fast one whose Python `decode` post-processes the Rust text): two
  `tokenizer.decode` calls per token on a short window (the TGI/vLLM prefix/read-offset trick).

Both keep the same window: `ids[_prefix:_read]` is context already shown (so decoders that drop a leading space
on the first token still see it), `ids[_read:]` the tokens not yet shown. DecodeStream emits exactly when the
two-decode path would (longer text that does not end in U+FFFD), so `_prefix`/`_read` mirror its state and the
fallback can take over mid-stream if DecodeStream ever raises (its InvalidPrefix error for a decoder whose
output is not a prefix-extension, or an id it cannot take).
"""

from __future__ import annotations

try:
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers ships with transformers; without it every tokenizer takes the fallback
    _RustTokenizer = DecodeStream = None


def rust_backend(tokenizer):
    """The `tokenizers.Tokenizer` behind `tokenizer` when its decode(ids, skip_special_tokens=True) is exactly the
    Rust decode of the same ids (so DecodeStream gives the same text), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if DecodeStream is None or not isinstance(backend, _RustTokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # transformers then rewrites " ." -> "." etc. in Python, which DecodeStream never does; transformers 5
        # skips that cleanup for BPE models (it corrupts them) unless told otherwise, so only BPE stays fast.
        forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        if type(backend.model).__name__ != "BPE" or forced:
            return None
    return backend


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
        self._backend = rust_backend(tokenizer)
        self._decoder = DecodeStream(skip_special_tokens=True) if self._backend is not None else None

    def push(self, token_id: int) -> str:
        """Add a token; return the text that became safe to show. Sets `stopped` when a stop string appears."""
        self.ids.append(token_id)
        new = self._step_fast(token_id) if self._decoder is not None else self._step_window()
        if new is not None:
            self.text += new
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
            # The same window as every push, decoded once more: the pending bytes come out as tokenizer.decode
            # writes them (U+FFFD for an incomplete character), on either path.
            before, after = self._decode_window()
            self.text += after[len(before) :]
            self._read = len(self.ids)
        return self._take(len(self.text))

    # ---- one token -> new text (None while undecided) ----------------------------------------------------------
    def _step_fast(self, token_id: int) -> str | None:
        try:
            return self._decoder.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - InvalidPrefix, an id out of range...: the window path decides instead
            self._decoder = None  # its state now lags ours; the window path continues from _prefix/_read
            return self._step_window()

    def _step_window(self) -> str | None:
        before, after = self._decode_window()
        if len(after) > len(before) and not after.endswith("\ufffd"):  # else: wait for the rest of a character
            return after[len(before) :]
        return None

    def _decode_window(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        return (decode(self.ids[self._prefix : self._read], skip_special_tokens=True),
                decode(self.ids[self._prefix :], skip_special_tokens=True))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
