"""The ``edgevlm`` command line.

Subcommands::

    edgevlm ask --image PATH [--model DIR] [--backend NAME] [--resolution PX] [--max-new-tokens N] "question"
    edgevlm serve --config FILE          # run the MQTT daemon (blocks until SIGTERM/SIGINT)
    edgevlm serve --check-config FILE    # validate a daemon config and exit
    edgevlm serve-ray --config FILE      # the engine under Ray Serve behind the OpenAI-compatible API
    edgevlm demo                         # private broker + daemon + questions, prints a table

Every failure the user can cause (bad arguments, a missing or corrupt image, a bad config, a model
that does not load) prints exactly one line, ``edgevlm: error: ...``, on stderr and exits with
status 2; tracebacks are only logged with ``-vv``. Logging: warnings only by default, ``-v`` info,
``-vv`` debug; ``serve`` logs at the config's ``log_level`` (default INFO, as a service should)
unless ``-v``/``-vv`` is given. ``serve`` checks ``model.path`` (the folder, ``config.json``,
the safetensors headers) before anything starts, and a model that then fails to load is also
one ``edgevlm: error: ...`` line with status 2. Subsystems (torch, OpenCV, the daemon) are
imported inside the subcommand that needs them, so ``import edgevlm.cli`` stays light.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from edgevlm import __version__
from edgevlm.cli_args import OneLineParser, fail, interrupted, positive_float, positive_int, torch_device
from edgevlm.errors import ConfigError, EdgeVLMError, ModelLoadError

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1

_DTYPES = ("float32", "bfloat16", "float16")
_BACKENDS = ("torch", "onnx", "tensorrt")  # edgevlm.runtime.backends.BACKENDS (not imported: no torch here)


class _UsageError(Exception):
    """A bad argument found after parsing (reported like an argparse error: one line, exit 2)."""


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0.0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def _unit_float(text: str, *, zero_ok: bool = True) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (0.0 <= value <= 1.0) or (value == 0.0 and not zero_ok):  # also rejects NaN
        raise argparse.ArgumentTypeError(f"expected a number in {'[0' if zero_ok else '(0'}, 1], got {text}")
    return value


def _fraction(text: str) -> float:
    return _unit_float(text, zero_ok=False)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``edgevlm`` command (exposed for docs and tests)."""
    parser = OneLineParser(
        prog="edgevlm",
        description="Edge deployment SDK and daemon for vision-language models.",
    )
    parser.add_argument("--version", action="version", version=f"edgevlm {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug with tracebacks)"
    )
    # -v also works after the subcommand (edgevlm ask -v ...).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    sub.required = True

    ask = sub.add_parser("ask", parents=[common], help="answer a question about an image file")
    ask.add_argument("question", nargs="+", help="the question (several words are joined with spaces)")
    ask.add_argument("--image", required=True, metavar="PATH", help="JPEG, PNG, BMP or WebP file")
    ask.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="Hugging Face checkpoint folder of any registered model family (another model_type is refused "
        "with the supported list) or engine bundle; default: the demo model",
    )
    ask.add_argument(
        "--backend",
        choices=_BACKENDS,
        default="torch",
        help="inference backend (default: torch); onnx and tensorrt run engine bundles built by "
        "'edgevlm quantize' only (tensorrt needs --device cuda)",
    )
    ask.add_argument(
        "--resolution",
        type=positive_int,
        metavar="PX",
        default=None,
        help="input resolution: the longer image side after resizing, px, rounded to the patch size; at "
        "least the model's patch size (the model is trained at its resolution-ladder rungs; default: the "
        "checkpoint's own image processor, as transformers, else its native size)",
    )
    ask.add_argument("--exit-layer", type=positive_int, metavar="K", default=None,
                     help="early exit: stop the vision encoder after block K (one of the model's exit points); "
                          "with --exit-threshold: the last exit point consulted")
    ask.add_argument("--exit-threshold", type=_unit_float, metavar="T", default=None,
                     help="early exit: stop at the first exit point whose confidence reaches T (e.g. 0.99)")
    ask.add_argument("--keep-ratio", type=_fraction, metavar="R", default=None,
                     help="visual-token pruning: keep this fraction of the vision tokens, in (0, 1]")
    ask.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="N", help="default: 64")
    ask.add_argument("--device", type=torch_device, default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    ask.add_argument(
        "--dtype", choices=_DTYPES, default=None,
        help="default: float32 on CPU, bfloat16 on CUDA; --backend onnx and tensorrt run float32 only"
    )
    ask.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy (default)")
    ask.add_argument("--seed", type=int, default=None, help="sampling seed")
    ask.add_argument("--stream", action="store_true", help="print the answer while it is generated")
    ask.add_argument(
        "--json", action="store_true", help="print one JSON object: answer (the text), stats, model, question; "
        "with --stream, JSON lines: {\"delta\": TEXT} per piece as generated, then that object"
    )
    ask.set_defaults(func=_cmd_ask)

    serve = sub.add_parser("serve", parents=[common], help="run the MQTT daemon")
    mode = serve.add_mutually_exclusive_group(required=True)
    mode.add_argument("--config", metavar="FILE", help="daemon config YAML; runs until SIGTERM/SIGINT")
    mode.add_argument("--check-config", metavar="FILE", help="validate the config file and exit")
    serve.set_defaults(func=_cmd_serve)

    serve_ray = sub.add_parser("serve-ray", parents=[common],
                               help="serve the model under Ray Serve behind the OpenAI-compatible HTTP API")
    serve_ray.add_argument("--config", metavar="FILE", required=True,
                           help="daemon config YAML (model:, http:, ray:); runs until SIGTERM/SIGINT")
    serve_ray.set_defaults(func=_cmd_serve_ray)

    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="start a private broker and the daemon on the bundled video, ask questions, print a table",
    )
    demo.add_argument("--model", metavar="DIR", default=None, help="model folder; default: the demo model")
    demo.add_argument(
        "--timeout-s", type=positive_float, default=180.0, help="give up after this long, s (default: 180)"
    )
    demo.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    demo.set_defaults(func=_cmd_demo)

    # Subsystems with parsers of their own: the rest of the command line is theirs.
    for name, target, summary in _DELEGATED:
        p = sub.add_parser(name, help=summary, add_help=False, prefix_chars="\0")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_cmd_delegate, target=target)
    return parser


