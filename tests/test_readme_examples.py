"""The README's in-process example runs verbatim on the frames its CLI section tells the reader to save."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _save_frames(cwd: Path) -> None:
    """Run the README's `python -c "..."` that saves a frame of the bundled video, in ``cwd``."""
    text = _readme()
    start = text.index('python -c "import cv2; c = cv2.VideoCapture(')
    line = text[start:text.index("\n", start)]
    code = line[len('python -c "'):-1]
    media = cwd / "runtime" / "demo" / "media"
    media.mkdir(parents=True)
    (media / "scenes.mp4").symlink_to(ROOT / "runtime" / "demo" / "media" / "scenes.mp4")
    subprocess.run([sys.executable, "-c", code], cwd=cwd, check=True, timeout=120)


def test_readme_engine_example_runs_on_the_saved_frame(tmp_path: Path) -> None:
    text = _readme()
    start = text.index("```python\nfrom edgevlm.runtime import Engine\n") + len("```python\n")
    snippet = text[start:text.index("```", start)]
    _save_frames(tmp_path)
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # the question fits the saved frame (a green triangle and a green cross): the demo model answers it right
    assert done.stdout.split(" ", 1)[0] == "yes", done.stdout[:500]


def test_readme_sdk_example_names_the_saved_frame() -> None:
    """The SDK example's inline image is one of the files the CLI section saves, and the section it
    points the reader to exists."""
    text = _readme()
    line = next(li for li in text.splitlines() if 'image="scene.jpg"' in li)
    assert "scene.jpg" in text[text.index('python -c "import cv2'):].split("\n", 1)[0]
    follow = text[text.index(line) + len(line):].split("\n", 1)[1].split("\n", 1)[0]
    quoted = follow.split('saved in "', 1)[1].split('"', 1)[0]
    assert f"## {quoted}\n" in text, f"the README has no section {quoted!r}"
