"""The inference-backend boundary of the runtime.

:class:`~edgevlm.runtime.engine.Engine` does everything that does not depend on how tensors are
computed (tokenising, preprocessing, sampling, stop strings, streaming, stats) and talks to a
:class:`Backend` for the model calls of generation: vision encoding, embedding, prefill, decode.
The torch backend runs every registered model family (:mod:`edgevlm.runtime.models`); the ONNX
backend runs the engine bundles of all four families, the TensorRT backend LLaVA engine bundles.

A backend lives in ``edgevlm.runtime.backends.<module>`` and is registered in :data:`BACKENDS`;
the module is imported only when that backend is asked for, so optional dependencies (onnxruntime,
TensorRT) are needed only by whoever uses them. Each module defines::

    def load(files: ModelFiles, *, device: torch.device, dtype: torch.dtype,
             max_seq_len: int) -> Backend

Tensors crossing the boundary are torch tensors on the backend's ``device``; logits come back as
``(1, V)`` in any float dtype (the engine samples in float32). Batch size is 1.
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from edgevlm.errors import InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    import torch

    from edgevlm.runtime.loader import ModelFiles
    from edgevlm.runtime.models.base import VisionInput
    from edgevlm.types import OperatingPoint

logger = logging.getLogger(__name__)

#: backend name -> (module, pip extra that provides its dependencies)
BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("edgevlm.runtime.backends.torch_backend", "runtime"),
    "onnx": ("edgevlm.runtime.backends.onnx_backend", "onnx"),
    "tensorrt": ("edgevlm.runtime.backends.tensorrt_backend", "tensorrt"),
}


class Backend(ABC):
    """One loaded model on one device, with a static KV cache of :attr:`max_seq_len` positions.

    Calls are not thread-safe: one request at a time (the daemon's single inference worker).
    """

    name: str = ""
    device: torch.device
    dtype: torch.dtype

    @property
    @abstractmethod
    def max_seq_len(self) -> int:
        """KV cache capacity in positions (prompt + vision tokens + generated tokens)."""

    @abstractmethod
    def encode_image(
        self, pixel_values: torch.Tensor, *, operating_point: OperatingPoint | None = None
    ) -> torch.Tensor:
        """Vision encoder + projector: ``(1, 3, H, W)`` float32 normalised pixels (H, W multiples of
        the patch size) -> ``(1, N, D_text)`` vision tokens."""

    def encode_vision(self, vision: VisionInput, *, operating_point: OperatingPoint | None = None,
                      prompt_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Vision tokens of a request's :class:`~edgevlm.runtime.models.base.VisionInput`, in the
        layout :meth:`embed` takes. Default: :meth:`encode_image` of its pixels (LLaVA bundles);
        the torch backend runs any family's ``encode_vision``."""
        return self.encode_image(vision.pixel_values, operating_point=operating_point)

    def position_ids(self, input_ids: torch.Tensor, vision: VisionInput | None, *,
                     kept_index: list[int] | None = None) -> tuple[torch.Tensor | None, int]:
        """RoPE positions of a prompt other than its slots, and the decode offset (``rope_delta``):
        ``(None, 0)`` for 1-D RoPE (the default); multimodal RoPE families return ``(3, 1, T)``.
        ``kept_index``: the vision tokens token pruning kept (indices into the unpruned run,
        ascending), when ``input_ids`` holds only those: each keeps its unpruned position."""
        return None, 0

    @abstractmethod
    def embed(self, input_ids: torch.Tensor, image_features: torch.Tensor | None) -> torch.Tensor:
        """``(1, T)`` int64 token ids -> ``(1, T, D_text)`` embeddings, the image placeholder tokens
        replaced in order by ``image_features`` ``(1, N, D_text)``."""

    @abstractmethod
    def prefill(self, embeds: torch.Tensor, *, operating_point: OperatingPoint | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``embeds`` ``(1, T, D_text)`` at slots ``0..T-1`` into the KV cache (T <=
        :attr:`max_seq_len`), at RoPE ``position_ids`` (from :meth:`position_ids`; None = the
        slots); returns the logits of the last position ``(1, V)``."""

    @abstractmethod
    def decode(self, token_id: int, pos: int, *, operating_point: OperatingPoint | None = None,
               rope_offset: int = 0) -> torch.Tensor:
        """Feed one token at slot ``pos`` (< :attr:`max_seq_len`), RoPE position ``pos +
        rope_offset``; returns logits ``(1, V)``."""

    def greedy_tokens(self, token_id: int, pos: int, max_tokens: int, *,
                      operating_point: OperatingPoint | None = None, rope_offset: int = 0) -> Iterator[int]:
        """Greedy decoding after a chosen token: feeds ``token_id`` at slot ``pos``, then each token
        it yields at the next slot; yields up to ``max_tokens`` greedy tokens (``argmax`` of each
        step's logits, the first index among equal maxima). The consumer may stop iterating at
        any token (EOS, a stop string); slots must stay below :attr:`max_seq_len` (``ValueError``).
        Default: :func:`decode_tokens` with ``argmax``; the torch backend queues step ``k + 1``
        on the device before the host reads token ``k`` (one step computed ahead, discarded when
        the consumer stops)."""
        import torch

        return decode_tokens(self, token_id, pos, max_tokens, lambda logits: int(torch.argmax(logits.float())),
                             operating_point=operating_point, rope_offset=rope_offset)

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Forget the cached sequence (static caches need nothing: positions past the new prompt
        are masked)."""

    def synchronize(self) -> None:  # noqa: B027 - optional hook
        """Block until queued device work is done (called before reading clocks)."""


def check_decode_span(pos: int, max_tokens: int, max_seq_len: int) -> None:
    """Raise ``ValueError`` unless ``max_tokens`` decode steps from slot ``pos`` stay inside a KV cache of
    ``max_seq_len`` slots (the last feeds slot ``pos + max_tokens - 1``)."""
    if max_tokens > 0 and not (0 <= pos and pos + max_tokens - 1 < max_seq_len):
        raise ValueError(f"greedy decode of {max_tokens} tokens from slot {pos} leaves the KV cache "
                         f"(0..{max_seq_len - 1})")


def decode_tokens(backend: Backend, token_id: int, pos: int, max_tokens: int, choose: Callable[[torch.Tensor], int],
                  *, operating_point: OperatingPoint | None = None, rope_offset: int = 0) -> Iterator[int]:
    """The host-fed decode loop: feeds ``token_id`` at slot ``pos`` (RoPE position ``pos + rope_offset``), then
    each token ``choose`` picks from a step's logits ``(V,)`` at the next slot; yields up to ``max_tokens``
    tokens, the consumer may stop at any. ``rope_offset`` is passed to :meth:`Backend.decode` only when
    nonzero (backends of 1-D RoPE models may not take it). Raises ``ValueError`` (:func:`check_decode_span`)."""
    check_decode_span(pos, max_tokens, backend.max_seq_len)
    for i in range(max_tokens):
        logits = backend.decode(token_id, pos + i, operating_point=operating_point, rope_offset=rope_offset) \
            if rope_offset else backend.decode(token_id, pos + i, operating_point=operating_point)
        token_id = choose(logits[0])
        yield token_id


def load_backend(name: str, files: ModelFiles, *, device, dtype, max_seq_len: int, **options) -> Backend:
    """Import backend ``name`` lazily and load ``files`` with it. ``options`` (backend-specific
    keyword arguments, e.g. the torch backend's ``cuda_graphs``/``kv_cache_dtype``) are passed to
    the backend's ``load`` only when given.

    Raises:
        InvalidRequestError: unknown backend name.
        ModelLoadError: the backend's optional dependencies are not installed (the message names
            the extra to install), or loading fails.
    """
    if name not in BACKENDS:
        raise InvalidRequestError(f"unknown backend {name!r} (one of: {', '.join(BACKENDS)})")
    module_name, extra = BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if getattr(exc, "name", None) == module_name:
            raise ModelLoadError(f"backend {name!r} is not part of this edgevlm build") from exc
        raise ModelLoadError(
            f"backend {name!r} needs optional dependencies that are not installed ({exc}); "
            f"install them with: pip install 'edgevlm[{extra}]'"
        ) from exc
    return module.load(files, device=device, dtype=dtype, max_seq_len=max_seq_len, **options)
