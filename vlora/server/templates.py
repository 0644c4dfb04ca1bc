"""Chat templates: the server's default (``--chat-template FILE``), checked at start, and what a request may change.

A template is compiled as transformers compiles it (a sandboxed Jinja environment with its extensions and
globals), so one that parses here parses when a request renders it.
"""

from __future__ import annotations

import inspect
import os

from vlora.config import ConfigError

# variables a request's chat_template_kwargs may not set: apply_chat_template's own parameters (they are not
# template variables) and the ones the server sets itself; the rest reach the template as variables
_OWN = {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
_TOP_LEVEL = {"chat_template", "add_generation_prompt", "continue_final_message"}     # request fields themselves


def _parameters() -> set[str]:
    try:
        from transformers import PreTrainedTokenizerBase

        params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
        return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    except (ImportError, AttributeError, TypeError, ValueError):
        return set()


RESERVED_KWARGS = frozenset(_OWN | _parameters())


def reserved_kwarg(kwargs: dict | None) -> tuple[str, str] | None:
    """(field, message) for the first key of ``chat_template_kwargs`` a request may not set, else None."""
    for key in kwargs or ():
        if key in RESERVED_KWARGS:
            hint = " (send it as a field of the request)" if key in _TOP_LEVEL else ""
            return "chat_template_kwargs", f"chat_template_kwargs may not set {key!r}{hint}"
    return None


def compile_template(text: str):
    """``text`` compiled as transformers compiles chat templates; raises jinja2.TemplateError if it does not parse."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:         # another transformers layout: a sandboxed environment as transformers uses
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                             extensions=[loopcontrols]).from_string(text)
    return _compile_jinja_template(text)


def describe(exc: Exception) -> str:
    """A template error in a line: the Jinja message, and the line for a syntax error."""
    import jinja2

    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    if isinstance(exc, jinja2.TemplateSyntaxError) and exc.lineno:
        return f"line {exc.lineno}: {message}"
    return message


def load_chat_template(path: str) -> str:
    """The text of the template file ``path`` (``--chat-template``), or ConfigError: missing, unreadable, not
    UTF-8, empty, or not a template that parses."""
    import jinja2

    if not os.path.isfile(path):
        raise ConfigError(f"--chat-template {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path}: cannot be read ({e})") from None
    if not text.strip():
        raise ConfigError(f"--chat-template {path}: the file is empty")
    try:
        compile_template(text)
    except jinja2.TemplateError as e:
        raise ConfigError(f"--chat-template {path}: not a valid Jinja template ({describe(e)})") from None
    return text
