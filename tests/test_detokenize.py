"""TextStream (runtime/engine/detokenize.py) over the bundled SmolLM2 tokenizer (GPT-2 style byte-level BPE).

The fast path (tokenizers' DecodeStream) and the fallback (two tokenizer.decode calls per token) must give the
text tokenizer.decode(all_ids, skip_special_tokens=True) gives, and push for push the same pieces as the
implementation before DecodeStream (OldTextStream below, kept verbatim as the reference), stop strings included.
Sequences are random (hypothesis, derandomized) and adversarial: multi-byte characters split one byte per token,
special tokens inside them, characters cut off at the end, stray continuation bytes.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers.decoders import DecodeStream

from oval_edge.runtime.engine import detokenize
from oval_edge.runtime.engine.detokenize import TextStream, rust_backend

SETTINGS = settings(max_examples=150, derandomize=True, deadline=None)
TEXTS = ["Hello world", " leading space", "  two spaces", "naïve café déjà vu", "你好，世界", "こんにちは",
         "👋🏽 hi 🇫🇷 flag", "👨‍👩‍👧 family", "✨ sparkle", "Grüße aus Köln", "a\nb\tc", " Paris.", "x = 1 + 2;"]
SPLIT_CHARS = "é你👋🏽🇫✨ü—€"  # written one byte per token below: every prefix of them is an incomplete character


class OldTextStream:
    """The two-decode TextStream as it was before DecodeStream: the reference for stop-string behaviour."""

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids, self.emitted, self.text, self.stopped = [], 0, "", False
        self._prefix = self._read = 0

    def push(self, token_id):
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self._prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
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
        for s in self.stop:
            for cut in range(min(len(s) - 1, safe), 0, -1):
                if self.text[safe - cut : safe] == s[:cut]:
                    safe = min(safe, len(self.text) - cut)
                    break
        return self._take(safe)

    def flush(self):
        if not self.stopped and self._read < len(self.ids):
            before = self.tokenizer.decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
            after = self.tokenizer.decode(self.ids[self._prefix :], skip_special_tokens=True)
            self.text += after[len(before) :]
            self._read = len(self.ids)
        return self._take(len(self.text))

    def _take(self, upto):
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out


class CountingTokenizer:
    """Forwards everything to the real tokenizer and counts decode calls. slow=True hides the Rust backend."""

    def __init__(self, tokenizer, slow=False):
        self._real, self._slow, self.decodes = tokenizer, slow, 0

    def decode(self, *args, **kwargs):
        self.decodes += 1
        return self._real.decode(*args, **kwargs)

    def __getattr__(self, name):
        if self._slow and name == "_tokenizer":
            raise AttributeError(name)
        return getattr(self._real, name)


@functools.cache
def _bundled():
    from oval_edge.runtime.model.gguf_metadata import cached_metadata_folder
    from oval_edge.runtime.model.origin.source import resolve_model
    from oval_edge.runtime.model.tokenizer import load_tokenizer

    source = resolve_model("default")
    return load_tokenizer(source, cached_metadata_folder(source.path))


@pytest.fixture(scope="module")
def tok():
    return _bundled()


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> vocabulary character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_ids(tok, data: bytes) -> list[int]:
    """One token per byte (the tokens that split a character where the model may sample them)."""
    table = _byte_to_unicode()
    ids = tok.convert_tokens_to_ids([table[b] for b in data])
    assert tok.unk_token_id not in ids and None not in ids
    return ids


def ids_strategy(tok):
    special = sorted(int(i) for i in tok._tokenizer.get_added_tokens_decoder())
    pieces = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    split = [byte_ids(tok, c.encode()) for c in SPLIT_CHARS]
    part = st.one_of(st.integers(0, len(tok) - 1).map(lambda i: [i]), st.sampled_from(special).map(lambda i: [i]),
                     st.sampled_from(pieces), st.sampled_from(split),
                     st.sampled_from(split).map(lambda ids: ids[:-1]),  # a character that never completes
                     st.sampled_from(split).map(lambda ids: ids[:1] + special[:1] + ids[1:]))  # special inside
    return st.lists(part, min_size=1, max_size=12).map(lambda parts: [i for p in parts for i in p])


def run(stream, ids):
    """Per-push pieces (pushing stops at a stop string, as the engine does) and the flushed tail."""
    pieces = []
    for i in ids:
        pieces.append(stream.push(i))
        if stream.stopped:
            break
    return pieces, stream.flush()


def test_bundled_tokenizer_takes_the_fast_path(tok):
    assert rust_backend(tok) is tok._tokenizer
    assert TextStream(tok)._decoder is not None
    assert rust_backend(CountingTokenizer(tok, slow=True)) is None


@pytest.mark.parametrize("text", TEXTS)
def test_known_texts_round_trip(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces, tail = run(TextStream(tok), ids)
    assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=True) == text


def test_adversarial_byte_splits(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    emoji = byte_ids(tok, "👋".encode())
    cases = [
        emoji,  # four tokens, one character
        emoji[:2] + [im_end] + emoji[2:],  # a special token inside the character (skipped, the bytes join)
        tok(" Hi", add_special_tokens=False)["input_ids"] + emoji[:3],  # cut off by max_tokens: U+FFFD on flush
        byte_ids(tok, b"\x80") + tok(" ok", add_special_tokens=False)["input_ids"],  # a stray continuation byte
        byte_ids(tok, "é".encode())[:1] + tok("a", add_special_tokens=False)["input_ids"],  # broken, then ASCII
        [im_end, im_end] + byte_ids(tok, " 你".encode()) + [im_end],
    ]
    for ids in cases:
        full = tok.decode(ids, skip_special_tokens=True)
        for stream in (TextStream(tok), TextStream(CountingTokenizer(tok, slow=True))):
            pieces, tail = run(stream, ids)
            assert "".join(pieces) + tail == full, (ids, pieces, tail, full)
            assert (pieces, tail) == run(OldTextStream(tok), ids)
    pieces, tail = run(TextStream(tok), cases[2])
    assert pieces[-3:] == ["", "", ""] and tail == "\ufffd"  # held back while incomplete, as before


@SETTINGS
@given(data=st.data())
def test_random_sequences_equal_the_full_decode(tok, data):
    ids = data.draw(ids_strategy(tok))
    full = tok.decode(ids, skip_special_tokens=True)
    fast, slow = TextStream(tok), TextStream(CountingTokenizer(tok, slow=True))
    expected = run(OldTextStream(tok), ids)
    for stream in (fast, slow):
        pieces, tail = run(stream, ids)
        assert "".join(pieces) + tail == full == stream.text
        assert (pieces, tail) == expected  # piece for piece, not only in total
        assert stream.ids == ids and stream.emitted == len(full)


@SETTINGS
@given(data=st.data())
def test_stop_strings_behave_as_before(tok, data):
    ids = data.draw(ids_strategy(tok))
    full = tok.decode(ids, skip_special_tokens=True)
    start = data.draw(st.integers(0, max(0, len(full) - 1)))
    stops = [full[start : start + data.draw(st.integers(1, 6))]] if full else []
    stops += data.draw(st.lists(st.text(alphabet=" .aeé你👋\ufffd\n", min_size=1, max_size=4), max_size=2))
    stop = tuple(s for s in stops if s)
    old = OldTextStream(tok, stop)
    expected = run(old, ids)
    for stream in (TextStream(tok, stop), TextStream(CountingTokenizer(tok, slow=True), stop)):
        assert run(stream, ids) == expected
        assert (stream.stopped, stream.text, stream.emitted, stream.ids) == (old.stopped, old.text, old.emitted,
                                                                             old.ids)


def test_stop_across_token_boundaries(tok):
    ids = tok(" The capital of France is Paris. It is big.", add_special_tokens=False)["input_ids"]
    for stop in (("is Pa",), ("Paris.",), (". It",), ("s. I", "big"), ("nowhere",), ("big.", "e is P")):
        expected = run(OldTextStream(tok, stop), ids)
        stream = TextStream(tok, stop)
        assert run(stream, ids) == expected
        if stop != ("nowhere",):
            assert stream.stopped and not any(s in stream.text for s in stop)


class CountingDecodeStream:
    """Wraps tokenizers' DecodeStream to count steps; fail_at=k raises on the k-th step (0-based)."""

    steps = 0

    def __init__(self, skip_special_tokens, fail_at=None):
        self._real = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.fail_at = fail_at

    def step(self, backend, token_id):
        if CountingDecodeStream.steps == self.fail_at:
            CountingDecodeStream.steps += 1
            raise Exception("Invalid prefix encountered")  # what DecodeStream raises for InvalidPrefix
        CountingDecodeStream.steps += 1
        return self._real.step(backend, token_id)


