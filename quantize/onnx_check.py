"""Check a bundle's ONNX graphs against its PyTorch modules before the bundle is accepted.

``edgevlm quantize`` writes the ONNX graphs node by node (:mod:`edgevlm.quantize.onnx_export`,
:mod:`edgevlm.quantize.onnx_vision_export`); nothing in the export itself proves that a graph
computes what the runtime computes. :func:`check_bundle_onnx` runs both on the finished bundle (its
manifest written, so both load it the way ``Engine.load`` does) and compares:

- **LLaVA vision** (``pixel_values (1, 3, H, W)`` -> ``image_features (1, N, D)``) at three sizes: the
  encoder's native square size, a non-square size (the rung's height cut to about 60 %), and a
  square size off the native one (one patch smaller, or larger for a one-patch encoder), so the
  in-graph ``Resize`` of the position embeddings is exercised in both directions;
- **LLaVA decoder**: the prefill logits ``(1, V)`` of a short prompt (the rendered chat prompt of
  :data:`PROMPT` with the vision features of the non-square image), then :data:`DECODE_STEPS`
  greedy decode steps fed the PyTorch argmax token, with the KV cache each side keeps;
- **Qwen2.5-VL / Qwen3-VL vision** (every output: ``image_features`` and Qwen3-VL's ``deepstack.{k}``)
  at the patch grids of :func:`vision_check_cases`: a square image, a non-square one (for Qwen2.5-VL
  its windows do not tile it: padded window segments), and a two-frame video (per-frame attention);
  random patch rows, the host-side feeds of :mod:`edgevlm.runtime.backends.onnx_vision` against the
  tower's ``forward``;
- **SmolVLM2 vision**: one tile, three tiles (a 1 x 2 split + the global image), and two tiles of which
  one is partly padding (``pixel_attention_mask``: bucketed positions and masked keys), against
  ``SmolVLMModel.encode_tiles``.

- **Qwen / SmolVLM decoder**, end to end through the onnx backend against the torch backend (vision
  graph, host-side embedding and M-RoPE positions, decoder graph with Qwen3-VL's DeepStack
  ``layer_add`` inputs): the prefill logits of :data:`PROMPT` with a small random non-square image,
  then :data:`DECODE_STEPS` greedy steps at RoPE position slot + ``rope_delta``.

Both sides compute in float32: PyTorch with the INT4 layers on the ``dequant`` reference kernel
(:func:`edgevlm.runtime.int4.set_int4_kernel`) and a 16-bit vision tower upcast exactly,
onnxruntime on the CPU execution provider with ``MatMulNBits``. The error of an output is
``max|onnx - torch| / max(1, max|torch|)``.

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
from dataclasses import dataclass
from pathlib import Path

import torch

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.bundle import OnnxCheck, OnnxDecoderCheck, OnnxVisionCheck

__all__ = ["DECODE_STEPS", "PROMPT", "TOLERANCE", "VisionCase", "check_bundle_onnx", "check_sizes",
           "vision_check_cases"]

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
            names the graph, the output and the input size), or the bundle does not load on
            either side.
        ImportError: onnxruntime is not installed.
    """
    from edgevlm.runtime.loader import read_model_files

    root = Path(bundle_dir)
    files = read_model_files(root)
    if files.family.name == "llava":
        return _check_llava(root)
    return _check_family(root, files)


def _check_llava(root: Path) -> OnnxCheck:
    import onnxruntime as ort

    from edgevlm.runtime import Engine
    from edgevlm.runtime.int4 import set_int4_kernel

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



# ------------------------------------------------------------------------ vision-only families
@dataclass(frozen=True)
class VisionCase:
    """One input of the vision check of a Qwen or SmolVLM bundle.

    Qwen: ``grid_thw`` ``((t, h, w), ...)`` patch grids of the items fed together; SmolVLM:
    ``n_tiles`` tiles of ``tile_px``, the last one half padding when ``padded``."""

    grid_thw: tuple[tuple[int, int, int], ...] | None = None
    n_tiles: int | None = None
    tile_px: int | None = None
    padded: bool = False

    def label(self, patch_px: int) -> str:
        """How the failure message names the input."""
        if self.grid_thw is not None:
            grids = ", ".join("x".join(map(str, g)) for g in self.grid_thw)
            t, h, w = self.grid_thw[0]
            kind = "video" if t > 1 else "image"
            return f"grid_thw {grids} ({kind} of {h * patch_px}x{w * patch_px} px)"
        padded = ", one half padding" if self.padded else ""
        return f"{self.n_tiles} tiles of {self.tile_px}x{self.tile_px} px{padded}"


