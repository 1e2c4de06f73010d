"""Hostile input over real HTTP on 127.0.0.1: every bad request gets a 4xx in the OpenAI error format (a
500 only for a failure of the server's own, naming no internals), the connection stays usable, and
requests running beside the bad ones finish with exactly the tokens they get alone.

The fuzz part is seeded and bounded: a replay of known bad inputs, then values of the wrong type and
range for every field, and bodies that are not JSON objects, fired in waves beside victim requests."""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from blockspec import LLM, SamplingParams
from blockspec.config import ServerConfig
from blockspec.server.app import create_app
from factories import save_tiny, save_tiny_tokenizer
from live_server import PATIENCE, LiveServer, get, metric, post

MAX_LEN = 128

ERROR_KEYS = {"message", "type", "param", "code"}
SEED = 2**63


def text_llm(path: Path) -> LLM:
    return LLM(str(path), device="cpu", max_model_len=MAX_LEN, max_num_seqs=4)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    path = save_tiny(tmp_path_factory.mktemp("text"), "qwen3", seed=7, vocab=98)
    save_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def text_ref(text_dir) -> LLM:
    return text_llm(text_dir)


@pytest.fixture(scope="module")
def server(text_dir) -> Iterator[LiveServer]:
    """As `blockspec serve` runs by default: the engine in a process of its own, no API key, no request
    templates."""
    live = LiveServer(create_app(functools.partial(text_llm, text_dir), "tiny", engine_process=True)).wait_ready()
    yield live
    live.close()


@pytest.fixture(scope="module")
def guarded(text_dir) -> Iterator[LiveServer]:
    """An operator's choices: an API key, a small body limit, request templates trusted (engine on a thread)."""
    config = ServerConfig(api_key="s3cret", max_request_bytes=4096, trust_request_chat_template=True)
    live = LiveServer(create_app(functools.partial(text_llm, text_dir), "tiny", config=config)).wait_ready()
    yield live
    live.close()


def is_openai_error(r: httpx.Response) -> bool:
    body = r.json()
    return set(body) == {"error"} and set(body["error"]) == ERROR_KEYS and bool(body["error"]["message"])


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
DONE = {"prompt": "a", "max_tokens": 4}

# The cases of the hardening issue, each with the status and the field its error must name.
KNOWN_BAD = [
    ("completions", {**DONE, "temperature": 0.5, "seed": SEED}, 400, "seed"),
    ("completions", {**DONE, "temperature": 0.5, "seed": 2**64}, 400, "seed"),
    ("completions", {**DONE, "temperature": 0.5, "seed": -SEED - 1}, 400, "seed"),
    ("chat/completions", {**CHAT, "temperature": 0.5, "seed": SEED}, 400, "seed"),
    ("chat/completions", {**CHAT, "chat_template": "{% for i in range(15000) %}{% endfor %}"}, 400, "chat_template"),
    ("chat/completions", {**CHAT, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400, "chat_template"),
    ("chat/completions", {**CHAT, "chat_template_kwargs": {"tokenize": False}}, 400, "chat_template_kwargs"),
    ("completions", {**DONE, "logit_bias": {"-1": 100}}, 400, "logit_bias"),
    ("completions", {**DONE, "logit_bias": {"5": "high"}}, 400, "logit_bias"),  # 1e39 is clamped to 100 (vLLM's)
    ("completions", {**DONE, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("completions", {**DONE, "logit_bias": {"5": True}}, 400, "logit_bias"),
    ("completions", {**DONE, "prompt": "abc \ud800 def"}, 400, "prompt"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "abc \ud800"}]}, 400, "messages"),
    ("completions", {**DONE, "n": True}, 400, "n"),
    ("completions", {**DONE, "max_tokens": True}, 400, "max_tokens"),
    ("completions", {**DONE, "logprobs": True}, 400, "logprobs"),
    ("completions", {**DONE, "stop_token_ids": [True]}, 400, "stop_token_ids"),
    ("completions", {**DONE, "stop": 123}, 400, "stop"),
    ("completions", {**DONE, "temperature": "0.5"}, 400, "temperature"),
    ("completions", {**DONE, "ignore_eos": 1}, 400, "ignore_eos"),
    ("completions", {**DONE, "prompt": "x" * 5000}, 400, "prompt"),  # past what 128 tokens can hold
    # a conversation whose rendered tokens pass the context: its field is messages (it was named prompt)
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi " * 100}]}, 400, "messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi " * 30}], "max_tokens": 100}, 400,
     "max_tokens"),
]


