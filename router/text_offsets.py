"""Where each token's text begins in a completion's returned text: the legacy logprobs' `text_offset`."""

from __future__ import annotations

from services.tokenizer import Tokenizer

INCOMPLETE = "\ufffd"  # what a decode ends with while a multi-byte character still lacks bytes


class TextOffsets:
    """The offsets of one run of token ids (a choice's prompt, or its output), pushed in order.

    A running sum of the tokens' own strings drifts from the text: a special token that the text
    skips still has a string ("<|begin_of_text|>"), and each lone byte of a multi-byte character
    reads as a whole U+FFFD. vLLM's offsets drift that way; clients that slice the text by them (the
    scoring harnesses) need them exact. So the ids are decoded here as the text is (in a short
    window with the previous piece as context, like `services.detokenizer`), and a token's offset
    is where the character holding its first byte begins: after the text that is final before it.
    A token that only completes a character (or is skipped) points at that character. Each offset
    depends on the tokens up to its own, so streamed and whole answers agree (but for tokens whose
    text a stop string removed: at the end they point at the text's end, streamed before it past it).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool, start: int = 0) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._context = 0  # ids[_context:_held]: the last final piece, decoded again only as context
        self._held = 0  # ids[_held:]: their text is not final yet (it ends in INCOMPLETE, or is empty)
        self._context_text = ""
        self._held_text = ""
        self._final = start  # where the text of ids[_held:] begins

    def push(self, token_ids: list[int], limit: int | None = None) -> list[int]:
        """The offsets of these next tokens, none past `limit`: the length of the whole text, once
        known (a stop string removes the text of the tokens that made it up)."""
        offsets = []
        for token_id in token_ids:
            self._ids.append(token_id)
            text = self._decode(self._ids[self._context:])[len(self._context_text):]
            # The held text's characters that this token did not change are final before it, except
            # a last INCOMPLETE that nothing follows yet: this token's bytes may belong to it.
            same = _common_prefix(self._held_text, text)
            if same == len(text) and same and text[-1] == INCOMPLETE:
                same -= 1
            offsets.append(self._final + same if limit is None else min(self._final + same, limit))
            if text and not text.endswith(INCOMPLETE):  # all final: the next window starts after it
                self._final += len(text)
                self._context, self._held = self._held, len(self._ids)
                self._context_text = self._decode(self._ids[self._context:self._held])
                text = ""
            self._held_text = text
        return offsets

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
