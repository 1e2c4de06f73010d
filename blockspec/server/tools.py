"""Tool calls in chat completions, as OpenAI's API and vLLM shape them.

- `tool_choice` "none": the tools are left out of the prompt and no call is made;
- a named function: the output is constrained to that function's parameters (a JSON schema), and it
  is the call's arguments;
- "required": the output is constrained to a JSON list of calls, each a tool's name and parameters;
- "auto": the tools go to the chat template, the model writes what it likes, and a parser for its
  family's format (`--tool-call-parser`) finds the calls in the text.

The constraints are structured outputs, so they hold exactly under speculation too.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blockspec.sampling_params import StructuredOutputsParams


@dataclass
class Call:
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict[str, Any]:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls, each {"name": one tool's, "parameters": that tool's schema}."""
    calls = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                               "parameters": t.get("parameters") or {"type": "object"}},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def constraint(tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool
               ) -> StructuredOutputsParams | None:
    """The output constraint a tool choice asks for (None: "none" and "auto" constrain nothing). `tools`
    are the request's function definitions."""
    if choice == "required":
        return StructuredOutputsParams(json=required_schema(tools, parallel))
    if isinstance(choice, dict):
        wanted = choice["name"]
        tool = next((t for t in tools if t["name"] == wanted), None)
        if tool is None:
            raise ValueError(f"tool_choice names the function {wanted!r}, which is not among the request's tools")
        return StructuredOutputsParams(json=tool.get("parameters") or {"type": "object"})
    return None


@dataclass
class ToolUse:
    """A chat request's tools (OpenAI function definitions), its tool choice ("none", "auto", "required",
    or {"name": ...}), and the parser that finds "auto" calls in the text."""

    tools: list[dict[str, Any]]
    choice: str | dict[str, Any]
    parallel: bool = True
    parser: Callable[[str], tuple[str, list[Call]]] | None = None

    @property
    def calls_possible(self) -> bool:
        return self.choice != "none" and (self.choice != "auto" or self.parser is not None)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (none for "none": the model is not told of them)."""
        if self.choice == "none":
            return None
        return [{"type": "function", "function": t} for t in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        return constraint(self.tools, self.choice, self.parallel)

    def split(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of an output; content None where the output is all calls."""
        if isinstance(self.choice, dict):
            return None, [Call(self.choice["name"], text)]
        if self.choice == "required":
            try:
                listed = json.loads(text)
            except json.JSONDecodeError:  # cut short by max_tokens: no complete call
                return text, []
            return None, [Call(c["name"], json.dumps(c["parameters"])) for c in listed]
        if self.choice == "auto" and self.parser is not None:
            content, calls = self.parser(text)
            return (content or None) if calls else text, calls
        return text, []


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def hermes(text: str) -> tuple[str, list[Call]]:
    """Qwen2.5 / Qwen3 / Hermes calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""
    calls = []
    for block in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL):
        value = _loads(block)
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            calls.append(Call(value["name"], json.dumps(value.get("arguments", {}))))
    content = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL).strip() if calls else text
    return content, calls


def llama3_json(text: str) -> tuple[str, list[Call]]:
    """Llama 3.1+ calls: the output is `{"name": ..., "parameters": {...}}` (after an optional
    `<|python_tag|>`), several separated by ';'."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls = []
    for part in (p.strip() for p in body.split(";")):
        value = _loads(part)
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
            return text, []
        calls.append(Call(value["name"], json.dumps(value.get("parameters", value.get("arguments", {})))))
    return "", calls


PARSERS: dict[str, Callable[[str], tuple[str, list[Call]]]] = {"hermes": hermes, "llama3_json": llama3_json}