@pytest.mark.parametrize("route, body, status, param", KNOWN_BAD)
def test_known_bad_input_gets_a_4xx_naming_the_field(server, route, body, status, param):
    r = post(f"{server.url}/v1/{route}", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert is_openai_error(r) and r.json()["error"]["param"] == param, r.text


def test_starlette_errors_speak_the_openai_format(server):
    r = get(f"{server.url}/v1/nowhere")
    assert r.status_code == 404 and is_openai_error(r) and "/v1/nowhere" in r.json()["error"]["message"]
    r = get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and is_openai_error(r) and "GET" in r.json()["error"]["message"]
    deep = "[" * 100_000 + "]" * 100_000
    r = post(f"{server.url}/v1/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and is_openai_error(r), r.text
    assert r.json()["error"]["message"] == "the request body nests arrays or objects too deeply to parse", r.text
    r = post(f"{server.url}/v1/completions", content=b'{"prompt": "a\xff\xfe"}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and is_openai_error(r), r.text
    assert r.json()["error"]["message"] == r"the request body is not valid UTF-8 (byte 13: b'\xff')", r.text
    assert post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


def test_an_internal_failure_is_a_500_that_keeps_the_connection_and_names_nothing(server, monkeypatch):
    inputs = server.app.state.engine.inputs
    prompt_ids = inputs.prompt_ids

    def explode(prompt, where, *rest):
        if prompt == "explode":
            raise KeyError("internal detail")
        return prompt_ids(prompt, where, *rest)

    monkeypatch.setattr(inputs, "prompt_ids", explode)
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=PATIENCE)
    headers = {"content-type": "application/json"}
    try:
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "explode"}), headers)
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 500 and body["error"]["type"] == "internal_server_error"
        assert "error id" in body["error"]["message"] and "internal detail" not in body["error"]["message"]
        sock = conn.sock
        for _ in range(5):  # the same connection serves on: nothing was reset or reopened
            conn.request("POST", "/v1/completions", json.dumps(DONE), headers)
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["choices"]
            assert conn.sock is sock
    finally:
        conn.close()


