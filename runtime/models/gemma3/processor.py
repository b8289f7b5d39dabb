"""Gemma 3 preprocessing and prompt expansion, equal to transformers' ``Gemma3Processor`` with
``Gemma3ImageProcessorPil`` (pan-and-scan off, its default).

Image pipeline (``Gemma3ImageProcessor`` at the hub's settings): resize every image to ``size``
(896 x 896, the tower's ``image_size``; the aspect ratio is not kept) with Pillow on uint8 and the
checkpoint's ``resample`` (Gemma 3: 2 = BILINEAR), then ``x * rescale_factor`` (float64 -> float32)
and ``(x - 0.5) / 0.5`` in float32, channels first. Pan-and-scan crops (``do_pan_and_scan``) are
refused at load.

Prompt: the hub's chat template renders ``<start_of_image>`` for an image part, which is not the
model's image token, so the shared tokenizer (:class:`edgevlm.runtime.tokenizer.VLMTokenizer`) puts
``<image_soft_token>\\n`` before the prompt text instead; :meth:`Gemma3Processor.expand_prompt`
replaces each such placeholder (or a ``<start_of_image>``, in a text rendered without it) by
``Gemma3Processor.full_image_sequence``: ``"\\n\\n<start_of_image>" + "<image_soft_token>" x 256 +
"<end_of_image>\\n\\n"``, and strips the whitespace after the last one (the template's ``| trim``), so
the token ids equal transformers'.

A resolution-ladder rung does not apply (every image costs ``mm_tokens_per_image`` tokens at the
tower's fixed size): ``resolution_px`` is accepted and ignored.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgevlm.errors import InvalidRequestError, ModelLoadError
from edgevlm.model_folder import read_json
from edgevlm.runtime.models.base import VisionInput
from edgevlm.runtime.models.blocks.pil_tiles import (
    PilTileProcessor,
    check_image_request,
    check_rgb,
    read_pil_settings,
)
from edgevlm.runtime.models.gemma3.config import Gemma3Config

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<image_soft_token>"
BOI_TOKEN = "<start_of_image>"
EOI_TOKEN = "<end_of_image>"


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The image-processor settings of a Gemma 3 checkpoint (defaults: the hub's
    ``preprocessor_config.json`` of gemma-3-4b-it, with the encoder's size)."""

    image_px: int = 896
    do_resize: bool = True
    resample: int = 2
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_seq_len: int = 256


def read_image_processor_config(pre: dict | None, model_dir: Path, cfg: Gemma3Config) -> ImageProcessorConfig:
    """The checkpoint's settings from ``pre`` (the loader's image-processor dict) and
    ``image_seq_length`` from it or ``processor_config.json``. ``pre`` None: the defaults above with
    the encoder's size, and a logged warning.

    Raises:
        ModelLoadError: a malformed key, a ``size`` that is not the encoder's square ``image_size``,
            ``do_pan_and_scan`` true, or an ``image_seq_length`` that disagrees with the model.
    """
    where = "image processor config"
    d = ImageProcessorConfig(image_px=cfg.image_px, image_seq_len=cfg.mm_tokens_per_image)
    if not isinstance(pre, dict):
        logger.warning("%s has no preprocessor_config.json or processor_config.json image_processor: using "
                       "Gemma 3's defaults (%d px, bilinear, mean/std 0.5)", model_dir, d.image_px)
        pre = {}

    def typed(key: str, default, typ):
        value = pre.get(key)
        value = default if value is None else value
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, typ) or (typ is not bool and isinstance(value, bool)):
            raise ModelLoadError(f"{where}: {key} must be {typ.__name__}, got {value!r}")
        return value

    size = pre.get("size") or {"height": d.image_px, "width": d.image_px}
    if not isinstance(size, dict) or size.get("height") != size.get("width") or size.get("height") != cfg.image_px:
        raise ModelLoadError(f"{where}: size {size!r} is not the encoder's {cfg.image_px}x{cfg.image_px} px input "
                             "(vision_config.image_size)")
    if pre.get("do_pan_and_scan"):
        raise ModelLoadError(f"{where}: do_pan_and_scan true is not supported (pan-and-scan crops; false or null)")
    do_resize = typed("do_resize", d.do_resize, bool)
    if not do_resize:
        raise ModelLoadError(f"{where}: do_resize false is not supported (the tower takes {cfg.image_px} px inputs)")
    proc = read_json(Path(model_dir) / "processor_config.json", required=False)
    seq_len = pre.get("image_seq_length")
    if seq_len is None and isinstance(proc, dict):
        seq_len = proc.get("image_seq_length")
    seq_len = cfg.mm_tokens_per_image if seq_len is None else seq_len
    if seq_len != cfg.mm_tokens_per_image:
        raise ModelLoadError(f"image_seq_length {seq_len!r} disagrees with config.json mm_tokens_per_image "
                             f"{cfg.mm_tokens_per_image}")
    return ImageProcessorConfig(
        **read_pil_settings(pre, d, where),
        image_px=cfg.image_px,
        do_resize=do_resize,
        do_rescale=typed("do_rescale", d.do_rescale, bool),
        rescale_factor=typed("rescale_factor", d.rescale_factor, float),
        do_normalize=typed("do_normalize", d.do_normalize, bool),
        image_seq_len=cfg.mm_tokens_per_image,
    )


