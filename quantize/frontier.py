"""Operating points: measure a knob grid, keep the Pareto frontier, print it, plot it, store it.

    python -m edgevlm.quantize.frontier MODEL [--n 90] [--profile cpu] [--rungs 384 256 ...]
        [--thresholds 0.9 0.75] [--keep-ratios 1 0.5] [--caps 16] [--out DIR] [--device cpu]

(``edgevlm calibrate`` runs it after training the exit heads.) For every grid point — resolution
rung x exit threshold (None = full depth) x keep ratio — the engine answers the demo evaluation set
(:func:`edgevlm.runtime.demo.scenes.eval_set`, greedy, exact match) and the per-stage times of
:class:`~edgevlm.types.Stats` are recorded (medians). Token caps need no extra runs: under a cap
``c`` an answer of ``m`` text tokens is unchanged if ``m <= c`` and truncated (wrong) otherwise,
and decoding stops after ``min(n, c)`` tokens. Two latencies per point: the mean e2e over the set
(``vision + prefill + (min(n, c) - 1) * tpot`` per item) and the worst case the latency controller
plans with for a request allowing ``MAX_NEW_TOKENS`` tokens (``vision + prefill + (min(24, c) - 1) *
tpot``) — the frontier's latency axis, so a token cap that costs no accuracy is preferred.

The Pareto frontier keeps every point that no other point beats on both accuracy (higher) and
worst-case latency (lower). Output: a table on stdout, ``frontier.json`` (:class:`edgevlm.profile.FrontierFile`,
what :func:`point_profiles` turns into the controller's :class:`~edgevlm.runtime.policy.PointProfile`
list) and ``frontier.png`` (accuracy against latency, every point grey, the frontier in blue).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import logging
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from edgevlm.atomic_files import AtomicFiles
from edgevlm.profile import FrontierFile, FrontierPoint, latency_ms, pareto  # noqa: F401  (pareto re-exported)
from edgevlm.types import asks_adaptive_vision

logger = logging.getLogger(__name__)

FRONTIER_JSON = "frontier.json"
FRONTIER_PNG = "frontier.png"
EVAL_SEED = 1000
MAX_NEW_TOKENS = 24


def point_name(rung: int | None, threshold: float | None, keep: float | None, cap: int | None) -> str:
    """``r256-x0.75-k0.5-t16``: rung, exit threshold, keep ratio, token cap (parts left out when off)."""
    name = f"r{rung}" if rung else "native"
    if threshold is not None:
        name += f"-x{threshold:g}"
    if keep is not None and keep < 1.0:
        name += f"-k{keep:g}"
    if cap is not None:
        name += f"-t{cap}"
    return name


def _operating_point(rung: int | None, threshold: float | None, keep: float | None):
    from edgevlm.types import OperatingPoint

    return OperatingPoint(name=point_name(rung, threshold, keep, None), resolution_px=rung,
                          exit_threshold=threshold, keep_ratio=keep if keep is not None and keep < 1.0 else None)


def _row(engine, item, op) -> tuple:
    a = engine.ask(item.image, item.qa.question, max_new_tokens=MAX_NEW_TOKENS, operating_point=op)
    s = a.stats
    text_tokens = s.new_tokens - (1 if s.finish_reason == "stop" else 0)
    return (a.text.strip() == item.qa.answer, s.new_tokens, text_tokens, s.vision_ms, s.prefill_ms, s.tpot_ms,
            s.exit_layer is not None)


def measure_point(engine, items, *, rung: int | None, threshold: float | None, keep: float | None,
                  caps: list[int | None]) -> list[FrontierPoint]:
    """Run ``items`` at one (rung, threshold, keep) setting; one :class:`FrontierPoint` per cap."""
    op = _operating_point(rung, threshold, keep)
    return summarise([_row(engine, it, op) for it in items], rung=rung, threshold=threshold, keep=keep, caps=caps)


def summarise(rows: list[tuple], *, rung: int | None, threshold: float | None, keep: float | None,
              caps: list[int | None]) -> list[FrontierPoint]:
    """Grid points (one per cap) from per-item rows ``(correct, new_tokens, text_tokens, vision_ms,
    prefill_ms, tpot_ms, exited)``."""
    vision = statistics.median(r[3] for r in rows)
    prefill = statistics.median(r[4] for r in rows)
    tpots = [r[5] for r in rows if r[1] > 1]
    tpot = statistics.median(tpots) if tpots else 0.0
    exit_rate = sum(r[6] for r in rows) / len(rows)
    out = []
    for cap in caps:
        correct = [ok and (cap is None or m <= cap) for ok, _, m, *_ in rows]
        n_tok = [min(n, cap) if cap else n for _, n, *_ in rows]
        e2e = statistics.fmean(vision + prefill + max(0, n - 1) * tpot for n in n_tok)
        worst = vision + prefill + (min(MAX_NEW_TOKENS, cap or MAX_NEW_TOKENS) - 1) * tpot
        out.append(FrontierPoint(
            name=point_name(rung, threshold, keep, cap), resolution_px=rung, exit_threshold=threshold,
            keep_ratio=keep if keep is not None and keep < 1.0 else None, max_new_tokens=cap,
            accuracy=round(sum(correct) / len(correct), 5), vision_ms=round(vision, 3),
            prefill_ms=round(prefill, 3), tpot_ms=round(tpot, 3), e2e_ms=round(e2e, 3), worst_case_ms=round(worst, 3),
            exit_rate=round(exit_rate, 5) if threshold is not None else None,
        ))
    return out


def measure_grid(engine, items, *, rungs: list[int], thresholds: list[float | None], keep_ratios: list[float],
                 caps: list[int], progress: Callable[[str], None] = logger.info) -> list[FrontierPoint]:
    """Every grid point (see the module doc). ``thresholds`` may contain None (full depth). Items
    are the outer loop — each item runs at every setting back to back — so a slow spell of a
    shared machine lands on all settings alike instead of inflating a few."""
    grid = [(r, t, k) for r in rungs for t in thresholds for k in keep_ratios]
    ops = [_operating_point(*g) for g in grid]
    rows: list[list[tuple]] = [[] for _ in grid]
    t0 = time.perf_counter()
    step = max(1, len(items) // 10)
    for i, it in enumerate(items, start=1):
        for j, op in enumerate(ops):
            rows[j].append(_row(engine, it, op))
        if i % step == 0 or i == len(items):
            progress(f"frontier: item {i}/{len(items)} x {len(grid)} settings ({time.perf_counter() - t0:.0f} s)")
    out: list[FrontierPoint] = []
    for (rung, threshold, keep), r in zip(grid, rows, strict=True):
        out += summarise(r, rung=rung, threshold=threshold, keep=keep, caps=[None, *caps])
    return out


def frontier_points(points: list[FrontierPoint]) -> list[FrontierPoint]:
    """What ``frontier.json`` stores: the Pareto frontier of all points, plus that of the points
    without early exit (what a model without exit heads can still run: without them the controller
    would lose the top rung when an exit point dominates the full-depth one), plus that of the plain
    points, without early exit or token pruning (what every backend runs, e.g. an INT4 bundle on ONNX
    Runtime, which neither exits nor prunes). Sorted by latency; the controller, sorting by accuracy
    then cost, prefers the cheaper of two equally accurate points."""
    full_depth = [p for p in points if p.exit_threshold is None and p.exit_layer is None]
    plain = [p for p in points if not asks_adaptive_vision(p)]
    keep = {id(p) for p in pareto(points)} | {id(p) for p in pareto(full_depth)} | {id(p) for p in pareto(plain)}
    return sorted((p for p in points if id(p) in keep), key=lambda p: (latency_ms(p), -p.accuracy))


def point_profiles(points: list[FrontierPoint]):
    """Frontier points as the controller's :class:`~edgevlm.runtime.policy.PointProfile` list."""
    from edgevlm.runtime.policy import PointProfile

    return [PointProfile(p.operating_point(), p.accuracy, p.vision_ms, p.prefill_ms, p.tpot_ms) for p in points]


