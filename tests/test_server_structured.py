"""Structured output and tool calls over the OpenAI API (the official client on 127.0.0.1): the output
keeps the constraint, and a server that drafts gives what plain constrained decoding gives."""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from blockspec import LLM, SamplingParams
from blockspec.config import ServerConfig
from blockspec.sampling_params import StructuredOutputsParams
from blockspec.server.app import create_app
from blockspec.server.tools import PARSERS, Call, ToolStream, ToolUse, hermes, llama3_json, required_schema
from factories import save_drafter_target
from live_server import LiveServer, post

FIXTURES = Path(__file__).parent / "fixtures" / "drafters"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["x", "yy", "zzz"]}},
          "required": ["a", "b"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return save_drafter_target(tmp_path_factory.mktemp("target"), tokenizer=True)


def load(target: Path, spec: bool) -> LLM:
    drafter = {"method": "dflash", "model": str(FIXTURES / "dflash"), "adaptive_draft_length": False}
    return LLM(str(target), device="cpu", max_model_len=160, speculative_config=drafter if spec else None)


@pytest.fixture(scope="module")
def plain(target) -> LLM:
    return load(target, spec=False)


@pytest.fixture(scope="module", params=["plain", "speculative"])
def server(target, request) -> Iterator[LiveServer]:
    live = LiveServer(create_app(functools.partial(load, target, request.param == "speculative"), "tiny",
                                 config=ServerConfig(tool_call_parser="hermes"))).wait_ready()
    yield live
    live.close()


def test_response_format_json_schema_equals_plain_constrained_decoding(server, plain):
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "pair", "schema": SCHEMA}}
    got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "say"}], max_tokens=60,
                                         temperature=0, response_format=fmt,
                                         extra_body={"return_token_ids": True})
    value = json.loads(got.choices[0].message.content)
    assert set(value) == {"a", "b"} and value["b"] in ("x", "yy", "zzz")
    want = plain.chat([{"role": "user", "content": "say"}],
                      SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
                      use_tqdm=False)[0].outputs[0]
    assert got.choices[0].model_extra["token_ids"] == want.token_ids


@pytest.mark.parametrize("extra, valid", [
    ({"structured_outputs": {"regex": "[a-c]{4}"}}, lambda t: len(t) == 4 and set(t) <= set("abc")),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"guided_regex": "[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
    ({"response_format": {"type": "json_object"}}, lambda t: t.startswith("{")),
])
def test_completions_take_vllm_constraints(server, extra, valid):
    out = server.client().completions.create(model="tiny", prompt="x", max_tokens=30, temperature=0.8, seed=2,
                                             extra_body=extra)
    assert valid(out.choices[0].text), out.choices[0].text


def test_bad_constraints_are_400s_naming_the_field(server):
    """A constraint that does not compile is one line naming the field it came from (it was llguidance's
    multi-line drawing, prefixed "prompt:", and named response_format whatever field gave it)."""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}
    for field, value, reason in (("guided_regex", "[a-", "unclosed character class"),
                                 ("structured_outputs", {"grammar": "start: ("}, "Expected"),
                                 ("response_format", schema, "bogus")):
        r = post(f"{server.url}/v1/completions", json={"prompt": "x", field: value})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field, r.text
        assert error["message"].startswith(f"{field}: ") and reason in error["message"], r.text
        assert "\n" not in error["message"] and "^" not in error["message"], r.text
    r = post(f"{server.url}/v1/completions", json={"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]})
    assert r.status_code == 400 and "one output constraint" in r.json()["error"]["message"], r.text
    r = post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                        "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


def test_a_named_tool_choice_returns_its_call(server):
    out = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER, TIME], max_tokens=60,
        temperature=0, tool_choice={"type": "function", "function": {"name": "weather"}})
    choice = out.choices[0]  # a forced call ends as "stop" (OpenAI's answer); "auto" and "required" calls as "tool_calls"
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "weather" and args["city"] in ("Oslo", "Lima") and 1 <= args["days"] <= 7


