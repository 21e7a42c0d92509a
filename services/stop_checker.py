"""Matches stop strings on streamed text without ever emitting part of a stop string."""

from __future__ import annotations


class StopChecker:
    """Filters one request's text stream through its stop strings.

    The stream stops at the first point where the text so far contains a stop string, i.e. at the
    occurrence that ends earliest (of those ending together, the one starting earliest); the output
    is the text before it, plus the stop string itself if `include_stop_str_in_output`. Any suffix
    that could still grow into a stop string is held back, so the concatenation of every `feed`
    result and the final `flush` equals that truncation of the whole text, however it was split.
    """

    def __init__(self, stop: tuple[str, ...], include_stop_str_in_output: bool = False) -> None:
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self._stop = tuple(dict.fromkeys(stop))
        self._include_stop_str_in_output = include_stop_str_in_output
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stop)

    def feed(self, new_text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string has completed). After a stop, ("", True)."""
        if self._stopped:
            return "", True
        text = self._held + new_text
        match = self._earliest_match(text)
        if match is not None:
            start, end = match
            self._held = ""
            self._stopped = True
            return text[:end] if self._include_stop_str_in_output else text[:start], True
        num_held = self._num_partial_chars(text)
        self._held = text[len(text) - num_held:]
        return text[:len(text) - num_held], False

    def flush(self) -> str:
        """Returns the held-back text at the end of a request that did not stop on a string."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> tuple[int, int] | None:
        # Only the held tail (shorter than any stop string) precedes the new text, so this scan is
        # bounded by len(new_text) + the longest stop string.
        best: tuple[int, int] | None = None
        for stop in self._stop:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < (best[1], best[0])):
                best = (start, start + len(stop))
        return best

    def _num_partial_chars(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
