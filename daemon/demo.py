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

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEVICE_ID = "demo"
SOURCE = "front"
MIN_ACCURACY = 0.75
"""Fraction of checkable answers that must be right for the demo to count as working."""
APT_PACKAGES = ("mosquitto", "mosquitto-clients")
INSTALL_COMMAND = "sudo apt-get update && sudo apt-get install -y mosquitto mosquitto-clients"
_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin", "/opt/homebrew/sbin", "/usr/local/opt/mosquitto/sbin")
# Question kinds asked about the segment on screen (after a first count question).
# Any question is graded on the frame the daemon actually used (Segment.expected).
_SEGMENT_KINDS = ("colour", "shape", "position_lr", "position_tb", "count_colour", "presence")


class DemoError(Exception):
    """A step of the demo failed; the message says which and what to do."""


# ---------------------------------------------------------------------------------- mosquitto


def find_mosquitto(
    path: str | None = None, extra_dirs: Sequence[str] = _SBIN_DIRS
) -> tuple[str | None, str | None]:
    """Paths of the ``mosquitto`` broker and ``mosquitto_rr`` (None where missing). The broker
    usually lives in /usr/sbin, which is not on a normal user's PATH, so ``extra_dirs`` are tried."""
    search = os.pathsep.join([path if path is not None else os.environ.get("PATH", ""), *extra_dirs])
    return shutil.which("mosquitto", path=search), shutil.which("mosquitto_rr", path=search)


def _privilege_prefix() -> list[str] | None:
    """``[]`` as root, ``["sudo", "-n"]`` with passwordless sudo, else None."""
    if os.geteuid() == 0:
        return []
    if shutil.which("sudo"):
        ok = subprocess.run(["sudo", "-n", "true"], stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        if ok.returncode == 0:
            return ["sudo", "-n"]
    return None


def ensure_mosquitto(
    *, path: str | None = None, extra_dirs: Sequence[str] = _SBIN_DIRS, may_install: bool = True
) -> tuple[str, str]:
    """Return ``(mosquitto, mosquitto_rr)`` paths, installing Debian's packages if needed and allowed.

    Raises:
        DemoError: missing and cannot be installed here; the message holds the exact command.
    """
    broker, rr = find_mosquitto(path, extra_dirs)
    if broker and rr:
        return broker, rr
    missing = [p for p, have in zip(APT_PACKAGES, (broker, rr), strict=True) if not have]
    prefix = _privilege_prefix() if may_install else None
    if prefix is None or shutil.which("apt-get") is None:
        raise DemoError(
            f"{' and '.join(missing)} not installed; install with: {INSTALL_COMMAND} "
            "(other systems: the 'mosquitto' package of your distribution, or 'brew install mosquitto')"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *missing]):
        print(f"+ {' '.join(prefix + cmd)}", flush=True)
        res = subprocess.run(prefix + cmd, stdin=subprocess.DEVNULL, env=env)
        if res.returncode != 0:
            raise DemoError(f"'{' '.join(cmd)}' failed with status {res.returncode}; run: {INSTALL_COMMAND}")
    broker, rr = find_mosquitto(path, extra_dirs)
    if not (broker and rr):
        raise DemoError(f"mosquitto still not found after apt-get install; run: {INSTALL_COMMAND}")
    return broker, rr


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _stop(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM, wait, then SIGKILL. Returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


class Broker:
    """A private mosquitto on 127.0.0.1:<free port> with a temporary config (no persistence)."""

    def __init__(self, mosquitto: str, workdir: Path) -> None:
        self.mosquitto, self.workdir = mosquitto, workdir
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "mosquitto.log"

    def start(self, timeout_s: float = 10.0) -> Broker:
        for _attempt in range(3):  # the free port can be taken between probe and bind
            self.port = free_port()
            conf = self.workdir / "mosquitto.conf"
            conf.write_text(
                f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                "log_dest stderr\nlog_type error\nlog_type warning\nlog_type notice\n"
            )
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [self.mosquitto, "-c", str(conf)], stdin=subprocess.DEVNULL, stdout=log, stderr=log
                )
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.proc.poll() is None:
                if _port_open(self.port):
                    return self
                time.sleep(0.05)
            _stop(self.proc, 5)
        raise DemoError(f"mosquitto did not start on 127.0.0.1: {_tail(self.log_path, 3)}")

    def stop(self) -> int:
        return _stop(self.proc, 10) if self.proc else 0


