"""``make demo`` / ``edgevlm demo``: the whole system end to end on this machine.

Steps:

1. make sure the mosquitto broker and ``mosquitto_rr`` exist; if not, install Debian's
   ``mosquitto mosquitto-clients`` with apt-get when running as root or with passwordless sudo,
   otherwise print the exact command and stop;
2. start a private mosquitto on a free loopback port (temporary config, no persistence);
3. start the daemon (``edgevlm serve``) in a subprocess with a generated config: the demo model
   and the bundled scene video (:func:`edgevlm.runtime.demo.video_path`) as camera ``front``;
4. wait for its retained status to say online;
5. ask questions through the SDK (:class:`edgevlm.Client`) and one through ``mosquitto_rr``
   (``-e`` Response Topic, ``-D publish correlation-data``);
6. print a table: question, answer, the expected answer from the video's sidecar ground truth
   (the segment that holds the frame position of the response), right/wrong, latencies;
7. stop the daemon (SIGTERM, it must exit 0) and the broker.

Exit status 0 only if every step worked, every question got an answer and at least
:data:`MIN_ACCURACY` of the checkable answers are right.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from edgevlm.daemon.demo_processes import (  # noqa: F401  (re-exported: the demo's processes)
    _SBIN_DIRS,
    APT_PACKAGES,
    DEVICE_ID,
    INSTALL_COMMAND,
    SOURCE,
    Broker,
    DaemonProcess,
    DemoError,
    _port_open,
    _privilege_prefix,
    _stop,
    _tail,
    daemon_config,
    ensure_mosquitto,
    find_mosquitto,
    free_port,
    start_private_broker,
)
from edgevlm.daemon.demo_questions import (  # noqa: F401  (re-exported: questions, grading, table)
    Row,
    Segment,
    _canonical_questions,
    _clip,
    _ms,
    _norm,
    _position_now_ms,
    _question_of_kind,
    ask_mosquitto_rr,
    ask_sdk,
    format_table,
    load_ground_truth,
    segment_at,
)

logger = logging.getLogger(__name__)

MIN_ACCURACY = 0.75
"""Fraction of checkable answers that must be right for the demo to count as working."""
# Question kinds asked about the segment on screen (after a first count question).
# Any question is graded on the frame the daemon actually used (Segment.expected).
_SEGMENT_KINDS = ("colour", "shape", "position_lr", "position_tb", "count_colour", "presence")


# -------------------------------------------------------------------------------------- main


def run_demo(
    *,
    model_dir: str | os.PathLike[str] | None = None,
    video: str | os.PathLike[str] | None = None,
    ground_truth: str | os.PathLike[str] | None = None,
    timeout_s: float = 180.0,
    json_out: bool = False,
) -> int:
    """Run the demo (see the module docstring). Returns the exit status: 0 if it worked, 1 if it ran and failed,
    2 for a bad argument (a model folder that does not load, a missing video, ``timeout_s`` not > 0: one line on
    stderr before anything starts), 130 when interrupted (Ctrl-C), 143 on SIGTERM (in both cases the broker and
    daemon are stopped first).

    Args:
        model_dir: model folder; None = the shipped demo model.
        video, ground_truth: camera video and its sidecar (:func:`load_ground_truth` format);
            None = the bundled scene video and ``scenes.json``.
        timeout_s: overall time limit (s).
        json_out: also print the results as one JSON line.
    """
    from edgevlm.cli_args import EXIT_INTERRUPTED, EXIT_USAGE, fail
    from edgevlm.errors import ModelLoadError
    from edgevlm.model_folder import check_model_folder
    from edgevlm.runtime import demo as demo_assets

    t_start = time.monotonic()
    if not 0.0 < timeout_s < float("inf"):
        return fail(f"the time limit must be a number of seconds > 0, got {timeout_s}")
    video = Path(video).resolve() if video else demo_assets.video_path()
    sidecar = Path(ground_truth).resolve() if ground_truth else demo_assets.scenes_json_path()
    model = Path(model_dir).resolve() if model_dir else None
    weights = model or demo_assets.model_dir()
    for what, path in (("camera video", video), ("its ground truth", sidecar)):
        if not path.is_file():
            return fail(f"{what} not found: {path}")
    try:
        check_model_folder(weights)
    except ModelLoadError as exc:
        return fail(exc, EXIT_USAGE if model is not None else 1)  # the shipped model missing: a broken install
    try:
        segments = load_ground_truth(sidecar)
        mosquitto, rr = ensure_mosquitto()
    except DemoError as exc:
        return fail(exc, 1)

    rows: list[Row] = []
    problems: list[str] = []
    interrupted = ""  # "interrupted" (Ctrl-C) or "terminated" (SIGTERM)
    previous_term = None
    if threading.current_thread() is threading.main_thread():  # SIGTERM stops the demo as Ctrl-C does
        previous_term = signal.signal(signal.SIGTERM, _on_sigterm)
    with tempfile.TemporaryDirectory(prefix="edgevlm-demo-") as tmp:
        workdir = Path(tmp)
        broker = Broker(mosquitto, workdir)
        daemon: DaemonProcess | None = None
        try:
            broker.start()
            print(f"broker   mosquitto on 127.0.0.1:{broker.port} (pid {broker.proc.pid})", flush=True)
            daemon = DaemonProcess(daemon_config(broker.port, video, model), workdir).start()
            print(f"daemon   edgevlm serve (pid {daemon.proc.pid}), model {weights}, camera '{SOURCE}' = {video.name}",
                  flush=True)  # fmt: skip
            rows = _ask_all(broker.port, rr, daemon, segments, t_start + timeout_s)
        except DemoError as exc:
            problems.append(str(exc))
        except KeyboardInterrupt as exc:
            interrupted = "terminated" if isinstance(exc, _Terminated) else "interrupted"
        finally:
            if daemon is not None:
                code = daemon.stop()
                if code != 0 and not problems and not interrupted:
                    problems.append(
                        f"the daemon exited with status {code} on SIGTERM; log:\n{_tail(daemon.log_path)}"
                    )
            broker.stop()
            if previous_term is not None:
                signal.signal(signal.SIGTERM, previous_term)
    if interrupted:
        print(f"demo: {interrupted} (broker and daemon stopped)", file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM if interrupted == "terminated" else EXIT_INTERRUPTED

    if rows:
        print()
        print(format_table(rows))
    checked = [r for r in rows if r.correct is not None]
    right = sum(bool(r.correct) for r in checked)
    errors = [r for r in rows if r.error]
    if errors:
        problems.append(f"{len(errors)} of {len(rows)} questions failed")
    if rows and not checked:
        problems.append("no answer could be checked against the ground truth")
    elif checked and right < MIN_ACCURACY * len(checked):
        problems.append(f"only {right} of {len(checked)} answers right")
    ok = not problems
    done = [r for r in rows if r.e2e_ms is not None]
    print()
    if rows:
        mean = (lambda xs: sum(xs) / len(xs)) if done else (lambda xs: 0.0)
        print(f"{right}/{len(checked)} checkable answers right; mean over {len(done)} answers: "
              f"rtt {mean([r.rtt_ms for r in done]):.0f} ms, e2e {mean([r.e2e_ms for r in done]):.0f} ms, "
              f"vision {mean([r.vision_ms for r in done]):.0f} ms, prefill {mean([r.prefill_ms for r in done]):.0f} ms, "
              f"ttft {mean([r.ttft_ms for r in done]):.0f} ms")  # fmt: skip
    for p in problems:
        print(f"demo: error: {p}", file=sys.stderr)
    print("demo: OK" if ok else "demo: FAILED", flush=True)
    if json_out:
        print(json.dumps({"ok": ok, "right": right, "checked": len(checked), "rows": [asdict(r) for r in rows],
                          "problems": problems}))  # fmt: skip
    return 0 if ok else 1


class _Terminated(KeyboardInterrupt):
    """SIGTERM while the demo runs: its broker and daemon are stopped as for Ctrl-C."""


def _on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one does not cut the clean-up short
    raise _Terminated


def _ask_all(
    port: int, rr: str, daemon: DaemonProcess, segments: list[Segment], deadline: float
) -> list[Row]:
    from edgevlm.client import Client

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DemoError("the demo ran past its time limit")
        return left

    rows: list[Row] = []
    t0 = time.monotonic()
    with Client("127.0.0.1", port, DEVICE_ID, connect_timeout_s=10) as client:
        while not client.wait_online(timeout_s=0.5):
            daemon.check_alive()
            remaining()
        status = client.device_status
        print(
            f"online   after {time.monotonic() - t0:.1f} s; sources {status.sources if status else '?'}",
            flush=True,
        )

        rows.append(ask_sdk(client, "how many shapes are there?", min(60.0, remaining())))
        # Follow-ups about the scene on screen: the video plays in real time, so the frame the
        # daemon will use is about the previous answer's frame plus the time since it was captured.
        for kind in _SEGMENT_KINDS:
            question = _question_of_kind(segment_at(segments, _position_now_ms(rows[-1])), kind)
            if question is not None:
                daemon.check_alive()
                rows.append(ask_sdk(client, question, min(60.0, remaining())))
        rows.append(ask_sdk(client, "describe the scene.", min(60.0, remaining())))
    daemon.check_alive()
    rows.append(ask_mosquitto_rr(rr, port, "how many shapes are there?", min(60.0, remaining())))
    for row in rows:
        row.grade(segments)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m edgevlm.daemon.demo [--model DIR] [--timeout-s S] [--json]``."""
    from edgevlm.cli_args import OneLineParser, positive_float

    parser = OneLineParser(prog="edgevlm demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder; default: the demo model")
    parser.add_argument("--timeout-s", type=positive_float, default=180.0, help="give up after this long, s")
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return run_demo(model_dir=args.model, timeout_s=args.timeout_s, json_out=args.json)


if __name__ == "__main__":
    sys.exit(main())
