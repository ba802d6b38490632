"""Tool calls of ``/v1/chat/completions``: a request's ``tools`` and ``tool_choice`` read and
bounded, the grammar a required or named choice is held to, and the model's text parsed back
into OpenAI's ``tool_calls``.

As vLLM serves them: ``tool_choice`` ``"none"`` generates text; a named function is held to
that function's parameters schema (the text is its ``arguments``); ``"required"`` to a JSON
list of ``{"name", "parameters"}`` objects, one of the functions each (both through the
structured-output path, :mod:`kvdrop_engine.structured`); ``"auto"`` (the default when tools
are given) leaves the model free and parses its output in the Hermes / Qwen format,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (a JSON list inside the tags, as
SmolLM2 writes them, is read too). The tools are given to the chat template as
``tools=[{"type": "function", "function": {...}}, ...]``, as transformers gives them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvdrop_engine.request_fields import BadRequestError
from kvdrop_engine.structured import Guide

__all__ = ["MAX_TOOLS", "ToolCall", "Tools", "parse_tool_calls", "parse_tools"]

#: Most tools per request, and the longest name.
MAX_TOOLS = 128
MAX_NAME_CHARS = 64
_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class Tools:
    """A request's tools (each ``{"name", "description", "parameters"}``) and its choice:
    ``"none"``, ``"auto"``, ``"required"`` or ``"named"`` (then ``name`` says which)."""

    functions: tuple[dict[str, Any], ...]
    choice: str
    name: str | None = None
    parallel: bool = True

    def template(self) -> list[dict[str, Any]]:
        """The tools as chat templates read them."""
        return [{"type": "function", "function": dict(f)} for f in self.functions]

    def guide(self) -> Guide | None:
        """The grammar a required or named choice is held to (None: the model is free)."""
        if self.choice == "named":
            function = next(f for f in self.functions if f["name"] == self.name)
            return Guide("json", json.dumps(function["parameters"]))
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "parameters": f["parameters"]},
                "required": ["name", "parameters"],
            }
            for f in self.functions
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return Guide("json", json.dumps(schema))

    @property
    def finish(self) -> str:
        """The finish reason of a choice that called tools (OpenAI's: "stop" for a named one)."""
        return "stop" if self.choice == "named" else "tool_calls"


@dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI's ``tool_calls[]`` lists it (``arguments`` is JSON text)."""

    name: str
    arguments: str
    id: str = ""

    def to_dict(self) -> dict[str, Any]:
        call_id = self.id or f"call_{uuid.uuid4().hex[:24]}"
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": call_id, "type": "function", "function": function}


def _function(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise BadRequestError(
            f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools"
        )
    function = tool.get("function")
    if not isinstance(function, Mapping) or set(function) - {
        "name", "description", "parameters", "strict"
    }:  # fmt: skip
        raise BadRequestError(
            f"{where}.function must hold 'name' and optionally 'description', 'parameters', "
            "'strict'",
            param="tools",
        )
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name) or len(name) > MAX_NAME_CHARS:
        raise BadRequestError(
            f"{where}.function.name must be 1 to {MAX_NAME_CHARS} letters, digits, '_', '.', "
            "':' or '-'",
            param="tools",
        )
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise BadRequestError(f"{where}.function.parameters must be a JSON schema", param="tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise BadRequestError(f"{where}.function.description must be a string", param="tools")
    out: dict[str, Any] = {"name": name, "parameters": dict(parameters)}
    if description:
        out["description"] = description
    return out


def _choice(value: Any, names: list[str]) -> tuple[str, str | None]:
    if value in ("none", "auto", "required"):
        return str(value), None
    if isinstance(value, Mapping) and value.get("type") == "function":
        name = (value.get("function") or {}).get("name")
        if name in names:
            return "named", str(name)
        raise BadRequestError(
            f"'tool_choice' names {name!r}, which is not among the tools ({', '.join(names)})",
            param="tool_choice",
        )
    raise BadRequestError(
        "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', "
        "'function': {'name': ...}}",
        param="tool_choice",
    )


def parse_tools(body: Mapping[str, Any]) -> Tools | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body (None: no tools,
    or ``tool_choice`` ``"none"`` with none); a 400 naming the field for a malformed one."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequestError(
            "'parallel_tool_calls' must be true or false", param="parallel_tool_calls"
        )
    if not tools:
        if choice not in (None, "none"):
            raise BadRequestError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequestError(f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    functions = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise BadRequestError("'tools' names a function twice", param="tools")
    kind, name = _choice("auto" if choice is None else choice, names)
    return Tools(functions, kind, name, parallel is not False)


def _calls_in(value: Any) -> list[ToolCall] | None:
    """``{"name", "arguments"|"parameters"}`` objects (one, or a list) as calls; None when
    ``value`` is not that."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append(ToolCall(item["name"], json.dumps(arguments)))
    return calls


def parse_tool_calls(tools: Tools, text: str) -> tuple[str | None, list[ToolCall]]:
    """The content and the calls of a choice's ``text``: for a named choice the text is the
    arguments; for ``"required"`` a JSON list of calls; for ``"auto"`` the Hermes/Qwen tagged
    calls (text that does not parse as calls stays content)."""
    if tools.choice == "named":
        assert tools.name is not None
        return None, [ToolCall(tools.name, text)]
    if tools.choice == "required":
        try:
            calls = _calls_in(json.loads(text))
        except json.JSONDecodeError:
            calls = None
        return (None, calls) if calls else (text, [])
    if tools.choice != "auto" or "<tool_call>" not in text:
        return text, []
    calls: list[ToolCall] = []
    for block in _TAGGED.findall(text):
        try:
            found = _calls_in(json.loads(block))
        except json.JSONDecodeError:
            found = None
        if found is None:
            return text, []
        calls.extend(found)
    if not tools.parallel:
        calls = calls[:1]
    content = text.split("<tool_call>", 1)[0].strip()
    return content or None, calls
