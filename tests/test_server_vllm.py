"""`blockspec serve` as a vLLM user's clients and dashboards expect it, over real HTTP on 127.0.0.1:
/v1/models/{id}, /tokenize, /detokenize, /version, the fields accepted and ignored, best_of and echo (with the
prompt's logprobs), prompt_logprobs, bad_words and continue_final_message,
a text-only model's answer to image parts, vLLM's metric names (no _created series), the periodic log,
and the ready line and clean shutdown of the command."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blockspec import LLM, SamplingParams
from blockspec.cli import main
from blockspec.config import ConfigError, ServerConfig
from blockspec.server.app import create_app
from factories import save_tiny_model_with_tokenizer
from live_server import PATIENCE, LiveServer, get, metric, post, wait_until

NAME = "org/tiny"  # a name with a slash, as hub ids have


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    return save_tiny_model_with_tokenizer(tmp_path_factory.mktemp("text") / "m")


def load(path: Path) -> LLM:
    return LLM(str(path), device="cpu", max_model_len=96, max_num_seqs=4)


@pytest.fixture(scope="module")
def server(text_dir) -> Iterator[LiveServer]:
    live = LiveServer(create_app(functools.partial(load, text_dir), NAME,
                                 config=ServerConfig(log_stats_interval_s=0.05))).wait_ready()
    yield live
    live.close()


@pytest.fixture(scope="module")
def tokenizer(text_dir):
    return load(text_dir).get_tokenizer()


# ---------------------------------------------------------------- routes
def test_one_model_by_id(server):
    client = server.client()
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.model_extra["max_model_len"] == 96
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("other")
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"


def test_tokenize_detokenize_and_version(server, tokenizer):
    r = post(f"{server.url}/tokenize", json={"model": NAME, "prompt": "hello", "return_token_strs": True})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer.encode("hello") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 96 and body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    plain = post(f"{server.url}/tokenize", json={"prompt": "hello", "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode("hello", add_special_tokens=False) and plain["token_strs"] is None
    r = post(f"{server.url}/detokenize", json={"model": NAME, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(body["tokens"])}
    r = post(f"{server.url}/detokenize", json={"tokens": [5, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert post(f"{server.url}/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404
    assert get(f"{server.url}/version").json() == {"version": "0.1.0"}


def test_tokenize_a_conversation_as_chat_renders_it(server, tokenizer):
    messages = [{"role": "user", "content": "hi there"}]
    r = post(f"{server.url}/tokenize", json={"messages": messages})
    assert r.status_code == 200
    chat = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    assert r.json()["tokens"] == tokenizer.encode("<user>hi there\n<assistant>")  # the tiny tokenizer's template
    assert r.json()["count"] == chat.usage.prompt_tokens
    r = post(f"{server.url}/tokenize", json={"messages": messages, "bogus": 1})
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
    # tools render without a tool-call parser (nothing is parsed), as vLLM's /tokenize; documents are accepted
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = post(f"{server.url}/tokenize", json={"messages": messages, "tools": tools, "documents": [{"text": "d"}]})
    assert r.status_code == 200 and r.json()["tokens"] == tokenizer.encode("<user>hi there\n<assistant>")
    # a history the template cannot take names messages (not continue_final_message)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
    r = post(f"{server.url}/tokenize", json={"messages": messages + [{"role": "assistant", "tool_calls": [call]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "tool_calls[0].function.arguments is not JSON" in r.json()["error"]["message"]


def test_requests_that_share_a_request_id_each_get_their_own_tokens(server):
    """Two requests sent at once with one request_id, and "a" with n = 2 beside "a-0": each gets its own tokens
    (one client waited forever while the other got both requests' tokens, the ids' queues and engine requests
    overwritten), and both keep the id they asked for."""
    import concurrent.futures

    url = f"{server.url}/v1/completions"
    cases = [({"prompt": "def quicksort(xs):", "request_id": "same"}, {"prompt": "class Foo:", "request_id": "same"}),
             ({"prompt": "import os", "request_id": "a", "n": 2, "temperature": 0.8, "seed": 1},
              {"prompt": "x = 1", "request_id": "a-0"})]
    for pair in cases:
        bodies = [{"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **b} for b in pair]
        alone = [post(url, json=b).json() for b in bodies]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda b: post(url, json=b).json(), bodies))
        for want, got in zip(alone, together):
            assert got["id"] == want["id"] == f"cmpl-{want['id'][5:]}"
            assert [c["token_ids"] for c in got["choices"]] == [c["token_ids"] for c in want["choices"]]


def test_default_chat_template_kwargs_apply_under_the_requests(text_dir):
    """vLLM's --default-chat-template-kwargs: every chat request's template variables, a request's own winning."""
    live = LiveServer(create_app(functools.partial(load, text_dir), NAME, config=ServerConfig(
        default_chat_template_kwargs={"suffix": "D"}, trust_request_chat_template=True))).wait_ready()
    try:
        tok = load(text_dir).get_tokenizer()
        body = {"messages": [{"role": "user", "content": "hi"}],
                "chat_template": "{{ messages[0]['content'] }}{{ suffix }}"}
        assert post(f"{live.url}/tokenize", json=body).json()["tokens"] == tok.encode("hiD", add_special_tokens=False)
        own = post(f"{live.url}/tokenize", json={**body, "chat_template_kwargs": {"suffix": "R"}}).json()["tokens"]
        assert own == tok.encode("hiR", add_special_tokens=False)
    finally:
        live.close()