# (subcommand, "module:function" taking argv and returning an exit status, help)
_DELEGATED = (
    ("quantize", "edgevlm.quantize.cli:main", "quantize a Hugging Face VLM folder into an INT4 engine bundle"),
    ("calibrate", "edgevlm.quantize.calibrate:main", "train early-exit heads and measure operating points"),
    ("bench", "edgevlm.quantize.benchmark:main", "benchmark edgevlm against Hugging Face transformers"),
    ("doctor", "edgevlm.daemon.doctor:main", "check CUDA, TensorRT, cameras, microphones, the broker"),
)


# ----------------------------------------------------------------------------------- commands


def _cmd_ask(args: argparse.Namespace) -> int:
    question = " ".join(args.question).strip()
    if not question:
        raise _UsageError("the question is empty")
    from edgevlm.config_runtime import backend_settings_error  # pydantic: not at `import edgevlm.cli`

    # before the TensorRT / ONNX Runtime import
    refused = backend_settings_error(args.backend, args.device, args.dtype)
    if refused is not None:
        raise _UsageError("--{}: {}".format(*refused))

    from edgevlm.runtime.image import load_image, native_stderr_captured  # OpenCV: the runtime extra

    # Fail on a bad file before loading the model. The decoders' own stderr lines (libjpeg's
    # "Corrupt JPEG data: ...") are kept off the terminal: the error, if any, is our one line.
    decoder_lines: list[str] = []
    try:
        with native_stderr_captured() as decoder_lines:
            image = load_image(args.image)
    finally:
        for line in decoder_lines:
            logger.debug("image decoder: %s", line)

    from edgevlm.runtime import Engine  # torch: the runtime extra (ImportError names it)
    from edgevlm.types import OperatingPoint

    t0 = time.perf_counter()
    engine = Engine.load(args.model, device=args.device, dtype=args.dtype, backend=args.backend)
    load_ms = (time.perf_counter() - t0) * 1000.0
    logger.info("loaded %s in %.0f ms", engine.model_dir, load_ms)
    patch = int(engine.patch_size_px)
    from edgevlm.types import MAX_RESOLUTION_PX

    if args.resolution is not None and args.resolution > MAX_RESOLUTION_PX:
        raise _UsageError(f"--resolution {args.resolution} px is above the largest input resolution, "
                          f"{MAX_RESOLUTION_PX} px")
    if args.resolution is not None and args.resolution < patch:
        ladder = ", ".join(str(r) for r in engine.resolution_ladder)  # empty: the checkpoint's own preprocessing
        raise _UsageError(
            f"--resolution {args.resolution} px is below the model's patch size ({patch} px): use at least "
            f"{patch}" + (f" (the model's resolution ladder: {ladder} px)" if ladder else "")
        )

    adaptive = {"--exit-layer": args.exit_layer, "--exit-threshold": args.exit_threshold,
                "--keep-ratio": args.keep_ratio if args.keep_ratio is not None and args.keep_ratio < 1.0 else None}
    asked = [flag for flag, v in adaptive.items() if v is not None]
    if asked and not engine.family.adaptive_vision:  # before the config's exit_geometry is read
        from edgevlm.runtime.models import FAMILIES, get_family

        ok = ", ".join(n for n in FAMILIES if get_family(n).adaptive_vision)
        raise _UsageError(f"{' / '.join(asked)}: early exit and token pruning are not supported for the "
                          f"{engine.family.name} family (supported: {ok})")
    points = engine.exit_points
    exit_flags = [flag for flag in ("--exit-layer", "--exit-threshold") if adaptive[flag] is not None]
    if exit_flags and not points:  # no exit heads: named by the flag, before the engine's operating point
        raise _UsageError(f"{' / '.join(exit_flags)}: {engine.no_exit_heads_reason}")
    if args.exit_layer is not None and args.exit_layer not in points:
        raise _UsageError(f"--exit-layer {args.exit_layer} is not an exit point of this model (exit points: "
                          f"{', '.join(map(str, points))})")
    knobs = {"resolution_px": args.resolution, "exit_layer": args.exit_layer,
             "exit_threshold": args.exit_threshold, "keep_ratio": args.keep_ratio}
    op = OperatingPoint(name="cli", **knobs) if any(v is not None for v in knobs.values()) else None
    kwargs = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, operating_point=op
    )
    if args.stream:
        stream = engine.stream(image, question, **kwargs)
        for delta in stream:
            sys.stdout.write(json.dumps({"delta": delta}) + "\n" if args.json else delta)
            sys.stdout.flush()
        if not args.json:
            sys.stdout.write("\n")
        answer = stream.answer
    else:
        answer = engine.ask(image, question, **kwargs)

    model = {
        "model_dir": str(engine.model_dir),
        "backend": engine.backend_name,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "resolution_ladder": list(engine.resolution_ladder),
        "load_ms": round(load_ms, 1),
    }
    if args.json:
        print(json.dumps(_json_result(answer, question, model)))
        return EXIT_OK
    if not args.stream:
        print(answer.text)
    print(_format_stats(answer.stats, model))
    return EXIT_OK