# ------------------------------------------------------------------------------------ daemon


def start_private_broker(prefix: str) -> Broker | None:
    """A private mosquitto on a free loopback port in a fresh temporary folder (benchmarks), or
    None when no mosquitto binary is installed."""
    import tempfile

    mosquitto, _ = find_mosquitto()
    if mosquitto is None:
        return None
    return Broker(mosquitto, Path(tempfile.mkdtemp(prefix=prefix))).start()


def daemon_config(port: int, video: Path, model_dir: Path | None) -> dict[str, Any]:
    """The daemon config (a :class:`edgevlm.config.DaemonConfig` mapping) the demo runs."""
    return {
        "mqtt": {"host": "127.0.0.1", "port": port, "device_id": DEVICE_ID},
        # One intra-op thread: the camera's decoder thread and the broker share the CPU with it.
        "model": {"path": str(model_dir) if model_dir else None, "device": "cpu", "cpu_threads": 1},
        "sources": [{"name": SOURCE, "uri": str(video)}],
        "defaults": {"max_new_tokens": 32, "timeout_ms": 120000},
        # The demo checks answers, not budgets: a generous default budget keeps the latency
        # controller on the most accurate operating point even on a slow, busy CPU.
        "controller": {"default_budget_ms": 120000},
        "log_level": "INFO",
    }


