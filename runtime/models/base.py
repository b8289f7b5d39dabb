"""What a model family provides to the runtime (the registry's contract, ``REGISTRY_CONTRACT.md``).

A family lives in ``edgevlm.runtime.models.<name>`` and exports ``FAMILY``, a :class:`ModelFamily`:
its config parser, its weight-name map (data: regex rules), a model builder and a processor
factory. :func:`edgevlm.runtime.models.family_for` picks the family from ``config.json``'s
``model_type``; :mod:`edgevlm.runtime.loader` and :class:`edgevlm.runtime.engine.Engine` only talk
to these interfaces, so a new family plugs in without changing either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch

    from edgevlm.runtime.decoder import Decoder
    from edgevlm.runtime.loader import ModelFiles


@dataclass(frozen=True)
class ModelFamily:
    """One model family.

    Attributes:
        name: registry key, e.g. ``"llava"``.
        model_types: ``config.json`` ``model_type`` values it serves.
        parse_config: raw ``config.json`` dict -> frozen family config (exposing ``.text``,
            ``.image_token_id``, ``.video_token_id``, ``.resolution_ladder``,
            ``.tie_word_embeddings``); raises ``ModelLoadError`` naming the key.
        weight_rules: ``(regex, replacement)`` pairs: the first rule whose regex matches
            (``re.search``) a checkpoint tensor name rewrites it with ``re.sub`` to the model's
            parameter name, or drops it (replacement None); no match keeps the name.
        build_model: family config -> the model (a :class:`VLMModel`), called under
            ``torch.device("meta")``; the loader fills the weights.
        make_processor: :class:`~edgevlm.runtime.loader.ModelFiles` -> :class:`Processor`.
        read_image_config: ``(model_dir, family config) ->`` the checkpoint's image-processor
            settings, read by the same code ``make_processor`` builds the processor with (torch-free,
            no weights); raises ``ModelLoadError`` naming the file or key. ``edgevlm serve
            --check-config`` runs it, so a processor file the load would refuse is refused there too.
        supports_video: whether the processor takes video (the Engine sends several frames of a
            request as one video).
        vision_state_free: ``encode_vision``'s result is all ``prefill`` needs, so the Engine may
            cache it per frame (False: the model keeps side features of ``encode_vision`` for the
            next ``prefill``, e.g. Qwen3-VL's DeepStack features).
        max_images: the most images one request may carry when the family takes no video (the
            Engine sends several frames as that many images; 1 = one image only).
        optional_prefixes: parameter-name prefixes the model may not build (e.g. vision blocks past
            the deepest feature layer): checkpoint tensors mapped under them are skipped when the
            model lacks them instead of being reported as unknown.
        adaptive_vision: early exit and token pruning (:mod:`edgevlm.runtime.exits`,
            :mod:`edgevlm.runtime.pruning`): the model has ``encode_vision_adaptive`` (see
            :class:`VLMModel`), exit heads from ``edgevlm calibrate`` attach to it, and the family
            config has ``exit_geometry`` (:class:`ExitGeometry`). Operating points may then set
            ``exit_layer`` / ``exit_threshold`` / ``keep_ratio``; without it those knobs are refused
            in one line.
        batched_pixels: the model has LLaVA's pixel path (``encode_image`` of ``(B, 3, H, W)``
            pixels, 1-D RoPE), so continuous batching encodes its plain images as one batch per
            input size; other families batch too, encoding each request's ``VisionInput`` alone.
        int4_vision: ``edgevlm quantize --vision int4`` can quantize the vision tower's linears
            (LLaVA's CLIP / SigLIP encoder); other families' towers stay 16-bit and the option is
            refused in one line.
    """

    name: str
    model_types: tuple[str, ...]
    parse_config: Callable[[dict], Any]
    weight_rules: tuple[tuple[str, str | None], ...]
    build_model: Callable[[Any], Any]
    make_processor: Callable[[ModelFiles], Processor]
    read_image_config: Callable[[Path, Any], Any]
    supports_video: bool = False
    optional_prefixes: tuple[str, ...] = ()
    adaptive_vision: bool = False
    batched_pixels: bool = False
    max_images: int = 1
    vision_state_free: bool = True
    int4_vision: bool = False


@dataclass(frozen=True)
class ExitGeometry:
    """What the exit heads of a family's ViT see (``cfg.exit_geometry`` of a family config with
    ``adaptive_vision``); ``exits.json`` records it and heads of another geometry are refused.

    Attributes:
        vision_hidden_size: width D of the ViT's hidden states (what the pooled heads read).
        vision_blocks: ViT blocks a full encode runs; exit points lie in ``1 .. vision_blocks - 1``
            (an exit "after block k" has run blocks ``1..k``).
        feature_dim: width F of the adapter's output: what the connector reads (LLaVA: D times the
            selected layers; Qwen / SmolVLM: D, the last block's output before the merger / the
            post-layernorm + pixel shuffle).
        grid_side: patches per side the pooled heads' scale feature is relative to (the trained
            position grid; Qwen2.5-VL, which has none: one attention window).
        has_cls_token: the hidden states start with a CLS token (CLIP); otherwise the pooled heads
            read the mean of the patch tokens in its place.
        cls_feature: the first vision token fed to the decoder is that CLS token (pruning keeps it).
        text_hidden_size: the decoder width (question-conditioned confidence heads read it).
    """

    vision_hidden_size: int
    vision_blocks: int
    feature_dim: int
    grid_side: int
    has_cls_token: bool
    text_hidden_size: int
    cls_feature: bool = False


@dataclass
class VisionInput:
    """The images (and videos) of one request, preprocessed by the family's :class:`Processor`.

    Attributes:
        pixel_values: float32 tensor in the family's layout (LLaVA ``(N_img, 3, H, W)``; Qwen
            ``(N_patches, C * T * p * p)``; SmolVLM ``(N_img * N_tiles, 3, H, W)``).
        tokens_per_item: vision tokens each image / video contributes, in prompt order.
        kinds: ``"image"`` or ``"video"`` per item.
        grid_thw: ``(N_items, 3)`` int64 patch grids (Qwen families), else None.
        input_sizes_px: ``(H, W)`` fed to the encoder per item (stats).
        extras: family-specific (SmolVLM rows/cols, attention masks, Qwen video timestamps, ...).
        token_groups: vision tokens of each token-pruning group in prompt order (SmolVLM: one
            tile's ``image_seq_len`` per tile, each tile keeping its own share); None: each item is
            one group. See :func:`edgevlm.runtime.pruning.pruned_tokens_per_item`.
    """

    pixel_values: torch.Tensor
    tokens_per_item: list[int]
    kinds: list[str]
    grid_thw: torch.Tensor | None = None
    input_sizes_px: list[tuple[int, int]] = field(default_factory=list)
    extras: dict = field(default_factory=dict)
    token_groups: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        """Vision tokens of every item together."""
        return sum(self.tokens_per_item)


class Processor(Protocol):
    """A family's preprocessing and prompt expansion (``models/<family>/processor.py``)."""

    def prepare(self, images: list[np.ndarray], *, resolution_px: int | None = None,
                video: list[np.ndarray] | None = None,
                video_timestamps_s: list[float] | None = None) -> VisionInput:
        """``images``: ``(H, W, 3)`` uint8 RGB each. ``resolution_px`` None = the checkpoint
        processor's own defaults, exactly as transformers' processor; a rung = the family's budget
        knob (LLaVA: the longer side; Qwen: a max_pixels step). Raises ``InvalidImageError`` for
        what the family's rules cannot resize, ``InvalidRequestError`` for video to a family
        without video."""
        ...

    def expand_prompt(self, text: str, vision: VisionInput) -> str:
        """``text``: the chat template rendered with one image (or video) content part per item,
        in order; returns it with each placeholder replaced by the family's token run. Raises
        ``InvalidRequestError`` when the placeholders do not match the items (e.g. the user's
        prompt holds the image token)."""
        ...


class VLMModel(Protocol):
    """A family's model (an ``nn.Module``, ``models/<family>/model.py``)."""

    language_model: Decoder

    def encode_vision(self, vision: VisionInput) -> torch.Tensor:
        """``(N_total, D_text)`` vision tokens in prompt order, model dtype."""
        ...

    def encode_vision_adaptive(self, vision: VisionInput, operating_point: Any = None,
                               prompt_ids: torch.Tensor | None = None, trunk: Any = None) -> tuple[torch.Tensor, Any]:
        """Families with ``adaptive_vision``: :meth:`encode_vision` with the operating point's
        early exit (``exit_layer`` / ``exit_threshold``, the attached exit heads) and token pruning
        (``keep_ratio``): ``((N', D_text) vision tokens, VisionInfo)`` (``N'`` =
        :func:`~edgevlm.runtime.pruning.pruned_tokens_per_item`'s sum); ``prompt_ids`` ``(1, T)``
        for question-conditioned confidence heads; ``trunk``: the frame's kept encoder walk
        (:class:`~edgevlm.runtime.vision_cache.VisionTrunk`, one image, no pruning), read and
        extended, with the same result. Raises ValueError for an exit the heads cannot
        serve (see :func:`edgevlm.runtime.vision.exit_plan`)."""
        ...

    def embed(self, input_ids: torch.Tensor, vision_features: torch.Tensor | None = None) -> torch.Tensor:
        """``(1, T)`` -> ``(1, T, D)``, the placeholders replaced in order."""
        ...

    def position_ids(self, input_ids: torch.Tensor, vision: VisionInput | None = None
                     ) -> tuple[torch.Tensor | None, int]:
        """``(None, 0)`` for 1-D RoPE; M-RoPE: ``((3, 1, T) int64, rope_delta)`` with the decode
        RoPE position = slot + ``rope_delta``."""
        ...

    def prefill(self, embeds: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """``(1, T, D)`` from slot 0 -> logits ``(1, V)`` (``(1, T, V)`` with ``all_logits``)."""
        ...

    def decode(self, token_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """``(B, 1)`` at cache slot ``input_pos`` ``(1,)`` -> logits ``(B, V)``."""
        ...

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None: ...