def _json_result(answer, question: str, model: dict) -> dict:
    """What ``ask --json`` prints (with ``--stream``: after one ``{"delta": TEXT}`` line per piece): ``answer`` (the text), ``stats`` (the per-stage latencies and
    token counts of :class:`edgevlm.types.Stats`; keys without a value left out, as in MQTT responses), ``model`` (folder, backend, device, dtype,
    resolution ladder, load time), plus ``question`` and the answer's other fields (e.g.
    ``frame_ts``) when set."""
    data = answer.model_dump(mode="json")
    stats = {k: v for k, v in data.pop("stats").items() if v is not None}  # as on the wire: no nulls
    out = {"answer": data.pop("text"), "stats": stats, "model": model, "question": question}
    out.update((k, v) for k, v in data.items() if v is not None and k not in out)
    return out


def _format_stats(stats, model: dict) -> str:
    s = stats
    exit_line = []
    if s.exit_layer is not None:
        conf = f" (confidence {s.exit_confidence:.3f})" if s.exit_confidence is not None else ""
        exit_line = [f"  exit     vision encoder stopped after block {s.exit_layer}{conf}"]
    elif s.exit_confidence is not None:
        exit_line = [f"  exit     none: full depth (last exit confidence {s.exit_confidence:.3f}, below the threshold)"]
    return "\n".join(
        [
            f"  model    {model['model_dir']} ({model['backend']}, {model['device']}, {model['dtype']}; "
            f"loaded in {model['load_ms']:.0f} ms)",
            f"  input    {s.input_width_px}x{s.input_height_px} px, {s.vision_tokens} vision tokens, "
            f"{s.prompt_tokens} prompt tokens",
            f"  output   {s.new_tokens} new tokens, finish_reason={s.finish_reason or '-'}",
            f"  latency  preprocess {s.preprocess_ms:.1f} ms | vision {s.vision_ms:.1f} ms | "
            f"prefill {s.prefill_ms:.1f} ms | ttft {s.ttft_ms:.1f} ms | tpot {s.tpot_ms:.1f} ms | "
            f"e2e {s.e2e_ms:.1f} ms",
        ]
        + exit_line
    )


