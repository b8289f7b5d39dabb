"""``edgevlm quantize MODEL_DIR --out BUNDLE_DIR [...]``: build an INT4 engine bundle.

Hook for the ``edgevlm`` command (edgevlm/cli.py): ``edgevlm.quantize.cli.main(argv) -> int`` with
``argv`` the arguments after ``quantize``; or :func:`add_arguments` on a subparser plus
:func:`run` on the parsed namespace. User errors (bad folder, bad flag, unknown profile, bad
calibration data, existing output) print one line ``edgevlm: error: ...`` and return 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from edgevlm.cli_args import OneLineParser, fail, interrupted, positive_int, sigterm_interrupts
from edgevlm.errors import EdgeVLMError
from edgevlm.runtime.models import FAMILIES  # torch-free: the registry's names

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``quantize`` arguments to ``p`` (a subparser of the ``edgevlm`` command)."""
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help=f"16-bit Hugging Face checkpoint folder (any registered family: {', '.join(FAMILIES)})")
    p.add_argument("--out", required=True, metavar="BUNDLE_DIR", help="bundle folder to create (must be new or empty)")
    p.add_argument("--method", choices=("awq", "rtn"), default=None, help="default: the profile's, else awq")
    p.add_argument("--group-size", type=int, choices=(32, 64, 128), default=None,
                   help="INT4 group size along in_features (default: the profile's, else 128)")
    p.add_argument("--calib", metavar="DIR|demo", default=None,
                   help="AWQ calibration data: 'demo' (scene generator) or a folder of images + prompts.txt "
                        "(default: demo for the demo model)")
    p.add_argument("--calib-samples", type=positive_int, default=32, metavar="N", help="default: 32")
    p.add_argument("--profile", metavar="NAME", default=None, help="target device profile (profiles/NAME.yaml)")
    p.add_argument("--vision", choices=("int4", "fp16"), default=None,
                   help="vision encoder linears INT4 or 16-bit (default: the profile's, else fp16)")
    p.add_argument("--lm-head", choices=("int4", "fp16"), default="fp16", help="default: fp16")
    p.add_argument("--keep-dtype", choices=("bfloat16", "float16"), default="bfloat16",
                   help="dtype of the tensors kept 16-bit (default: bfloat16)")
    p.add_argument("--w4a16-layout", choices=("canonical", "mma"), default="canonical",
                   help="INT4 weight layouts stored: canonical (default) = the portable tensors every backend "
                        "reads; mma = also each INT4 linear's tensor-core layout (w4a16-mma v1, CUDA sm_80+) in "
                        "layouts/, read at load instead of repacking. The copy doubles the INT4 bytes of the "
                        "bundle (about +0.5 byte per INT4 weight)")
    p.add_argument("--no-onnx", action="store_true", help="skip the ONNX export")
    p.add_argument("--no-tensorrt", action="store_true", help="skip the TensorRT build")
    p.add_argument("--overwrite", action="store_true", help="replace BUNDLE_DIR when it holds an engine bundle (a folder that is not one is refused)")
    p.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    return p


def build_parser(prog: str = "edgevlm quantize") -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description="Quantize a checkpoint into an INT4 (W4A16) engine bundle.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v info logging, -vv debug")
    return add_arguments(parser)


class _ProgressBar:
    """A one-line text progress bar on stderr (redrawn in place on a terminal)."""

    def __init__(self, stream=None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def __call__(self, stage: str, done: int, total: int) -> None:
        frac = done / total if total else 1.0
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        line = f"[{bar}] {stage:<9} {done}/{total}  {time.perf_counter() - self.t0:6.1f} s"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done >= total else ""))
        elif done >= total or done == 0:
            self.stream.write(line + "\n")
        self.stream.flush()