# ---------------------------------------------------------------- request fields
def test_fields_that_change_nothing_are_accepted_and_named_in_the_log(server, caplog):
    client = server.client()
    with caplog.at_level(logging.INFO, logger="blockspec.server"):
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                           store=True, metadata={"k": "v"}, service_tier="auto",
                                           parallel_tool_calls=False, reasoning_effort="low", verbosity="low")
    assert r.choices[0].message.content is not None
    lines = [rec.getMessage() for rec in caplog.records if "accepted and ignored" in rec.getMessage()]
    assert len(lines) == 1
    for name in ("store", "metadata", "service_tier", "reasoning_effort", "verbosity", "parallel_tool_calls"):
        assert name in lines[0]
    r = post(f"{server.url}/v1/completions", json={"prompt": "a", "suffix": "b"})  # suffix would change the output
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"


def test_vllm_extras_are_honoured_or_refused_by_name(server, tokenizer):
    """Fields vLLM's clients send (each was a 400 "unrecognized request argument"): add_special_tokens,
    request_id and return_tokens_as_token_ids are honoured; priority, use_beam_search, length_penalty and
    guided_whitespace_pattern are taken at their defaults, guided_decoding_backend is ignored, and other
    values are refused naming the field. A guided_choice error names guided_choice, a stop string with a
    lone surrogate is refused as a prompt's is, and a body not sent as JSON is a 415 that says so."""
    url = f"{server.url}/v1/completions"
    chat = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "return_token_ids": True}
    for where, payload in ((url, {"prompt": "hello", "max_tokens": 1}), (f"{server.url}/v1/chat/completions", chat)):
        assert post(where, json={**payload, "add_special_tokens": True}).status_code == 200
    body = {"prompt": "hello", "max_tokens": 3, "logprobs": 2, "temperature": 0, "request_id": "job-7",
            "return_tokens_as_token_ids": True, "priority": 0, "use_beam_search": False, "length_penalty": 1.0,
            "guided_whitespace_pattern": None, "guided_decoding_backend": "xgrammar", "return_token_ids": True}
    r = post(url, json=body).json()
    assert r["id"] == "cmpl-job-7"
    choice = r["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
    assert post(f"{server.url}/v1/chat/completions", json={**chat, "request_id": "c1"}).json()["id"] == "chatcmpl-c1"
    for where, extra, param in ((url, {"priority": 1}, "priority"), (url, {"use_beam_search": True}, "use_beam_search"),
                                (url, {"length_penalty": 0.5}, "length_penalty"),
                                (url, {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
                                (url, {"guided_choice": []}, "guided_choice"), (url, {"stop": ["a\ud800"]}, "stop"),
                                (f"{server.url}/v1/chat/completions", {"echo": True}, "echo")):
        payload = {"prompt": "hello", "max_tokens": 1} if where == url else dict(chat)
        r = post(where, content=json.dumps({**payload, **extra}), headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.json())
    r = post(url, content=json.dumps({"prompt": "hello", "max_tokens": 1}),
             headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]


def test_add_special_tokens_puts_the_tokenizers_bos_where_vllm_does(offline, text_dir):
    """Completions tokenize a text with the tokenizer's special tokens unless add_special_tokens is false;
    chat renders the template without them unless it is true (vLLM's defaults), here with a tokenizer
    that adds a BOS."""
    import dataclasses

    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from blockspec.server.app import chat_prompt, completion_prompts
    from blockspec.server.protocol import ChatCompletionRequest

    tok = AutoTokenizer.from_pretrained(text_dir)
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    inputs = dataclasses.replace(offline.inputs, tokenizer=tok)
    bare = tok.encode("hello", add_special_tokens=False)
    assert [completion_prompts(inputs, "hello", False, flag)[0][1] for flag in (True, False)] == [[0] + bare, bare]
    chat = {"messages": [{"role": "user", "content": "a"}]}
    opened = chat_prompt(inputs, ChatCompletionRequest(**chat), ServerConfig())[1]
    assert opened[0] != 0
    assert chat_prompt(inputs, ChatCompletionRequest(**chat, add_special_tokens=True),
                       ServerConfig())[1] == [0] + opened


def test_best_of_must_equal_n(server):
    client = server.client()
    r = client.completions.create(model=NAME, prompt="ab", n=2, best_of=2, max_tokens=2, temperature=1, seed=1)
    assert len(r.choices) == 2
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=NAME, prompt="ab", best_of=3, max_tokens=2)
    assert exc.value.body["param"] == "best_of" and "must equal n (1)" in exc.value.body["message"]


def test_echo_puts_the_prompt_before_the_output(server, tokenizer):
    client = server.client()
    plain = client.completions.create(model=NAME, prompt="abc", max_tokens=4, temperature=0)
    echoed = client.completions.create(model=NAME, prompt="abc", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "abc" + plain.choices[0].text
    ids = tokenizer.encode("xyz")
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(tokenizer.decode(ids))
    chunks = list(client.completions.create(model=NAME, prompt="abc", max_tokens=4, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text == "abc" and "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_return_token_ids_puts_the_prompt_ids_where_vllm_does(server, tokenizer):
    """With return_token_ids: a chat response's prompt_token_ids at its top level (it was in each choice), a
    completion choice's in the choice; streamed, on each choice's first chunk only (they were never streamed),
    echo's first chunk included."""
    chat = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 3, "return_token_ids": True, "n": 2,
            "temperature": 1, "seed": 3}
    whole = post(f"{server.url}/v1/chat/completions", json=chat).json()
    prompt = whole["prompt_token_ids"]
    assert prompt and all("prompt_token_ids" not in c for c in whole["choices"])
    client = server.client()
    chunks = [c.model_dump() for c in client.chat.completions.create(model=NAME, stream=True, **{
        k: v for k, v in chat.items() if k in ("messages", "max_tokens", "n", "temperature", "seed")},
        extra_body={"return_token_ids": True})]
    carrying = [c for c in chunks if c.get("prompt_token_ids")]
    assert [c["choices"][0]["index"] for c in carrying] == [0, 1] and all(c["prompt_token_ids"] == prompt
                                                                          for c in carrying)
    ids = tokenizer.encode("abc")
    for echo in (False, True):
        chunks = [c.model_dump() for c in client.completions.create(
            model=NAME, prompt="abc", max_tokens=3, n=2, temperature=1, seed=3, stream=True, echo=echo,
            extra_body={"return_token_ids": True})]
        carrying = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("prompt_token_ids")]
        assert sorted(c["index"] for c in carrying) == [0, 1] and all(c["prompt_token_ids"] == ids for c in carrying)
        firsts = {}
        for c in chunks:
            if c["choices"]:
                firsts.setdefault(c["choices"][0]["index"], c["choices"][0])
        assert all(f.get("prompt_token_ids") == ids for f in firsts.values())


@pytest.fixture(scope="module")
def offline(text_dir) -> LLM:
    return load(text_dir)


def test_echo_with_logprobs_gives_the_prompt_tokens_their_logprobs(server, offline, tokenizer):
    """As OpenAI and vLLM: the echoed prompt's tokens come first in logprobs, the first with null, the
    others with the model's logprobs of them and their alternatives; streamed, the echo chunk has them."""
    client = server.client()
    ids = tokenizer.encode("abcd")
    want = offline.generate("abcd", SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2),
                            use_tqdm=False)[0]
    r = client.completions.create(model=NAME, prompt="abcd", max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp, out = r.choices[0].logprobs, want.outputs[0]
    assert lp.tokens == [tokenizer.decode([t]) for t in ids + out.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[:2] == [0, 1]
    entries = want.prompt_logprobs[1:] + out.logprobs
    for got, top, tok, entry in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], ids[1:] + out.token_ids, entries):
        assert abs(got - entry[tok].logprob) < 1e-5
        assert top.keys() == {tokenizer.decode([t]) for t, e in entry.items() if t == tok or e.rank <= 2}
    assert r.choices[0].model_extra["prompt_logprobs"][0] is None  # vLLM returns the prompt's entries too
    chunks = list(client.completions.create(model=NAME, prompt="abcd", max_tokens=3, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    first = chunks[0].choices[0]
    assert first.text == "abcd" and first.logprobs.tokens == lp.tokens[:4] and first.logprobs.token_logprobs[0] is None
    streamed = [t for c in chunks if c.choices for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


class Spelled:
    """A tokenizer stub whose text of a token differs from the decoded_token the entries below carry."""

    def decode(self, ids: list[int]) -> str:
        return f"<{ids[0]}>"


def test_logprob_tokens_are_shown_as_their_decoded_token():
    """The server shows each logprob token as the engine's decoded_token, without decoding it again;
    its own token strings serve only a token without one: an echoed prompt's first (no entry), and any
    token of a model without a tokenizer ('token_id:N')."""
    from blockspec.inputs import Prompt
    from blockspec.request import Logprob, TokenStrings
    from blockspec.server.app import ChatRenderer, CompletionRenderer
    from blockspec.server.protocol import ChatCompletionRequest, CompletionRequest

    def entries(named: bool) -> list[dict[int, Logprob] | None]:
        return [None, {6: Logprob(-0.5, 1, "six" if named else None), 7: Logprob(-1.5, 2, "seven" if named else None)}]

    params = SamplingParams(logprobs=2, prompt_logprobs=2)
    echo = CompletionRequest(prompt=[5, 6], echo=True, logprobs=2)
    completion = CompletionRenderer(echo, NAME, [Prompt(None, [5, 6])], params, TokenStrings(Spelled()), False)
    got = completion.logprobs(0, entries(True), [5, 6])
    assert got.tokens == ["<5>", "six"] and got.top_logprobs == [None, {"six": -0.5, "seven": -1.5}]
    assert [e and {t: p.decoded_token for t, p in e.items()} for e in completion.prompt_logprobs(entries(True))] \
        == [None, {6: "six", 7: "seven"}]
    chat_body = ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], logprobs=True, top_logprobs=2)
    chat = ChatRenderer(chat_body, NAME, [Prompt(None, [5])], params, TokenStrings(Spelled()), False)
    content = chat.logprobs([entries(True)[1]], [6]).content[0]
    assert content.token == "six" and [t.token for t in content.top_logprobs] == ["six", "seven"]
    bare = CompletionRenderer(CompletionRequest(prompt=[5, 6], logprobs=2), NAME, [Prompt(None, [5, 6])], params,
                              TokenStrings(None), False)
    assert bare.logprobs(0, entries(False)[1:], [6]).tokens == ["token_id:6"]


def test_echo_with_max_tokens_zero_scores_the_prompt(server, offline, tokenizer):
    """vLLM's (and OpenAI's legacy) scoring request: echo with max_tokens 0 returns the prompt and its tokens'
    logprobs, nothing generated, whole or streamed; max_tokens 0 without echo stays a 400."""
    client = server.client()
    ids = tokenizer.encode("abcd")
    want = offline.generate("abcd", SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    r = client.completions.create(model=NAME, prompt="abcd", max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == "abcd" and choice.finish_reason == "length" and r.usage.completion_tokens == 0
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in ids] and choice.logprobs.token_logprobs[0] is None
    assert [round(p, 5) for p in choice.logprobs.token_logprobs[1:]] == \
        [round(e[t].logprob, 5) for e, t in zip(want.prompt_logprobs[1:], ids[1:])]
    chunks = list(client.completions.create(model=NAME, prompt="abcd", max_tokens=0, echo=True, logprobs=1,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "abcd"
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == choice.logprobs.tokens
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=NAME, prompt="abcd", max_tokens=0)
    assert exc.value.body["param"] == "max_tokens"


def test_masked_logprobs_and_the_whole_vocabulary_as_vllm_shows_them():
    """A logprob of -inf (processed logprobs of a token top-k, a grammar or min_tokens masked) is shown as
    -9999.0, as vLLM and OpenAI show it: JSON has no infinity (it was a 500, and null streamed); -1 alternatives
    is every token (chat dropped the last, completions gave only the sampled one); an explicit prompt_logprobs
    is kept beside echo, which otherwise asks the logprobs' count for the prompt (vLLM)."""
    from blockspec.inputs import Prompt
    from blockspec.request import Logprob, TokenStrings
    from blockspec.server.app import ChatRenderer, CompletionRenderer
    from blockspec.server.protocol import ChatCompletionRequest, CompletionRequest

    entry = {6: Logprob(-0.5, 1, "six"), 7: Logprob(-1.5, 2, "seven"), 8: Logprob(float("-inf"), 3, "eight")}
    for k in (3, -1):
        params = SamplingParams(logprobs=k)
        completion = CompletionRenderer(CompletionRequest(prompt=[5], logprobs=k), NAME, [Prompt(None, [5])], params,
                                        TokenStrings(Spelled()), False)
        chat_body = ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], logprobs=True, top_logprobs=k)
        chat = ChatRenderer(chat_body, NAME, [Prompt(None, [5])], params, TokenStrings(Spelled()), False)
        legacy = completion.logprobs(0, [entry], [8])
        content = chat.logprobs([entry], [8]).content[0]
        assert legacy.token_logprobs == [-9999.0] and legacy.top_logprobs == [{"six": -0.5, "seven": -1.5,
                                                                               "eight": -9999.0}]
        assert content.logprob == -9999.0 and [(t.token, t.logprob) for t in content.top_logprobs] == \
            [("six", -0.5), ("seven", -1.5), ("eight", -9999.0)]
        for shown in (legacy, content):
            json.dumps(shown.model_dump(), allow_nan=False)  # what a JSON response writes
            assert None not in json.loads(shown.model_dump_json()).values()  # what a stream writes
    assert CompletionRequest(prompt="a", echo=True, logprobs=2, prompt_logprobs=-1).wanted_prompt_logprobs == -1
    assert CompletionRequest(prompt="a", echo=True, logprobs=3, prompt_logprobs=1).wanted_prompt_logprobs == 1
    assert CompletionRequest(prompt="a", echo=True, logprobs=-1).wanted_prompt_logprobs == -1
    assert CompletionRequest(prompt="a", logprobs=2).wanted_prompt_logprobs is None


def test_prompt_logprobs_in_extra_body(server, offline, tokenizer):
    """vLLM's prompt_logprobs: on each completion choice, and on a chat response; each entry maps token ids
    to logprob, rank and text; refused with stream."""
    client = server.client()
    ids = tokenizer.encode("hello")
    want = offline.generate("hello", SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    r = client.completions.create(model=NAME, prompt="hello", max_tokens=1, extra_body={"prompt_logprobs": 1})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert r.choices[0].logprobs is None and len(got) == len(ids) and got[0] is None
    for entry, tok, ref in zip(got[1:], ids[1:], want.prompt_logprobs[1:]):
        assert entry.keys() == {str(t) for t in ref}
        assert entry[str(tok)]["rank"] == ref[tok].rank and abs(entry[str(tok)]["logprob"] - ref[tok].logprob) < 1e-5
        assert entry[str(tok)]["decoded_token"] == tokenizer.decode([tok])
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1, n=2, temperature=1,
                                          extra_body={"prompt_logprobs": 0})
    want = offline.chat(messages, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    got = chat.model_extra["prompt_logprobs"]
    assert len(got) == chat.usage.prompt_tokens == len(want.prompt_logprobs) and got[0] is None
    assert all(e.keys() == {str(t) for t in ref} for e, ref in zip(got[1:], want.prompt_logprobs[1:]))
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=NAME, prompt="a", max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1})
    assert exc.value.body["param"] == "prompt_logprobs"


def test_allowed_token_ids_and_truncate_prompt_tokens_in_extra_body(server, offline, tokenizer):
    """vLLM's allowed_token_ids and truncate_prompt_tokens: the output holds only the allowed tokens, the
    prompt counts its last k tokens, each as the offline engine gives it; spaces_between_special_tokens is
    accepted; bad values are a 400 naming the field."""
    client = server.client()
    allowed = tokenizer.encode("ab ")
    r = client.completions.create(model=NAME, prompt="abc", max_tokens=12, temperature=0,
                                  extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    want = offline.generate("abc", SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=allowed),
                            use_tqdm=False)[0].outputs[0]
    assert set(r.choices[0].token_ids) <= set(allowed) and r.choices[0].token_ids == want.token_ids
    r = client.completions.create(model=NAME, prompt="abcdefgh", max_tokens=4, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 3})
    want = offline.generate({"prompt_token_ids": tokenizer.encode("abcdefgh")[-3:]},
                            SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert r.usage.prompt_tokens == 3 and r.choices[0].text == want.text
    # echoed, the prompt is the one the model read: the kept tokens' text, which the logprobs' tokens spell
    r = client.completions.create(model=NAME, prompt="abcdefgh", max_tokens=4, temperature=0, echo=True, logprobs=0,
                                  extra_body={"truncate_prompt_tokens": 3})
    kept = tokenizer.decode(tokenizer.encode("abcdefgh")[-3:])
    assert r.choices[0].text == kept + want.text and "".join(r.choices[0].logprobs.tokens) == r.choices[0].text
    r = client.completions.create(model=NAME, prompt="abc", max_tokens=4, temperature=0,
                                  extra_body={"spaces_between_special_tokens": False})
    assert r.choices[0].text == offline.generate("abc", SamplingParams(temperature=0, max_tokens=4),
                                                 use_tqdm=False)[0].outputs[0].text
    for field, bad in (("allowed_token_ids", []), ("allowed_token_ids", [10**6]), ("truncate_prompt_tokens", 0),
                       ("truncate_prompt_tokens", 96), ("spaces_between_special_tokens", "no")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=NAME, prompt="a", max_tokens=1, extra_body={field: bad})
        assert field in exc.value.body["message"], (field, bad, exc.value.body)


def test_truncation_takes_a_text_longer_than_the_context_and_own_masks_that_leave_no_token_are_a_400(server,
                                                                                                     tokenizer):
    """A text prompt past what max_model_len tokens can hold is tokenized and cut when the request truncates it (it
    used to be refused by its length in characters first); a request whose allowed_token_ids its bad_words then
    ban is a 400 naming both, streamed or not (it was a 500 saying the model produced non-finite logits);
    top_logprobs 0 without logprobs asks for nothing and is accepted, as OpenAI accepts it."""
    client = server.client()
    inputs = server.app.state.engine.inputs
    long_text = "ab " * (inputs.max_prompt_chars // 3 + 10)
    r = client.completions.create(model=NAME, prompt=long_text, max_tokens=2, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": long_text}], max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError, match="characters, more than max_model_len"):
        client.completions.create(model=NAME, prompt=long_text, max_tokens=2)
    stuck = {"allowed_token_ids": tokenizer.encode("a")[:1], "bad_words": ["a"]}
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=NAME, prompt="ab", max_tokens=3, extra_body=stuck)
    assert exc.value.body["message"].startswith("no token could be sampled at output token 1: this request's "
                                                "allowed_token_ids, bad_words leave no token allowed there")
    with pytest.raises(openai.APIError, match="no token could be sampled"):
        for _ in client.completions.create(model=NAME, prompt="ab", max_tokens=3, stream=True, extra_body=stuck):
            pass
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "ab"}], max_tokens=2,
                                       top_logprobs=0)
    assert r.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "ab"}], max_tokens=2,
                                       top_logprobs=2)


