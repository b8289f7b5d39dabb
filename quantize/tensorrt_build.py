"""TensorRT engines from the bundle's ONNX vision encoder, with one optimization profile spanning
the resolution ladder (public TensorRT Python API: ``trt.Builder``, ``trt.OnnxParser``,
``IBuilderConfig.add_optimization_profile``, ``IOptimizationProfile.set_shape``,
``Builder.build_serialized_network``; NVIDIA TensorRT developer guide, "Working with Dynamic Shapes").

Profile of the encoder input ``pixel_values (1, 3, H, W)``: every rung ``r`` of the ladder serves
frames whose longer side is ``r`` (rounded to the patch size) and whose shorter side keeps the
aspect ratio, down to ``min_aspect`` (default 1:2). So::

    min = (1, 3, p(min_rung * min_aspect), p(min_rung * min_aspect))
    opt = (1, 3, p(max_rung * 3 / 4), p(max_rung))        # the top rung at 4:3 landscape
    max = (1, 3, p(max_rung), p(max_rung))

with ``p()`` rounding to the nearest multiple of the patch size (at least one patch), exactly like
:func:`edgevlm.runtime.preprocess.target_size`. ``min <= opt <= max`` is checked per dimension
before any build. The decoder ONNX uses onnxruntime's ``com.microsoft::MatMulNBits``, which the
TensorRT ONNX parser does not implement, so no decoder engine is built from it.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

VISION_INPUT = "pixel_values"
TRT_DIR = "tensorrt"


def round_to_patch(px: float, patch_px: int) -> int:
    """Nearest multiple of ``patch_px`` (at least one patch), as in preprocess.target_size."""
    return max(patch_px, int(round(px / patch_px)) * patch_px)


def vision_profile(ladder: list[int], patch_px: int, *, min_aspect: float = 0.5
                   ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(min, opt, max)`` shapes of ``pixel_values`` for a ladder (see the module docstring).

    Raises ``ValueError`` for an empty ladder, non-positive rungs or patch size, ``min_aspect``
    outside (0, 1], or a profile that violates ``min <= opt <= max``.
    """
    if not ladder or any(r <= 0 for r in ladder) or patch_px <= 0:
        raise ValueError(f"bad ladder {ladder} or patch size {patch_px}")
    if not 0.0 < min_aspect <= 1.0:
        raise ValueError(f"min_aspect must be in (0, 1], got {min_aspect}")
    lo, hi = min(ladder), max(ladder)
    side_min = round_to_patch(lo * min_aspect, patch_px)
    side_max = round_to_patch(hi, patch_px)
    shapes = (
        (1, 3, side_min, side_min),
        (1, 3, min(round_to_patch(hi * 3 / 4, patch_px), side_max), side_max),
        (1, 3, side_max, side_max),
    )
    check_profile(*shapes)
    return shapes


def check_profile(mn: tuple[int, ...], opt: tuple[int, ...], mx: tuple[int, ...]) -> None:
    """Raise ``ValueError`` unless ``min <= opt <= max`` in every dimension (and ranks agree)."""
    if not len(mn) == len(opt) == len(mx):
        raise ValueError(f"profile ranks differ: {mn} {opt} {mx}")
    for i, (a, b, c) in enumerate(zip(mn, opt, mx, strict=True)):
        if not 0 < a <= b <= c:
            raise ValueError(f"profile dimension {i}: need 0 < min <= opt <= max, got {a}, {b}, {c}")


def tensorrt_available() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


def build_tensorrt_engines(bundle_dir: str | Path, ladder: list[int], *, patch_px: int | None = None,
                           fp16: bool = True) -> str:
    """Build ``tensorrt/vision.engine`` from ``onnx/vision.onnx``. Returns a one-line note
    (``"tensorrt: ..."``) on what was and was not built; the bundle stays complete either way.

    Raises ``ValueError`` for a bad profile and ``RuntimeError`` when TensorRT fails to parse or build.
    """
    root = Path(bundle_dir)
    onnx_path = root / "onnx" / "vision.onnx"
    if not onnx_path.is_file():
        return "tensorrt: not built (no onnx/vision.onnx to build from); the bundle is complete for torch"
    try:
        import tensorrt as trt
    except ImportError:
        return "tensorrt: not built (tensorrt is not importable here); the bundle is complete for torch and onnx"
    if patch_px is None:
        import json

        patch_px = json.loads((root / "config.json").read_text())["vision_config"]["patch_size"]
    mn, opt, mx = vision_profile(ladder, patch_px)  # checked before any TensorRT call
    trt_logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(trt_logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, trt_logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    profile.set_shape(VISION_INPUT, mn, opt, mx)
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path}")
    out = root / TRT_DIR
    out.mkdir(exist_ok=True)
    (out / "vision.engine").write_bytes(bytes(engine))
    logger.info("TensorRT vision engine built: profile min %s opt %s max %s", mn, opt, mx)
    return "tensorrt: vision engine built; decoder not built (MatMulNBits is an onnxruntime contrib op)"
