"""One-line messages for pydantic validation errors, shared by every schema edgevlm validates.

The daemon config, device profiles, ``frontier.json``, bundle manifests and exit-head specs all
report a validation failure as one line that starts with the key path, e.g.
``mqtt.prot: unknown key``, ``sources[1].uri: a V4L2 index must be >= 0`` or
``operating_points.frontier[0].accuracy: Input should be less than or equal to 1``.

Torch-free (core): the runtime and the quantizer import it too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from edgevlm.errors import EdgeVLMError
from edgevlm.protocol import format_loc

__all__ = ["first_error_message", "format_loc", "read_json_model"]  # format_loc: from edgevlm.protocol

M = TypeVar("M", bound=BaseModel)

_KEY_PATH_RE = re.compile(r"^[A-Za-z0-9_.\[\]]+$")


def first_error_message(
    exc: ValidationError, *, unknown: str = "unknown key", missing: str = "required key missing"
) -> str:
    """The first error of ``exc`` as ``<key path>: <message>``, one line.

    A model-level check (``@model_validator``) that raises ``ValueError("key: message")`` names
    its key itself: that key is appended to the location (``sources[1].name: duplicate ...``).
    pydantic's ``"Value error, "`` prefix is removed. When there are more errors,
    `` (and N more)`` is appended.

    Args:
        exc: the error raised by ``Model.model_validate``.
        unknown: the message for a key the model forbids (``extra="forbid"``).
        missing: the message for a required key that is absent.
    """
    errors = exc.errors(include_url=False)
    first = errors[0]
    path = format_loc(first["loc"])
    if first["type"] == "extra_forbidden":
        msg = unknown
    elif first["type"] == "missing":
        msg = missing
    else:
        msg = " ".join(str(first["msg"]).removeprefix("Value error, ").split())
        head, sep, rest = msg.partition(": ")
        if sep and _KEY_PATH_RE.match(head):
            path, msg = (head if path == "$" else f"{path}.{head}"), rest
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{path}: {msg}{more}"


def read_json_model(
    path: str | Path, model: type[M], *, error: type[EdgeVLMError], not_found: str | None = None
) -> M:
    """Read a JSON file and validate it as ``model``.

    Args:
        path: the file.
        model: the pydantic model to validate with.
        error: the exception class to raise (e.g. ``ConfigError``, ``ModelLoadError``).
        not_found: the message for a missing file (default ``"<path> not found"``).

    Raises:
        error: missing file (``not_found``), unreadable or not JSON (``<path>: not valid JSON
            (...)``), or invalid (``<path>: <key path>: <message>``, see :func:`first_error_message`).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(not_found or f"{path} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{path}: not valid JSON ({exc})") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{path}: {first_error_message(exc)}") from None
