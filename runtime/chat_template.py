"""Chat templates compiled in a sandbox and rendered under a budget, so that a template shipped
with a checkpoint can neither reach outside its inputs nor stall the inference worker.

A chat template is Jinja2 code from the model folder, rendered the way transformers'
``apply_chat_template`` renders it (``ImmutableSandboxedEnvironment``, ``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception`` and ``strftime_now``
globals). A template that branches on the prompt can do unbounded work at request time, e.g.
``{% if 'x' in messages[0].content %}{% for i in range(100000) %}{% for j in range(100000) %}
{% endfor %}{% endfor %}{% endif %}``. :func:`compile_chat_template` returns a
:class:`ChatTemplate` whose :meth:`~ChatTemplate.render` bounds that work three ways:

1. **steps and time**: a trace function (:func:`sys.settrace`, on the rendering thread only, for
   the duration of one render) counts every Python ``call`` event (generator resumes included) and
   every ``line`` event of the compiled template's own code; past :data:`MAX_RENDER_STEPS` events or
   :data:`MAX_RENDER_S` seconds it raises :class:`ChatTemplateBudgetError` inside the template.
   This bounds loops (nested or not, over ``range`` or any sequence) and macro recursion (deep
   recursion also ends in Python's own ``RecursionError``, reported the same way).
2. **single operations that run in C**, where no trace event fires: ``*``, ``**``, ``+``, ``%``,
   ``~``, ``range``, ``str.format`` widths, the ``center``/``indent``/``join``/``replace``/
   ``format`` filters and the padding string methods (``ljust``, ``rjust``, ``center``, ``zfill``,
   ``expandtabs``, ``join``, ``replace``) are checked *before* they run: a result of more than
   :data:`MAX_STRING_CHARS` characters (or items), an integer of more than :data:`MAX_INT_BITS`
   bits, or a range of more than :data:`MAX_RANGE_ITEMS` items is refused (``'a' * 10**9``,
   ``10 ** 10 ** 10``, ``'{:>999999999}'.format(1)``).
3. **total size**: the characters those operations produce and the rendered output are counted
   per render, at most :data:`MAX_TOTAL_CHARS` (a loop that prints a large string many times).

A prompt is at most a few thousand tokens (the KV cache), so the limits are far above what a
real template needs (the llava-hf templates render in well under a millisecond, a few hundred
trace events). Errors: :class:`ChatTemplateError` (an :class:`~edgevlm.errors.InvalidRequestError`,
``INVALID_REQUEST`` on the wire) for a template that fails or runs past a limit on a request; the
tokenizer turns one at load time into a :class:`~edgevlm.errors.ModelLoadError`.
"""

from __future__ import annotations

import math
import re
import string
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

from edgevlm.errors import InvalidRequestError

__all__ = [
    "MAX_INT_BITS",
    "MAX_RANGE_ITEMS",
    "MAX_RENDER_S",
    "MAX_RENDER_STEPS",
    "MAX_STRING_CHARS",
    "MAX_TOTAL_CHARS",
    "ChatTemplate",
    "ChatTemplateBudgetError",
    "ChatTemplateError",
    "compile_chat_template",
]

MAX_RENDER_STEPS = 1_000_000
"""Python ``call``/``line`` trace events one render may take (about 0.3-1 s of tracing on a CPU)."""
MAX_RENDER_S = 1.0
"""Wall-clock seconds one render may take."""
MAX_STRING_CHARS = 1_000_000
"""Largest string (characters) or sequence (items) a single operation may build."""
MAX_TOTAL_CHARS = 4_000_000
"""Characters all checked operations of one render may build together, and the output's length."""
MAX_INT_BITS = 4096
"""Largest integer (bits) ``*`` and ``**`` may build."""
MAX_RANGE_ITEMS = 10_000
"""Longest ``range()``."""

_CHECK_TIME_EVERY = 1024  # trace events between two clock reads
_BIG_WIDTH = re.compile(r"%[-#0 +]*(\*|\d{7,})|%[-#0 +]*\d*\.(\*|\d{7,})")  # printf-style width/precision


class ChatTemplateError(InvalidRequestError):
    """The chat template failed or was refused while rendering a request (the message says why)."""


class ChatTemplateBudgetError(ChatTemplateError):
    """The chat template ran past a step, time or size limit of this module."""


class _Budget:
    """What one render has spent (kept per thread: one render at a time per thread)."""

    def __init__(self, max_steps: int, max_s: float) -> None:
        self.steps = 0
        self.max_steps = max_steps
        self.max_s = max_s
        self.deadline = time.perf_counter() + max_s
        self.chars = 0
        self.exceeded: str | None = None

    def fail(self, reason: str) -> ChatTemplateBudgetError:
        self.exceeded = self.exceeded or reason
        return ChatTemplateBudgetError(f"chat template refused: {reason}")

    def tick(self) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            raise self.fail(f"more than {self.max_steps} steps (a loop or recursion too large)")
        if self.steps % _CHECK_TIME_EVERY == 0 and time.perf_counter() > self.deadline:
            raise self.fail(f"rendering took more than {self.max_s:g} s")

    def charge(self, chars: int, what: str) -> None:
        if chars > MAX_STRING_CHARS:
            raise self.fail(f"{what} would build {chars} characters/items (limit {MAX_STRING_CHARS})")
        self.chars += chars
        if self.chars > MAX_TOTAL_CHARS:
            raise self.fail(f"more than {MAX_TOTAL_CHARS} characters built in one render")


