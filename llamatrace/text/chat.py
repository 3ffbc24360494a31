"""Chat messages → prompt text through the model's Jinja chat template, in a bounded sandbox.

The template comes from the model file, so it is untrusted code. We render it the way Hugging Face
``apply_chat_template`` does (``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)``
with HF's ``raise_exception``, ``strftime_now``, ``tojson``, ``dict`` and ``namespace``) and add the
bounds HF leaves out: render time, output size, and the size of any one string, list or number the
template builds. Every failure becomes a one-line :class:`PromptError`.

``render_chat`` returns the prompt as parts ``(text, is_user_content)`` so the tokenizer can let
the template's own text produce control tokens while message contents stay plain text: a user who
types "<|im_end|>" must not end their own turn.
"""

from __future__ import annotations

import json
import re
import secrets
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from llamatrace.errors import PromptError

MAX_OUTPUT_CHARS = 1_000_000  # rendered prompt, and any single string or list the template builds
MAX_TEMPLATE_CHARS = 1_000_000
TIME_LIMIT_S = 2.0
_MAX_INT_BITS = 4096  # numbers the template computes (10**1233 fits; 2**10**9 does not)
_MAX_FORMAT_WIDTH = 10_000  # '%99999999d' % 1, '{:>99999999}'.format(1)
_WIDE_FORMAT = re.compile(r"\d{%d,}" % (len(str(_MAX_FORMAT_WIDTH)) + 1))


class _RenderTimeout(BaseException):
    """Raised inside the template's frames at the deadline (BaseException: no `except Exception` swallows it)."""


def _too_big(what: str) -> SecurityError:
    return SecurityError(f"{what} exceeds the chat template size limit of {MAX_OUTPUT_CHARS}")


def _check_size(value: Any) -> Any:
    """A value the template built: strings and containers are bounded, integers too."""
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > MAX_OUTPUT_CHARS:
        unit = "characters" if isinstance(value, str) else "items"
        raise _too_big(f"a {type(value).__name__} of {len(value)} {unit}")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _MAX_INT_BITS:
        raise SecurityError(f"a number of {value.bit_length()} bits exceeds the chat template limit")
    return value


def _check_format_string(fmt: Any) -> None:
    if isinstance(fmt, str) and _WIDE_FORMAT.search(fmt):
        raise SecurityError(f"a format width above the chat template limit of {_MAX_FORMAT_WIDTH}")


def _estimate_call(func: Any, args: tuple, kwargs: dict) -> None:
    """Reject calls whose result would be huge *before* they allocate it (``'x'.center(10**9)``)."""
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", "")
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_OUTPUT_CHARS:
            raise _too_big(f"argument {value} to {name}()")
        _check_size(value)  # a macro called with a doubled string, f(s ~ s)
    if isinstance(owner, str):
        if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            count = owner.count(args[0]) if args[0] else len(owner) + 1
            if len(owner) + count * (len(args[1]) - len(args[0])) > MAX_OUTPUT_CHARS:
                raise _too_big("str.replace() result")
        elif name == "join" and args and isinstance(args[0], (list, tuple)):
            total = sum(len(x) for x in args[0] if isinstance(x, str)) + len(owner) * len(args[0])
            if total > MAX_OUTPUT_CHARS:
                raise _too_big("str.join() result")
        elif name == "expandtabs":
            size = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(size, int) and len(owner) + owner.count("\t") * size > MAX_OUTPUT_CHARS:
                raise _too_big("str.expandtabs() result")