def test_fast_path_decodes_once_per_push(tok, monkeypatch):
    monkeypatch.setattr(CountingDecodeStream, "steps", 0)
    monkeypatch.setattr(detokenize, "DecodeStream", CountingDecodeStream)
    counted = CountingTokenizer(tok)
    ids = tok("Grüße 👋🏽 你好 and more text", add_special_tokens=False)["input_ids"] + byte_ids(tok, "✨".encode())[:2]
    stream = TextStream(counted, ("zzz",))
    for i in ids:
        stream.push(i)
    assert CountingDecodeStream.steps == len(ids) and counted.decodes == 0  # one Rust decode step per push
    assert stream.flush() == "\ufffd" and counted.decodes == 2  # the cut-off character: once per request
    assert stream.text == tok.decode(ids, skip_special_tokens=True)
    slow = CountingTokenizer(tok, slow=True)
    run(TextStream(slow), ids)
    assert slow.decodes == 2 * len(ids) + 2  # the fallback: two per push (and two for the tail)


@pytest.mark.parametrize("fail_at", [0, 3, 7])
def test_decode_stream_error_falls_back_mid_stream(tok, monkeypatch, fail_at):
    monkeypatch.setattr(CountingDecodeStream, "steps", 0)
    monkeypatch.setattr(detokenize, "DecodeStream", functools.partial(CountingDecodeStream, fail_at=fail_at))
    ids = tok(" naïve 👋🏽 café", add_special_tokens=False)["input_ids"]
    stream = TextStream(tok, (" caf",))
    assert run(stream, ids) == run(OldTextStream(tok, (" caf",)), ids)
    assert stream._decoder is None and stream.stopped


def test_cleanup_rule(tok, monkeypatch):
    """transformers 5 ignores clean_up_tokenization_spaces for BPE (its decode stays the Rust decode), so the
    fast path stays; a forced cleanup, or a non-BPE model with cleanup, takes the fallback."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordPiece

    ids = tok(" a . b , c 's d n't", add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True, raising=False)
    assert rust_backend(tok) is tok._tokenizer
    assert "".join(run(TextStream(tok), ids)[0]) == tok.decode(ids, skip_special_tokens=True)
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", True,
                        raising=False)
    assert rust_backend(tok) is None
    wordpiece = CountingTokenizer(tok)
    wordpiece.__dict__["_tokenizer"] = Tokenizer(WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.__dict__["clean_up_tokenization_spaces"] = True
    assert rust_backend(wordpiece) is None
    wordpiece.__dict__["clean_up_tokenization_spaces"] = False
    assert rust_backend(wordpiece) is not None