_local = threading.local()


def _budget() -> _Budget | None:
    return getattr(_local, "budget", None)


def _charge(chars: int, what: str) -> None:
    budget = _budget()
    if budget is not None:
        budget.charge(chars, what)
    elif chars > MAX_STRING_CHARS:  # outside render() (e.g. a constant folded at compile time)
        raise ChatTemplateBudgetError(f"chat template refused: {what} would build {chars} characters/items "
                                      f"(limit {MAX_STRING_CHARS})")


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple)) else None


def _check_int_bits(bits: float, what: str) -> None:
    if bits > MAX_INT_BITS:
        raise ChatTemplateBudgetError(f"chat template refused: {what} would build an integer of about "
                                      f"{int(bits)} bits (limit {MAX_INT_BITS})")


def _check_binop(op: str, left: Any, right: Any) -> None:
    """Refuse ``left op right`` before it runs when its result would exceed the limits."""
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if _size(seq) is not None and isinstance(n, int):
                _charge(_size(seq) * max(n, 0), "'*'")
                return
        if ints:
            _check_int_bits(left.bit_length() + right.bit_length(), "'*'")
    elif op == "**" and ints and right > 0 and abs(left) > 1:
        _check_int_bits(right * math.log2(abs(left)), "'**'")
    elif op == "+" and _size(left) is not None and _size(right) is not None:
        _charge(_size(left) + _size(right), "'+'")
    elif op == "%" and isinstance(left, str):
        _check_printf(left)


def _check_printf(fmt: str) -> None:
    if _BIG_WIDTH.search(fmt):
        raise ChatTemplateBudgetError("chat template refused: a '%' format with a '*' or 7-digit width/precision")


