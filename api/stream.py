"""Token ids from an engine -> the text a client gets: incremental detokenization and stop
strings, the one text pipeline of mxserve (the router's, and the offline `LLM`'s).

The engine emits token ids only and ends a request on EOS, stop token ids and length; stop
strings are matched here, on the text. For each new token, in order:
  1. append its text (the detokenizer holds back an incomplete UTF-8 character);
  2. the worker said "stop" (EOS or a stop id)      -> done, flush held-back text;
  3. a stop string appears (once min_tokens reached) -> done, text cut there, no flush;
  4. the worker said "length"                       -> done, flush.
While running, the last `stop_holdback` characters are not sent: a stop string may complete
across them.
"""

from __future__ import annotations

from collections.abc import Sequence

from mxserve.api.sampling_params import SamplingParams
from mxserve.api.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputStream:
    """One request's output as the router and the offline LLM see it: token ids in, text deltas
    out. Without a tokenizer (dummy weights) there is no text, and no stop string is allowed."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids: Sequence[int],
                 params: SamplingParams, eos_token_ids: Sequence[int] = ()) -> None:
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self._detok = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prompt_ids, params.skip_special_tokens)
        self.text = ""
        self.num_text_sent = 0
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_ids: Sequence[int], worker_finish_reason: str | None) -> int:
        """Take one worker step's tokens (the reason, if any, belongs to the last one). Returns
        how many of them count: fewer when a stop string ends the request early. Without stop
        strings nothing can end between them: the step's tokens are detokenized as one window
        (two decodes a message rather than two a token, on the router's event loop)."""
        if not self.params.stop and token_ids:
            self._add_tokens(token_ids, worker_finish_reason)
            return len(token_ids)
        for i, token in enumerate(token_ids):
            last = i == len(token_ids) - 1
            self._add_tokens([token], worker_finish_reason if last else None)
            if self.finished:
                return i + 1
        return len(token_ids)

    def take_text(self) -> str:
        """The text not yet sent that is safe to send now."""
        holdback = 0 if self.finished else stop_holdback(self.params.stop)
        end = max(self.num_text_sent, len(self.text) - holdback)
        delta = self.text[self.num_text_sent:end]
        self.num_text_sent = end
        return delta

    def _add_tokens(self, tokens: Sequence[int], worker_reason: str | None) -> None:
        """Tokens no stop string can end between (one, when the request has stop strings);
        the worker's reason belongs to the last."""
        params = self.params
        text_start = len(self.text)
        if self._detok is not None:
            self.text += self._detok.step(tokens)
        self.num_tokens += len(tokens)
        if worker_reason == "stop":
            self._finish("stop", self._stop_token(tokens[-1]))
            return
        if params.stop and self.num_tokens >= params.min_tokens:
            match = find_stop_string(self.text, text_start, params.stop,
                                     params.include_stop_str_in_output)
            if match is not None:
                self.text = self.text[:match[0]]
                self.finish_reason, self.stop_reason = "stop", match[1]
                return
        if worker_reason is not None:
            self._finish(worker_reason, None)

    def _finish(self, reason: str, stop_reason: int | None) -> None:
        if self._detok is not None:
            self.text += self._detok.flush()
        self.finish_reason, self.stop_reason = reason, stop_reason

    def _stop_token(self, token: int) -> int | None:
        """The stop id that ended the request; None for EOS (checked first, as the engine does)."""
        if token in self.eos_token_ids and not self.params.ignore_eos:
            return None
        return token if token in self.params.stop_token_ids else None


def find_stop_string(text: str, text_start: int, stop: tuple[str, ...],
                     include_stop_str: bool) -> tuple[int, str] | None:
    """The stop-string rule, shared by the engine and the router (which detokenizes when the
    worker does not): the earliest stop string in `text` that may end at or after `text_start`
    (the text length before the newest token), as (length of text to keep, the stop string);
    None when there is none."""
    if not stop:
        return None
    search_from = max(0, text_start - max(len(s) for s in stop) + 1)
    found = [(i, s) for s in stop if (i := text.find(s, search_from)) != -1]
    if not found:
        return None
    index, hit = min(found)
    return (index + len(hit) if include_stop_str else index), hit


def stop_holdback(stop: tuple[str, ...]) -> int:
    """Characters of output text to withhold while streaming an unfinished request: a stop
    string may still complete across them, and then they must never have been sent."""
    return max(len(s) for s in stop) - 1 if stop else 0
