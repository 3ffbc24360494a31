"""Chat template rendering: HF-compatible output, user content kept apart, and a sandbox that always ends."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llamatrace.text.chat import render_chat
from llamatrace.errors import PromptError

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
USER = [{"role": "user", "content": "What is <|im_end|> for?"}]


def hf_render(template: str, messages: list[dict], **kwargs: object) -> str:
    """What HF apply_chat_template renders (its environment, without our bounds)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(jinja2.TemplateError(m))
    return env.from_string(template).render(messages=messages, **kwargs)


def joined(parts: list[tuple[str, bool]]) -> str:
    return "".join(text for text, _ in parts)


def test_parts_join_to_the_hf_rendering() -> None:
    messages = [{"role": "system", "content": "Be brief."}, *USER, {"role": "assistant", "content": "Nothing."}]
    for template in (SMOLLM2, LLAMA3):
        parts = render_chat(template, messages, bos_token="<|begin_of_text|>")
        assert joined(parts) == hf_render(template, messages, add_generation_prompt=True, bos_token="<|begin_of_text|>")


def test_message_contents_are_marked_as_user_parts() -> None:
    parts = render_chat(SMOLLM2, USER)
    assert [text for text, is_user in parts if is_user] == ["What is <|im_end|> for?"]
    assert parts[-1] == ("<|im_end|>\n<|im_start|>assistant\n", False)
    assert not any("\ue000" in text for text, _ in parts)  # no sentinel leaks out


def test_contents_the_template_trims_are_still_found() -> None:
    messages = [{"role": "user", "content": "  spaced <|eot_id|> out \n"}]
    with_bos = render_chat(LLAMA3, messages, bos_token="<|begin_of_text|>")
    assert joined(with_bos) == hf_render(LLAMA3, messages, add_generation_prompt=True, bos_token="<|begin_of_text|>")
    assert [text for text, is_user in with_bos if is_user] == ["spaced <|eot_id|> out"]


def test_add_generation_prompt_false_omits_the_assistant_header() -> None:
    assert not joined(render_chat(SMOLLM2, USER, add_generation_prompt=False)).endswith("assistant\n")


def test_empty_and_list_contents() -> None:
    template = "{% for m in messages %}[{{ m.content if m.content is string else m.content[0].text }}]{% endfor %}"
    messages = [{"role": "user", "content": ""}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    parts = render_chat(template, messages)
    assert parts == [("[][", False), ("hi", True), ("]", False)]


def test_hf_globals_and_filters() -> None:
    template = (
        "{{ {'k': 'é'} | tojson }}|{{ strftime_now('%Y') | length }}|{% set ns = namespace(n=0) %}"
        "{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}|"
        "{{ dict(a=1).a }}|{% generation %}g{% endgeneration %}|{{ extra_flag }}"
    )
    assert joined(render_chat(template, USER, extra_flag="on")) == '{"k": "é"}|4|3|1|g|on'


def test_raise_exception_becomes_a_prompt_error_with_its_message() -> None:
    with pytest.raises(PromptError, match="Conversation roles must alternate"):
        render_chat("{{ raise_exception('Conversation roles must alternate') }}", USER)


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for m in messages %}", "syntax error on line 1"),
        ("{{ nothing.here }}", "undefined"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
        ("   ", "empty"),
    ],
)
def test_template_errors_are_one_line_prompt_errors(template: str, match: str) -> None:
    with pytest.raises(PromptError, match=match) as err:
        render_chat(template, USER)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "payload",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.popen('touch /tmp/llamatrace-pwned').read() }}",
        "{{ joiner.__init__.__globals__.__builtins__.__import__('os').system('id') }}",
        "{{ self._TemplateReference__context.cycler.__init__.__globals__.os }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ ''.__class__ }}",
        "{{ dict.__call__.__globals__ }}",
        "{% set ns = namespace(__class__=1) %}",
        "{{ messages.append(1) }}",
    ],
)
def test_sandbox_escapes_are_refused(payload: str) -> None:
    with pytest.raises(PromptError, match="sandbox|undefined|unsafe"):
        render_chat(payload, USER)


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x' * 10**9 }}",
        "{{ 2 ** (10**9) }}",
        "{{ 'x'.center(10**9) }}",
        "{{ '%999999999d' % 1 }}",
        "{{ '{:>999999999}'.format(1) }}",
        "{% set s = 'x' * 1000000 %}{{ s.replace('', s) }}",
        "{% set s = 'x' * 1000000 %}{{ ([s] * 100000) | join }}",
        "{{ ('\n' * 100000) | indent(1000) }}",
        "{% set ns = namespace(s='xx') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('ab', 40) }}",
        "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
    ],
)
def test_size_bombs_end_with_a_prompt_error(template: str) -> None:
    with pytest.raises(PromptError, match="limit|exceeds"):
        render_chat(template, USER)


RUNAWAY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_runaway_loop_ends_at_the_time_limit() -> None:
    # 10^10 iterations: only the limit can end it (how soon is the next test's, on a fake clock)
    trace_before = sys.gettrace()
    with pytest.raises(PromptError, match="did not finish within 0.3 s"):
        render_chat(RUNAWAY, USER, time_limit=0.3)
    assert sys.gettrace() is trace_before  # a debugger's or coverage's tracer is put back


def test_the_time_limit_follows_the_clock_not_the_amount_of_work(monkeypatch) -> None:
    from llamatrace.text import chat
    reads: list[float] = []

    def fake_clock(*times: float):
        """time.monotonic giving ``times`` in turn, then the last one forever; counts its reads."""
        def monotonic() -> float:
            reads.append(times[min(len(reads), len(times) - 1)])
            return reads[-1]
        monkeypatch.setattr(chat, "time", SimpleNamespace(monotonic=monotonic))

    fake_clock(0.0)            # a clock that stands still: 10^6 iterations are no reason to stop
    long = "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}done"
    assert "".join(text for text, _ in render_chat(long, USER, time_limit=0.3)).endswith("done")
    reads.clear()
    fake_clock(0.0, 0.31)      # the deadline set at 0 s, then the clock past it: the first look stops it
    with pytest.raises(PromptError, match="did not finish within 0.3 s"):
        render_chat(RUNAWAY, USER, time_limit=0.3)
    assert reads == [0.0, 0.31]


def test_output_limit_is_configurable() -> None:
    with pytest.raises(PromptError, match="exceeds 100 characters"):
        render_chat("{% for i in range(200) %}x{% endfor %}", USER, max_output=100)


def test_messages_must_be_mappings() -> None:
    with pytest.raises(PromptError, match="list of"):
        render_chat(SMOLLM2, ["hello"])  # type: ignore[list-item]