def vision_check_cases(family: str, cfg) -> list[VisionCase]:
    """The inputs of the vision check of a ``qwen2_5_vl`` / ``qwen3_vl`` / ``smolvlm`` / ``internvl`` bundle (small
    grids: the check runs the whole tower on the CPU in float32). Qwen, with ``m`` the merge size and
    ``u`` the patches a side of a Qwen2.5-VL attention window (``4 m`` for Qwen3-VL): a square image
    ``(1, 2u, 2u)``, a non-square ``(1, u + m, 2u + m)`` (windows that do not tile it) and a
    two-frame video ``(2, 2m, 3m)``. SmolVLM: 1 tile, 3 tiles, 2 tiles with the second half padding.
    InternVL: 1 tile, 3 tiles. Gemma 3: 1 image, 2 images.

    Raises ValueError for another family."""
    if family in ("qwen2_5_vl", "qwen3_vl"):
        vc = cfg.vision
        m = vc.spatial_merge_size
        u = vc.window_units * m if family == "qwen2_5_vl" else 4 * m
        return [VisionCase(grid_thw=((1, 2 * u, 2 * u),)), VisionCase(grid_thw=((1, u + m, 2 * u + m),)),
                VisionCase(grid_thw=((2, 2 * m, 3 * m),))]
    if family == "smolvlm":
        t = cfg.vision.image_size
        return [VisionCase(n_tiles=1, tile_px=t), VisionCase(n_tiles=3, tile_px=t),
                VisionCase(n_tiles=2, tile_px=t, padded=True)]
    if family in ("internvl", "gemma3"):  # tiles / images at the trained size only (no padding)
        t = cfg.vision.image_size
        return [VisionCase(n_tiles=1, tile_px=t), VisionCase(n_tiles=3 if family == "internvl" else 2, tile_px=t)]
    raise ValueError(f"no ONNX vision check for the {family} family")


def _torch_vision(model, family: str, pixels: torch.Tensor, grid: torch.Tensor | None,
                  mask: torch.Tensor | None) -> list[torch.Tensor]:
    """The PyTorch tower's outputs, in the graph's output order."""
    if family == "qwen2_5_vl":
        return [model.visual(pixels, grid)]
    if family == "qwen3_vl":
        main, deepstack = model.visual(pixels, grid)
        return [main, *deepstack]
    if family == "internvl":
        return [model.encode_tiles(pixels)]
    if family == "gemma3":
        return [model.encode_images(pixels)]
    return [model.encode_tiles(pixels, mask)]