def test_continue_final_message_in_extra_body(server, offline):
    """vLLM's continue_final_message: the reply continues the last message, as the offline engine's chat does;
    with add_generation_prompt left on it is a 400 naming the field."""
    client = server.client()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x ="}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False,
                        add_generation_prompt=False, continue_final_message=True)[0]
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=1,
                                       extra_body={"continue_final_message": True})
    assert exc.value.body["param"] == "continue_final_message"
    assert "cannot both be true" in exc.value.body["message"]


def test_bad_words_in_extra_body(server, offline):
    """vLLM's bad_words: a word the plain output holds is not in the output, which equals the offline
    engine's; a bad value is a 400 naming the field."""
    client = server.client()
    plain = client.completions.create(model=NAME, prompt="abc", max_tokens=16, temperature=0).choices[0].text
    word = next(plain[i : i + 2] for i in range(len(plain) - 1) if plain[i : i + 2].strip() == plain[i : i + 2])
    r = client.completions.create(model=NAME, prompt="abc", max_tokens=16, temperature=0,
                                  extra_body={"bad_words": [word]})
    want = offline.generate("abc", SamplingParams(temperature=0, max_tokens=16, bad_words=[word]), use_tqdm=False)[0]
    assert word not in r.choices[0].text and r.choices[0].text == want.outputs[0].text
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a"}], max_tokens=4,
                                          extra_body={"bad_words": ["x"]})
    assert "x" not in chat.choices[0].message.content
    for bad in ([""], ["a"] * 200, ["é"]):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=NAME, prompt="a", max_tokens=1, extra_body={"bad_words": bad})
        assert exc.value.body["param"] == "bad_words"
    r = post(f"{server.url}/v1/completions", content=b'{"prompt": "a", "bad_words": ["\\ud800"]}',
             headers={"content-type": "application/json"})  # a lone surrogate, which the client cannot send
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"


