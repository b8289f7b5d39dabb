"""Replace files so that a reader never sees part of one, and a group of files changes together.

``edgevlm calibrate`` rewrites a model folder or engine bundle in place (``exits.safetensors``,
``exits.json``, the bundle's ``manifest.json`` that lists both with their SHA-256), while a daemon
may hot-reload that folder. Written in place, an interrupt (Ctrl-C, ``systemctl stop``, SIGTERM from
a CI job's time limit) between two writes left new weights beside an old spec, or files whose hashes
the manifest did not hold: a bundle that no longer loads. :class:`AtomicFiles` writes every file of a
group to a temporary name beside its target, flushes them to disk, then renames each onto its target
(``os.replace``: POSIX ``rename(2)`` is atomic for a reader) with SIGINT and SIGTERM held back until
the last rename is done (then delivered as usual). What is left: a crash of the machine between two
renames (microseconds apart), which no interrupt can cause. :func:`replace_folder` does the same for a
whole folder (``edgevlm quantize --overwrite`` putting a new bundle in the place of the old).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

_TEMP_PREFIX = ".edgevlm-tmp-"


class AtomicFiles:
    """A group of files replaced together on :meth:`commit` (or when the ``with`` block ends without
    an exception); on an exception or :meth:`discard` no target changes and the temporary files are
    removed.

    Usage::

        with AtomicFiles() as group:
            save_file(tensors, str(group.path(folder / "exits.safetensors")))
            group.write_text(folder / "exits.json", spec_json)

    :meth:`path` names where to write a target's new content (any writer that takes a path);
    :meth:`staged` tells where a target's new content is before the commit (to hash it). A replaced
    file has the permissions its temporary file was written with, not the old file's.
    """

    def __init__(self) -> None:
        self._staged: dict[Path, Path] = {}

    def path(self, target: str | Path) -> Path:
        """The temporary path (same folder, so the rename stays on one file system) to write ``target``'s
        new content to. The folder must exist. Asking twice for one target gives the same path."""
        target = Path(target)
        if target not in self._staged:
            self._staged[target] = target.with_name(f"{_TEMP_PREFIX}{os.getpid()}-{target.name}")
        return self._staged[target]

    def write_text(self, target: str | Path, text: str) -> Path:
        """Stage ``text`` (UTF-8) as ``target``'s new content; returns the temporary path."""
        tmp = self.path(target)
        tmp.write_text(text, encoding="utf-8")
        return tmp

    def staged(self, target: str | Path) -> Path:
        """Where ``target``'s content is now: its temporary file when staged, else ``target`` itself."""
        return self._staged.get(Path(target), Path(target))

    def commit(self) -> None:
        """Flush every staged file to disk, then rename each onto its target, in the order staged.

        Raises:
            OSError: a staged file is missing or a rename fails (the targets renamed before stay new;
                the temporary files left are removed).
        """
        try:
            for tmp in self._staged.values():
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
            with _interrupts_held():
                for target, tmp in self._staged.items():
                    os.replace(tmp, target)
            for folder in {t.parent for t in self._staged}:
                _fsync_dir(folder)
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove the temporary files not renamed yet; no target changes."""
        for tmp in self._staged.values():
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self._staged.clear()

    def __enter__(self) -> AtomicFiles:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.discard()


def write_text_atomic(target: str | Path, text: str) -> None:
    """Replace ``target`` with ``text`` (UTF-8) so that a reader sees the old content or the new, never
    a part (:class:`AtomicFiles` with one file). Raises OSError."""
    with AtomicFiles() as group:
        group.write_text(target, text)


def replace_folder(staged: str | Path, target: str | Path) -> None:
    """Put the finished folder ``staged`` in the place of ``target`` (which may not exist), so that
    ``target`` holds the old folder or the new one, whole, at every moment a failure can stop it: the
    old folder is renamed aside (a temporary name in the same parent), ``staged`` renamed onto
    ``target``, then the old one deleted; a failed second rename puts the old folder back. SIGINT and
    SIGTERM are held during the renames (as in :class:`AtomicFiles`). The parent must be one file system.

    Raises:
        OSError: a rename failed (``target`` is then as it was before the call).
    """
    staged, target = Path(staged), Path(target)
    aside = target.with_name(_TEMP_PREFIX + target.name + ".old")
    shutil.rmtree(aside, ignore_errors=True)  # a leftover of a machine crash between the renames
    with _interrupts_held():
        moved = target.exists()
        if moved:
            os.replace(target, aside)
        try:
            os.replace(staged, target)
        except BaseException:
            if moved:
                os.replace(aside, target)
            raise
        _fsync_dir(target.parent)
    shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """SIGINT and SIGTERM arriving in the block are delivered when it ends (to the handlers in place
    before it). Python runs signal handlers in the main thread only, so only there can they be held;
    in another thread the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, frame: object) -> None:
        caught.append(signum)

    previous = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            logger.debug("delivering signal %d held during the file renames", caught[0])
            signal.raise_signal(caught[0])


def _fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (the renames) to disk; a file system that cannot is skipped."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
