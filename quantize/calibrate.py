"""``edgevlm calibrate MODEL_OR_BUNDLE``: train the exit heads of a model, then measure its operating points.

    edgevlm calibrate DIR [--exit-blocks 2 3] [--steps 300] [--kd-steps 100] [--batch-size 8]
        [--agreement-images 300] [--questions-per-image 3] [--adapter-hidden N] [--adapter-attn-dim 0]
        [--adapter-blocks 0] [--question-conditioned] [--max-answer-change 0.01] [--risk-delta 0.1]
        [--rungs 384 ...] [--workers N] [--lr 2e-3] [--time-budget-s S] [--init DIR [--keep-adapters]] [--seed 0]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--threads N] [--no-frontier] [--frontier-n 90]
        [--profile NAME] [--out DIR]

(also ``python -m edgevlm.quantize.calibrate ...``). Writes ``exits.safetensors`` + ``exits.json``
(:mod:`edgevlm.runtime.exits`) and, unless ``--no-frontier``, ``frontier.json`` + ``frontier.png``
(:mod:`edgevlm.quantize.frontier`) into the model folder (or ``--out``). For an engine bundle the
new files are added to ``manifest.json`` with their SHA-256.

Calibration data: the demo scene generator (:mod:`edgevlm.runtime.demo.scenes`, its own seeded
stream ``rng_for(seed, 3, i)``, disjoint from training, evaluation and video streams), rendered at
384x288 (by a process pool with ``--workers``) and fed at the rungs of ``--rungs`` (default: the
model's resolution ladder) in turn. The model stays frozen; heads train in float32 (on CUDA under
bfloat16 autocast when the model is bfloat16).

1. **Adapters + classifiers** (distillation): for each exit block ``k``, the adapter is trained so
   that ``adapter(h_k)`` matches the full encoder's selected features ``f``: normalised MSE plus
   (1 - cosine) on ``f``, plus normalised MSE after the frozen projector (the decoder's input).
   Classifiers (on every exit block and the last block) learn the scene's closed-set labels with
   binary cross-entropy.
2. **Answer distillation** (``--kd-steps``): the adapters are fine-tuned end to end through the
   frozen projector and decoder: KL(teacher || student) of the next-token distributions along the
   ground-truth answer (teacher = decoder on the full features, student = decoder on the adapted
   ones; Hinton et al., "Distilling the Knowledge in a Neural Network", 2015), plus 0.25 x the
   phase-1 feature loss as an anchor.
3. **Confidence + threshold** (:mod:`edgevlm.quantize.exit_confidence`): per (image, question)
   pair, whether the greedy answer from each exit equals the full encoder's; the confidence heads
   learn it (``--question-conditioned``: they also read the question), and the cascade threshold
   certified by Learn then Test on the held-out 20% of images (true answer-change rate <=
   ``--max-answer-change`` with probability >= 1 - ``--risk-delta``) is recorded as
   ``recommended_threshold``. ``--init DIR --steps 0 --kd-steps 0`` redoes only this step.

**Qwen2.5-VL, Qwen3-VL, SmolVLM** (models with an ``exit_run``, towers without CLS): phases 1 and 3
run through the family's block-by-block exit run and ``Engine.ask`` (:mod:`edgevlm.quantize.calibrate_vit`:
adapters distilled against the connector's output, Qwen3-VL's DeepStack features included; agreement
pairs on the deployed request path); phase 2 (``--kd-steps``), ``--adapter-blocks`` and the closed-set
label classifiers are LLaVA's (refused in one line / not trained). The confidence heads and the
certified threshold are fitted the same way for every family.

For a model trained with early-exit losses (its adapters trained with it, e.g. the demo model by
:mod:`edgevlm.runtime.demo.train_exits`), ``--init DIR --keep-adapters`` keeps the adapters: phase 1
trains only the classifiers, phase 2 is skipped, phase 3 runs as above. The init heads may be made
for other weights (the 16-bit model behind an INT4 bundle: ``edgevlm calibrate BUNDLE --init MODEL
--keep-adapters``): phase 3 certifies the threshold on this model's own answers either way.

Errors (bad folder, bad options) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edgevlm.atomic_files import AtomicFiles
from edgevlm.cli_args import fail, interrupted, sigterm_interrupts
from edgevlm.quantize.calibrate_data import (  # noqa: F401  (re-exported: used by tests and monitors)
    CALIB_DOMAIN,
    NOISE_SIGMA,
    BatchStream,
    _pixels,
    calibration_scene,
    encoder_states,
    grid_of,
    make_batch,
    scene_labels,
    selected_features,
)
from edgevlm.quantize.calibrate_train import (  # noqa: F401  (phases 1-2; re-exported)
    KD_OFFSET,
    _autocast,
    _phase1_metrics,
    _schedule,
    distill_answers,
    feature_loss,
    fit_classifier,
    train_adapters,
)
from edgevlm.quantize.exit_confidence import (  # noqa: F401  (re-exported: used by tests and benches)
    MAX_ANSWER_TOKENS,
    THRESHOLDS,
    decoder_logits,
    greedy_tokens,
    reproduces,
    threshold_table,
)
from edgevlm.runtime.demo.scenes import demo_labels  # noqa: F401  (re-exported: used by tests)

logger = logging.getLogger(__name__)

AGREEMENT_OFFSET = 1_000_000  # image-index offset of the agreement pairs in the calibration stream

# --------------------------------------------------------------------------- driver


def default_exit_blocks(n_blocks: int) -> list[int]:
    """Exit points at about one third and one half of the encoder depth (e.g. 6 blocks: [2, 3];
    12 blocks: [4, 6]); one point for shallow encoders."""
    blocks = sorted({max(1, round(n_blocks / 3)), max(1, n_blocks // 2)} - {n_blocks})
    return blocks or ([1] if n_blocks > 1 else [])


def calibrate(engine, *, exit_blocks: list[int] | None = None, steps: int = 300, batch_size: int = 8,
              agreement_images: int = 300, questions_per_image: int = 3, seed: int = 0, kd_steps: int = 0,
              adapter_hidden: int | None = None, adapter_attn_dim: int = 0, adapter_blocks: int = 0,
              question_conditioned: bool = False, max_answer_change: float = 0.01, lr: float = 2e-3,
              rungs: list[int] | None = None, workers: int = 0, time_budget_s: float | None = None,
              risk_delta: float = 0.1, init: str | Path | None = None, keep_adapters: bool = False,
              progress: Callable[[str], None] = logger.info):
    """Train exit heads for ``engine`` (a loaded :class:`~edgevlm.runtime.Engine`, torch backend,
    CPU or CUDA) and choose their threshold (see the module doc).

    Returns the trained :class:`~edgevlm.runtime.exits.ExitHeads` (float32, on the engine's
    device) with the calibration record, per-exit metrics, the held-out cascade table and
    ``recommended_threshold`` in its spec. The engine's model is not changed. With
    ``time_budget_s`` the phases stop early at 45% (features), 80% (answer distillation) and 95%
    (agreement pairs) of it, so a run on a time-limited machine always ends with heads. ``init``:
    a folder with ``exits.json`` + ``exits.safetensors`` of this model to start from (their
    architecture wins over the ``adapter_*``/``exit_blocks``/``question_conditioned`` arguments;
    ``steps = kd_steps = 0`` then only re-collects agreement pairs and refits the confidence).
    ``keep_adapters`` (needs ``init``, no ``kd_steps``): the ``steps`` of phase 1 train only the
    classifiers; the adapters stay as in ``init`` (adapters trained jointly with the model, e.g. by
    :mod:`edgevlm.runtime.demo.train_exits`, whose weights the heads' fingerprint must match).

    Raises:
        ValueError: bad exit blocks, counts or rungs; a backend other than torch; ``keep_adapters``
            without ``init`` or with ``kd_steps``.
    """
    import torch

    from edgevlm.quantize import exit_confidence as ec
    from edgevlm.runtime.exits import (
        CascadeRow,
        ExitHeads,
        ExitMetrics,
        ThresholdRow,
        make_spec,
        weights_fingerprint,
    )

    if engine.backend_name != "torch":
        raise ValueError(f"calibration needs the torch backend, not {engine.backend_name!r}")
    if steps < (0 if init else 1) or batch_size < 1 or agreement_images < 5 or questions_per_image < 1:
        raise ValueError("steps (>= 0 with init), batch_size, questions_per_image must be >= 1 and "
                         "agreement_images >= 5")
    if keep_adapters and (init is None or kd_steps):
        raise ValueError("keep_adapters needs init and kd_steps = 0 (the adapters are not trained)")
    if not 0.0 <= risk_delta < 1.0:
        raise ValueError(f"risk_delta must be in [0, 1), got {risk_delta}")
    if not 0.0 <= max_answer_change <= 1.0:
        raise ValueError(f"max_answer_change must be in [0, 1], got {max_answer_change}")
    if rungs and any(r < engine.patch_size_px for r in rungs):
        raise ValueError(f"rungs must be >= the patch size ({engine.patch_size_px} px), got {rungs}")
    model = engine.backend.model
    dev = engine.backend.device
    if not engine.family.adaptive_vision:
        raise ValueError(f"the {engine.family.name} family has no early exit (exit heads need adaptive_vision)")
    vit = hasattr(model, "exit_run")  # a CLS-free native-resolution ViT (edgevlm.quantize.calibrate_vit)
    if vit and (kd_steps or adapter_blocks):
        raise ValueError(f"{'--kd-steps' if kd_steps else '--adapter-blocks'}: answer distillation and ViT-block "
                         f"adapters are LLaVA's; the {engine.family.name} family calibrates with --kd-steps 0 "
                         "--adapter-blocks 0")
    n_blocks = model.cfg.exit_geometry.vision_blocks
    blocks = list(exit_blocks) if exit_blocks else default_exit_blocks(n_blocks)
    torch.manual_seed(seed)
    if init is not None:
        heads = _initial_heads(engine, Path(init), other_weights_ok=keep_adapters, progress=progress)
        spec = heads.spec
        blocks = list(spec.exit_blocks)
    else:
        # closed-set label classifiers (daemon monitors) are LLaVA's: the ViT families get exits only
        spec = make_spec(model.cfg, exit_blocks=blocks, labels=[] if vit else demo_labels(),
                         adapter_hidden=adapter_hidden, adapter_attn_dim=adapter_attn_dim,
                         adapter_blocks=adapter_blocks, confidence_query=question_conditioned)
        heads = ExitHeads(spec, model.cfg.vision).to(dev, torch.float32)
        layers = model.vision_tower.encoder.layers if adapter_blocks else []
        for k in spec.exit_blocks:
            adapter = heads.adapters[str(k)]
            adapter.reset_to_identity()
            for blk, src in zip(getattr(adapter, "blocks", []), layers[len(layers) - adapter_blocks:], strict=True):
                blk.load_state_dict({n: t.float() for n, t in src.state_dict().items()})  # start as the last blocks
    previous = dict(spec.calibration) if init is not None else None
    spec.max_answer_change = max_answer_change
    spec.risk_delta = risk_delta
    t0 = time.perf_counter()
    progress(f"calibrate: exit blocks {blocks} of {n_blocks}, {len(spec.labels)} labels, {steps} steps x "
             f"{batch_size} on {dev} ({engine.backend.dtype})")
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)  # the model stays fixed; only the heads learn

    def due(share: float) -> float | None:
        return None if time_budget_s is None else t0 + share * time_budget_s

    kd_run = 0
    try:
        if vit:
            from edgevlm.quantize import calibrate_vit

            p1 = calibrate_vit.train_vit_adapters(engine, heads, steps=steps, batch_size=batch_size, seed=seed,
                                                  lr=lr, rungs=rungs, deadline=due(0.45), progress=progress,
                                                  adapters=not keep_adapters)
            t1 = time.perf_counter()
            data = calibrate_vit.collect_vit_pairs(engine, heads, seed=seed, offset=AGREEMENT_OFFSET,
                                                   images=agreement_images, questions=questions_per_image,
                                                   rungs=rungs, max_new_tokens=MAX_ANSWER_TOKENS,
                                                   deadline=due(0.95), progress=progress)
        else:
            p1, kd_run, t1, data = _llava_phases(
                engine, heads, steps=steps, kd_steps=kd_steps, batch_size=batch_size, seed=seed, lr=lr,
                rungs=rungs, workers=workers, agreement_images=agreement_images,
                questions_per_image=questions_per_image, keep_adapters=keep_adapters, due=due, progress=progress)
    finally:
        for p in frozen:
            p.requires_grad_(True)
    n_img = int(data["image"].max()) + 1
    n_train_img = max(1, int(round(0.8 * n_img)))
    tr = data["image"] < n_train_img
    ho = ~tr
    query = data["query"]
    conf_ho: dict[int, np.ndarray] = {}
    agree_ho: dict[int, np.ndarray] = {}
    metrics = {}
    fit = {}
    image_t = torch.from_numpy(data["image"]).to(dev)
    tr_t, ho_t = torch.from_numpy(tr).to(dev), torch.from_numpy(ho).to(dev)
    for k in spec.exit_blocks:
        head = heads.confidence[str(k)]
        x = data["pooled"][k][image_t].clone()  # (n_pairs, 7D + 1)
        q = query.clone() if query is not None else None
        fit[str(k)] = ec.train_confidence(head, x[tr_t], q[tr_t] if q is not None else None, data["agree"][k][tr],
                                          groups=data["image"][tr], seed=seed)
        with torch.no_grad():
            conf_ho[k] = torch.sigmoid(head.head(x[ho_t], q[ho_t] if q is not None else None)[:, 0]).cpu().numpy()
        agree_ho[k] = data["agree"][k][ho]
        kinds = sorted(set(data["kinds"]))
        by_kind = {kind: round(float(np.mean([a for a, kk in zip(data["agree"][k], data["kinds"], strict=True)
                                              if kk == kind])), 4) for kind in kinds}
        metrics[str(k)] = ExitMetrics(
            feature_cosine=round(p1[f"feature_cosine_{k}"], 5),
            forced_agreement=round(float(data["agree"][k].mean()), 5),
            thresholds=[ThresholdRow(**{key: round(v, 5) for key, v in r.items()})
                        for r in ec.threshold_table(conf_ho[k], agree_ho[k])],
            agreement_by_kind=by_kind,
        )
        progress(f"calibrate: exit {k}: feature cosine {p1[f'feature_cosine_{k}']:.4f}, answers unchanged "
                 f"{data['agree'][k].mean():.3f}, exit accuracy {data['correct_exit'][k].mean():.3f} vs full "
                 f"{data['correct_full'].mean():.3f}; confidence fit {fit[str(k)]}")
    rows = ec.cascade_table(conf_ho, agree_ho, n_blocks)
    spec.recommended_threshold = ec.recommend_threshold(rows, max_answer_change, risk_delta)  # sets p_value
    spec.cascade = [CascadeRow(**r) for r in rows]
    chosen = next((r for r in rows if r["threshold"] == spec.recommended_threshold), None)
    progress(f"calibrate: recommended threshold {spec.recommended_threshold} on {int(ho.sum())} held-out pairs: "
             + (f"exit rates {chosen['exit_rates']}, answer change {chosen['answer_change']:.4f}, "
                f"blocks {chosen['blocks_mean']:.2f}" if chosen else "no threshold meets the target"))
    spec.exit_metrics = metrics
    spec.weights_fingerprint = weights_fingerprint(engine.model_dir)
    spec.classifier_accuracy = {str(k): round(p1[f"classifier_accuracy_{k}"], 5) for k in spec.classifier_blocks}
    spec.classifier_balanced_accuracy = {str(k): round(p1[f"classifier_balanced_accuracy_{k}"], 5)
                                         for k in spec.classifier_blocks}
    if spec.classifier_balanced_accuracy:  # no labels: no classifiers, no line
        progress("calibrate: classifier balanced accuracy " + ", ".join(
            f"block {k}: {v:.3f}" for k, v in spec.classifier_balanced_accuracy.items()))
    spec.calibration = {
        "data": "demo scenes (edgevlm.runtime.demo.scenes), stream rng_for(seed, 3, i)",
        "seed": seed, "steps": p1.get("steps_run", steps), "batch_size": batch_size, "agreement_images": n_img,
        "agreement_pairs": int(len(data["image"])), "held_out_pairs": int(ho.sum()),
        "questions_per_image": questions_per_image, "kd_steps": kd_run, "lr": lr,
        "adapters": "kept from init (trained with the model)" if keep_adapters else "trained here",
        "time_budget_s": time_budget_s,
        "resolution_ladder": list(engine.resolution_ladder), "rungs": list(rungs or engine.resolution_ladder),
        "device": str(dev), "dtype": str(engine.backend.dtype).replace("torch.", ""),
        "full_accuracy": round(float(data["correct_full"].mean()), 5),
        "exit_accuracy": {str(k): round(float(v.mean()), 5) for k, v in data["correct_exit"].items()},
        "confidence_fit": fit,
        "adapter_s": round(t1 - t0, 1), "confidence_s": round(time.perf_counter() - t1, 1),
        "source": str(engine.model_dir),
    }
    if previous is not None:
        spec.calibration.update({"init": str(init), "init_calibration": previous})
    return heads


def _llava_phases(engine, heads, *, steps: int, kd_steps: int, batch_size: int, seed: int, lr: float, rungs,
                  workers: int, agreement_images: int, questions_per_image: int, keep_adapters: bool, due,
                  progress: Callable[[str], None]):
    """Phases 1-3 of a LLaVA model (see the module doc): ``(phase-1 metrics, answer-distillation
    steps run, phase-3 start time, agreement pairs)``."""
    from edgevlm.quantize import exit_confidence as ec

    if steps > 0:
        p1 = train_adapters(engine, heads, steps=steps, batch_size=batch_size, seed=seed, lr=lr, rungs=rungs,
                            workers=workers, deadline=due(0.45), progress=progress, adapters=not keep_adapters)
    else:
        p1 = {**_phase1_metrics(engine, heads, seed=seed + 1, n=min(64, max(2 * batch_size, 16))), "steps_run": 0}
    kd_run = 0
    if kd_steps > 0:
        kd_run = distill_answers(engine, heads, steps=kd_steps, batch_size=batch_size, seed=seed, rungs=rungs,
                                 workers=workers, deadline=due(0.80), progress=progress)
        p1.update({k: v for k, v in _phase1_metrics(engine, heads, seed=seed + 1,
                                                    n=min(64, max(2 * batch_size, 16))).items()})
    t1 = time.perf_counter()
    per_batch = max(1, min(batch_size, 64))
    stream = BatchStream(engine, seed=seed, offset=AGREEMENT_OFFSET, steps=math.ceil(agreement_images / per_batch),
                         batch_size=per_batch, rungs=rungs or list(engine.resolution_ladder), labels=[],
                         questions=questions_per_image, workers=workers, total=agreement_images)
    data = ec.collect_pairs(engine, heads, stream, progress=progress, total=agreement_images, deadline=due(0.95))
    return p1, kd_run, t1, data


def _initial_heads(engine, folder: Path, *, other_weights_ok: bool = False,
                   progress: Callable[[str], None] = logger.info):
    """Exit heads of ``engine``'s model saved in ``folder`` (``--init``), float32 on its device.

    ``other_weights_ok`` (``--keep-adapters``): heads fingerprinted to other weights are accepted
    with a note, for adapters trained with a version of this model (an INT4 bundle of it, say):
    the confidence heads and the certified threshold are then refitted on *this* model, so the
    answer-change guarantee holds for it whatever the adapters are worth (the frontier measures that).
    Raises ValueError for heads of another architecture or (without ``other_weights_ok``) other
    weights, ModelLoadError for unreadable files."""
    import torch
    from safetensors.torch import load_file

    from edgevlm.runtime.exits import EXITS_WEIGHTS, ExitHeads, read_spec, weights_fingerprint

    model = engine.backend.model
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--init {folder}: not a folder (give the folder holding exits.json)")
    spec = read_spec(folder)
    cfg = model.cfg
    geo = cfg.exit_geometry
    if (spec.vision_hidden_size, spec.vision_blocks, spec.grid_side, spec.feature_dim) != (
            geo.vision_hidden_size, geo.vision_blocks, geo.grid_side, geo.feature_dim):
        raise ValueError(f"--init {folder}: exit heads of another architecture")
    if spec.weights_fingerprint and spec.weights_fingerprint != weights_fingerprint(engine.model_dir):
        if not other_weights_ok:
            raise ValueError(f"--init {folder}: exit heads calibrated for other weights than {engine.model_dir}'s "
                             "(--keep-adapters keeps their adapters and refits the rest on this model)")
        progress(f"calibrate: --init {folder} was made for other weights than {engine.model_dir}'s: keeping its "
                 "adapters, refitting confidence heads, classifiers and threshold on this model")
    heads = ExitHeads(spec, cfg.vision)
    try:
        heads.load_state_dict({k: v.float() for k, v in load_file(str(folder / EXITS_WEIGHTS)).items()})
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"--init {folder}: cannot load {EXITS_WEIGHTS} ({' '.join(str(exc).split())[:200]})") from None
    return heads.to(engine.backend.device, torch.float32)


def add_to_manifest(bundle_dir: Path, names: list[str], group: AtomicFiles) -> None:
    """Stage in ``group`` an engine bundle's ``manifest.json`` that records (or refreshes) ``names`` with
    their SHA-256, read from where ``group`` holds their new content; replaced with them at its commit."""
    from edgevlm.runtime.bundle import MANIFEST_NAME, FileEntry, read_manifest, sha256_file

    manifest = read_manifest(bundle_dir)
    keep = [e for e in manifest.files if e.path not in names]
    for name in names:
        p = group.staged(bundle_dir / name)
        keep.append(FileEntry(path=name, sha256=sha256_file(p), size_bytes=p.stat().st_size))
    manifest.files = sorted(keep, key=lambda e: e.path)
    group.write_text(bundle_dir / MANIFEST_NAME, manifest.model_dump_json(indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    from edgevlm.cli_args import OneLineParser, non_negative_int, positive_int, torch_device

    ap = OneLineParser(prog="edgevlm calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="model folder or engine bundle")
    ap.add_argument("--exit-blocks", type=int, nargs="+", default=None,
                    help="vision blocks to put exit heads after (default: ~1/3 and ~1/2 of the depth)")
    ap.add_argument("--steps", type=non_negative_int, default=300, help="adapter/classifier training steps")
    ap.add_argument("--batch-size", type=positive_int, default=8, help="images per training step")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the feature phase")
    ap.add_argument("--adapter-hidden", type=positive_int, default=None, help="adapter MLP width (default: D)")
    ap.add_argument("--adapter-attn-dim", type=non_negative_int, default=0,
                    help="inner width of an attention layer in each adapter (0 = MLP only)")
    ap.add_argument("--adapter-blocks", type=non_negative_int, default=0,
                    help="full ViT blocks in each adapter, initialised from the encoder's last blocks (LLaVA only)")
    ap.add_argument("--kd-steps", type=non_negative_int, default=None,
                    help="answer-distillation steps through the frozen decoder after the feature loss "
                         "(LLaVA only: default 100, 0 with --keep-adapters; the other families take 0)")
    ap.add_argument("--agreement-images", type=positive_int, default=300, help="images for the confidence heads (at least 5)")
    ap.add_argument("--questions-per-image", type=positive_int, default=3)
    ap.add_argument("--question-conditioned", action="store_true",
                    help="confidence heads also read the question (prompt embedding)")
    ap.add_argument("--max-answer-change", type=float, default=0.01,
                    help="held-out answer-change rate the recommended threshold may cost")
    ap.add_argument("--rungs", type=int, nargs="+", default=None,
                    help="training/calibration resolutions in px (default: the resolution ladder)")
    ap.add_argument("--workers", type=non_negative_int, default=0, help="scene-rendering worker processes (0 = inline)")
    ap.add_argument("--risk-delta", type=float, default=0.1,
                    help="Learn-then-Test level of the threshold choice (0 = point estimate)")
    ap.add_argument("--init", default=None,
                    help="start from the exit heads in this folder (with --steps 0 --kd-steps 0: refit confidence only)")
    ap.add_argument("--keep-adapters", action="store_true",
                    help="with --init: keep its adapters (trained with the model); --steps train the classifiers")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="stop each phase early so that training ends within about this many seconds (the "
                         "operating-point measurement after it is not bounded: --frontier-n or --no-frontier)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", type=torch_device, default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: per device)")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="output folder (default: the model folder)")
    ap.add_argument("--no-frontier", action="store_true", help="skip the operating-point measurement")
    ap.add_argument("--frontier-n", type=positive_int, default=90, help="evaluation items per grid point")
    ap.add_argument("--profile", default=None, help="device profile whose knob grid to measure")
    return ap


def _check_writable(out: Path, *, given: bool) -> Path | None:
    """Create ``out`` and check that files can be written into it, before any training. Returns the
    outermost folder this created (``out`` or one of its parents), None if ``out`` was there.

    Raises:
        ValueError: the folder cannot be created or is not writable (named as ``--out`` when given,
            else as the model folder, with the hint to give ``--out``).
    """
    what = f"--out {out}" if given else f"model folder {out} (the default --out)"
    created = next((p for p in reversed([out, *out.absolute().parents]) if not p.exists()), None)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{what}: cannot create the folder ({exc.strerror or exc})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"{what} is not writable" + ("" if given else "; give --out FOLDER"))
    return created


def _remove_empty_folders(top: Path, out: Path) -> None:
    """Remove ``out`` and its parents up to ``top`` while they are empty (after an interrupted run:
    the folders it created and wrote nothing into; files already written are kept)."""
    for folder in [out.absolute(), *out.absolute().parents]:
        try:
            folder.rmdir()
        except OSError:  # not empty (or gone): the folders above it stay
            return
        if folder == top.absolute():
            return


def main(argv: list[str] | None = None) -> int:
    """CLI entry (``edgevlm calibrate``). Returns 0, or 2 after a one-line error."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from edgevlm.errors import EdgeVLMError

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    out: Path | None = None
    created: Path | None = None  # the outermost folder of --out that this run made
    with sigterm_interrupts():  # SIGTERM as Ctrl-C: the clean-up below runs for both
        try:
            if args.steps < 1 and not args.init:
                raise ValueError(f"--steps must be >= 1 (0 only with --init), got {args.steps}")
            shape_opts = {"--exit-blocks": args.exit_blocks, "--adapter-hidden": args.adapter_hidden,
                          "--adapter-attn-dim": args.adapter_attn_dim or None, "--adapter-blocks": args.adapter_blocks or None,
                          "--question-conditioned": args.question_conditioned or None}
            given = [name for name, value in shape_opts.items() if value is not None]
            if args.init and given:
                raise ValueError(f"{', '.join(given)}: the heads' architecture comes from --init {args.init}; "
                                 "leave these out")
            if args.keep_adapters and not args.init:
                raise ValueError("--keep-adapters needs --init (the folder whose adapters to keep)")
            if args.keep_adapters and args.kd_steps:
                raise ValueError("--keep-adapters trains no adapter: leave out --kd-steps")
            if args.agreement_images < 5:
                raise ValueError(f"--agreement-images must be >= 5, got {args.agreement_images}")
            if not 0.0 <= args.risk_delta < 1.0:
                raise ValueError(f"--risk-delta must be in [0, 1), got {args.risk_delta}")
            if not args.lr > 0 or not math.isfinite(args.lr):  # `not > 0` refuses NaN too
                raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
            if args.time_budget_s is not None and not args.time_budget_s > 0:
                raise ValueError(f"--time-budget-s must be > 0, got {args.time_budget_s}")
            if not 0.0 <= args.max_answer_change <= 1.0:
                raise ValueError(f"--max-answer-change must be in [0, 1], got {args.max_answer_change}")
            if args.profile is not None:  # read now: the frontier reads it only after the whole training
                from edgevlm.profile import load_profile

                load_profile(args.profile)
            import torch

            if args.threads is not None:
                torch.set_num_threads(max(1, args.threads))
            if args.device.startswith("cuda"):
                if not torch.cuda.is_available():
                    raise ValueError(f"--device {args.device}: CUDA is not available")
            from edgevlm.runtime import Engine
            from edgevlm.runtime.bundle import is_bundle
            from edgevlm.runtime.exits import EXITS_JSON, EXITS_WEIGHTS, load_exit_heads, save_exit_heads

            engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
            out = Path(args.out) if args.out else Path(engine.model_dir)
            created = _check_writable(out, given=args.out is not None)  # before the training, not after it
            if args.kd_steps is None:  # answer distillation is LLaVA's (a ViT family's model has exit_run)
                args.kd_steps = 0 if args.keep_adapters or hasattr(engine.backend.model, "exit_run") else 100
            heads = calibrate(engine, exit_blocks=args.exit_blocks, steps=args.steps, batch_size=args.batch_size,
                              agreement_images=args.agreement_images, questions_per_image=args.questions_per_image,
                              seed=args.seed, kd_steps=max(0, args.kd_steps), adapter_hidden=args.adapter_hidden,
                              adapter_attn_dim=args.adapter_attn_dim, adapter_blocks=args.adapter_blocks,
                              question_conditioned=args.question_conditioned, max_answer_change=args.max_answer_change,
                              lr=args.lr, rungs=args.rungs, workers=args.workers, time_budget_s=args.time_budget_s,
                              risk_delta=args.risk_delta, init=args.init, keep_adapters=args.keep_adapters,
                              progress=say)
            written = [EXITS_WEIGHTS, EXITS_JSON]
            # heads and, in a bundle, the manifest listing them are replaced together: an interrupt leaves
            # the old three or the new three (a bundle loads no file its manifest lacks or mis-hashes)
            with AtomicFiles() as group:
                weights, spec_path = save_exit_heads(heads, out, group=group)
                if args.out is None and is_bundle(out):
                    add_to_manifest(out, written, group)
            say(f"calibrate: wrote {weights} and {spec_path}")
            if not args.no_frontier:
                from edgevlm.quantize import frontier

                engine.backend.model.attach_exit_heads(load_exit_heads(out, engine.config, device=engine.backend.device,
                                                                       dtype=engine.backend.dtype,
                                                                       weights_dir=engine.model_dir))
                with AtomicFiles() as group:  # frontier.json / .png and the manifest listing them, together
                    measured = frontier.run(engine, out, n=args.frontier_n, profile=args.profile, progress=say,
                                            show=print, group=group)
                    if args.out is None and is_bundle(out):
                        add_to_manifest(out, measured, group)
                written += measured
            if args.out is None and is_bundle(out):
                say(f"calibrate: added {', '.join(written)} to {out / 'manifest.json'}")
        except (EdgeVLMError, ValueError, OSError) as exc:
            return fail(exc)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM
            if created is not None and out is not None:
                _remove_empty_folders(created, out)
            return interrupted()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
