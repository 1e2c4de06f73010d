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
        return {"id": call_id(), "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    """A new tool call's id, in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


def hoisted(parameters: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameter schema to nest inside another: its definitions ($defs, definitions) moved into `defs`
    under `prefix` (so two tools' names cannot collide) and its references rewritten to them, the schema's own
    root ("#") included, since a reference resolves from the schema that finally holds it."""
    own = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    body = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
    root = f"{prefix}root"

    def moved(node: Any) -> Any:
        if isinstance(node, list):
            return [moved(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: moved(v) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref == "#":
                out["$ref"], defs[root] = f"#/$defs/{root}", None  # filled below
            for kind in ("#/$defs/", "#/definitions/"):
                if ref.startswith(kind):
                    out["$ref"] = f"#/$defs/{prefix}{ref[len(kind):]}"
        return out

    result = moved(body)
    for name, schema in own.items():
        defs[f"{prefix}{name}"] = moved(schema)
    if root in defs:
        defs[root] = result
    return result


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls, each {"name": one tool's, "parameters": that tool's schema}; the tools' definitions
    gathered at the top, where their references resolve."""
    defs: dict[str, Any] = {}
    calls = [{"type": "object",
              "properties": {"name": {"const": t["name"]},
                             "parameters": hoisted(t.get("parameters") or {"type": "object"}, f"tool{i}_", defs)},
              "required": ["name", "parameters"], "additionalProperties": False} for i, t in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if defs:
        schema["$defs"] = defs
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


@dataclass(frozen=True)
class Parser:
    """A model family's tool-call format: `split` finds the calls in a whole output; `streamable` is the
    content of an output so far that no call can have begun in (what a stream may send before the end)."""

    split: Callable[[str], tuple[str, list[Call]]]
    streamable: Callable[[str], str]


@dataclass
class ToolUse:
    """A chat request's tools (OpenAI function definitions), its tool choice ("none", "auto", "required",
    or {"name": ...}), and the parser that finds "auto" calls in the text."""

    tools: list[dict[str, Any]]
    choice: str | dict[str, Any]
    parallel: bool = True
    parser: Parser | None = None
    hide_when_none: bool = False  # tool choice "none": leave the tools out of the template (vLLM's opt-in)

    @property
    def calls_possible(self) -> bool:
        return self.choice != "none" and (self.choice != "auto" or self.parser is not None)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them; under "none" too (the model sees what it may not call, as
        OpenAI's and vLLM's do), unless `hide_when_none`."""
        if self.choice == "none" and self.hide_when_none:
            return None
        return [{"type": "function", "function": t} for t in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        return constraint(self.tools, self.choice, self.parallel)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """A choice's finish reason once it made calls: "tool_calls" where the model chose to call ("auto",
        "required"); a named choice forced the call, so it stays "stop", as OpenAI's API answers."""
        if engine_reason == "stop" and not isinstance(self.choice, dict):
            return "tool_calls"
        return engine_reason

    def split(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of an output; content None where the output is all calls."""
        if isinstance(self.choice, dict):
            return None, [Call(self.choice["name"], text)]
        if self.choice == "required":
            try:
                listed = json.loads(text)
            except json.JSONDecodeError:  # cut short by max_tokens: no complete call
                return text, []
            return None, [Call(c["name"], arguments_text(c["parameters"])) for c in listed]
        if self.choice == "auto" and self.parser is not None:
            content, calls = self.parser.split(text)
            if not self.parallel:  # parallel_tool_calls false: at most one call, as OpenAI's API answers
                calls = calls[:1]
            return (content or None) if calls else text, calls
        return text, []


@dataclass
class ToolStream:
    """One streamed choice's output under a tool choice, piece by piece: a named function's arguments as they
    come (the call's id and name with the first piece); under "auto", content while no call can have begun,
    the rest and the calls when the choice ends; a "required" list of calls when it ends."""

    use: ToolUse
    text: str = ""
    sent: str = ""  # content streamed so far
    call_id: str | None = None  # a named function's call, once opened

    def feed(self, piece: str) -> tuple[str, dict[str, Any] | None]:
        """(content to send now, a piece of the named call to send now: its OpenAI delta fields)."""
        self.text += piece
        if isinstance(self.use.choice, dict):
            if self.call_id is None:
                self.call_id = call_id()
                return "", {"id": self.call_id, "type": "function",
                            "function": {"name": self.use.choice["name"], "arguments": piece}}
            return "", {"function": {"arguments": piece}} if piece else None
        if self.use.choice == "auto" and self.use.parser is not None:
            ready = self.use.parser.streamable(self.text)
            if ready.startswith(self.sent) and len(ready) > len(self.sent):
                new, self.sent = ready[len(self.sent):], ready
                return new, None
        return "", None

    def finish(self) -> tuple[str | None, list[Call]]:
        """(content not sent yet, calls not sent yet) once the choice has ended."""
        if isinstance(self.use.choice, dict):
            return None, []
        content, calls = self.use.split(self.text)
        if content is not None and content.startswith(self.sent):
            return content[len(self.sent):] or None, calls
        return None, calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def arguments_text(value: Any) -> str:
    """A call's arguments as the JSON text OpenAI's API carries, non-ASCII kept as written (vLLM's)."""
    return json.dumps(value, ensure_ascii=False)


def hermes(text: str) -> tuple[str, list[Call]]:
    """Qwen2.5 / Qwen3 / Hermes calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the
    last one maybe unclosed (the output ended at EOS or a stop string); the content is the text before the
    first (vLLM's rule)."""
    calls = []
    for closed, open_tail in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>|<tool_call>\s*(.*)", text, re.DOTALL):
        value = _loads(closed or open_tail.strip())
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            calls.append(Call(value["name"], arguments_text(value.get("arguments", {}))))
    return (text[:text.index("<tool_call>")] if calls else text), calls


def llama3_json(text: str) -> tuple[str, list[Call]]:
    """Llama 3.1+ calls: the output is `{"name": ..., "parameters": {...}}` (after an optional
    `<|python_tag|>`), several separated by ';'; each object is read whole, so a ';' inside an argument
    is text."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls, at, decoder = [], 0, json.JSONDecoder()
    while at < len(body):
        try:
            value, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
            return text, []
        calls.append(Call(value["name"], arguments_text(value.get("parameters", value.get("arguments", {})))))
        at = end
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1
    return ("", calls) if calls else (text, [])


def before(text: str, marker: str) -> str:
    """`text` up to `marker`, or up to a tail that may be its beginning (the rest of it not yet written)."""
    at = text.find(marker)
    if at >= 0:
        return text[:at]
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return text[:-n]
    return text


def hermes_streamable(text: str) -> str:
    """Content before the first `<tool_call>`, as the split keeps it (whitespace included: vLLM's)."""
    return before(text, "<tool_call>")


def llama3_streamable(text: str) -> str:
    """All of it once it cannot be a call (a call's output starts with `{` or `<|python_tag|>`), else nothing."""
    body, tag = text.lstrip(), "<|python_tag|>"
    if not body or body.startswith(("{", tag)) or tag.startswith(body):
        return ""
    return text


PARSERS = {"hermes": Parser(hermes, hermes_streamable), "llama3_json": Parser(llama3_json, llama3_streamable)}
