"""Token ids in, text out, for one request: incremental detokenization plus stop strings (no torch).

Used by the router for every choice it streams and by `Engine.generate` offline, so both produce
the same text for the same tokens.
"""

from __future__ import annotations

from services.detokenizer import IncrementalDetokenizer
from services.sampling_params import SamplingParams
from services.stop_checker import StopChecker
from services.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.stopped = False  # a stop string ended the text
        self.consumed = 0  # how many tokens of the last `feed` count: those up to a stop string's end

    def feed(self, token_ids: list[int], finished: bool) -> str:
        """Text that is safe to emit after these tokens (partial characters and partial stop-string
        matches are held back until `finished`). After a stop string, `stopped` is set and every
        later call returns "". `consumed` tells how many of `token_ids` the text used: a stop string
        completed by one token of several (a lagging reader's merged delta) drops the ones after it
        from the output and from its token count."""
        if self.stopped:
            self.consumed = 0
            return ""
        if len(token_ids) > 1 and self.stop_checker.has_stop_strings:
            emitted = ""
            for i, token_id in enumerate(token_ids):
                emitted += self._feed([token_id], finished and i == len(token_ids) - 1)
                if self.stopped:
                    break
            self.consumed = i + 1
            return emitted
        self.consumed = len(token_ids)
        return self._feed(token_ids, finished)

    def _feed(self, token_ids: list[int], finished: bool) -> str:
        new_text = self.detokenizer.push(token_ids)
        if finished:
            new_text += self.detokenizer.flush()  # a character cut in half by the end
        emitted, self.stopped = self.stop_checker.feed(new_text)
        if finished and not self.stopped:
            emitted += self.stop_checker.flush()
        self.text += emitted
        return emitted