def _resolve(args: argparse.Namespace):
    """Merge flags with the profile's defaults into BuildOptions (ConfigError for bad values)."""
    from edgevlm.errors import ConfigError
    from edgevlm.quantize.build import BuildOptions

    method, group, vision = args.method, args.group_size, args.vision
    if args.profile:
        from edgevlm.profile import load_profile

        w = load_profile(args.profile).weights
        if w.scheme != "W4A16":
            raise ConfigError(f"profile {args.profile!r} asks for {w.scheme} weights, not W4A16")
        method, group = method or w.method, group or w.group_size
        vision = vision or ("int4" if w.vision == "int4" else "fp16")
    method, group, vision = method or "awq", group or 128, vision or "fp16"
    calib = args.calib
    if method == "awq" and calib is None:
        from edgevlm.runtime.demo import model_dir as demo_dir

        if Path(args.model_dir).expanduser().resolve() == demo_dir().resolve():
            calib = "demo"
        else:
            raise ConfigError("AWQ needs calibration data: --calib DIR (images + prompts.txt) or --calib demo; "
                              "or use --method rtn")
    return BuildOptions(method=method, group_size=group, vision=vision, lm_head=args.lm_head == "int4",
                        keep_dtype=args.keep_dtype, calib=calib, calib_samples=args.calib_samples,
                        profile=args.profile, onnx=not args.no_onnx, tensorrt=not args.no_tensorrt,
                        overwrite=args.overwrite, w4a16_layout=args.w4a16_layout)


def _check_input(model_dir: str) -> None:
    """The source folder exists, looks loadable, and is not already a bundle.

    Raises:
        ModelLoadError: ``model folder X does not exist``, ``X is not a folder``, a missing or
            broken config.json / safetensors file, or ``X is already an engine bundle``.
    """
    from edgevlm.errors import ModelLoadError
    from edgevlm.model_folder import check_model_folder, read_json
    from edgevlm.runtime.models import family_for

    path = Path(model_dir).expanduser()
    check_model_folder(path)
    if (path / "manifest.json").is_file():
        raise ModelLoadError(f"{path} is already an engine bundle; quantize the 16-bit source model")
    raw = read_json(path / "config.json")
    family_for(raw).parse_config(raw)  # an unsupported family or a bad config.json first, before any option


def _check_output(out: str) -> None:
    """``--out``'s parent folder exists and is writable (checked before any work is done).

    Raises:
        ConfigError: naming the folder.
    """
    import os
    import tempfile

    from edgevlm.errors import ConfigError

    parent = Path(out).expanduser().absolute().parent
    if not parent.is_dir():
        raise ConfigError(f"--out {out}: the folder {parent} does not exist")
    try:  # a real probe: permission bits do not tell for root, read-only mounts or /proc
        os.rmdir(tempfile.mkdtemp(prefix=".edgevlm-write-probe-", dir=parent))
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write in {parent} ({exc.strerror or exc})") from None