def test_null_is_an_unset_field_where_null_has_no_meaning_of_its_own():
    """OpenAI's clients send unset fields as null (vLLM declares these Optional): n, stream, echo, logprobs,
    parallel_tool_calls take their defaults; a null max_tokens keeps its own meaning (no limit), and a
    required field is still required. stream_options without stream is refused, as OpenAI and vLLM do."""
    import pydantic

    from blockspec.server.protocol import ChatCompletionRequest, CompletionRequest

    nulls = dict.fromkeys(["n", "stream", "echo", "logprobs", "max_tokens", "min_tokens", "ignore_eos"])
    r = CompletionRequest.model_validate({"prompt": "x", **nulls})
    assert (r.n, r.stream, r.echo, r.logprobs, r.max_tokens, r.min_tokens, r.ignore_eos) == (1, False, False, None,
                                                                                             None, 0, False)
    c = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "n": None,
                                              "stream": None, "logprobs": None, "parallel_tool_calls": None})
    assert (c.n, c.stream, c.logprobs, c.parallel_tool_calls) == (1, False, False, True)
    for bad in ({"prompt": None}, {"prompt": "x", "n": "2"},
                {"prompt": "x", "stream_options": {"include_usage": True}}):
        with pytest.raises(pydantic.ValidationError):
            CompletionRequest.model_validate(bad)
    assert CompletionRequest.model_validate({"prompt": "x", "stream": True,
                                             "stream_options": {"include_usage": True}}).include_usage


