"""Pixel shuffle (space-to-depth) over a square grid of ViT tokens, the token merger of the SmolVLM /
Idefics3 connector and of InternVL's projector (Shi et al., "Real-Time Single Image and Video
Super-Resolution Using an Efficient Sub-Pixel Convolutional Neural Network", 2016, run in reverse).

Both transformers implementations (``SmolVLMConnector.pixel_shuffle`` and
``InternVLModel.pixel_shuffle`` with ``scale_factor = 1 / r``) give the same channel order: ``r``
neighbours merged along the width, a transpose, ``r`` neighbours merged along the height, and the
transpose back; so one function serves both and their projector weights load unchanged.
"""

from __future__ import annotations

import torch


def pixel_shuffle(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """Space-to-depth over a square token grid: ``(N, S*S, D)`` -> ``(N, S*S / r^2, D * r^2)``,
    tokens in raster order of the ``S/r x S/r`` grid. Raises ``ValueError`` when the sequence is
    not a square grid divisible by ``r``."""
    n, seq, d = x.shape
    side = round(seq**0.5)
    r = scale_factor
    if side * side != seq or side % r:
        raise ValueError(f"{seq} tokens are not a square grid divisible by scale_factor {r}")
    x = x.reshape(n, side, side // r, d * r)  # merge r neighbours along the width
    x = x.permute(0, 2, 1, 3)  # (N, S/r, S, D r)
    x = x.reshape(n, side // r, side // r, d * r * r)  # merge r neighbours along the height
    x = x.permute(0, 2, 1, 3)  # back to (N, S/r rows, S/r cols, D r^2)
    return x.reshape(n, seq // (r * r), d * r * r)
