"""Minimal PNG charts drawn with OpenCV (no plotting library needed on the device).

Used for the operating-point frontier plot (:mod:`edgevlm.quantize.frontier`) and the controller
timeline of ``bench/budget.py``: axes with "nice" ticks (1-2-5 steps), lines, scatter points,
horizontal reference lines, a legend, and an optional right-hand axis.

    chart = Chart("accuracy vs latency", "e2e latency (ms)", "accuracy (%)", xlim=(0, 400), ylim=(60, 100))
    chart.scatter(xs, ys, (160, 160, 160))
    chart.line(fx, fy, (40, 90, 220), label="frontier")
    chart.save("frontier.png")

Colours are RGB tuples; the PNG is written RGB-correct.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

BLUE = (40, 90, 220)
RED = (220, 50, 40)
GREEN = (30, 150, 60)
ORANGE = (240, 140, 20)
GREY = (150, 150, 150)
BLACK = (20, 20, 20)


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Tick values covering ``[lo, hi]`` with a 1/2/5 x 10^k step, about ``target`` of them."""
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v - round(v)) < 1e-9 else f"{v:g}"


class Chart:
    """A white canvas with a plot area, axes, title and legend (see the module doc)."""

    def __init__(self, title: str, xlabel: str, ylabel: str, *, xlim: tuple[float, float],
                 ylim: tuple[float, float], y2lim: tuple[float, float] | None = None, y2label: str = "",
                 width_px: int = 960, height_px: int = 600) -> None:
        self.cv2 = _cv2()
        self.w, self.h = width_px, height_px
        self.img = np.full((height_px, width_px, 3), 255, np.uint8)  # RGB
        self.left, self.right = 80, width_px - (80 if y2lim else 30)
        self.top, self.bottom = 50, height_px - 60
        self.xlim, self.ylim, self.y2lim = xlim, ylim, y2lim
        self.legend: list[tuple[str, tuple[int, int, int]]] = []
        self._axes(title, xlabel, ylabel, y2label)

    # -- coordinates ----------------------------------------------------------------------------
    def _px(self, x: float, y: float, axis: str = "left") -> tuple[int, int]:
        y0, y1 = self.y2lim if axis == "right" and self.y2lim else self.ylim
        x0, x1 = self.xlim
        u = self.left + (x - x0) / (x1 - x0 or 1) * (self.right - self.left)
        v = self.bottom - (y - y0) / (y1 - y0 or 1) * (self.bottom - self.top)
        return int(round(u)), int(round(v))

    def _text(self, s: str, org: tuple[int, int], scale: float = 0.45, colour=BLACK, anchor: str = "left") -> None:
        cv2 = self.cv2
        (tw, th), _ = cv2.getTextSize(s, cv2.FONT_HERSHEY_SIMPLEX, scale, 1)
        x, y = org
        if anchor == "center":
            x -= tw // 2
        elif anchor == "right":
            x -= tw
        cv2.putText(self.img, s, (x, y + th // 2), cv2.FONT_HERSHEY_SIMPLEX, scale, colour, 1, cv2.LINE_AA)

    def _axes(self, title: str, xlabel: str, ylabel: str, y2label: str) -> None:
        cv2 = self.cv2
        for t in nice_ticks(*self.xlim):
            u, _ = self._px(t, self.ylim[0])
            cv2.line(self.img, (u, self.top), (u, self.bottom), (235, 235, 235), 1)
            self._text(_fmt(t), (u, self.bottom + 14), anchor="center")
        for t in nice_ticks(*self.ylim):
            _, v = self._px(self.xlim[0], t)
            cv2.line(self.img, (self.left, v), (self.right, v), (235, 235, 235), 1)
            self._text(_fmt(t), (self.left - 8, v), anchor="right")
        if self.y2lim:
            for t in nice_ticks(*self.y2lim):
                _, v = self._px(self.xlim[0], t, "right")
                self._text(_fmt(t), (self.right + 8, v))
            self._text(y2label, (self.w - 10, self.top - 22), anchor="right")
        cv2.rectangle(self.img, (self.left, self.top), (self.right, self.bottom), BLACK, 1)
        self._text(title, (self.w // 2, 20), scale=0.6, anchor="center")
        self._text(xlabel, ((self.left + self.right) // 2, self.h - 22), anchor="center")
        self._text(ylabel, (10, self.top - 22))

    # -- marks ------------------------------------------------------------------------------------
    def line(self, xs, ys, colour, *, thickness: int = 2, label: str = "", axis: str = "left",
             step: bool = False) -> None:
        """A polyline (``step``: hold each value until the next x)."""
        pts = [self._px(x, y, axis) for x, y in zip(xs, ys, strict=True)]
        if step and len(pts) > 1:
            stepped = []
            for a, b in zip(pts, pts[1:], strict=False):
                stepped += [a, (b[0], a[1])]
            pts = stepped + [pts[-1]]
        if len(pts) > 1:
            arr = np.asarray(pts, np.int32).reshape(-1, 1, 2)
            self.cv2.polylines(self.img, [arr], False, colour, thickness, self.cv2.LINE_AA)
        if label:
            self.legend.append((label, colour))

    def scatter(self, xs, ys, colour, *, radius: int = 4, label: str = "", axis: str = "left",
                names: list[str] | None = None) -> None:
        """Filled dots, optionally annotated with ``names``."""
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            p = self._px(x, y, axis)
            self.cv2.circle(self.img, p, radius, colour, -1, self.cv2.LINE_AA)
            if names:
                self._text(names[i], (p[0] + 6, p[1] - 8), scale=0.35, colour=colour)
        if label:
            self.legend.append((label, colour))

    def hline(self, y: float, colour, *, label: str = "", axis: str = "left", dash_px: int = 8) -> None:
        """A dashed horizontal line at ``y``."""
        _, v = self._px(self.xlim[0], y, axis)
        for u in range(self.left, self.right, 2 * dash_px):
            self.cv2.line(self.img, (u, v), (min(u + dash_px, self.right), v), colour, 2)
        if label:
            self.legend.append((label, colour))

    def vline(self, x: float, colour, *, text: str = "") -> None:
        """A thin vertical line at ``x`` with an optional caption at its top."""
        u, _ = self._px(x, self.ylim[0])
        self.cv2.line(self.img, (u, self.top), (u, self.bottom), colour, 1)
        if text:
            self._text(text, (u + 4, self.top + 10), colour=colour)

    def save(self, path: str | Path) -> Path:
        """Draw the legend and write the PNG (RGB-correct). Raises OSError if it cannot be written."""
        x, y = self.left + 12, self.top + 14
        for name, colour in self.legend:
            self.cv2.line(self.img, (x, y), (x + 24, y), colour, 3)
            self._text(name, (x + 30, y))
            y += 18
        path = Path(path)
        if not self.cv2.imwrite(str(path), self.img[:, :, ::-1]):
            raise OSError(f"cannot write {path}")
        return path


def _cv2():
    try:
        import cv2
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError("plots need OpenCV: pip install 'edgevlm[runtime]'") from exc
    return cv2