def test_a_named_tool_choice_streams_its_arguments_as_they_come(server):
    """The first piece opens the call (id, type, name), the rest add to its arguments (they used to arrive in one
    delta at the end, after empty chunks); joined they are the call a non-streamed request returns."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER, TIME], max_tokens=60,
              temperature=0, tool_choice={"type": "function", "function": {"name": "weather"}})
    whole = server.client().chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = list(server.client().chat.completions.create(**kw, stream=True))
    pieces = [c for chunk in chunks for choice in chunk.choices for c in (choice.delta.tool_calls or [])]
    assert len(pieces) > 3 and pieces[0].id and pieces[0].function.name == "weather"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert "".join(p.function.arguments for p in pieces) == whole.function.arguments
    finishes = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert finishes == ["stop"]
    # the openai SDK's stream helper accumulates the pieces: a later piece's `"type": null` broke it
    with server.client().chat.completions.stream(**kw) as events:
        final = events.get_final_completion().choices[0].message.tool_calls[0]
    assert (final.type, final.function.name, final.function.arguments) == ("function", "weather",
                                                                           whole.function.arguments)


def test_auto_tool_streams_send_content_until_a_call_can_begin():
    """Under "auto" a stream sends content while no call can have begun (never a piece of a call's opening tag)
    and the calls when the choice ends; the content sent and the rest add up to the whole output's content."""
    use = ToolUse([WEATHER["function"]], "auto", parser=PARSERS["hermes"])
    stream = ToolStream(use)
    pieces = ["Sure", ", one", " moment.\n<tool", '_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}',
              "\n</tool_call>"]
    sent = [stream.feed(p)[0] for p in pieces]
    assert sent == ["Sure", ", one", " moment.\n", "", ""]
    rest, calls = stream.finish()
    assert rest is None and calls == [Call("weather", '{"city": "Oslo"}')]
    assert "".join(sent) == use.split("".join(pieces))[0]
    plain = ToolStream(use)
    assert [plain.feed(p)[0] for p in ("no <", "call ", "here ")] == ["no ", "<call ", "here "]
    assert plain.finish() == (None, [])
    # content around the text before a call, whitespace included, streamed as the whole output keeps it (vLLM's)
    spaced = ToolStream(use)
    pieces = ["\n\n  Hi", "  \n<tool_call>", '{"name": "time", "arguments": {}}</tool_call>']
    sent = [spaced.feed(p)[0] for p in pieces]
    assert "".join(sent) + (spaced.finish()[0] or "") == use.split("".join(pieces))[0] == "\n\n  Hi  \n"
    llama = ToolStream(ToolUse([TIME["function"]], "auto", parser=PARSERS["llama3_json"]))
    assert [llama.feed(p)[0] for p in (" ", '{"name": "time", ', '"parameters": {"zone": "UTC"}}')] == ["", "", ""]
    assert llama.finish() == (None, [Call("time", '{"zone": "UTC"}')])
    prose = ToolStream(ToolUse([TIME["function"]], "auto", parser=PARSERS["llama3_json"]))
    assert [prose.feed(p)[0] for p in (" ", "It is", " noon")] == ["", " It is", " noon"]


def test_required_tool_choice_streams_its_calls_when_the_choice_ends(server):
    stream = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "now?"}], tools=[WEATHER, TIME], max_tokens=100,
        temperature=0.7, seed=4, tool_choice="required", parallel_tool_calls=False, stream=True)
    chunks = list(stream)
    calls = [c for chunk in chunks for choice in chunk.choices for c in (choice.delta.tool_calls or [])]
    finishes = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    assert len(calls) == 1 and calls[0].function.name in ("weather", "time") and finishes == ["tool_calls"]
    json.loads(calls[0].function.arguments)


def test_auto_tool_choice_needs_a_parser(target):
    live = LiveServer(create_app(functools.partial(load, target, False), "tiny")).wait_ready()
    try:
        with pytest.raises(openai.BadRequestError, match="tool-call-parser"):
            live.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                  tools=[WEATHER])
    finally:
        live.close()


def test_the_parsers_find_calls_in_each_family_format():
    content, calls = hermes('Sure.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert content == "Sure.\n" and calls == [Call("weather", '{"city": "Oslo"}')]
    assert hermes("no calls here") == ("no calls here", [])
    content, calls = llama3_json('<|python_tag|>{"name": "time", "parameters": {"zone": "UTC"}}; '
                                 '{"name": "weather", "parameters": {"city": "Lima"}}')
    assert content == "" and [c.name for c in calls] == ["time", "weather"]
    assert llama3_json("plain text")[1] == []
    # vLLM's readings: a ';' inside an argument is text; hermes content is what precedes the first call, a last
    # call left unclosed still counts, and arguments keep non-ASCII text
    assert llama3_json('{"name": "sql", "parameters": {"q": "SELECT 1; SELECT 2"}}') == (
        "", [Call("sql", '{"q": "SELECT 1; SELECT 2"}')])
    content, calls = hermes('Two.\n<tool_call>\n{"name": "a", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
                            'between\n<tool_call>\n{"name": "b", "arguments": {}}')
    assert content == "Two.\n" and calls == [Call("a", '{"city": "Zürich"}'), Call("b", "{}")]
    schema = required_schema([WEATHER["function"]], parallel=False)
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "weather"}