class DaemonProcess:
    """``python -m edgevlm.cli serve --config FILE`` in a subprocess, logging to a file."""

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        import yaml

        self.config_path = workdir / "daemon.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = workdir / "daemon.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> DaemonProcess:
        cmd = [sys.executable, "-m", "edgevlm.cli", "serve", "--config", str(self.config_path)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        return self

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise DemoError(
                f"the daemon exited with status {self.proc.returncode}; its log ends:\n{_tail(self.log_path)}"
            )

    def stop(self) -> int:
        return _stop(self.proc, 30) if self.proc else 0


# --------------------------------------------------------------------------------- questions


@dataclass
class Segment:
    """One scene of the bundled video: [start_ms, end_ms) and its questions -> exact answers."""

    start_ms: float
    end_ms: float
    answers: dict[str, str]
    kinds: dict[str, str] = field(default_factory=dict)
    objects: list[dict] = field(default_factory=list)
    size_px: tuple[int, int] = (0, 0)

    def expected(self, question: str) -> str | None:
        """The exact answer to ``question`` for this scene: the sidecar's own, else computed by the
        scene generator from the segment's objects for any canonical question (None when the
        question has no exact answer here, e.g. "what color is the triangle?" without a triangle)."""
        if question in self.answers:
            return self.answers[question]
        if not self.objects or not self.size_px[0]:
            return None
        from edgevlm.runtime.demo import scenes

        parsed = _canonical_questions().get(_norm(question))
        if parsed is None:
            return None
        objs = tuple(
            scenes.SceneObject(
                o["shape"], o["colour"], o["size"], float(o["cx_px"]), float(o["cy_px"]), 0.0, 0.0, (0, 0, 0)
            )
            for o in self.objects
        )
        scene = scenes.Scene(self.size_px[0], self.size_px[1], None, objs)  # type: ignore[arg-type]
        kind, colour, shape = parsed
        try:
            return scenes.answer(scene, kind, colour=colour, shape=shape)
        except ValueError:
            return None


def _canonical_questions() -> dict[str, tuple[str, str, str]]:
    """Every canonical question text of the scene generator -> (kind, colour, shape)."""
    from edgevlm.runtime.demo import scenes

    table = {}
    for kind in scenes.KINDS:
        for colour in scenes.COLOURS:
            for shape in scenes.SHAPES:
                table[_norm(scenes.question_text(kind, colour=colour, shape=shape))] = (kind, colour, shape)
    return table


def load_ground_truth(path: Path) -> list[Segment]:
    """Read the video's sidecar (``scenes.json``): a list of segments (or ``{"segments": [...]}``),
    each with ``start_ms``, ``end_ms`` and ``questions`` (items with ``question``, ``answer`` and
    optionally ``kind``). Raises DemoError when it is missing or malformed."""
    try:
        data = json.loads(path.read_text())
        items = data["segments"] if isinstance(data, dict) else data
        segments = []
        for item in items:
            answers, kinds = {}, {}
            for qa in item["questions"]:
                answers[qa["question"]] = str(qa["answer"])
                if "kind" in qa:
                    kinds[qa["question"]] = qa["kind"]
            size = (
                (int(data.get("width_px", 0)), int(data.get("height_px", 0)))
                if isinstance(data, dict)
                else (0, 0)
            )
            segments.append(
                Segment(
                    float(item["start_ms"]),
                    float(item["end_ms"]),
                    answers,
                    kinds,
                    list(item.get("objects", [])),
                    size,
                )
            )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DemoError(
            f"cannot read the video's ground truth {path}: {exc.__class__.__name__}: {exc}"
        ) from None
    if not segments:
        raise DemoError(f"no segments in the video's ground truth {path}")
    return segments


def segment_at(segments: Sequence[Segment], pos_ms: float | None) -> Segment | None:
    """The segment holding media position ``pos_ms`` (the video loops, so wrap around)."""
    if pos_ms is None:
        return None
    period = max(s.end_ms for s in segments)
    pos = pos_ms % period if period > 0 else pos_ms
    for seg in segments:
        if seg.start_ms <= pos < seg.end_ms:
            return seg
    return None


def _norm(text: str | None) -> str:
    return " ".join((text or "").strip().lower().rstrip(".").split())


@dataclass
class Row:
    """One question of the demo and what came back."""

    via: str
    question: str
    answer: str | None = None
    expected: str | None = None
    correct: bool | None = None
    frame_pos_ms: float | None = None
    frame_ts: float | None = None
    rtt_ms: float | None = None
    e2e_ms: float | None = None
    vision_ms: float | None = None
    prefill_ms: float | None = None
    ttft_ms: float | None = None
    error: str | None = None

    def grade(self, segments: Sequence[Segment]) -> None:
        seg = segment_at(segments, self.frame_pos_ms)
        self.expected = seg.expected(self.question) if seg else None
        if self.expected is not None and self.answer is not None:
            self.correct = _norm(self.answer) == _norm(self.expected)

    def fill(self, answer: Any, rtt_ms: float) -> None:
        self.answer = answer.text
        self.frame_pos_ms = answer.frame_pos_ms
        self.frame_ts = answer.frame_ts
        self.rtt_ms = rtt_ms
        s = answer.stats
        self.e2e_ms, self.vision_ms, self.prefill_ms, self.ttft_ms = (
            s.e2e_ms,
            s.vision_ms,
            s.prefill_ms,
            s.ttft_ms,
        )


def _position_now_ms(row: Row) -> float | None:
    """Predicted media position (ms) of the camera now, from an answer's frame position and its
    capture time (the file source plays at its native rate)."""
    if row.frame_pos_ms is None:
        return None
    if row.frame_ts is None:
        return row.frame_pos_ms
    return row.frame_pos_ms + max(0.0, time.time() - row.frame_ts) * 1000.0


def _question_of_kind(seg: Segment | None, kind: str) -> str | None:
    """The segment's question of ``kind`` (None if the sidecar has none for that scene)."""
    if seg is None:
        return None
    return next((q for q, k in seg.kinds.items() if k == kind), None)


def ask_sdk(client: Any, question: str, timeout_s: float) -> Row:
    from edgevlm.errors import EdgeVLMError

    row = Row("sdk", question)
    t0 = time.perf_counter()
    try:
        answer = client.ask(question, source=SOURCE, timeout_s=timeout_s)
    except (EdgeVLMError, ConnectionError, TimeoutError) as exc:
        row.error = f"{exc.__class__.__name__}: {exc}"
        return row
    row.fill(answer, (time.perf_counter() - t0) * 1000.0)
    return row


def ask_mosquitto_rr(rr: str, port: int, question: str, timeout_s: float) -> Row:
    """One request through ``mosquitto_rr`` (MQTT v5: ``-e`` Response Topic, ``-D publish
    correlation-data``), the way a non-Python program would ask."""
    from edgevlm.errors import EdgeVLMError
    from edgevlm.protocol import parse_response, request_topic, response_topic

    row = Row("mosquitto_rr", question)
    body = json.dumps({"prompt": question, "source": SOURCE, "timeout_ms": int(timeout_s * 1000)})
    cmd = [
        rr, "-h", "127.0.0.1", "-p", str(port), "-V", "mqttv5", "-q", "1",
        "-t", request_topic("edgevlm", DEVICE_ID),
        "-e", response_topic("edgevlm", DEVICE_ID, f"rr{os.getpid()}"),
        "-D", "publish", "correlation-data", f"demo-{os.getpid()}",
        "-W", str(max(1, int(timeout_s))), "-m", body,
    ]  # fmt: skip
    t0 = time.perf_counter()
    res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s + 10)
    rtt_ms = (time.perf_counter() - t0) * 1000.0
    if res.returncode != 0 or not res.stdout.strip():
        row.error = (
            f"mosquitto_rr exited {res.returncode}: {res.stderr.decode(errors='replace').strip()[:200]}"
        )
        return row
    try:
        answer = parse_response(res.stdout.strip()).to_answer()
    except EdgeVLMError as exc:
        row.error = f"{exc.__class__.__name__}: {exc}"
        return row
    row.fill(answer, rtt_ms)
    return row


