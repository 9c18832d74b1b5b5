"""A grammar (llguidance's Lark dialect) for a forced DSV4 tool-call block (DSV4_FACTS section 6).

``tool_choice: "required"`` or a named function makes the answer exactly one tool-call block:

    "\\n\\n<｜DSML｜tool_calls>\\n" (invoke "\\n")+ "</｜DSML｜tool_calls>"
    invoke    = '<｜DSML｜invoke name="NAME">\\n' (parameter "\\n")* "</｜DSML｜invoke>"
    parameter = '<｜DSML｜parameter name="KEY" string="true|false">' VALUE "</｜DSML｜parameter>"

which :mod:`dsv4.text.chat_parse` reads back. ``｜DSML｜`` is a special token, so the grammar names it
by id (``<[id]>``); ordinary text can never produce it. Each tool's parameters follow its JSON schema:
the schema's properties in order, the required ones always, the others optional; no other keys. A
property whose values are a fixed set of strings (``enum``, ``const``) is written raw
(``string="true"``); every other value is JSON (``string="false"``) matching its sub-schema, strings
included: a JSON string ends at an unescaped quote, so the grammar knows where it ends whatever it
holds (raw text would have to end at ``</``, which code in an argument may contain), the parser
reads it back as the same string, and it keeps every string keyword (``pattern``, ``maxLength``).
"""

from __future__ import annotations

import json
from typing import Any

from .markup import DSML



class ToolGrammarError(ValueError):
    """A tool's schema cannot be turned into a grammar (the message names the tool and key)."""


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _raw_values(schema: Any) -> list[str] | None:
    """The values of a property that is a fixed set of strings (written raw), else None."""
    if not isinstance(schema, dict):
        return None
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return values if values and all(isinstance(v, str) and "<" not in v for v in values) else None


def _param_rule(tool: str, key: str, schema: Any, d: str) -> str:
    """The Lark expression of one parameter (tag, value, closing tag)."""
    if '"' in key or "<" in key:
        raise ToolGrammarError(f"tools: {tool}.parameters.properties: key {key!r} cannot be written in the markup")
    values = _raw_values(schema)
    if values is not None:
        head = f'"<" {d} ' + _lit(f'parameter name="{key}" string="true">')
        choices = " | ".join(_lit(v) for v in values)
        return f'{head} ({choices}) "</" {d} "parameter>\\n"'
    sub = schema if isinstance(schema, dict) else {}
    head = f'"<" {d} ' + _lit(f'parameter name="{key}" string="false">')
    return f'{head} %json{json.dumps(sub, ensure_ascii=False)} "</" {d} "parameter>\\n"'


def shortest_block(tools: list[dict], name: str | None = None) -> str:
    """The markup of the longest of the shortest one-call blocks (required parameters only, each
    valued ``0``): about what a grammar must keep in reserve to close a block from anywhere."""
    best = ""
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {}
        body = "".join(f'<{DSML}parameter name="{k}" string="false">0</{DSML}parameter>\n'
                       for k in params.get("required") or [])
        block = f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="{fn["name"]}">\n{body}</{DSML}invoke>\n</{DSML}tool_calls>'
        best = max(best, block, key=len)
    return best


def tool_calls_grammar(tools: list[dict], dsml_id: int, *, name: str | None = None, parallel: bool = True) -> str:
    """The grammar of a tool-call block calling ``name`` (or any of ``tools``); one call unless
    ``parallel``. ``tools`` are OpenAI tool dicts (``{"type": "function", "function": {...}}``)."""
    d = f"<[{dsml_id}]>"
    rules, invokes = [], []
    for k, tool in enumerate(tools):
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        if not isinstance(props, dict):
            raise ToolGrammarError(f"tools: {fn['name']}.parameters.properties must be an object")
        required = set(params.get("required") or [])
        body = []
        for j, (key, sub) in enumerate(props.items()):
            rules.append(f"p{k}_{j}: {_param_rule(fn['name'], key, sub, d)}")
            body.append(f"p{k}_{j}" + ("" if key in required else "?"))
        missing = required - set(props)
        if missing:
            raise ToolGrammarError(f"tools: {fn['name']}.parameters.required names {sorted(missing)}, which are not "
                                   "in its properties")
        open_tag = _lit(f'invoke name="{fn["name"]}">\n')
        rules.append(f'invoke{k}: "<" {d} {open_tag} {" ".join(body)} "</" {d} "invoke>\\n"')
        invokes.append(f"invoke{k}")
    if not invokes:
        raise ToolGrammarError(f"tool_choice: no tool named {name!r} in tools")
    calls = f"({' | '.join(invokes)})" + ("+" if parallel else "")
    head = f'"\\n\\n<" {d} "tool_calls>\\n"'
    return "\n".join([f'start: {head} {calls} "</" {d} "tool_calls>"', *rules])


__all__ = ["ToolGrammarError", "shortest_block", "tool_calls_grammar"]