def test_required_tool_choice_keeps_each_tools_definitions_and_auto_honours_parallel_false(plain):
    """Tools whose parameters use $defs (as Pydantic writes them) or refer to themselves ("#"): under "required"
    their schemas sit inside a list of calls, where the references pointed at nothing (a 400, "Pointer
    '/$defs/loc' does not exist"); the definitions are gathered at the top, renamed per tool. Under "auto",
    parallel_tool_calls false keeps the first call only (both were returned)."""
    import jsonschema

    from blockspec.structured import new_matcher

    place = {"name": "place", "parameters": {"type": "object", "properties": {"at": {"$ref": "#/$defs/loc"}},
                                             "required": ["at"], "$defs": {"loc": {"type": "string"}}}}
    other = {"name": "other", "parameters": {"type": "object", "properties": {"at": {"$ref": "#/definitions/loc"}},
                                             "definitions": {"loc": {"type": "integer"}}}}
    tree = {"name": "tree", "parameters": {"type": "object", "properties": {"kids": {"type": "array",
                                                                                     "items": {"$ref": "#"}}}}}
    schema = required_schema([place, other, tree], parallel=True)
    jsonschema.validate([{"name": "place", "parameters": {"at": "Oslo"}}, {"name": "other", "parameters": {"at": 3}},
                         {"name": "tree", "parameters": {"kids": [{"kids": []}]}}], schema)
    for wrong in ([{"name": "place", "parameters": {"at": 3}}], [{"name": "other", "parameters": {"at": "x"}}],
                  [{"name": "tree", "parameters": {"kids": [{"kids": 1}]}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    inputs = plain.inputs
    new_matcher(StructuredOutputsParams(json=schema), inputs.tokenizer, inputs.vocab_size, inputs.eos_ids, "t")
    two = ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "weather", "arguments": {"city": "Lima"}}\n</tool_call>')
    for parallel, found in ((True, 2), (False, 1)):
        use = ToolUse([WEATHER["function"]], "auto", parallel, PARSERS["hermes"])
        assert len(use.split(two)[1]) == found
        stream = ToolStream(use)
        stream.feed(two)
        assert len(stream.finish()[1]) == found


@pytest.mark.parametrize("text, phase, want", [
    ("<think>\nplan\n</think>\n\nanswer", "first", ("\nplan\n", "\n\nanswer")),
    ("plain answer", "first", (None, "plain answer")),
    ("plain answer", "thinking", ("plain answer", None)),  # R1 with no tag in its prompt
    ("<think>cut off by max_tokens", "first", ("cut off by max_tokens", None)),
    ("thought</think>answer", "thinking", ("thought", "answer")),  # the prompt opened the block
    ("<think>again</think>answer", "thinking", ("again", "answer")),  # R1-0528 writes the <think> its prompt opened
    ("<think></think>\n\nhi <think>", "first", (None, "\n\nhi <think>")),
    ("<think>x</think>y", "answer", (None, "<think>x</think>y")),  # the prompt closed its block: all content
])
def test_reasoning_parsers_split_thinking_from_content(text, phase, want):
    """vLLM's --reasoning-parser readings from where an output starts; read in pieces at every split point, an
    output splits as it does whole (a tag cut between two pieces included)."""
    from blockspec.server.reasoning import ReasoningStream, split_reasoning

    assert split_reasoning(text, phase) == want
    for cut in range(len(text) + 1):
        reader, got = ReasoningStream.starting(phase), ["", ""]
        for piece in (text[:cut], text[cut:], ""):
            for i, part in enumerate(reader.feed(piece)):
                got[i] += part
        for i, part in enumerate(reader.finish()):
            got[i] += part
        assert (got[0] or None, got[1] or None) == want, cut


@pytest.mark.parametrize("prompt, qwen3, deepseek_r1", [
    ([5, 7, 6], "thinking", "thinking"),  # the prompt left a block open
    ([8, 7], "thinking", "thinking"),
    ([5, 7, 8], "answer", "answer"),  # closed at its end (enable_thinking false): vLLM's reading
    ([5, 7, 6, 8, 9, 9], "answer", "answer"),  # ... whitespace aside
    ([7, 6, 8, 5], "first", "first"),  # an earlier turn's closed block: the output may open its own
    ([5, 6], "first", "thinking"),  # no tag: R1's older templates leave the opening to the model
])
def test_where_an_output_starts_thinking(prompt, qwen3, deepseek_r1):
    """<think> is 7, </think> 8, 9 a whitespace token."""
    from blockspec.reasoning import ThinkTokens

    def decode(ids: list[int]) -> str:
        return "".join(" " if t == 9 else "x" for t in ids)

    assert ThinkTokens("qwen3", 7, 8).phase(prompt, decode) == qwen3
    assert ThinkTokens("deepseek_r1", 7, 8).phase(prompt, decode) == deepseek_r1


def thinking_llm(target: Path) -> LLM:
    return LLM(str(target), device="cpu", max_model_len=160, reasoning_parser="qwen3")


def test_a_reasoning_parser_returns_the_think_block_as_reasoning_content(tmp_path):
    """reasoning_parser qwen3: the output's think block (the prompt opened it) is the message's reasoning_content,
    whole and streamed (as reasoning_content deltas, then content), and the structured output holds the answer
    after it."""
    target = save_drafter_target(tmp_path, think=True)
    live = LiveServer(create_app(functools.partial(thinking_llm, target), "tiny",
                                 config=ServerConfig(tool_call_parser="hermes"))).wait_ready()
    try:
        client = live.client()
        end = str(AutoTokenizer.from_pretrained(target).convert_tokens_to_ids("</think>"))
        ask = dict(model="tiny", messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "<think>"}],
                   max_tokens=40, temperature=0.8, seed=2, logit_bias={end: 1.5},
                   extra_body={"continue_final_message": True, "add_generation_prompt": False,
                               "structured_outputs": {"regex": "[d-f]{4}"}})
        whole = client.chat.completions.create(**ask).choices[0].message
        thought, answer = whole.model_extra["reasoning_content"], whole.content
        assert len(thought) >= 2 and "think>" not in thought and len(answer) == 4 and set(answer) <= set("def")
        assert whole.model_extra["reasoning"] == thought  # vLLM's name since its rename, beside DeepSeek's
        chunks = list(client.chat.completions.create(stream=True, **ask))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == thought
        assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == thought
        assert "".join(d.content or "" for d in deltas) == answer
        # vLLM's thinking_token_budget: the think block closes after that many tokens (a character each here)
        budget = {**ask, "extra_body": {**ask["extra_body"], "thinking_token_budget": 1}}
        short = client.chat.completions.create(**budget).choices[0].message
        assert len(short.model_extra["reasoning"]) == 1 and re.fullmatch("[d-f]{4}", short.content)
        # vLLM's include_reasoning false: the thinking is dropped, whole and streamed
        ask["extra_body"]["include_reasoning"] = False
        bare = client.chat.completions.create(**ask).choices[0].message
        assert bare.model_extra.get("reasoning_content") is None and bare.content == answer
        deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **ask) if c.choices]
        assert not any(d.model_extra.get("reasoning_content") for d in deltas)
        assert "".join(d.content or "" for d in deltas) == answer
    finally:
        live.close()


