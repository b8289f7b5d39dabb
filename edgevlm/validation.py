"""One-line messages for pydantic validation errors, shared by every schema edgevlm validates.

The daemon config, device profiles, ``frontier.json``, bundle manifests and exit-head specs all
report a validation failure as one line that starts with the key path, e.g.
``mqtt.prot: unknown key``, ``sources[1].uri: a V4L2 index must be >= 0`` or
``operating_points.frontier[0].accuracy: Input should be less than or equal to 1``.

It also holds the two parsing rules every config schema shares: :class:`StrictModel` (unknown
keys refused; numbers and booleans strict: ``"4"``, ``4.0`` for an integer, ``"true"`` or ``1``
for a boolean are refused) and :func:`load_yaml` (a duplicate mapping key is an error naming the
key and its line, where PyYAML would keep the last value).

Torch-free (core): the runtime and the quantizer import it too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Strict, ValidationError

from edgevlm.errors import EdgeVLMError
from edgevlm.protocol import format_loc

__all__ = [  # format_loc: from edgevlm.protocol
    "ConfigPath",
    "DuplicateKeyError",
    "StrictModel",
    "check_host",
    "first_error_message",
    "format_loc",
    "load_yaml",
    "read_json_model",
    "yaml_error_message",
]

M = TypeVar("M", bound=BaseModel)

_KEY_PATH_RE = re.compile(r"^[A-Za-z0-9_.\[\]]+$")


class StrictModel(BaseModel):
    """Base of every config and profile schema: unknown keys are refused (``extra="forbid"``) and
    values are validated in pydantic's strict mode, so a string is never read as a number or a
    boolean (``queue_max_size: "4"`` is refused like ``mqtt.port: "1883"``), a float is never
    truncated to an integer (``4.0``) and ``1``/``"yes"`` are not booleans. An integer is still a
    valid float. File paths are written as strings in YAML: annotate them :data:`ConfigPath`."""

    model_config = ConfigDict(extra="forbid", strict=True)


def check_host(v: str) -> str:
    """A host name or IP address in a config (``mqtt.host``, ``offload.host``, ``http.host``): no whitespace,
    control character or ``/`` (a URL), which no resolver accepts (the daemon would retry it for ever)."""
    if any(c.isspace() or not c.isprintable() for c in v) or "/" in v:
        raise ValueError(f"not a host name or address: {v!r}")
    return v


ConfigPath = Annotated[Path, Strict(False)]
"""A file path in a strict schema: a string is accepted and converted to :class:`~pathlib.Path`."""


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A YAML mapping holds the same key twice; :attr:`message` is
    ``duplicate key 'port' at line 5 column 3 (first at line 3)``."""

    def __init__(self, key: Any, first_line: int, mark: yaml.Mark, context_mark: yaml.Mark) -> None:
        self.key, self.first_line = key, first_line
        self.message = f"duplicate key {key!r} at line {mark.line + 1} column {mark.column + 1} (first at line {first_line})"
        super().__init__("while constructing a mapping", context_mark, self.message, mark)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing duplicate mapping keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:  # the mapping's own keys; values merged in by '<<' may be overridden
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(key, seen[key], key_node.start_mark, node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


# YAML 1.2 booleans only: PyYAML resolves YAML 1.1's yes/no/on/off (any case) to booleans, so
# `enabled: yes` would pass a strict boolean field; here only true/false are booleans and the rest
# stay strings (refused by the strict schemas with the key path).
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def load_yaml(text: str) -> Any:
    """Parse YAML like ``yaml.safe_load``, but a key given twice in one mapping is an error.

    Raises:
        DuplicateKeyError: a duplicate key (its ``message`` names the key and both lines).
        yaml.YAMLError: any other syntax error.
    """
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506  (a SafeLoader subclass)


def yaml_error_message(exc: yaml.YAMLError) -> str:
    """`` at line L column C: <problem>`` for a YAML syntax error (one line; no location when PyYAML gives none)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{where}: {problem}"


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