def _check_format_spec(fmt: str) -> None:
    """``str.format`` fields: no nested fields in a spec, no width/precision of 7+ digits."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format raises the same error itself
    for _, _, spec, _ in fields:
        if spec and ("{" in spec or re.search(r"\d{7,}", spec)):
            raise ChatTemplateBudgetError("chat template refused: a format field with a nested or 7-digit width")


def _total_len(items: Iterable[Any]) -> tuple[list[str], int]:
    parts = [x if isinstance(x, str) else str(x) for x in items]
    return parts, sum(len(p) for p in parts)


def _join_size(sep: str, items: Sequence[Any]) -> int:
    _, n = _total_len(items)
    return n + len(sep) * max(len(items) - 1, 0)


def _replace_size(s: str, old: str, new: str, count: int = -1) -> int:
    hits = s.count(old) if old else len(s) + 1
    if count is not None and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


# str methods that build a string whose size an argument chooses: method -> size of the result
_STR_METHODS: dict[str, Callable[..., int]] = {
    "ljust": lambda s, width, *a: max(len(s), int(width)),
    "rjust": lambda s, width, *a: max(len(s), int(width)),
    "center": lambda s, width, *a: max(len(s), int(width)),
    "zfill": lambda s, width: max(len(s), int(width)),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t") * max(int(tabsize), 0),
    "join": lambda s, items: _join_size(s, list(items) if not isinstance(items, (list, tuple)) else items),
    "replace": lambda s, old, new, count=-1: _replace_size(s, old, new, count),
}


def _bounded_filter(name: str, fn: Callable[..., Any], size: Callable[..., int]) -> Callable[..., Any]:
    """Jinja filter ``fn`` that charges ``size(*args)`` characters before it runs."""

    passes_context = hasattr(fn, "jinja_pass_arg")  # @pass_eval_context etc.: Jinja passes it first

    def filt(*args: Any, **kwargs: Any) -> Any:
        _charge(size(*(args[1:] if passes_context else args), **kwargs), f"filter '{name}'")
        return fn(*args, **kwargs)

    filt.__name__ = getattr(fn, "__name__", name)
    if passes_context:
        filt.jinja_pass_arg = fn.jinja_pass_arg  # type: ignore[attr-defined]
    return filt


def _filter_sizes() -> dict[str, Callable[..., int]]:
    def center(value: Any, width: int = 80) -> int:
        return max(len(str(value)), int(width))

    def indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> int:
        text = str(s)
        pad = len(width) if isinstance(width, str) else int(width)
        return len(text) + (text.count("\n") + 1) * max(pad, 0)

    def join(value: Any, d: str = "", attribute: Any = None) -> int:
        items = list(value) if not isinstance(value, (list, tuple)) else value
        return _join_size(str(d), items) if attribute is None else len(items) * 64

    def replace(s: Any, old: str, new: str, count: int | None = None) -> int:
        return _replace_size(str(s), str(old), str(new), -1 if count is None else count)

    def fmt(value: Any, *args: Any, **kwargs: Any) -> int:
        _check_printf(str(value))
        return len(str(value))

    return {"center": center, "indent": indent, "join": join, "replace": replace, "format": fmt}


def _make_environment(extensions: Sequence[Any]) -> Any:
    from jinja2 import TemplateError
    from jinja2.compiler import CodeGenerator
    from jinja2.nodes import Concat
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        """``a ~ b`` compiled to ``environment.bounded_concat((a, b))`` (sized before it is built)."""

        def visit_Concat(self, node: Concat, frame: Any) -> None:
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
            owner, name = getattr(target, "__self__", None), getattr(target, "__name__", None)
            if isinstance(owner, str) and name in ("format", "format_map"):
                _check_format_spec(owner)
            elif isinstance(owner, str) and name in _STR_METHODS:
                try:
                    size = _STR_METHODS[name](owner, *args, **kwargs)
                except (TypeError, ValueError):
                    size = 0  # bad arguments: the method raises its own error
                _charge(size, f"str.{name}")
            out = super().call(__context, __obj, *args, **kwargs)
            if isinstance(owner, str) and isinstance(out, str):
                _charge(len(out), f"str.{name}")
            return out

        @staticmethod
        def bounded_concat(items: Iterable[Any]) -> str:
            parts, n = _total_len(items)
            _charge(n, "'~'")
            return "".join(parts)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def bounded_range(*args: int) -> range:
        r = range(*args)
        if len(r) > MAX_RANGE_ITEMS:
            raise ChatTemplateBudgetError(f"chat template refused: range of {len(r)} items (limit {MAX_RANGE_ITEMS})")
        return r

    def bounded_join(pieces: Iterable[str]) -> str:  # the render's output
        out, n = [], 0
        for piece in pieces:
            n += len(piece)
            if n > MAX_TOTAL_CHARS:
                raise ChatTemplateBudgetError(f"chat template refused: output longer than {MAX_TOTAL_CHARS} characters")
            out.append(piece)
        return "".join(out)

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=["jinja2.ext.loopcontrols", *extensions])
    env.concat = bounded_join
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = bounded_range
    for name, size in _filter_sizes().items():
        env.filters[name] = _bounded_filter(name, env.filters[name], size)
    return env


class ChatTemplate:
    """A compiled chat template; :meth:`render` runs it under the module's limits."""

    def __init__(self, template: Any, source: str) -> None:
        self.template = template
        self.source = source

    def render(self, **variables: Any) -> str:
        """Render with ``variables`` (``messages``, ``add_generation_prompt``, ``bos_token``, ...).

        Raises:
            ChatTemplateBudgetError: past a step, time or size limit (the message names it).
            ChatTemplateError: the template raised (``raise_exception``, an undefined name, a
                type error, a recursion too deep): the message gives its reason.
        """
        budget = _Budget(MAX_RENDER_STEPS, MAX_RENDER_S)

        def trace_lines(frame: Any, event: str, arg: Any) -> Any:
            budget.tick()
            return trace_lines

        def trace(frame: Any, event: str, arg: Any) -> Any:  # every call (generator resumes included)
            budget.tick()
            # line events only in the template's own code: its loops; the Jinja runtime and filters
            # it calls are counted per call, which keeps the tracing cost per render small
            return trace_lines if frame.f_code.co_filename == "<template>" else None

        previous, outer = sys.gettrace(), _budget()
        _local.budget = budget
        sys.settrace(trace)
        try:
            out = self.template.render(**variables)
        except ChatTemplateBudgetError:
            raise
        except RecursionError:
            raise ChatTemplateBudgetError("chat template refused: recursion too deep") from None
        except Exception as exc:  # the template's own failure: any exception type user code can raise
            if budget.exceeded:
                raise ChatTemplateBudgetError(f"chat template refused: {budget.exceeded}") from None
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            sys.settrace(previous)
            _local.budget = outer
        if budget.exceeded:  # raised inside and swallowed by the template's runtime
            raise ChatTemplateBudgetError(f"chat template refused: {budget.exceeded}")
        return out


def compile_chat_template(source: str, *, extensions: Sequence[Any] = ()) -> ChatTemplate:
    """Compile ``source`` in the bounded sandbox (``extensions``: extra Jinja extensions).

    Raises:
        ChatTemplateError: a syntax error, or a constant expression past the limits (Jinja folds
            constants such as ``'a' * 10**9`` while compiling); the message gives the reason.
    """
    from jinja2 import TemplateError

    env = _make_environment(extensions)
    try:
        return ChatTemplate(env.from_string(source), source)
    except ChatTemplateError:
        raise
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from None