def test_text_parts_reach_the_template_joined_by_newlines():
    """vLLM's rule, shared with LLM.chat (inputs.text_content)."""
    from blockspec.server.protocol import ChatMessage

    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    assert ChatMessage(role="user", content=parts).for_template() == {"role": "user", "content": "hi\nthere"}


def test_an_image_part_is_refused_by_name(server):
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]
    with pytest.raises(openai.BadRequestError) as exc:
        server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    assert exc.value.body["message"] == ("messages.0.content.1: image_url parts are not supported; this server serves "
                                         "a text model")
    assert exc.value.body["param"] == "messages"


def test_generation_config_fills_what_a_request_leaves_unset(tmp_path):
    model = save_tiny_model_with_tokenizer(tmp_path / "m")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "max_new_tokens": 3, "top_k": 1}))
    live = LiveServer(create_app(functools.partial(load, model), NAME)).wait_ready()
    try:
        chat = functools.partial(live.client().chat.completions.create, model=NAME,
                                 messages=[{"role": "user", "content": "hi"}], temperature=1.0)
        short = chat(extra_body={"ignore_eos": True})
        assert short.usage.completion_tokens == 3  # max_new_tokens: the model's default max_tokens
        longer = chat(max_tokens=7, extra_body={"ignore_eos": True, "seed": 1})
        assert longer.usage.completion_tokens == 7  # the request's own value wins
        # top_k=1 from the file makes temperature 1.0 greedy: two seeds agree; a request's top_k overrides it
        seeds = {chat(max_tokens=7, extra_body={"ignore_eos": True, "seed": s}).choices[0].message.content
                 for s in (1, 2)}
        assert seeds == {longer.choices[0].message.content}
        varied = {chat(max_tokens=7, extra_body={"ignore_eos": True, "seed": s, "top_k": 0}).choices[0].message.content
                  for s in range(1, 5)}
        assert len(varied) > 1
    finally:
        live.close()


