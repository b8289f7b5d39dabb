"""Test hook: make a loaded engine's device look ``factor`` times slower (thermal throttling drill).

    from edgevlm.runtime.slowdown import inject_slowdown
    hook = inject_slowdown(engine, 2.0)   # from now on every stage takes 2x as long
    hook.factor = 1.0                     # back to normal (the wrapper stays, at no cost)

:class:`SlowdownBackend` wraps the engine's backend: after each timed call (``encode_image``,
``prefill``, ``decode``) it synchronises the device and sleeps ``(factor - 1)`` times the call's
own duration, so every per-stage time in :class:`~edgevlm.types.Stats` (vision, prefill, TPOT,
e2e) grows by ``factor`` as on a slower device, while outputs stay bit-identical. Everything else
(exit heads, pruning support, classifier, the wrapped model) is delegated unchanged. Used by
``bench/budget.py`` (the injected 2x slowdown mid-run) and the controller tests; not used by the
daemon itself.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from edgevlm.runtime.backends import Backend

logger = logging.getLogger(__name__)


class SlowdownBackend(Backend):
    """A backend whose timed calls take ``factor`` times as long (see the module doc)."""

    def __init__(self, inner: Backend, factor: float = 1.0) -> None:
        self.inner = inner
        self.name = inner.name
        self.device = inner.device
        self.dtype = inner.dtype
        self._factor = 1.0
        self._lock = threading.Lock()
        self.factor = factor

    @property
    def factor(self) -> float:
        return self._factor

    @factor.setter
    def factor(self, value: float) -> None:
        if not value >= 1.0:  # also rejects NaN
            raise ValueError(f"slowdown factor must be >= 1, got {value!r}")
        with self._lock:
            self._factor = float(value)
        logger.info("slowdown hook: factor %.2f", value)

    def __getattr__(self, name: str) -> Any:  # exit_heads, supports_pruning, last_vision_info, model...
        return getattr(self.inner, name)

    def _slow(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        f = self._factor
        if f > 1.0:
            self.inner.synchronize()
            time.sleep((f - 1.0) * (time.perf_counter() - t0))
        return out

    @property
    def max_seq_len(self) -> int:
        return self.inner.max_seq_len

    def encode_image(self, pixel_values, *, operating_point=None, **kwargs):
        # kwargs: backend-specific extras passed through unchanged (the torch backend's prompt_ids,
        # read by question-conditioned exit confidence heads)
        return self._slow(self.inner.encode_image, pixel_values, operating_point=operating_point, **kwargs)

    def embed(self, input_ids, image_features):
        return self.inner.embed(input_ids, image_features)

    def prefill(self, embeds, *, operating_point=None):
        return self._slow(self.inner.prefill, embeds, operating_point=operating_point)

    def decode(self, token_id, pos, *, operating_point=None):
        return self._slow(self.inner.decode, token_id, pos, operating_point=operating_point)

    def reset(self) -> None:
        self.inner.reset()

    def synchronize(self) -> None:
        self.inner.synchronize()


def inject_slowdown(engine: Any, factor: float) -> SlowdownBackend:
    """Wrap ``engine.backend`` (once) in a :class:`SlowdownBackend` and set its ``factor``.
    Returns the wrapper. Raises ValueError for a factor below 1."""
    be = engine.backend
    if not isinstance(be, SlowdownBackend):
        be = SlowdownBackend(be)
        engine.backend = be
    be.factor = factor
    return be