def summary(result) -> tuple[str, dict]:
    """The end-of-run table and its JSON-able numbers for a BuildResult."""
    m = result.manifest
    s = m.stats
    n4 = sum(d.action == "int4" for d in m.layers)
    awq_layers = [d for d in m.layers if d.rel_error is not None and d.rel_error_rtn is not None]
    manifest_path = Path(result.bundle_dir) / "manifest.json"  # not listed in itself, but part of the bundle
    n_files = len(m.files) + 1
    bundle_bytes = sum(f.size_bytes for f in m.files) + (manifest_path.stat().st_size if manifest_path.is_file() else 0)
    ratio = s["decoder_linear_int4_bytes"] / s["decoder_linear_16bit_bytes"] if s["decoder_linear_16bit_bytes"] else 0
    data = {
        "bundle": str(result.bundle_dir), "method": m.method, "group_size": m.group_size,
        "int4_layers": n4, "kept_layers": len(m.layers) - n4,
        "decoder_linear_int4_mb": s["decoder_linear_int4_bytes"] / 1e6,
        "decoder_linear_16bit_mb": s["decoder_linear_16bit_bytes"] / 1e6, "decoder_linear_ratio": ratio,
        "bundle_mb": bundle_bytes / 1e6, "files": n_files, "quantize_time_s": s["quantize_time_s"],
        "peak_rss_mb": s["peak_rss_mb"], "resolution_ladder": m.resolution_ladder,
    }
    if awq_layers:
        data["awq_mean_rel_error"] = sum(d.rel_error for d in awq_layers) / len(awq_layers)
        data["rtn_mean_rel_error"] = sum(d.rel_error_rtn for d in awq_layers) / len(awq_layers)
    rows = [
        ("bundle", str(result.bundle_dir)),
        ("method / scheme", f"{m.method.upper()} W4A16, group size {m.group_size}"),
        ("layers", f"{n4} INT4, {len(m.layers) - n4} kept 16-bit"),
        ("decoder linear weights", f"{data['decoder_linear_int4_mb']:.2f} MB INT4 vs "
                                   f"{data['decoder_linear_16bit_mb']:.2f} MB 16-bit ({100 * ratio:.1f}%)"),
        ("bundle size", f"{data['bundle_mb']:.2f} MB in {n_files} files"),
        ("resolution ladder", ", ".join(str(r) for r in m.resolution_ladder) + " px" if m.resolution_ladder
         else "none (the family's own preprocessing)"),
        ("quantize time", f"{s['quantize_time_s']:.1f} s"),
        ("peak RAM (RSS)", f"{s['peak_rss_mb']:.0f} MB"),
    ]
    if awq_layers:
        rows.insert(3, ("calib output error", f"AWQ {data['awq_mean_rel_error']:.3g} vs RTN "
                                              f"{data['rtn_mean_rel_error']:.3g} (mean relative MSE)"))
    for backend, what in m.artifacts.items():
        rows.append((f"artifacts: {backend}", what))
    for r in m.kernel_layouts:
        rows.append((f"stored layout {r.name}", f"v{r.version} ({', '.join(r.targets)}): {r.layers} INT4 layers, "
                                                 f"{r.size_bytes / 1e6:.2f} MB in {', '.join(r.files)}"))
        data.setdefault("kernel_layouts", []).append({"name": r.name, "version": r.version, "layers": r.layers,
                                                      "mb": r.size_bytes / 1e6})
    if m.onnx_check is not None:
        c = m.onnx_check
        worst = c.max_error
        sizes = ", ".join(f"{v.height_px}x{v.width_px}" for v in c.vision)
        rows.append(("ONNX vs PyTorch", f"max error {worst:.2g} (tolerance {c.tolerance:g}): vision at {sizes} px, "
                                        f"prefill + {c.decoder.decode_steps} decode steps; onnxruntime {c.onnxruntime}"))
        data["onnx_check_max_error"] = worst
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows), data


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``quantize`` command. Returns the exit status; raises EdgeVLMError for user errors."""
    from edgevlm.quantize.build import build_bundle

    _check_input(args.model_dir)  # before the options: a missing folder is the first thing to report
    opts = _resolve(args)
    _check_output(args.out)
    result = build_bundle(args.model_dir, args.out, opts, on_plan=lambda text: print(text, flush=True),
                          progress=_ProgressBar())
    table, data = summary(result)
    print(table)
    if args.json:
        print(json.dumps(data))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``argv`` are the arguments after ``edgevlm quantize``. Returns the exit status."""
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose >= 2 else logging.INFO if args.verbose == 1 else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        with sigterm_interrupts():  # build_bundle removes BUNDLE_DIR.partial on either
            return run(args)
    except (EdgeVLMError, ValueError, OSError) as exc:
        logger.debug("quantize failed", exc_info=True)
        return fail(exc, EXIT_USAGE)
    except KeyboardInterrupt:
        return interrupted()


if __name__ == "__main__":
    sys.exit(main())