# ---------------------------------------------------------------- metrics and logs
def families(live: LiveServer) -> dict:
    return {f.name: f for f in text_string_to_metric_families(get(f"{live.url}/metrics").text)}


def test_metrics_have_vllms_names_and_labels_and_no_created_series(server, tokenizer):
    before = server.metrics()
    server.client().completions.create(model=NAME, prompt="abc", max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    after = server.metrics()
    text = get(f"{server.url}/metrics").text
    assert "_created" not in text
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                 "request_decode_time", "request_inference_time", "request_time_per_output_token"):
        key = f"vllm:{name}_seconds_count"
        assert metric(after, key, model_name=NAME, engine="0") - metric(before, key) == 1, name
    steps = metric(after, "vllm:inter_token_latency_seconds_count") - metric(before, "vllm:inter_token_latency_seconds_count")
    assert steps == 4  # five tokens, one a step: four intervals after the first
    assert metric(after, "vllm:time_per_output_token_seconds_count") == metric(after, "vllm:inter_token_latency_seconds_count")
    assert metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total") == 5
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:request_success",
            "blockspec:request_failure"} <= set(families(server))
    # the token-count panels of vLLM's dashboard: per request, and a prompt's n copies' longest once all finish
    mid = server.metrics()
    server.client().completions.create(model=NAME, prompt="abcd", n=3, max_tokens=6, temperature=1, seed=2,
                                       extra_body={"ignore_eos": True})
    end = server.metrics()

    def grew(name: str, at: dict, since: dict) -> float:
        return metric(at, name) - metric(since, name)

    assert grew("vllm:request_prompt_tokens_count", after, before) == 1
    assert grew("vllm:request_prompt_tokens_sum", after, before) == len(tokenizer.encode("abc"))
    assert grew("vllm:request_generation_tokens_sum", after, before) == 5
    assert grew("vllm:request_params_max_tokens_sum", after, before) == 5
    assert grew("vllm:iteration_tokens_total_sum", after, before) == len(tokenizer.encode("abc")) + 5
    assert grew("vllm:request_generation_tokens_count", end, mid) == 3
    assert grew("vllm:request_generation_tokens_sum", end, mid) == 18
    assert (grew("vllm:request_params_n_count", end, mid), grew("vllm:request_params_n_sum", end, mid)) == (1, 3)
    assert grew("vllm:request_max_num_generation_tokens_count", end, mid) == 1
    assert grew("vllm:request_max_num_generation_tokens_sum", end, mid) == 6
    assert not any(name.startswith("blockspec:") and name[len("blockspec:"):] in ("num_requests_running",
                                                                                 "generation_tokens")
                   for name in families(server))