def format_table(points: list[FrontierPoint]) -> str:
    """Markdown table of points: knobs, accuracy, stage medians, mean e2e."""
    lines = ["| point | res px | exit thr | keep | cap | accuracy | exit rate | vision ms | prefill ms | "
             "tpot ms | e2e ms (mean) | worst case ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        def f(v, spec=""):
            return "-" if v is None else format(v, spec)
        lines.append(f"| {p.name} | {f(p.resolution_px)} | {f(p.exit_threshold, 'g')} | {f(p.keep_ratio, 'g')} | "
                     f"{f(p.max_new_tokens)} | {100 * p.accuracy:.1f}% | "
                     f"{'-' if p.exit_rate is None else f'{100 * p.exit_rate:.0f}%'} | {p.vision_ms:.1f} | "
                     f"{p.prefill_ms:.1f} | {p.tpot_ms:.2f} | {f(p.e2e_ms, '.1f')} | {f(p.worst_case_ms, '.1f')} |")
    return "\n".join(lines)


def plot(points: list[FrontierPoint], frontier: list[FrontierPoint], path: str | Path, title: str = "") -> Path:
    """PNG: accuracy (%) against latency (ms, :func:`latency_ms`); all points grey, the frontier
    blue and named."""
    from edgevlm.quantize.plot import BLUE, GREY, Chart

    xs = [latency_ms(p) for p in points]
    ys = [100 * p.accuracy for p in points]
    x_hi = max(xs) * 1.15 if xs and max(xs) > 0 else 1.0
    y_lo = max(0.0, min(ys) - 5) if ys else 0.0
    chart = Chart(title or "operating points: accuracy vs latency", f"latency (ms): vision + prefill + "
                  f"{MAX_NEW_TOKENS - 1} x TPOT (fewer under a token cap)",
                  "exact-match accuracy (%)", xlim=(0.0, x_hi), ylim=(y_lo, 100.0))
    chart.scatter(xs, ys, GREY, radius=3, label="grid point")
    fx = [latency_ms(p) for p in frontier]
    fy = [100 * p.accuracy for p in frontier]
    chart.line(fx, fy, BLUE, label="Pareto frontier")
    chart.scatter(fx, fy, BLUE, radius=5, names=[p.name for p in frontier])
    return chart.save(path)


def host_description(engine) -> str:
    """``platform, CPU threads`` (+ GPU name on CUDA)."""
    import torch

    desc = f"{platform.platform()}, {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}"
    if engine.device.startswith("cuda"):
        desc += f", {torch.cuda.get_device_name(torch.device(engine.device))}"
    return desc


def recommended_threshold(engine) -> float | None:
    """The exit threshold chosen at calibration on held-out pairs (``exits.json``'s
    ``recommended_threshold``: answer-change rate <= its ``max_answer_change``), None without one."""
    heads = getattr(engine.backend, "exit_heads", None)
    return heads.spec.recommended_threshold if heads is not None else None


def grid_from_profile(engine, profile: str | None) -> dict[str, list]:
    """The knob grid: the profile's ``operating_points`` (default values without a profile), rungs
    from the engine's resolution ladder (``[None]``, the checkpoint's own preprocessing, without one); thresholds only if the model has exit heads, and then
    always the heads' ``recommended_threshold`` (:func:`recommended_threshold`) too."""
    from edgevlm.profile import OperatingPointsConfig, load_profile

    ops = load_profile(profile).operating_points if profile else OperatingPointsConfig()
    thresholds: list[float | None] = [None]
    if engine.exit_points:
        thresholds += list(ops.exit_thresholds)
        rec = recommended_threshold(engine)
        if rec is not None and rec not in thresholds:
            thresholds.append(rec)
    # no ladder (a Qwen or SmolVLM checkpoint without edgevlm.resolution_ladder): the checkpoint's own
    # preprocessing is the one rung (None; points named "native")
    return {"rungs": sorted(engine.resolution_ladder, reverse=True) or [None], "thresholds": thresholds,
            "keep_ratios": list(ops.keep_ratios), "caps": list(ops.max_new_tokens_caps)}


def run(engine, out_dir: str | Path, *, n: int = 90, seed: int = EVAL_SEED, profile: str | None = None,
        grid: dict[str, list] | None = None, progress: Callable[[str], None] = logger.info,
        show: Callable[[str], None] = logger.info, group: AtomicFiles | None = None) -> list[str]:
    """Measure the grid, hand the frontier table to ``show`` (the CLIs pass ``print``: stdout),
    write ``frontier.json`` and ``frontier.png`` into ``out_dir``, replaced together (a daemon may be
    reading them). ``group``: stage them in it instead, for the caller to commit with other files (a
    bundle's ``manifest.json`` listing them). Returns the file names written."""
    from edgevlm.runtime.demo import scenes
    from edgevlm.runtime.exits import weights_fingerprint

    grid = grid or grid_from_profile(engine, profile)
    items = scenes.eval_set(n, seed)
    points = measure_grid(engine, items, rungs=sorted(grid["rungs"], reverse=True), thresholds=grid["thresholds"],
                          keep_ratios=grid["keep_ratios"], caps=grid["caps"], progress=progress)
    front = frontier_points(points)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = FrontierFile(
        created_utc=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        model=str(engine.model_dir),
        device=f"{engine.device} {str(engine.dtype).removeprefix('torch.')} {engine.backend_name}",
        host=host_description(engine), eval_items=n, eval_seed=seed, grid=grid, points=points, frontier=front,
        weights_fingerprint=weights_fingerprint(engine.model_dir),
    )
    with contextlib.nullcontext(group) if group is not None else AtomicFiles() as files:
        files.write_text(out / FRONTIER_JSON, record.model_dump_json(indent=2) + "\n")
        plot(points, front, files.path(out / FRONTIER_PNG), title=f"operating points ({record.device}, n={n})")
    show(f"Pareto frontier of {len(points)} grid points, with the full-depth and the plain points' own "
         f"({record.device}, {n} eval items):")
    show(format_table(front))
    return [FRONTIER_JSON, FRONTIER_PNG]


def main(argv: list[str] | None = None) -> int:
    """CLI entry. Returns 0, or 2 after a one-line error."""
    ap = argparse.ArgumentParser(prog="python -m edgevlm.quantize.frontier", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="model folder or engine bundle")
    ap.add_argument("--n", type=int, default=90, help="evaluation items per grid point")
    ap.add_argument("--seed", type=int, default=EVAL_SEED)
    ap.add_argument("--profile", default=None, help="device profile whose knob grid to measure")
    ap.add_argument("--rungs", type=int, nargs="+", default=None)
    ap.add_argument("--thresholds", type=float, nargs="+", default=None, help="exit thresholds (full depth always)")
    ap.add_argument("--keep-ratios", type=float, nargs="+", default=None)
    ap.add_argument("--caps", type=int, nargs="*", default=None, help="max_new_tokens caps")
    ap.add_argument("--out", default=None, help="output folder (default: the model folder)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from edgevlm.errors import EdgeVLMError

    try:
        if args.n < 1:
            raise ValueError("--n must be >= 1")
        import torch

        from edgevlm.runtime import Engine

        if args.threads:
            torch.set_num_threads(args.threads)
        engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
        grid = grid_from_profile(engine, args.profile)
        if args.rungs:
            grid["rungs"] = args.rungs
        if args.thresholds is not None:
            rec = recommended_threshold(engine)
            grid["thresholds"] = [None, *args.thresholds, *([rec] if rec is not None and rec not in args.thresholds
                                                             else [])]
        if args.keep_ratios:
            grid["keep_ratios"] = args.keep_ratios
        if args.caps is not None:
            grid["caps"] = args.caps
        from edgevlm.runtime.bundle import is_bundle

        # in a bundle, frontier.json / .png and the manifest listing them are replaced together: an interrupt
        # leaves the old three or the new three (a bundle loads no file its manifest lacks or mis-hashes)
        with AtomicFiles() as group:
            written = run(engine, args.out or engine.model_dir, n=args.n, seed=args.seed, grid=grid,
                          progress=lambda m: print(m, file=sys.stderr, flush=True), show=print, group=group)
            if args.out is None and is_bundle(engine.model_dir):
                from edgevlm.quantize.calibrate import add_to_manifest

                add_to_manifest(Path(engine.model_dir), written, group)
    except (EdgeVLMError, ValueError, OSError) as exc:
        from edgevlm.cli_args import fail

        return fail(exc, prog="edgevlm frontier")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