def _guard_filter(name: str, func: Callable) -> Callable:
    """Wrap a built-in filter with the same size estimates (filters bypass the sandbox's ``call``)."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        passed = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)  # pass_context & co
        values = [a for a in args if not isinstance(a, passed)]
        value, rest = (values[0], values[1:]) if values else (None, [])
        if name == "join" and isinstance(value, (list, tuple)):
            sep = rest[0] if rest and isinstance(rest[0], str) else kwargs.get("d", "")
            total = sum(len(str(x)) for x in value) + len(sep) * len(value)
            if total > MAX_OUTPUT_CHARS:
                raise _too_big("join result")
        elif name == "replace" and isinstance(value, str) and len(rest) >= 2:
            _estimate_call(value.replace, tuple(str(x) for x in rest[:2]), {})
        elif name == "indent" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 4)
            width = len(width) if isinstance(width, str) else width
            if isinstance(width, int) and len(value) + (value.count("\n") + 1) * width > MAX_OUTPUT_CHARS:
                raise _too_big("indent result")
        elif name == "format" and isinstance(value, str):
            _check_format_string(value)
        for v in (*rest, *kwargs.values()):
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_OUTPUT_CHARS:
                raise _too_big(f"argument {v} to the {name} filter")
        return _check_size(func(*args, **kwargs))

    if hasattr(func, "jinja_pass_arg"):  # keep jinja's pass_context / pass_eval_context / pass_environment
        guarded.jinja_pass_arg = func.jinja_pass_arg  # type: ignore[attr-defined]
    return guarded


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """HF's sandbox plus size checks on every call, filter and amplifying operator."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT_CHARS:
                    raise _too_big(f"{type(seq).__name__} repetition")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if max(abs(left).bit_length(), 1) * right > _MAX_INT_BITS:
                raise SecurityError(f"{left} ** {right} exceeds the chat template number limit")
        elif operator == "%" and isinstance(left, str):
            _check_format_string(left)
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _estimate_call(__obj, args, kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None
        _check_format_string(getattr(value, "__self__", None))
        return lambda *args, **kwargs: _check_size(fmt(*args, **kwargs))

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # HF returns an Undefined that fails only when used; we fail at once, naming the attribute
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (HF's AssistantTracker tag): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """HF's ``dict`` global: builds dicts, exposes no attribute of the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """HF's ``namespace``: refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        _check_size(value)  # {% set ns.s = ns.s ~ ns.s %} in a loop doubles a string each time
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes ({name!r})")


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # HF's version: no HTML escaping, and the json.dumps options exposed
    if isinstance(indent, int) and indent > 100:
        raise SecurityError("tojson indent above 100 is not allowed in chat templates")
    return _check_size(
        json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    )


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = _ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Interrupt Python code running in this thread after ``seconds`` (a trace function checks the clock).

    Jinja compiles a template to Python, so every loop iteration of the template raises trace
    events. The previous trace function (a debugger, coverage) is restored afterwards.
    """
    end = time.monotonic() + seconds
    events = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal events
        events += 1
        if events & 0xFF == 0 and time.monotonic() > end:
            raise _RenderTimeout
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


def _plain(value: Any) -> Any:
    """Only plain JSON-like data reaches the template (HF's ``_plain_template_data``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _render(template: str, variables: dict[str, Any], time_limit: float, max_output: int) -> str:
    """Render once within the bounds; every failure becomes a one-line PromptError."""
    try:
        with _deadline(time_limit):
            compiled = _compile(template)
            out: list[str] = []
            size = 0
            for chunk in compiled.generate(**variables):
                size += len(chunk)
                if size > max_output:
                    raise PromptError(f"chat template output exceeds {max_output} characters")
                out.append(chunk)
        return "".join(out)
    except PromptError:
        raise
    except _RenderTimeout:
        raise PromptError(f"chat template did not finish within {time_limit:g} s (a runaway loop?)") from None
    except jinja2.TemplateSyntaxError as err:
        raise PromptError(f"chat template syntax error on line {err.lineno}: {err.message}") from None
    except SecurityError as err:
        raise PromptError(f"chat template refused by the sandbox: {_one_line(err)}") from None
    except jinja2.UndefinedError as err:
        raise PromptError(f"chat template uses an undefined value: {_one_line(err)}") from None
    except jinja2.TemplateError as err:  # raise_exception('...') in the template
        raise PromptError(f"chat template error: {_one_line(err)}") from None
    except RecursionError:
        raise PromptError("chat template recursed too deeply") from None
    except Exception as err:  # TypeError, OverflowError (range too big), ZeroDivisionError, ...
        raise PromptError(f"chat template failed: {type(err).__name__}: {_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def render_chat(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    *,
    time_limit: float = TIME_LIMIT_S,
    max_output: int = MAX_OUTPUT_CHARS,
    **extra: Any,
) -> list[tuple[str, bool]]:
    """Render ``messages`` with a chat template → ``[(text, is_user_content), ...]`` in prompt order.

    Each message content is replaced by a unique sentinel, the template is rendered, and the result
    is split at the sentinels: the pieces between them are template text, the sentinels become the
    contents again. A second, plain render checks the template did not transform a content (trim,
    split, escape); where it did, contents are located in the plain render instead, and text that
    cannot be located is template text (with a warning).
    """
    if not isinstance(template, str) or not template.strip():
        raise PromptError("the chat template is empty; use --raw to send the prompt as is")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise PromptError(f"the chat template has {len(template)} characters; the limit is {MAX_TEMPLATE_CHARS}")
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise PromptError("chat messages must be a list of {'role': ..., 'content': ...} mappings")

    now = datetime.now()  # one clock for both renders
    common = {
        "add_generation_prompt": add_generation_prompt, "bos_token": bos_token, "eos_token": eos_token,
        "tools": None, "documents": None, "strftime_now": lambda fmt: now.strftime(str(fmt)),
    }  # fmt: skip
    common.update(_plain(extra))
    plain_messages = _plain(list(messages))
    real = _render(template, {**common, "messages": plain_messages}, time_limit, max_output)

    # the same messages with every content (and every text block of a list content) as a sentinel
    nonce = secrets.token_hex(6)
    contents: list[str] = []

    def sentinel(text: str) -> str:
        contents.append(text)
        return f"\ue000{nonce}:{len(contents) - 1}\ue001"

    marked = []
    for message in plain_messages:
        message = dict(message)
        content = message.get("content")
        if isinstance(content, str) and content:
            message["content"] = sentinel(content)
        elif isinstance(content, list):
            message["content"] = [
                {**block, "text": sentinel(block["text"])}
                if isinstance(block, dict) and isinstance(block.get("text"), str) and block["text"]
                else block
                for block in content
            ]
        marked.append(message)
    if not contents:
        return [(real, False)] if real else []
    rendered = _render(template, {**common, "messages": marked}, time_limit, max_output)

    parts: list[tuple[str, bool]] = []
    for k, piece in enumerate(re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)):
        parts.append((contents[int(piece)], True) if k % 2 else (piece, False))
    if "".join(text for text, _ in parts) != real:
        parts = _locate_contents(real, contents)
    return _merge(parts)


def _locate_contents(real: str, contents: list[str]) -> list[tuple[str, bool]]:
    """Fallback when the template changed contents: find each (or its stripped form) in order."""
    parts: list[tuple[str, bool]] = []
    cursor = 0
    lost = 0
    for content in contents:
        for candidate in (content, content.strip()):
            at = real.find(candidate, cursor) if candidate else -1
            if at >= 0:
                parts += [(real[cursor:at], False), (candidate, True)]
                cursor = at + len(candidate)
                break
        else:
            lost += 1
    parts.append((real[cursor:], False))
    if lost:
        warnings.warn(
            f"the chat template rewrites {lost} message content(s); their text is tokenized as template text",
            stacklevel=3,
        )
    return parts


def _merge(parts: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    merged: list[tuple[str, bool]] = []
    for text, is_user in parts:
        if not text:
            continue
        if merged and merged[-1][1] == is_user:
            merged[-1] = (merged[-1][0] + text, is_user)
        else:
            merged.append((text, is_user))
    return merged