# ------------------------------------------------------------------------------------ output


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _clip(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def format_table(rows: Sequence[Row]) -> str:
    """The results as a fixed-width text table (long texts clipped to 48 characters)."""
    head = ["#", "via", "question", "answer", "expected", "ok", "frame s", "rtt ms", "e2e ms", "vision ms",
            "prefill ms", "ttft ms"]  # fmt: skip
    body = []
    for i, r in enumerate(rows, 1):
        ok = "ERROR" if r.error else {True: "right", False: "WRONG", None: "n/a"}[r.correct]
        frame = "-" if r.frame_pos_ms is None else f"{r.frame_pos_ms / 1000:.1f}"
        answer = r.error if r.error else r.answer
        body.append([str(i), r.via, _clip(r.question), _clip(answer or ""), _clip(r.expected or "-"), ok, frame, _ms(r.rtt_ms),
                     _ms(r.e2e_ms), _ms(r.vision_ms), _ms(r.prefill_ms), _ms(r.ttft_ms)])  # fmt: skip
    widths = [max(len(row[c]) for row in [head, *body]) for c in range(len(head))]
    numeric = set(range(6, len(head)))

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(head), rule, *(line(r) for r in body)])


# -------------------------------------------------------------------------------------- main


def run_demo(
    *,
    model_dir: str | os.PathLike[str] | None = None,
    video: str | os.PathLike[str] | None = None,
    ground_truth: str | os.PathLike[str] | None = None,
    timeout_s: float = 180.0,
    json_out: bool = False,
) -> int:
    """Run the demo (see the module docstring). Returns the exit status: 0 if it worked.

    Args:
        model_dir: model folder; None = the shipped demo model.
        video, ground_truth: camera video and its sidecar (:func:`load_ground_truth` format);
            None = the bundled scene video and ``scenes.json``.
        timeout_s: overall time limit (s).
        json_out: also print the results as one JSON line.
    """
    from edgevlm.runtime import demo as demo_assets

    t_start = time.monotonic()
    video = Path(video).resolve() if video else demo_assets.video_path()
    sidecar = Path(ground_truth).resolve() if ground_truth else demo_assets.scenes_json_path()
    model = Path(model_dir).resolve() if model_dir else None
    weights = model or demo_assets.model_dir()
    for what, path in (("camera video", video), ("its ground truth", sidecar),
                       ("model config", weights / "config.json")):  # fmt: skip
        if not path.is_file():
            print(f"demo: error: {what} not found: {path}", file=sys.stderr)
            return 1
    try:
        segments = load_ground_truth(sidecar)
        mosquitto, rr = ensure_mosquitto()
    except DemoError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 1

    rows: list[Row] = []
    problems: list[str] = []
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
        except KeyboardInterrupt:
            problems.append("interrupted")
        finally:
            if daemon is not None:
                code = daemon.stop()
                if code != 0 and not problems:
                    problems.append(
                        f"the daemon exited with status {code} on SIGTERM; log:\n{_tail(daemon.log_path)}"
                    )
            broker.stop()

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
    parser = argparse.ArgumentParser(prog="edgevlm demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder; default: the demo model")
    parser.add_argument("--timeout-s", type=float, default=180.0, help="give up after this long")
    parser.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return run_demo(model_dir=args.model, timeout_s=args.timeout_s, json_out=args.json)


if __name__ == "__main__":
    sys.exit(main())
