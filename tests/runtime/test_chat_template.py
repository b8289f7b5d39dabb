"""Chat templates render under a step/time/size budget (edgevlm.runtime.chat_template): a template
that would hang or exhaust memory is refused with a reason, at load time or per request, and the
daemon's worker keeps answering (issue 11)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from edgevlm.errors import InvalidRequestError, ModelLoadError
from edgevlm.runtime.chat_template import ChatTemplateBudgetError, ChatTemplateError, compile_chat_template
from edgevlm.runtime.testing import CHAT_TEMPLATE, write_tiny_checkpoint

MESSAGES = [{"role": "user", "content": "hi"}]

# The template: 10^10 empty iterations (hours), then variants that stay inside every
# single limit but not inside the step or time budget, and single C-level operations.
REFUSED = {
    "issue": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
              "range of 100000 items"),
    "nested loops": ("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}",
                     "more than 1000000 steps"),
    "nested loops over strings": ("{% for i in 'x' * 5000 %}{% for j in 'y' * 5000 %}{% endfor %}{% endfor %}",
                                  "more than 1000000 steps"),
    "string multiplication": ("{{ 'a' * 10**9 }}", r"'\*' would build 1000000000 characters"),
    "list multiplication": ("{{ ([0] * 10**8)|length }}", r"'\*' would build 100000000 characters/items"),
    "power": ("{{ 10 ** 100000000 }}", r"'\*\*' would build an integer"),
    "doubling concatenation": ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                               "{% endfor %}{{ ns.s }}", "'~' would build 1048576 characters"),
    "doubling addition": ("{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                          "{% endfor %}", r"'\+' would build 1048576"),
    "infinite recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion too deep"),
    "exponential recursion": ("{% macro f(n) %}{% if n < 40 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}{% endmacro %}"
                              "{{ f(0) }}", "more than 1000000 steps|took more than"),
    "str.ljust": ("{{ 'a'.ljust(10**9) }}", "str.ljust would build 1000000000"),
    "str.format width": ("{{ '{:>999999999}'.format(1) }}", "7-digit width"),
    "printf width": ("{{ '%999999999d' % 1 }}", "'%' format"),
    "center filter": ("{{ 'a'|center(1000000000) }}", "filter 'center' would build"),
    "join filter": ("{{ (['x' * 100000] * 1000)|join }}", "filter 'join' would build 100000000"),
    "replace filter": ("{{ ('a' * 100000)|replace('a', 'b' * 1000) }}", "filter 'replace' would build"),
    "output size": ("{% for i in range(10000) %}{{ 'x' * 1000 }}{% endfor %}", "more than 4000000 characters"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unbounded_templates_are_refused_quickly(case):
    source, reason = REFUSED[case]
    template = compile_chat_template(source)
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateBudgetError, match=reason) as info:
        template.render(messages=MESSAGES)
    assert time.perf_counter() - t0 < 3.0
    assert isinstance(info.value, InvalidRequestError)  # INVALID_REQUEST on the wire


def test_real_templates_render_as_before():
    template = compile_chat_template(CHAT_TEMPLATE)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    assert template.render(messages=msgs, add_generation_prompt=True) == "USER: <image>\nwhat is it? ASSISTANT:"
    # legitimate uses of the checked operations still work
    ok = compile_chat_template("{{ '-' * 3 }}{{ 2 ** 10 }}{{ 'ab'|center(6) }}{{ [1, 2]|join(',') }}"
                               "{{ '{:>4}'.format(7) }}{{ '%03d' % 5 }}{{ 'x' ~ 1 }}{{ 'a b'|replace(' ', '_') }}"
                               "{% for i in range(3) %}{{ i }}{% endfor %}{{ 'z'.rjust(3) }}")
    assert ok.render() == "---1024  ab  1,2   7005x1a_b012  z"


def test_template_errors_are_request_errors_with_the_reason():
    template = compile_chat_template("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render(messages=MESSAGES)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        compile_chat_template("{% for %}")


def test_sandbox_still_blocks_internals():
    template = compile_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="SecurityError|UndefinedError|unsafe"):
        template.render()


def test_a_tracer_already_installed_is_restored():
    import sys

    def tracer(frame, event, arg):
        return None

    sys.settrace(tracer)
    try:
        compile_chat_template("{{ 1 }}").render()
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def test_template_that_hangs_on_every_prompt_is_a_load_error(tmp_path):
    from edgevlm.runtime import Engine

    spin = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}" + CHAT_TEMPLATE
    model = write_tiny_checkpoint(tmp_path / "m", chat_template=spin)
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError, match="chat template refused: more than 1000000 steps"):
        Engine.load(model)
    assert time.perf_counter() - t0 < 10.0


# the hang, behind a prompt word: the probe at load time never says "spin"
TRIGGERED = (
    "{% for m in messages %}{% for item in m['content'] %}"
    "{% if item['type'] == 'text' and 'spin' in item['text'] %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% endif %}{% endfor %}{% endfor %}" + CHAT_TEMPLATE
)
SLOW = TRIGGERED.replace("range(100000)", "range(3000)")  # inside the range cap: the step budget stops it


def test_engine_answers_invalid_request_and_goes_on(tmp_path):
    from edgevlm.runtime import Engine

    engine = Engine.load(write_tiny_checkpoint(tmp_path / "m", chat_template=SLOW))
    image = np.zeros((32, 32, 3), np.uint8)
    with pytest.raises(InvalidRequestError, match="chat template refused"):
        engine.ask(image, "spin please", max_new_tokens=2)
    assert engine.ask(image, "how many?", max_new_tokens=2).stats.new_tokens >= 1


def test_daemon_worker_lives_on_after_a_hanging_template(start_daemon, mosquitto, tmp_path):
    """Through the real daemon and broker: the request that triggers the template is answered
    INVALID_REQUEST within its deadline, and the next request is answered."""
    from edgevlm import Client
    from edgevlm.runtime import Engine

    image = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    for source in (TRIGGERED, SLOW):
        engine = Engine.load(write_tiny_checkpoint(tmp_path / str(len(source)), chat_template=source))
        daemon = start_daemon(engine=engine, device_id=f"dev{len(source)}")
        with Client(mosquitto.host, mosquitto.port, device_id=f"dev{len(source)}") as client:
            assert client.wait_online(timeout_s=10)
            t0 = time.monotonic()
            with pytest.raises(InvalidRequestError, match="chat template refused"):
                client.ask("spin the wheel", image=image, timeout_s=20)
            assert time.monotonic() - t0 < 10
            answer = client.ask("how many shapes are there?", image=image, timeout_s=20)
            assert answer.text == engine.ask(image, "how many shapes are there?", max_new_tokens=4).text
        daemon.stop()
