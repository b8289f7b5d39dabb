"""Check a bundle's ONNX graphs against its PyTorch modules before the bundle is accepted.

``edgevlm quantize`` writes ``onnx/vision.onnx`` and ``onnx/decoder.onnx`` node by node
(:mod:`edgevlm.quantize.onnx_export`); nothing in the export itself proves that a graph computes
what the runtime computes. :func:`check_bundle_onnx` runs both on the finished bundle (its manifest
written, so both load it the way ``Engine.load`` does) and compares:

- **vision** (``pixel_values (1, 3, H, W)`` -> ``image_features (1, N, D)``) at three sizes: the
  encoder's native square size, a non-square size (the rung's height cut to about 60 %), and a
  square size off the native one (one patch smaller, or larger for a one-patch encoder), so the
  in-graph ``Resize`` of the position embeddings is exercised in both directions;
- **decoder**: the prefill logits ``(1, V)`` of a short prompt (the rendered chat prompt of
  :data:`PROMPT` with the vision features of the non-square image), then :data:`DECODE_STEPS`
  greedy decode steps fed the PyTorch argmax token, with the KV cache each side keeps.

Both sides compute in float32: PyTorch with the INT4 layers on the ``dequant`` reference kernel
(:func:`edgevlm.runtime.int4.set_int4_kernel`), onnxruntime on the CPU execution provider with
``MatMulNBits``. The error of an output is ``max|onnx - torch| / max(1, max|torch|)``.

Tolerance :data:`TOLERANCE` = 2e-3: the two sides differ only in float32 summation order (a dot
product of K terms in float32 carries a relative error of about ``sqrt(K) * 6e-8``, some 1e-5 for
K = 16384, compounded over the residual stream of a few dozen layers: 1e-4 and below in practice;
the tiny test models and the demo model measure 1e-6 to 1e-5). An export bug — a transposed or
mis-packed weight, a wrong nibble or zero-point order, a wrong RoPE half, a wrong interpolation
mode, a dropped AWQ input scale, a perturbed weight — moves outputs by 1e-2 and more of their scale.
2e-3 leaves an order of magnitude on either side.

The record (:class:`edgevlm.runtime.bundle.OnnxCheck`: sizes, errors, tolerance, onnxruntime
version) goes into ``manifest.json`` as ``onnx_check``. A mismatch raises ModelLoadError naming the
graph, the size and the error: the build is refused and no bundle is left behind.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.bundle import OnnxCheck, OnnxDecoderCheck, OnnxVisionCheck

__all__ = ["DECODE_STEPS", "PROMPT", "TOLERANCE", "check_bundle_onnx", "check_sizes"]

logger = logging.getLogger(__name__)

TOLERANCE = 2e-3
"""Largest accepted ``max|onnx - torch| / max(1, max|torch|)`` (see the module docstring)."""
PROMPT = "describe the scene."
DECODE_STEPS = 3
MAX_SEQ_LEN = 1024  # KV cache positions of the check's engines (the prompt needs a few hundred)


def _error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(max|got - want| / max(1, max|want|), max|want|)`` of two float tensors of one shape."""
    want = want.detach().float().cpu()
    got = got.detach().float().cpu()
    if got.shape != want.shape:
        return float("inf"), float(want.abs().max())
    scale = float(want.abs().max())
    return float((got - want).abs().max()) / max(1.0, scale), scale


def check_sizes(image_size_px: int, patch_size_px: int) -> list[tuple[int, int]]:
    """The ``(H, W)`` input sizes of the vision check (px, multiples of the patch size)."""
    p, s = patch_size_px, image_size_px // patch_size_px * patch_size_px
    short = max(p, round(s * 0.6 / p) * p)
    if short == s:
        short = s + p
    off = s - p if s > p else s + p
    return [(s, s), (short, s), (off, off)]


def _fail(what: str, error: float) -> ModelLoadError:
    return ModelLoadError(
        f"ONNX export check failed: {what} differs from PyTorch by {error:.3g} of its scale (tolerance "
        f"{TOLERANCE:g}); the graph does not compute what the runtime computes, so the bundle is refused "
        "(rebuild with --no-onnx to skip the ONNX artifacts, and report the model)"
    )


def check_bundle_onnx(bundle_dir: str | Path) -> OnnxCheck:
    """Compare the ONNX graphs of the bundle at ``bundle_dir`` with its PyTorch modules.

    Returns:
        The record for the manifest (every error measured, ``passed`` true).

    Raises:
        ModelLoadError: a graph's output differs by more than :data:`TOLERANCE` (the message
            names the graph and the input size), or the bundle does not load on either side.
        ImportError: onnxruntime is not installed.
    """
    import onnxruntime as ort

    from edgevlm.runtime import Engine
    from edgevlm.runtime.int4 import set_int4_kernel

    root = Path(bundle_dir)
    ref = Engine.load(root, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ_LEN)
    set_int4_kernel(ref.backend.model, "dequant")  # float32 reference path, like the graphs
    onnx = Engine.load(root, backend="onnx", max_seq_len=MAX_SEQ_LEN)
    tb, ob = ref.backend, onnx.backend
    vc = ref.config.vision
    gen = torch.Generator().manual_seed(0)
    vision: list[OnnxVisionCheck] = []
    feats = None
    with torch.no_grad():
        for h, w in check_sizes(vc.image_size, vc.patch_size):
            pixels = torch.randn(1, vc.num_channels, h, w, generator=gen)  # (1, 3, H, W), normalised scale
            want = tb.encode_image(pixels)
            error, scale = _error(ob.encode_image(pixels), want)
            vision.append(OnnxVisionCheck(height_px=h, width_px=w, max_error=error, max_abs_torch=scale))
            if error > TOLERANCE:
                raise _fail(f"onnx/vision.onnx at {h}x{w} px", error)
            if h != w and feats is None:
                feats = want.float()
        ids = ref.tokenizer.encode_prompt(PROMPT, feats.shape[1])
        input_ids = torch.tensor([ids])
        logits_t = tb.prefill(tb.embed(input_ids, feats))
        logits_o = ob.prefill(ob.embed(input_ids, feats))
        prefill_error, scale = _error(logits_o, logits_t)
        if prefill_error > TOLERANCE:
            raise _fail(f"onnx/decoder.onnx prefill ({len(ids)} positions)", prefill_error)
        decode_error = 0.0
        pos = len(ids)
        for _ in range(DECODE_STEPS):
            token = int(logits_t.argmax(-1))
            logits_t, logits_o = tb.decode(token, pos), ob.decode(token, pos)
            step_error, _ = _error(logits_o, logits_t)
            decode_error = max(decode_error, step_error)
            if step_error > TOLERANCE:
                raise _fail(f"onnx/decoder.onnx decode step at position {pos}", step_error)
            pos += 1
    record = OnnxCheck(
        onnxruntime=ort.__version__, providers=list(ob.providers), tolerance=TOLERANCE, vision=vision,
        decoder=OnnxDecoderCheck(prompt_tokens=len(ids), decode_steps=DECODE_STEPS, prefill_max_error=prefill_error,
                                 decode_max_error=decode_error, max_abs_torch=scale),
        passed=True,
    )
    worst = max([v.max_error for v in vision] + [prefill_error, decode_error])
    logger.info("ONNX check passed: %d vision sizes, prefill + %d decode steps; worst error %.2g (tolerance %g)",
                len(vision), DECODE_STEPS, worst, TOLERANCE)
    return record