def test_metrics_prefix_blockspec(text_dir):
    live = LiveServer(create_app(functools.partial(load, text_dir), "tiny",
                                 config=ServerConfig(metrics_prefix="blockspec"))).wait_ready()
    try:
        names = set(families(live))
        assert {"blockspec:num_requests_running", "blockspec:generation_tokens", "blockspec:request_failure"} <= names
        assert not any(name.startswith("vllm:") for name in names)
    finally:
        live.close()


def test_a_metric_that_fails_costs_no_request_its_tokens(text_dir, monkeypatch, caplog):
    """A step report whose observation raises (a Prometheus counter refuses a negative step: the server then
    answered nothing, while /health said ok) still delivers the step's tokens, and the log says why."""
    from blockspec.server.metrics import ServerMetrics

    def refuse(self, report):
        raise ValueError("Counters can only be incremented by non-negative amounts.")

    monkeypatch.setattr(ServerMetrics, "observe", refuse)
    live = LiveServer(create_app(functools.partial(load, text_dir), "tiny")).wait_ready()
    try:
        with caplog.at_level(logging.ERROR, logger="blockspec.server"):
            out = live.client().completions.create(model="tiny", prompt="abc", max_tokens=4,
                                                   extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        assert any("could not be observed" in r.getMessage() for r in caplog.records)
    finally:
        live.close()


def test_prefix_caching_reports_cached_prompt_tokens_in_usage_and_metrics(text_dir):
    """`--enable-prefix-caching`: a prompt sent again finds its pages; usage's prompt_tokens_details and
    vLLM's prefix-cache counters say how many tokens, and the completion is the same."""
    def cached_load() -> LLM:
        return LLM(str(text_dir), device="cpu", max_model_len=96, max_num_seqs=4, kv_page_size=16,
                   enable_prefix_caching=True)

    live = LiveServer(create_app(cached_load, NAME)).wait_ready()
    try:
        client, prompt = live.client(), "def parse(self, text):\n    return [line.split() for line in text]\n"
        outs = [client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0) for _ in range(2)]
        assert outs[0].choices[0].text == outs[1].choices[0].text
        first, second = (o.usage.prompt_tokens_details.cached_tokens for o in outs)
        assert first == 0 and second >= 16 and second % 16 == 0 and second < outs[1].usage.prompt_tokens
        wait_until(lambda: metric(live.metrics(), "vllm:prefix_cache_hits_total") == second, PATIENCE,
                   "the prefix-cache counter")
        queries = metric(live.metrics(), "vllm:prefix_cache_queries_total")
        assert queries == 2 * outs[0].usage.prompt_tokens  # each looks up its prompt (vLLM's count)
        # vLLM's cache_salt: a salted request finds only its salt's pages
        salted = [client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0,
                                            extra_body={"cache_salt": salt}) for salt in ("s1", "s1", "s2")]
        assert [o.usage.prompt_tokens_details.cached_tokens for o in salted] == [0, second, 0]
        assert {o.choices[0].text for o in salted} == {outs[0].choices[0].text}
        with pytest.raises(openai.BadRequestError, match="cache_salt.*non-empty"):
            client.completions.create(model=NAME, prompt=prompt, max_tokens=6, extra_body={"cache_salt": ""})
    finally:
        live.close()


def test_the_log_reports_throughput_while_busy(server, caplog):
    with caplog.at_level(logging.INFO, logger="blockspec.server"):
        server.client().completions.create(model=NAME, prompt="abc", max_tokens=6, extra_body={"ignore_eos": True})

        def logged() -> list[str]:
            return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Avg prompt throughput")]

        wait_until(lambda: logged(), PATIENCE, "a throughput line")
    line = logged()[0]
    assert "Avg generation throughput:" in line and "Running:" in line and "KV cache usage:" in line


