"""Streams generated token ids to text, emitting only complete characters, in O(1) amortised per token."""

from __future__ import annotations

from services.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns one request's generated ids into text piece by piece (vLLM's prefix/read-offset scheme).

    Contract: `"".join(pushes) + flush() == tokenizer.decode(generated_ids, skip_special_tokens)`, the
    non-streaming decode of the generated ids alone. Each push decodes a window `ids[prefix_offset:]`:
    `ids[prefix_offset:read_offset]` is context already emitted (so decoders that treat the first
    token specially, like SentencePiece's leading-space strip, see the same neighbourhood as a full
    decode) and `ids[read_offset:]` is new. Text ending in "\\ufffd" may be a multi-byte character
    split across byte tokens, so it is held back until a later token completes it, or until `flush`.
    The window stays a few tokens long except while such a tail stays incomplete.

    The contract holds for decoders whose output for a prefix of ids only grows at its end (ByteLevel,
    WordPiece, Metaspace, and byte fallback over valid UTF-8). One exception: `decoders.ByteFallback`
    turns a byte-token run that is invalid UTF-8 into one "\ufffd" per byte, so an already emitted
    valid byte (e.g. "<0x0A>") can later become "\ufffd" in the full decode; the stream keeps "\n".

    `prompt_token_ids` is accepted for the engine's call shape but deliberately not used as decoding
    context: with it, the first generated word could gain a leading space that `decode(generated_ids)`
    lacks, breaking the contract above.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far (held-back text excluded)."""
        return "".join(self._pieces)

    def push(self, token_ids: list[int]) -> str:
        """Appends newly generated ids; returns the text they complete (possibly "")."""
        if not token_ids:
            return ""
        self._token_ids.extend(token_ids)
        prefix_text, new_text = self._decode_window()
        # Shorter-or-equal text means the new ids decoded to nothing yet (skipped specials, or bytes of
        # a split character): keep them in the window so later decodes see them in context.
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        piece = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """Returns the held-back tail (e.g. an incomplete character) when the request finishes."""
        prefix_text, new_text = self._decode_window()
        piece = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset = len(self._token_ids)
        self._pieces.append(piece)
        return piece

    def _decode_window(self) -> tuple[str, str]:
        decode, skip = self._tokenizer.decode, self._skip_special_tokens
        prefix_text = decode(self._token_ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        new_text = decode(self._token_ids[self._prefix_offset:], skip_special_tokens=skip)
        return prefix_text, new_text