def _cmd_serve(args: argparse.Namespace) -> int:
    from edgevlm.config import load_daemon_config

    path = args.check_config if args.check_config is not None else args.config
    cfg = load_daemon_config(path)
    from edgevlm.daemon.preflight import preflight

    # The start-up checks, before anything starts; --check-config runs the same ones (the bundle's
    # hashes: here for --check-config, by the model load itself when serving).
    source_problems = preflight(cfg, verify_hashes=args.check_config is not None)
    from edgevlm.daemon.systemd_unit import stop_timeout_problem

    stop_problem = stop_timeout_problem(cfg)  # the installed unit's TimeoutStopSec= bounds the shutdown
    if args.check_config is not None:
        if source_problems:
            raise ConfigError(source_problems[0])
        if stop_problem is not None:
            raise ConfigError(stop_problem)
        names = ", ".join(s.name for s in cfg.sources) or "none"
        print(
            f"{args.check_config}: OK (broker {cfg.mqtt.host}:{cfg.mqtt.port}, device_id {cfg.mqtt.device_id}, "
            f"sources: {names}, model: {cfg.model.path or 'demo'})"
        )
        return EXIT_OK
    if args.verbose == 0:  # the config's log_level (default INFO: a service logs its life to the journal)
        logging.getLogger().setLevel(cfg.log_level)
    for problem in source_problems:  # a camera may come later: its source keeps reopening it
        logger.warning("%s; starting anyway, requests for that source fail until it delivers frames", problem)
    if stop_problem is not None:  # serves; only a stop during a long request loses it
        logger.warning("%s", stop_problem)
    from edgevlm.daemon.app import run

    try:
        code = int(run(cfg, raise_startup_errors=True))
    except ModelLoadError as exc:
        where = cfg.model.path or "the demo model"
        raise ConfigError(f"model: cannot load {where} on {cfg.model.device}: {exc.message}") from exc
    _end_if_worker_left(code)
    return code


_NATIVE_WORKERS = ("edgevlm-inference", "edgevlm-reload")
"""The daemon's threads that run the model or load one (native code, torch) and that a shutdown may leave
running: the inference worker (a stop during the model load, a request past ``service.shutdown_timeout_s``)
and the hot-reload thread (a stop during a reload's load)."""


def _end_if_worker_left(code: int) -> None:
    """End the process now when the daemon stopped with one of its :data:`_NATIVE_WORKERS` still running:
    it is inside native code (torch), and the interpreter's finalization would stop that thread mid-call and
    abort the process (SIGABRT, "terminate called without an active exception") instead of exiting ``code``."""
    import threading

    if not any(t.name in _NATIVE_WORKERS and t.is_alive() for t in threading.enumerate()):
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _cmd_serve_ray(args: argparse.Namespace) -> int:
    from edgevlm.config import load_daemon_config
    from edgevlm.model_folder import check_config_model_path

    cfg = load_daemon_config(args.config)
    check_config_model_path(cfg)
    if args.verbose == 0:
        logging.getLogger().setLevel(cfg.log_level)
    from edgevlm.daemon.ray_serve import run

    return int(run(cfg))


def _cmd_delegate(args: argparse.Namespace) -> int:
    import importlib

    module, func = args.target.split(":")
    return int(getattr(importlib.import_module(module), func)(list(args.rest)))


def _cmd_demo(args: argparse.Namespace) -> int:
    from edgevlm.daemon.demo import run_demo

    return int(run_demo(model_dir=args.model, timeout_s=args.timeout_s, json_out=args.json))


# --------------------------------------------------------------------------------------- main


def _setup_logging(verbose: int, command: str | None) -> None:
    if verbose >= 2:
        level = logging.DEBUG
    elif verbose == 1 or command in ("serve", "serve-ray"):
        level = logging.INFO
    else:
        level = logging.WARNING
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``edgevlm`` console script. Returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose, args.command)
    try:
        return args.func(args)
    except _UsageError as exc:
        return fail(str(exc))
    except EdgeVLMError as exc:
        logger.debug("failed", exc_info=True)
        return fail(exc.message or exc.__class__.__name__)
    except BrokenPipeError:  # the reader went away (`edgevlm ask --stream ... | head -1`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second complaint at exit
        return EXIT_OK
    except (OSError, ImportError) as exc:
        logger.debug("failed", exc_info=True)
        return fail(str(exc) or exc.__class__.__name__)
    except KeyboardInterrupt:
        return interrupted()
    except Exception as exc:  # a bug: still one line, the traceback only with -vv
        logger.debug("unexpected error", exc_info=True)
        return fail(
            f"internal error: {exc.__class__.__name__}: {exc} (run with -vv for the traceback)", EXIT_FAILURE
        )


if __name__ == "__main__":
    sys.exit(main())