def test_a_prompt_too_long_for_the_context_is_refused_without_tokenizing_it(server, monkeypatch):
    inputs = server.app.state.engine.inputs
    seen = []
    encode = inputs.tokenizer.encode

    def spy(text, *args, **kwargs):
        seen.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(inputs.tokenizer, "encode", spy)
    r = post(f"{server.url}/v1/completions", json={"prompt": "y" * (inputs.max_prompt_chars + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and seen == []
    r = post(f"{server.url}/v1/completions", json={"prompt": "y" * (MAX_LEN + 10)})  # tokenized, then refused
    assert r.status_code == 400 and seen == [MAX_LEN + 10]


def test_tokenizing_and_templates_run_off_the_event_loop(server, monkeypatch):
    tok = server.app.state.engine.inputs.tokenizer
    threads = []
    for name in ("encode", "apply_chat_template"):
        method = getattr(tok, name)

        def spy(*args, _method=method, **kwargs):
            threads.append(threading.current_thread().name)
            return _method(*args, **kwargs)

        monkeypatch.setattr(tok, name, spy)
    assert post(f"{server.url}/v1/completions", json=DONE).status_code == 200
    assert post(f"{server.url}/v1/chat/completions", json=CHAT).status_code == 200
    assert len(threads) >= 2 and all(t.startswith(("blockspec-tokenize", "blockspec-template")) for t in threads)


def test_browsers_may_call_from_any_origin_by_default_and_a_preflight_needs_no_key(guarded):
    """CORS as vLLM's defaults set it: a preflight is answered (it used to be a 405) before the API key is
    asked for, and a keyed request from a browser gets the origin header back; a wrong key is still a 401."""
    origin = {"origin": "http://ui.example"}
    r = httpx.options(f"{guarded.url}/v1/chat/completions", timeout=PATIENCE,
                      headers={**origin, "access-control-request-method": "POST",
                               "access-control-request-headers": "authorization, content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", origin["origin"])
    ok = post(f"{guarded.url}/v1/completions", json=DONE, headers={**origin, "authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and "access-control-allow-origin" in ok.headers
    assert post(f"{guarded.url}/v1/completions", json=DONE, headers=origin).status_code == 401


def test_several_served_names_each_answer_under_its_own_name(text_dir):
    """--served-model-name a b: /v1/models lists both, a request may give either and its response carries that
    name, another name is a 404 that lists them."""
    live = LiveServer(create_app(functools.partial(text_llm, text_dir), ["tiny", "alias"])).wait_ready()
    try:
        assert [m["id"] for m in get(f"{live.url}/v1/models").json()["data"]] == ["tiny", "alias"]
        for name in ("tiny", "alias"):
            r = post(f"{live.url}/v1/completions", json={**DONE, "model": name})
            assert r.status_code == 200 and r.json()["model"] == name
        assert get(f"{live.url}/v1/models/alias").json()["id"] == "alias"
        r = post(f"{live.url}/v1/completions", json={**DONE, "model": "other"})
        assert r.status_code == 404 and "serves 'tiny' or 'alias'" in r.json()["error"]["message"]
    finally:
        live.close()


def test_api_key_body_limit_and_trusted_templates(guarded):
    url = guarded.url
    assert get(f"{url}/health").status_code == 200 and get(f"{url}/metrics").status_code == 200  # probes need no key
    r = post(f"{url}/v1/completions", json=DONE)
    assert r.status_code == 401 and is_openai_error(r) and r.json()["error"]["code"] == "invalid_api_key"
    r = post(f"{url}/v1/completions", json=DONE, headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401
    key = {"authorization": "Bearer s3cret"}
    assert post(f"{url}/v1/completions", json=DONE, headers=key).status_code == 200
    big = {**DONE, "prompt": "z" * 5000}
    r = post(f"{url}/v1/completions", json=big, headers=key)
    assert r.status_code == 413 and is_openai_error(r) and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is counted as the body arrives
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 1000):
            yield payload[i:i + 1000]

    r = post(f"{url}/v1/completions", content=chunks(), headers={**key, "content-type": "application/json"})
    assert r.status_code == 413 and is_openai_error(r)
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    r = post(f"{url}/v1/chat/completions", headers=key, json={**CHAT, "chat_template": template, "max_tokens": 2,
                                                              "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == [ord(c) - 30 for c in "[hi]"]  # the character tokenizer


# ---------------------------------------------------------------- fuzz
WRONG_VALUES = [True, False, None, -1, 0, 2**64, -(2**64), 1e308, -1e308, 0.5, "", "x", "\ud800", [], [1, "a"],
                [[]], {}, {"a": {"b": [1]}}, "x" * 3000, [2**70]]
FIELDS = ["model", "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
          "logit_bias", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
          "use_speculation", "return_token_ids",
          "stream", "stream_options", "user", "bad_words", "prompt_logprobs"]


def fuzz_cases(rng: random.Random) -> list[tuple[str, bytes]]:
    """(route, raw body): the known cases, one wrong value in every field (two draws a field), three
    wrong values at once, and bodies that are not a JSON object."""
    cases = [(route, json.dumps(body).encode()) for route, body, _, _ in KNOWN_BAD]
    for route, base, fields in (("completions", DONE, FIELDS + ["prompt", "logprobs", "echo"]),
                                ("chat/completions", CHAT, FIELDS + ["messages", "logprobs", "top_logprobs",
                                                                      "max_completion_tokens", "chat_template_kwargs",
                                                                      "add_generation_prompt",
                                                                      "continue_final_message"])):
        for field in fields:
            for value in rng.sample(WRONG_VALUES, 2):
                cases.append((route, json.dumps({**base, field: value}).encode()))
        for _ in range(10):
            body = dict(base)
            for field in rng.sample(fields, 3):
                body[field] = rng.choice(WRONG_VALUES)
            cases.append((route, json.dumps(body).encode()))
    junk = [b"", b"null", b"[]", b"42", b'"prompt"', b"{", b'{"prompt": "a",', b'{"prompt": NaN}',
            bytes(rng.randrange(256) for _ in range(64)), b'{"prompt": "a"}' * 2, b'{"prompt": "\\ud800"}']
    cases += [(route, body) for body in junk for route in ("completions", "chat/completions")]
    return cases


def test_hostile_requests_never_reach_the_requests_beside_them(server, text_ref):
    """Waves of fuzzed bodies fired beside two victims (a greedy stream and a seeded sample): each bad
    body gets a 4xx in the OpenAI format (a valid one a 200), the server never answers 500, and every
    victim gets exactly its tokens alone."""
    rng = random.Random(26)
    cases = fuzz_cases(rng)
    victims = [dict(prompt="def f(x):", temperature=0, max_tokens=60, ignore_eos=True),
               dict(prompt="class A:", temperature=0.8, seed=11, max_tokens=60, ignore_eos=True)]
    want = [o.outputs[0].token_ids for o in text_ref.generate(
        [v["prompt"] for v in victims], [SamplingParams(**{k: v for k, v in body.items() if k != "prompt"})
                                         for body in victims], use_tqdm=False)]
    failures = metric(server.metrics(), "blockspec:request_failure_total")

    async def victim(client: httpx.AsyncClient, body: dict) -> list[int]:
        ids = []
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                  "return_token_ids": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    ids += chunk["choices"][0]["token_ids"] or []
        return ids

    async def hostile(client: httpx.AsyncClient, route: str, body: bytes) -> tuple[str, bytes, int, bool]:
        r = await client.post(f"/v1/{route}", content=body, headers={"content-type": "application/json"})
        ok = r.status_code == 200 or (400 <= r.status_code < 500 and is_openai_error(r))
        if r.headers.get("content-type", "").startswith("text/event-stream"):  # a valid body asked to stream
            ok = r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
        return route, body, r.status_code, ok

    async def run() -> tuple[list[list[int]], list[tuple[str, bytes, int, bool]]]:
        got, answers = [], []
        async with httpx.AsyncClient(base_url=server.url, timeout=PATIENCE) as client:
            wave = 40
            for start in range(0, len(cases), wave):
                results = await asyncio.gather(*(victim(client, v) for v in victims),
                                               *(hostile(client, *c) for c in cases[start:start + wave]))
                got.append(results[:2])
                answers += results[2:]
        return got, answers

    got, answers = asyncio.run(run())
    assert len(answers) == len(cases) >= 150
    wrong = [(route, body[:120], status) for route, body, status, ok in answers if not ok]
    assert not wrong, wrong
    assert sum(status >= 400 for *_, status, _ in answers) > len(answers) // 2  # the fuzz is mostly refused
    assert all(pair == want for pair in got)
    assert metric(server.metrics(), "blockspec:request_failure_total") == failures