def test_tool_calls_are_looked_for_in_the_content_only():
    """A tool call written inside the think block is thinking, whole and streamed; one in the content is a call."""
    from blockspec.engine.loop import Delta
    from blockspec.inputs import Prompt
    from blockspec.request import TokenStrings
    from blockspec.server.app import ChatRenderer, tool_use
    from blockspec.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "x"}], tools=[TIME])
    call = '<tool_call>\n{"name": "time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    for text, calls, content in ((f"<think>{call}</think>ok", 0, "ok"), (f"<think>hm</think>{call}", 1, None)):
        def renderer() -> ChatRenderer:
            return ChatRenderer(body, "tiny", [Prompt("x", [1])], SamplingParams(), TokenStrings(None), False,
                                tools=tool_use(body, "hermes"), phase="first")

        message = renderer().message(text)
        assert len(message.tool_calls or []) == calls and message.content == content, text
        streamed = renderer()
        pieces = [streamed.chunk(Delta(0, text[i: i + 5], [], None)) for i in range(0, len(text), 5)]
        pieces.append(streamed.chunk(Delta(0, "", [], None, finish_reason="stop")))
        deltas = [p.choices[0].delta for p in pieces]
        assert sum(len(d.tool_calls or []) for d in deltas) == calls
        assert "".join(d.content or "" for d in deltas) == (content or "")


def test_a_streams_chunks_share_one_created_time(monkeypatch):
    """OpenAI's chunks of one stream carry one `created` (vLLM's too); each chunk stamped its own second."""
    from blockspec.engine.loop import Delta
    from blockspec.inputs import Prompt
    from blockspec.request import TokenStrings
    from blockspec.server import protocol
    from blockspec.server.app import ChatRenderer, Choice
    from blockspec.server.protocol import ChatCompletionRequest

    clock = itertools.count(1_000_000)  # each call a second later
    monkeypatch.setattr(protocol.time, "time", lambda: next(clock))
    body = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "x"}])
    renderer = ChatRenderer(body, "tiny", [Prompt("x", [1])], SamplingParams(), TokenStrings(None), False)
    chunks = renderer.opening_chunks() + [renderer.chunk(Delta(0, t, [], None)) for t in ("a", "b", "c")]
    chunks.append(renderer.usage_chunk([Choice()]))
    assert {c.created for c in chunks} == {renderer.created}
