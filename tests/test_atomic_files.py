"""edgevlm.atomic_files: a group of files is replaced together, or not at all, and an interrupt that
arrives during the renames waits until they are done (a real signal sent to this process)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from edgevlm import atomic_files
from edgevlm.atomic_files import AtomicFiles, write_text_atomic


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".edgevlm-tmp-"))


def test_commit_replaces_every_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("old a")
    with AtomicFiles() as group:
        group.write_text(tmp_path / "a.json", "new a")
        group.path(tmp_path / "b.bin").write_bytes(b"\x00\x01")
        assert group.staged(tmp_path / "a.json").read_text() == "new a"
        assert (tmp_path / "a.json").read_text() == "old a"  # nothing replaced before the commit
        assert group.staged(tmp_path / "c.txt") == tmp_path / "c.txt"  # not staged: the target itself
    assert (tmp_path / "a.json").read_text() == "new a"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert _leftovers(tmp_path) == []


def test_an_error_in_the_block_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("old a")
    with pytest.raises(RuntimeError, match="writer failed"):
        with AtomicFiles() as group:
            group.write_text(tmp_path / "a.json", "new a")
            group.write_text(tmp_path / "b.json", "new b")
            raise RuntimeError("writer failed")
    assert (tmp_path / "a.json").read_text() == "old a"
    assert not (tmp_path / "b.json").exists()
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_during_the_renames_is_delivered_after_the_last(tmp_path: Path, monkeypatch, signum) -> None:
    # the signal is sent to this process right after the first of three renames: without the hold the
    # KeyboardInterrupt would stop the group with one new file beside two old ones
    targets = [tmp_path / f"{n}.json" for n in "abc"]
    for t in targets:
        t.write_text(f"old {t.stem}")
    renames: list[str] = []
    real_replace = os.replace

    def replace_then_signal(src, dst):
        real_replace(src, dst)
        renames.append(Path(dst).name)
        if len(renames) == 1:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(atomic_files.os, "replace", replace_then_signal)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as `edgevlm calibrate` runs
    try:
        with pytest.raises(KeyboardInterrupt):
            with AtomicFiles() as group:
                for t in targets:
                    group.write_text(t, f"new {t.stem}")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert renames == ["a.json", "b.json", "c.json"]
    assert [t.read_text() for t in targets] == ["new a", "new b", "new c"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    assert _leftovers(tmp_path) == []


def test_write_text_atomic_replaces_one_file(tmp_path: Path) -> None:
    target = tmp_path / "frontier.json"
    target.write_text("{}")
    write_text_atomic(target, '{"points": []}\n')
    assert target.read_text() == '{"points": []}\n'
    assert _leftovers(tmp_path) == []


def test_save_exit_heads_replaces_both_files_or_neither(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from edgevlm.runtime.exits import EXITS_JSON, EXITS_WEIGHTS, ExitHeads, make_spec, save_exit_heads
    from edgevlm.runtime.loader import read_model_files
    from edgevlm.runtime.testing import write_tiny_checkpoint

    model_dir = write_tiny_checkpoint(tmp_path / "model", vision_layers=3)
    cfg = read_model_files(model_dir).config
    old = ExitHeads(make_spec(cfg, exit_blocks=[1], labels=["red", "green"], head_hidden=8))
    save_exit_heads(old, model_dir)
    old_bytes = {n: (model_dir / n).read_bytes() for n in (EXITS_WEIGHTS, EXITS_JSON)}
    assert (model_dir / EXITS_WEIGHTS).stat().st_mode & 0o777 == 0o644

    new = ExitHeads(make_spec(cfg, exit_blocks=[1, 2], labels=["red", "green", "blue"], head_hidden=8))
    # the fault: the spec's temporary file cannot be written (a folder stands in its place), after the
    # weights' temporary file was; was: new weights written in place beside the old spec
    blocker = AtomicFiles().path(model_dir / EXITS_JSON)
    blocker.mkdir()
    with pytest.raises(IsADirectoryError):
        save_exit_heads(new, model_dir)
    blocker.rmdir()
    assert {n: (model_dir / n).read_bytes() for n in old_bytes} == old_bytes
    assert _leftovers(model_dir) == []

    weights, spec = save_exit_heads(new, model_dir, dtype=torch.float32)
    assert '"exit_blocks": [\n    1,\n    2\n  ]' in spec.read_text()
    assert weights.stat().st_mode & 0o777 == 0o644
    assert _leftovers(model_dir) == []


def _folder(path: Path, **files: str) -> Path:
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def test_replace_folder_swaps_a_whole_folder_and_leaves_nothing_aside(tmp_path: Path) -> None:
    """``edgevlm quantize --overwrite`` deleted the earlier bundle, then renamed the new one in: a failure
    between the two left neither. ``replace_folder`` moves the old one aside first and deletes it last."""
    from edgevlm.atomic_files import replace_folder

    target = _folder(tmp_path / "bundle", **{"manifest.json": "old", "old-only.txt": "x"})
    replace_folder(_folder(tmp_path / "bundle.partial", **{"manifest.json": "new"}), target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]
    assert sorted(p.name for p in target.iterdir()) == ["manifest.json"]
    assert (target / "manifest.json").read_text() == "new"
    replace_folder(_folder(tmp_path / "fresh.partial", a="1"), tmp_path / "fresh")  # no earlier folder
    assert (tmp_path / "fresh" / "a").read_text() == "1" and not (tmp_path / "fresh.partial").exists()


def test_replace_folder_puts_the_old_folder_back_when_the_new_cannot_move_in(tmp_path: Path, monkeypatch) -> None:
    """The fault injected: the rename of the new folder onto the target fails (as on a full or read-only
    file system); the earlier bundle is back in place, whole, and the error is raised."""
    from edgevlm.atomic_files import replace_folder

    target = _folder(tmp_path / "bundle", **{"manifest.json": "old"})
    staged = _folder(tmp_path / "bundle.partial", **{"manifest.json": "new"})
    real = os.replace

    def failing(src, dst):
        if Path(src) == staged:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(atomic_files.os, "replace", failing)
    with pytest.raises(OSError, match="No space left on device"):
        replace_folder(staged, target)
    assert (target / "manifest.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "bundle.partial"]
