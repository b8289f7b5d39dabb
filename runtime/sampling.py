"""Next-token selection and stop-string handling.

Greedy decoding is ``argmax``; sampling divides the logits by the temperature, keeps the smallest
set of tokens whose probability mass reaches ``top_p`` (nucleus sampling, Holtzman et al., "The
Curious Case of Neural Text Degeneration", 2020; same rule as transformers' ``TopPLogitsWarper``:
the most likely token is always kept) and draws with a seeded ``torch.Generator``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from edgevlm.errors import InvalidRequestError
from edgevlm.protocol import INT64_MAX

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """Validated generation knobs of one request."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def validate(cls, max_new_tokens, temperature, top_p, stop, seed) -> SamplingParams:
        """Check user-supplied values; raises InvalidRequestError naming the bad argument (``seed``: an
        integer in ``[0, 2**63 - 1]``, the wire protocol's range)."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not math.isfinite(temperature) or temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p!r}")
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError(f"stop must be a list of non-empty strings, got {stop!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InvalidRequestError(f"seed must be an integer, got {seed!r}")
        if seed is not None and not 0 <= seed <= INT64_MAX:  # the wire's range; torch.Generator overflows past 2**64
            raise InvalidRequestError(f"seed must be in [0, {INT64_MAX}], got {seed}")
        return cls(max_new_tokens, float(temperature), float(top_p), tuple(stop), seed)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A generator seeded with ``seed`` on ``device`` (None: the global RNG is used)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def select_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from ``logits`` ``(V,)`` (any float dtype; computed in float32)."""
    logits = logits.float()
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= params.top_p  # mass before this token
        drop[0] = False
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_feed(logits: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> None:
    """The next decode step's inputs from this step's logits, on the device: ``tokens (B, 1)`` int64
    := each row's greedy token (``argmax`` of ``logits (B, V)``, the first index among equal maxima
    as :func:`select_token`), ``positions (B,)`` int64 += 1. In place, no host sync: a decode loop
    that feeds itself this way can queue step ``k + 1`` before the host has read token ``k``
    (:meth:`~edgevlm.runtime.backends.torch_backend.TorchBackend.greedy_step`). Raises ``ValueError``
    for mismatched shapes."""
    b = logits.shape[0]
    if logits.dim() != 2 or tokens.shape != (b, 1) or positions.shape != (b,):
        raise ValueError(f"greedy_feed: logits {tuple(logits.shape)}, tokens {tuple(tokens.shape)}, "
                         f"positions {tuple(positions.shape)} do not match")
    torch.argmax(logits, dim=-1, keepdim=True, out=tokens)
    positions.add_(1)


def find_stop(text: str, stops: tuple[str, ...]) -> int:
    """Index of the earliest occurrence of any stop string in ``text``, or -1."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


def holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string: text that
    a stream must not show yet because the next tokens may complete a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best


class TextAssembler:
    """Accumulates decoded text, applies stop strings, and yields what is safe to show.

    The shown text is the raw text without leading/trailing whitespace and cut before the first
    stop string; a stream's deltas always concatenate to :attr:`final_text`.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.raw = ""
        self.shown = ""
        self.stopped = False

    def add(self, piece: str) -> str:
        """Append decoded text; returns the new visible delta. Sets :attr:`stopped` on a stop string."""
        self.raw += piece
        idx = find_stop(self.raw, self.stops) if self.stops else -1
        if idx >= 0:
            self.raw = self.raw[:idx]
            self.stopped = True
            return self.finish()
        visible = self.raw[: len(self.raw) - holdback(self.raw, self.stops)].strip()
        return self._advance(visible)

    def finish(self) -> str:
        """Flush: the rest of the text (minus trailing whitespace)."""
        return self._advance(self.raw.strip())

    def _advance(self, visible: str) -> str:
        if len(visible) <= len(self.shown) or not visible.startswith(self.shown):
            return ""
        delta = visible[len(self.shown):]
        self.shown = visible
        return delta

    @property
    def final_text(self) -> str:
        return self.shown
