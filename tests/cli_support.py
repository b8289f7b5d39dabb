"""Helpers for tests of the ``edgevlm`` CLI run in-process (``edgevlm.cli.main``)."""

from __future__ import annotations


def one_line_error(capsys) -> str:
    """The CLI's error after a failing ``main([...])``: exactly one line on stderr, ``edgevlm: error: ...``,
    no traceback, nothing on stdout. Returns the message after the prefix."""
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgevlm: error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    return lines[0].removeprefix("edgevlm: error: ")