def full_image_sequence(n_tokens: int) -> str:
    """One image's text in the prompt (``Gemma3Processor.full_image_sequence`` for ``n_tokens`` soft tokens)."""
    return f"\n\n{BOI_TOKEN}{IMAGE_TOKEN * n_tokens}{EOI_TOKEN}\n\n"


class Gemma3Processor(PilTileProcessor):
    """:class:`~edgevlm.runtime.models.base.Processor` of the Gemma 3 family."""

    family_title = "Gemma 3"
    read_config = staticmethod(read_image_processor_config)

    def preprocess_image(self, image: np.ndarray) -> np.ndarray:
        """One ``(H, W, 3)`` uint8 RGB image -> ``(1, 3, P, P)`` float32.

        Raises:
            InvalidImageError: not an ``(H, W, 3)`` uint8 array, or an empty one.
        """
        p = self.image_cfg.image_px
        return self._normalize([self._resize(check_rgb(image), p, p)])

    def prepare(self, images: list[np.ndarray], *, resolution_px: int | None = None,
                video: list[np.ndarray] | None = None,
                video_timestamps_s: list[float] | None = None) -> VisionInput:
        """Images (each ``(H, W, 3)`` uint8 RGB) -> :class:`VisionInput` with ``pixel_values``
        ``(N_img, 3, P, P)`` float32 and ``mm_tokens_per_image`` tokens per image.

        Raises:
            InvalidImageError: an image that is not a non-empty ``(H, W, 3)`` uint8 array.
            InvalidRequestError: ``video`` given (this family serves images only), or a
                non-positive ``resolution_px``.
        """
        import torch

        check_image_request(self.cfg.model_type, video, resolution_px)
        p, seq = self.image_cfg.image_px, self.image_cfg.image_seq_len
        pixel_values = (torch.from_numpy(np.concatenate([self.preprocess_image(img) for img in images]))
                        if images else torch.zeros(0, 3, p, p))
        n = int(pixel_values.shape[0])
        return VisionInput(pixel_values=pixel_values, tokens_per_item=[seq] * n, kinds=["image"] * n,
                           input_sizes_px=[(p, p)] * n, token_groups=[seq] * n)

    def expand_prompt(self, text: str, vision: VisionInput) -> str:
        """Replace the i-th image placeholder of the rendered chat template (``<image_soft_token>``
        and the newline the tokenizer puts after it, or else ``<start_of_image>``) by
        :func:`full_image_sequence` of image i's vision tokens (fewer after token pruning).

        Raises:
            InvalidRequestError: the text holds a different number of placeholders than images.
        """
        soft = IMAGE_TOKEN in text
        parts = re.split(re.escape(IMAGE_TOKEN) + r"\n?", text) if soft else text.split(BOI_TOKEN)
        if len(parts) - 1 != len(vision.tokens_per_item):
            name = IMAGE_TOKEN if soft else BOI_TOKEN
            raise InvalidRequestError(f"prompt has {len(parts) - 1} {name} placeholders for "
                                      f"{len(vision.tokens_per_item)} images")
        out = [parts[0]]
        for i, (n, rest) in enumerate(zip(vision.tokens_per_item, parts[1:], strict=True)):
            out.append(full_image_sequence(n))
            out.append(rest.lstrip() if soft and i == len(parts) - 2 else rest)
        return "".join(out)