def _case_inputs(cfg, case: VisionCase, gen: torch.Generator):
    """Random normalised-scale pixels for ``case``: ``(pixels, grid_thw | None, pixel_mask | None)``."""
    if case.grid_thw is not None:
        vc = cfg.vision
        grid = torch.tensor(case.grid_thw, dtype=torch.int64)
        k = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        return torch.randn(int(grid.prod(-1).sum()), k, generator=gen), grid, None
    t = case.tile_px
    pixels = torch.randn(case.n_tiles, cfg.vision.num_channels, t, t, generator=gen)
    mask = None
    if case.padded:
        mask = torch.ones(case.n_tiles, t, t)
        mask[-1, :, t // 2:] = 0  # the last tile's right half is padding
    return pixels, None, mask


def _check_family(root: Path, files) -> OnnxCheck:
    """The vision and decoder graphs of a Qwen2.5-VL / Qwen3-VL / SmolVLM2 bundle against the
    PyTorch modules (module doc)."""
    import onnxruntime as ort

    from edgevlm.runtime import Engine
    from edgevlm.runtime.int4 import set_int4_kernel

    family, cfg = files.family.name, files.config
    ref = Engine.load(root, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ_LEN)
    model = ref.backend.model
    set_int4_kernel(model, "dequant")  # float32 reference path, like the graphs
    onnx = Engine.load(root, backend="onnx", max_seq_len=MAX_SEQ_LEN)
    graph, providers = onnx.backend.vision, list(onnx.backend.providers)
    patch_px = cfg.vision.patch_size
    gen = torch.Generator().manual_seed(0)
    vision: list[OnnxVisionCheck] = []
    with torch.no_grad():
        for case in vision_check_cases(family, cfg):
            pixels, grid, mask = _case_inputs(cfg, case, gen)
            want = _torch_vision(model, family, pixels, grid, mask)
            got = graph.run(pixels, grid_thw=grid, pixel_mask=mask)
            errors = {}
            for name, a, b in zip(graph.output_names, got, want, strict=True):
                errors[name] = _error(a, b)
                if errors[name][0] > TOLERANCE:
                    raise _fail(f"onnx/vision.onnx {name} at {case.label(patch_px)}", errors[name][0])
            worst, scale = max(e for e, _ in errors.values()), errors["image_features"][1]
            if grid is not None:
                h, w = case.grid_thw[0][1] * patch_px, case.grid_thw[0][2] * patch_px
            else:
                h = w = case.tile_px
            vision.append(OnnxVisionCheck(
                height_px=h, width_px=w, max_error=worst, max_abs_torch=scale,
                grid_thw=[list(g) for g in case.grid_thw] if case.grid_thw is not None else None,
                n_tiles=case.n_tiles, padded=case.padded))
        decoder = _check_family_decoder(ref, onnx, family)
    record = OnnxCheck(onnxruntime=ort.__version__, providers=providers, tolerance=TOLERANCE, vision=vision,
                       decoder=decoder, passed=True)
    logger.info("ONNX check passed: %s vision.onnx at %d inputs (%s), decoder.onnx prefill + %d decode steps; "
                "worst error %.2g (tolerance %g)", family, len(vision),
                "; ".join(c.label(patch_px) for c in vision_check_cases(family, cfg)), DECODE_STEPS,
                record.max_error, TOLERANCE)
    return record


def _check_family_decoder(ref, onnx, family: str) -> OnnxDecoderCheck:
    """decoder.onnx of a Qwen / SmolVLM bundle, end to end through the onnx backend (vision graph,
    host-side embedding and M-RoPE positions, decoder graph with Qwen3-VL's DeepStack ``layer_add``)
    against the torch backend: the prefill logits of :data:`PROMPT` with a small random non-square
    image, then :data:`DECODE_STEPS` greedy steps (RoPE position = slot + ``rope_delta``)."""
    import numpy as np

    tb, ob, cfg = ref.backend, onnx.backend, ref.config
    image = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    if family in ("smolvlm", "internvl", "gemma3"):  # one tile / image (Gemma 3: the rung is ignored)
        rung = cfg.vision.image_size
    else:
        rung = 4 * cfg.vision.patch_size * cfg.vision.spatial_merge_size
    vision_in = ref.processor.prepare([image], resolution_px=rung)
    ids = ref.tokenizer.encode_request(PROMPT, vision_in, ref.processor)
    input_ids = torch.tensor([ids])
    logits = []
    for be in (tb, ob):
        pos, delta = be.position_ids(input_ids, vision_in)
        logits.append(be.prefill(be.embed(input_ids, be.encode_vision(vision_in)), position_ids=pos))
    logits_t, logits_o = logits
    prefill_error, scale = _error(logits_o, logits_t)
    if prefill_error > TOLERANCE:
        raise _fail(f"onnx/decoder.onnx prefill ({len(ids)} positions)", prefill_error)
    decode_error = 0.0
    step = len(ids)
    for _ in range(DECODE_STEPS):
        token = int(logits_t.argmax(-1))
        logits_t, logits_o = tb.decode(token, step, rope_offset=delta), ob.decode(token, step, rope_offset=delta)
        step_error, _ = _error(logits_o, logits_t)
        decode_error = max(decode_error, step_error)
        if step_error > TOLERANCE:
            raise _fail(f"onnx/decoder.onnx decode step at position {step}", step_error)
        step += 1
    return OnnxDecoderCheck(prompt_tokens=len(ids), decode_steps=DECODE_STEPS, prefill_max_error=prefill_error,
                            decode_max_error=decode_error, max_abs_torch=scale)
