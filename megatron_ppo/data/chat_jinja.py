"""jinja2 as `transformers` sets it up for chat templates (`chat.ChatTemplate`'s engine, imported with the first
template): `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the loop-controls extension and
`{% generation %}` blocks, a `tojson` filter that does not escape HTML, the globals `raise_exception` and
`strftime_now`."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# What a template raises when it refuses the messages (its `raise_exception`, or any other jinja2 error in rendering)
REFUSAL = jinja2.TemplateError


def compile_template(source: str, origin: str) -> jinja2.Template:
    """The compiled template; a `ValueError` naming `origin` when the source is not valid Jinja."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{origin}: the chat_template is not valid Jinja ({e.message}, line {e.lineno})") from e


class _GenerationBlocks(Extension):
    """Parses `{% generation %}...{% endgeneration %}` (which marks assistant text for training masks in some
    templates) and renders its body unchanged, as `transformers` does when no mask is asked for."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's Extension API: a class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
