"""Argument parsing shared by every ``edgevlm`` sub-command (core: no torch).

The CLI convention: a usage error is one line on stderr, ``edgevlm: error: <message>``, exit status 2
(:data:`EXIT_USAGE`) — never argparse's multi-line usage dump, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import NoReturn

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C


def one_line(message: object) -> str:
    """``message`` with all whitespace runs collapsed to single spaces."""
    return " ".join(str(message).split())


def fail(error: str | BaseException, code: int = EXIT_USAGE, *, prog: str = "edgevlm") -> int:
    """Print ``<prog>: error: <one line>`` on stderr and return ``code``. ``error`` is a message or an
    exception (an :class:`edgevlm.errors.EdgeVLMError`'s ``message``, else ``str(exc)``)."""
    from edgevlm.errors import EdgeVLMError

    message = error.message if isinstance(error, EdgeVLMError) else str(error)
    sys.stderr.write(f"{prog}: error: {one_line(message)}\n")
    sys.stderr.flush()
    return code


def interrupted(prog: str = "edgevlm") -> int:
    """Print ``<prog>: interrupted`` on stderr and return :data:`EXIT_INTERRUPTED` (the answer to a
    ``KeyboardInterrupt``: Ctrl-C, or SIGTERM under :func:`sigterm_interrupts`)."""
    sys.stderr.write(f"{prog}: interrupted\n")
    sys.stderr.flush()
    return EXIT_INTERRUPTED


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block SIGTERM (``kill``, ``systemctl stop``, a CI job's timeout) raises
    ``KeyboardInterrupt`` as SIGINT does, so a command's clean-up for Ctrl-C (``except
    KeyboardInterrupt`` / ``finally``) also runs for it; the previous handler is restored after.
    Signals are only delivered to the main thread: from another thread this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_RST_ROLE_RE = re.compile(r":[a-z]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")


def plain_text(rst: str) -> str:
    """Docstring text (reStructuredText inline markup) as plain text for ``--help``:
    ````edgevlm calibrate```` -> ``edgevlm calibrate``, ``:class:`~edgevlm.Client``` -> ``edgevlm.Client``
    (``~`` keeps the last name: ``Client``), ``*x*``/``**x**`` -> ``x``."""
    def role(m: re.Match[str]) -> str:
        target = m.group(1)
        return target.rsplit(".", 1)[-1] if m.group(0).split("`", 1)[1].startswith("~") else target

    text = _RST_ROLE_RE.sub(role, rst).replace("``", "")
    return re.sub(r"(?<![\w*])\*{1,2}([^*\s][^*]*?)\*{1,2}(?![\w*])", r"\1", text)


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (``edgevlm: error: ...``), exit status 2, and whose
    ``description`` (often a docstring's first line) is shown without reStructuredText markup
    (:func:`plain_text`)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        if isinstance(kwargs.get("description"), str):
            kwargs["description"] = plain_text(kwargs["description"])  # type: ignore[arg-type]
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"edgevlm: error: {one_line(message)} (see '{self.prog} --help')\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """As argparse's, except that arguments left over are reported by the parser of the subcommand
        that was given (``see 'edgevlm serve --help'``): argparse hands a subparser's leftovers up to
        the top-level parser, whose usage is not the one to read."""
        argv = list(sys.argv[1:] if args is None else args)
        self._check_leading_options(argv)
        namespace, extras = self.parse_known_args(argv, namespace)
        if extras:
            self._subcommand_parser(namespace).error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace

    def _check_leading_options(self, argv: list[str]) -> None:
        """Refuse an unknown option given before the subcommand (``edgevlm --nope serve``) as this parser's
        own error: argparse would collect it as a leftover and first report what the subcommand misses
        (``one of the arguments --config --check-config is required``), never naming ``--nope``. Only a
        parser with subcommands and without options that take a value (the ``edgevlm`` top level) checks."""
        commands = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        if not commands or any(a.nargs != 0 for a in self._actions if a.option_strings
                               and not isinstance(a, (argparse._VersionAction, argparse._HelpAction))):
            return
        known = self._option_string_actions
        for arg in argv:
            if arg == "--" or not arg.startswith("-") or arg == "-":
                return  # the subcommand (or a positional) starts here
            if arg in known or (not arg.startswith("--") and all(f"-{c}" in known for c in arg[1:])):
                continue  # -v, --verbose, -vv
            self.error(f"unrecognized arguments: {arg}")

    def _subcommand_parser(self, namespace: argparse.Namespace) -> argparse.ArgumentParser:
        """The innermost parser of the subcommands named in ``namespace`` (``self`` without any; a
        subparsers action needs a ``dest`` for its choice to be known)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None))
                if isinstance(chosen, OneLineParser):
                    return chosen._subcommand_parser(namespace)
        return self


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (NaN and infinity refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0.0 < value < float("inf"):  # also rejects NaN
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def torch_device(text: str) -> str:
    """argparse type: ``cpu``, ``cuda`` or ``cuda:N``."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text
