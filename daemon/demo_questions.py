"""The demo's questions: the video's ground truth, asking the daemon, grading and the results table.

Part of :mod:`edgevlm.daemon.demo`: :class:`Segment` and :func:`load_ground_truth` (the video's
sidecar), :class:`Row` (one question and what came back), :func:`ask_sdk` and
:func:`ask_mosquitto_rr`, and :func:`format_table`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgevlm.daemon.demo_processes import DEVICE_ID, SOURCE, DemoError


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
