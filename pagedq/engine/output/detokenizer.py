"""Incremental detokenization and stop strings.

Each new token is decoded by the `tokenizers` library's DecodeStream, which keeps only a small window of
state (it handles byte-fallback and UTF-8 sequences split across tokens), so the cost per token does not
grow with the output. Stop strings are searched only in the tail that the new text could complete, and only
once `min_tokens` tokens precede the new one (vLLM's rule): a stop string completed by one of the first
`min_tokens` tokens does not count, though its tail may begin one that a later token completes.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        skip_special_tokens: bool,
        stop: list[str],
        min_tokens: int = 0,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._skip_special_tokens = skip_special_tokens
        self._stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self._include_stop = include_stop_str_in_output
        # What a stream must hold back: a tail that could still grow into a stop string that will be cut
        self._holdback = 0 if include_stop_str_in_output else max(0, self._max_stop_len - 1)
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self.text = ""
        self._num_reported_chars = 0

    def append(self, token_id: int) -> str | None:
        """Decode one more token; return the stop string it completed, if any (text is then cut before it)."""
        piece = self._stream.step(self._backend, token_id)
        self._num_tokens += 1
        if not piece:
            return None
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += piece
        if self._num_tokens <= self._min_tokens:
            return None  # the first min_tokens tokens cannot stop; the tail they leave may still start a match
        return self._cut_at_stop(search_from)

    def _cut_at_stop(self, search_from: int) -> str | None:
        best = None
        for stop in self._stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self._include_stop else self.text[:at]
        return stop

    def finalize(self, output_token_ids: list[int], stopped_by_string: bool) -> None:
        """At the end, let a full decode settle anything the stream still buffers (an unfinished UTF-8 byte run)."""
        if stopped_by_string:
            return
        full = self._tokenizer.decode(output_token_ids, skip_special_tokens=self._skip_special_tokens)
        if full.startswith(self.text):
            self.text = full

    def take_delta(self, finished: bool) -> str:
        """Text not yet reported. Until the end, hold back a tail that could still grow into a stop string."""
        limit = len(self.text) if finished else max(self._num_reported_chars, len(self.text) - self._holdback)
        delta = self.text[self._num_reported_chars : limit]
        self._num_reported_chars = limit
        return delta

    def reported_text(self) -> str:
        return self.text[: self._num_reported_chars]
