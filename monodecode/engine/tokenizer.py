"""Text <-> token ids for the engine: the checkpoint's `tokenizer.json`, or a byte-level fallback.

Fallback (checkpoints without `tokenizer.json`, e.g. the random-weight presets): when the
vocabulary has at least 259 ids, text is UTF-8 encoded and byte b becomes id b + 3 (ids 0-2 stay
free for BOS, EOS and padding, as in the presets). Decoding maps ids 3..258 back to bytes, drops
every other id, and shows invalid UTF-8 as U+FFFD. It exists so that text requests work end to
end on any model; on random weights the text it returns is noise. A smaller vocabulary has no
text: only token-id prompts are accepted.
"""

from __future__ import annotations

from pathlib import Path

BYTE_OFFSET = 3
BYTE_VOCAB = BYTE_OFFSET + 256


class ByteTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_VOCAB).decode("utf-8", "replace")


class FileTokenizer:
    """A checkpoint's `tokenizer.json` through the `tokenizers` library."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def file_tokenizer(source) -> FileTokenizer | None:
    """The `tokenizer.json` of checkpoint directory `source`, or None."""
    path = Path(str(source)) / "tokenizer.json"
    return FileTokenizer(path) if path.is_file() else None


def load_tokenizer(source, vocab_size: int) -> FileTokenizer | ByteTokenizer | None:
    """The tokenizer of checkpoint directory or preset `source`, or None (token ids only)."""
    return file_tokenizer(source) or (ByteTokenizer() if vocab_size >= BYTE_VOCAB else None)


def text_offsets(tokenizer, ids: list[int]) -> list[int]:
    """Where each token's text starts in the text of `ids`, as the request's output offsets are
    counted: the length of the text the tokens before it complete."""
    detokenizer, offsets = IncrementalDetokenizer(tokenizer), []
    for token_id in ids:
        offsets.append(len(detokenizer.text))
        detokenizer.add(token_id)
    return offsets


class IncrementalDetokenizer:
    """The text of a growing list of output ids, released in pieces that are safe to show:
    a trailing U+FFFD (an incomplete multi-byte character) waits for the next token."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.text = tokenizer, [], ""

    def add(self, token_id: int) -> str:
        """Append a token; the new text it completes (possibly empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ""
        new, self.text = text[len(self.text):], text
        return new

    def flush(self) -> str:
        """At the end: whatever text is still held back."""
        text = self.tokenizer.decode(self.ids)
        new = text[len(self.text):] if text.startswith(self.text) else ""
        self.text += new
        return new