# ---------------------------------------------------------------- the command
def test_serve_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: vllm)", "(default: 8000)", "(default: loopback only)", "(default: 64)"):
        assert default in text, default


def test_serve_takes_vllms_key_variable_and_cors_flag(monkeypatch):
    """vLLM's server reads its key from VLLM_API_KEY where --api-key is not given (blockspec's server ran open
    with it set) and names the CORS credentials flag --allow-credentials."""
    import argparse

    from blockspec.server import add_serve_parser

    monkeypatch.delenv("BLOCKSPEC_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "m", "--allow-credentials"])
    assert args.api_key == ["secret"] and args.allowed_credentials is True
    monkeypatch.setenv("BLOCKSPEC_API_KEY", "ours")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve", "m"]).api_key == ["ours"]
    assert parser.parse_args(["serve", "m", "--api-key", "k1", "k2"]).api_key == ["k1", "k2"]  # vLLM's list


def test_any_of_several_api_keys_opens_the_api():
    """vLLM's --api-key takes several keys; each opens /v1/, and nothing else does."""
    import asyncio

    from blockspec.server.middleware import APIKey

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def status(key: str | None) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        await APIKey(app, ("k1", "k2"))({"type": "http", "path": "/v1/models", "headers": headers}, None, send)
        return sent[0]["status"]

    assert [asyncio.run(status(k)) for k in ("k1", "k2", "k3", None)] == [200, 200, 401, 401]
    with pytest.raises(ConfigError, match="api_key must be a non-empty string, a list of them"):
        ServerConfig(api_key=("k1", ""))


def serve_command(text_dir: Path, *extra: str) -> tuple[subprocess.Popen, str, list[str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "blockspec.cli", "serve", str(text_dir), "--port", str(port), "--max-model-len",
           "64", "--device", "cpu", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    return proc, f"http://127.0.0.1:{port}", lines


# vLLM flags a migrated command line carries: accepted, each knob without a counterpart named in the log
VLLM_FLAGS = ("--uvicorn-log-level", "warning", "--disable-log-requests", "--enable-prompt-tokens-details",
              "--enable-chunked-prefill", "--swap-space", "4", "--disable-custom-all-reduce")


@pytest.mark.parametrize("stop", ["SIGTERM to the server", "Ctrl-C to the process group"])
def test_serve_says_when_it_is_ready_and_stops_cleanly(text_dir, stop):
    proc, url, lines = serve_command(text_dir, "--served-model-name", "cli", *VLLM_FLAGS)
    try:
        wait_until(lambda: any("blockspec serve ready on" in line for line in lines) or proc.poll() is not None,
                   PATIENCE, "the ready line")
        ready = next(line for line in lines if "blockspec serve ready on" in line)
        assert f"ready on {url}, model cli, speculation off" in ready
        assert get(f"{url}/health").status_code == 200
        if stop.startswith("SIGTERM"):
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process of the group
        assert proc.wait(PATIENCE) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines)
    assert "error:" not in text and "exited with code" not in text and "Traceback" not in text, text
    assert "swap_space: blockspec recomputes a preempted request" in text and "disable_custom_all_reduce" in text


EXIT_WITHOUT_SHUTDOWN = """
import asyncio, functools, sys
from blockspec import LLM
from blockspec.server.async_engine import AsyncEngine
from blockspec.server.metrics import ServerMetrics

async def main():
    ready = asyncio.Event()
    engine = AsyncEngine(functools.partial(LLM, sys.argv[1], device="cpu", max_model_len=64), ServerMetrics("m"),
                         process=True, on_ready=lambda inputs: ready.set())
    engine.start()
    await asyncio.wait_for(ready.wait(), 600)
    print(engine.process_id, flush=True)

if __name__ == "__main__":  # the engine process is spawned: it imports this file
    asyncio.run(main())  # ends with no engine.shutdown(), as a forced exit (a second Ctrl-C) skips the app's
"""


def test_an_exit_that_skips_shutdown_still_stops_the_engine_process(text_dir, tmp_path):
    """A second Ctrl-C makes uvicorn exit without the app's shutdown; the interpreter then waited forever on the
    engine process (not a daemon, waiting for commands). It now stops it at exit."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT_WITHOUT_SHUTDOWN)
    proc = subprocess.Popen([sys.executable, str(script), str(text_dir)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.wait(PATIENCE) == 0
        child = int(proc.stdout.read().split()[0])
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_tool_choice_none_shows_the_tools_unless_the_server_excludes_them(offline, tokenizer):
    """As vLLM (and OpenAI's models): under tool_choice "none" the template still sees the tools, which the
    model may not call; --exclude-tools-when-tool-choice-none leaves them out (they were always left out)."""
    from blockspec.server.app import chat_prompt, tool_use
    from blockspec.server.protocol import ChatCompletionRequest

    shown = ("{% for t in tools or [] %}{{ t['function']['name'] }};{% endfor %}"
             "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], chat_template=shown, tool_choice="none",
                                 tools=[{"type": "function", "function": {"name": "get_time", "parameters": {}}}])
    for hide, text in ((False, "get_time;hi"), (True, "hi")):
        ids = chat_prompt(offline.inputs, body, ServerConfig(trust_request_chat_template=True),
                          tool_use(body, None, hide))[1]
        assert ids == tokenizer.encode(text, add_special_tokens=False), hide
