"""The OpenAI-compatible server over real HTTP on 127.0.0.1 (OpenAI client and httpx): API shape,
streaming, bad input, metrics, cancellation, and exactness of concurrent (continuously batched)
requests against LLM.generate, with and without speculation."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from blockspec import LLM, SamplingParams
from blockspec.cli import main
from blockspec.server.app import create_app
from factories import FAIL_PROMPT, llm_with_faults, save_drafter_target, save_tiny, save_tiny_tokenizer
from live_server import PATIENCE, LiveServer, get, metric, post, stream, wait_until

FIXTURES = Path(__file__).parent / "fixtures" / "drafters"
MAX_LEN = 128


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Engine thread, server loop and clients share two cores: intra-op threads would only contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    path = save_tiny(tmp_path_factory.mktemp("text"), "qwen3", seed=7, vocab=98)  # vocab = the tokenizer's
    save_tiny_tokenizer(path)
    return path


def text_llm_kwargs(path: Path) -> dict:
    return dict(model=str(path), device="cpu", max_model_len=MAX_LEN, max_num_seqs=4)


def text_llm(path: Path) -> LLM:
    return LLM(**text_llm_kwargs(path))


@pytest.fixture(scope="module")
def text_ref(text_dir) -> LLM:
    return text_llm(text_dir)


ENGINE_PLACES = ["thread", "process"]


def served(load: Callable[[], LLM], name: str, place: str, **kw) -> LiveServer:
    """A live server whose engine runs on a thread of this process or in an engine process."""
    return LiveServer(create_app(load, name, engine_process=place == "process", **kw))


@pytest.fixture(scope="module", params=ENGINE_PLACES)
def text_server(text_dir, request) -> Iterator[LiveServer]:
    server = served(functools.partial(text_llm, text_dir), "tiny", request.param).wait_ready()
    yield server
    server.close()


@pytest.fixture(scope="module", params=ENGINE_PLACES)
def faulty_server(text_dir, request) -> Iterator[LiveServer]:
    """Steps take >= 10 ms (a request is surely still running when its client leaves) and fail while a
    request with FAIL_PROMPT runs."""
    load = functools.partial(llm_with_faults, 0.01, **text_llm_kwargs(text_dir))
    server = served(load, "tiny", request.param).wait_ready()
    yield server
    server.close()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_drafter_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def plain_ref(target_dir) -> LLM:
    return LLM(str(target_dir), device="cpu", max_model_len=160)


@pytest.fixture(scope="module", params=[*ENGINE_PLACES, "process, tensor parallel 2"])
def spec_server(target_dir, request) -> Iterator[LiveServer]:
    """Also with the target split over two rank processes (gloo), which step in lockstep with the
    commands rank 0 broadcasts: the same outputs and counts as one process."""
    # a fixed draft length: the adaptive policy would (rightly) stop this random drafter from drafting
    spec = {"method": "dflash", "model": str(FIXTURES / "dflash"), "adaptive_draft_length": False}
    tp = 2 if "tensor parallel" in request.param else 1
    load = functools.partial(LLM, str(target_dir), device="cpu", max_model_len=160, max_num_seqs=8,
                             speculative_config=spec, tensor_parallel_size=tp)
    server = served(load, "spec", request.param.split(",")[0]).wait_ready()
    yield server
    server.close()


GREEDY = dict(temperature=0, max_tokens=24)
NO_EOS = {"ignore_eos": True}


# ---------------------------------------------------------------- life cycle
def test_health_is_503_while_loading_then_200(text_dir):
    release = threading.Event()

    def load() -> LLM:
        release.wait(PATIENCE)
        return text_llm(text_dir)

    server = LiveServer(create_app(load, "late"))
    try:
        r = get(f"{server.url}/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        assert get(f"{server.url}/ping").status_code == 503  # vLLM's (SageMaker's) health check
        r = post(f"{server.url}/v1/completions", json={"prompt": "a"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        release.set()
        server.wait_ready()
        assert get(f"{server.url}/ping").status_code == post(f"{server.url}/ping").status_code == 200
        models = server.client().models.list().data
        assert [m.id for m in models] == ["late"] and models[0].max_model_len == MAX_LEN
    finally:
        release.set()
        server.close()


@pytest.mark.parametrize("place", ENGINE_PLACES)
def test_load_failure_is_reported(text_dir, place):
    failures = []
    load = functools.partial(LLM, str(text_dir), device="cpu", max_model_len=10**6)  # past max_position_embeddings
    server = served(load, "broken", place, on_engine_error=failures.append)
    try:
        wait_until(lambda: failures, PATIENCE, "the load error")
        r = get(f"{server.url}/health")
        assert r.status_code == 503 and "max_position_embeddings" in r.json()["error"]
    finally:
        server.close()


@contextlib.contextmanager
def cli_server(text_dir: Path, *flags: str, scheme: str = "http", verify: Any = True
               ) -> Iterator[tuple[subprocess.Popen, str, int]]:
    """`blockspec serve` of the text model in a process of its own, healthy: (process, url, port); stopped after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "blockspec.cli", "serve", "--model", str(text_dir), "--port", str(port),
           "--device", "cpu", "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"{scheme}://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, proc.stderr.read().decode()
        try:
            return get(f"{url}/health", verify=verify).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(healthy, PATIENCE, "`blockspec serve` to become healthy")
        yield proc, url, port
    finally:
        proc.terminate()
        proc.wait(PATIENCE)


def test_cli_serve_subprocess(text_dir):
    with cli_server(text_dir, "--max-model-len", "64", "--served-model-name", "cli") as (_, url, _):
        r = post(f"{url}/v1/completions", json={"model": "cli", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_cli_serve_that_cannot_load_says_why_once_and_exits_2(text_dir):
    """A model that cannot serve as asked (a reasoning parser over a tokenizer without think tokens) is one line
    on stderr, said once (the engine process's log said it as well), and exit status 2."""
    cmd = [sys.executable, "-m", "blockspec.cli", "serve", "--model", str(text_dir), "--port", "0", "--device", "cpu",
           "--log-level", "warning", "--reasoning-parser", "qwen3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PATIENCE)
    lines = [line for line in done.stderr.splitlines() if "<think>" in line]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: reasoning_parser 'qwen3'"), \
        done.stderr


def test_cli_serve_over_https_under_a_root_path(text_dir, tmp_path):
    """vLLM's --ssl-keyfile / --ssl-certfile serve HTTPS; under --root-path (a reverse proxy's prefix)
    the API key still guards /v1/ (the scope's path then starts with the root path); --response-role names
    a new turn's role, and a continued message keeps its own."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    tls = {"verify": ssl.create_default_context(cafile=str(cert))}
    with cli_server(text_dir, "--max-model-len", "64", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                    "--root-path", "/proxy", "--api-key", "k", "--response-role", "bot", scheme="https",
                    **tls) as (_, url, port):
        assert get(f"{url}/v1/models", **tls).status_code == 401
        auth = {"authorization": "Bearer k"}
        assert get(f"{url}/v1/models", headers=auth, **tls).status_code == 200
        chat = {"model": str(text_dir), "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        r = post(f"{url}/v1/chat/completions", json=chat, headers=auth, **tls)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "bot"
        chat["messages"].append({"role": "assistant", "content": "def"})
        r = post(f"{url}/v1/chat/completions", json={**chat, "add_generation_prompt": False,
                                                     "continue_final_message": True}, headers=auth, **tls)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port is no answer
            get(f"http://127.0.0.1:{port}/health", timeout=30)


@pytest.mark.parametrize("timeout", [None, "300"])
def test_cli_serve_sigterm_aborts_requests_in_flight_or_waits_shutdown_timeout(text_dir, timeout):
    """vLLM's --shutdown-timeout: by default SIGTERM stops the requests in flight at once, each answered with
    why (a stream's error event and [DONE], a non-streamed request's 503, in OpenAI's error format; they got a
    cut connection and a plain-text 500, and the log a traceback each); with a timeout they finish first (to
    max_tokens, then [DONE])."""
    from prometheus_client.parser import text_string_to_metric_families

    def running() -> float:
        text = get(f"{url}/metrics").text
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == "vllm:num_requests_running")

    flags = ["--shutdown-timeout", timeout] if timeout else []
    with cli_server(text_dir, "--max-model-len", "512", *flags) as (proc, url, _):
        # stopped, each request has far more left to run than the shutdown's moment
        body = {"prompt": "a", "max_tokens": 500 if timeout is None else 300, "ignore_eos": True, "temperature": 0}
        answers = []
        whole = threading.Thread(target=lambda: answers.append(post(f"{url}/v1/completions", json=body)))
        if timeout is None:  # running before the stream starts (a moment ahead of it: far less than its run)
            whole.start()
            wait_until(lambda: running() >= 1, PATIENCE, "the non-streamed request to run")
        lines = []
        with stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line and not lines:
                    proc.send_signal(signal.SIGTERM)  # the first token is out: the requests are in flight
                lines += [line] if line else []
        assert proc.wait(PATIENCE) == 0
        assert "Traceback" not in proc.stderr.read().decode()
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        if timeout is None:
            whole.join(PATIENCE)
            said = "the server is shutting down and stopped this request before it finished"
            assert chunks[-1]["error"]["message"].startswith(said) and chunks[-1]["error"]["code"] == 503
            assert "length" not in [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
            assert answers[0].status_code == 503 and answers[0].json()["error"]["message"].startswith(said)
        else:
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("flags, says", [
    (["--ssl-keyfile", "k.pem"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"], "--ssl-keyfile k.pem: no such file, or not readable"),
    (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs 1 or 2 checks client certificates against --ssl-ca-certs"),
])
def test_cli_serve_names_a_tls_flag_that_cannot_work_before_loading(tmp_path, capsys, monkeypatch, flags, says):
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "--model", str(tmp_path / "missing"), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert f"error: {says}" in err and "missing" not in err


def test_cli_serve_without_the_server_extras_says_which_to_install(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert main(["serve", "--model", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert capsys.readouterr().err == 'error: serve needs the server extras (uvicorn not installed): pip install ' \
                                      '"blockspec[server]"\n'


def test_cli_serve_exits_when_the_model_cannot_load(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "missing"), "--port", "0", "--log-level", "critical"]) == 2
    assert "error:" in capsys.readouterr().err


def test_cli_serve_refuses_a_port_it_cannot_listen_on_before_loading(tmp_path, capsys):
    """A port out of range is an argument error, and one in use is said in a line before any model loads
    (the model named here does not exist, so a load would say that instead)."""
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", str(tmp_path / "missing"), "--port", "99999"])
    assert exc.value.code == 2 and "--port: must be 0-65535, got 99999" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(tmp_path / "missing"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot listen on 127.0.0.1 port {port}:" in err and "missing" not in err


def test_cli_serve_refuses_tensor_parallelism_on_a_thread_by_name(text_dir, capsys):
    assert main(["serve", "--model", str(text_dir), "--tensor-parallel-size", "2", "--no-engine-process",
                 "--port", "0"]) == 2
    assert "--tensor-parallel-size 2 needs the engine process" in capsys.readouterr().err
    # a target the ranks cannot split is named before the server starts (it was found by the engine process,
    # after uvicorn's start-up lines, and said twice)
    assert main(["serve", "--model", str(text_dir), "--tensor-parallel-size", "3", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("error: tensor_parallel_size=3 does not divide") == 1 and "(--tensor-parallel-size)" in err


# ---------------------------------------------------------------- API shape
def test_completion_equals_llm_generate(text_server, text_ref):
    want = text_ref.generate("def f(x):", SamplingParams(**GREEDY, ignore_eos=True), use_tqdm=False)[0]
    resp = text_server.client().completions.create(model="tiny", prompt="def f(x):", **GREEDY,
                                                   extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = resp.choices[0]
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion" and resp.model == "tiny"
    assert choice.text == want.outputs[0].text and choice.token_ids == want.outputs[0].token_ids
    assert choice.prompt_token_ids == want.prompt_token_ids and choice.finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(want.prompt_token_ids), 24)
    assert getattr(resp, "spec_decode", None) is None  # no drafter on this server


def test_streaming_completion_with_usage(text_server):
    client = text_server.client()
    whole = client.completions.create(model="tiny", prompt="import os", **GREEDY, extra_body=NO_EOS)
    chunks = list(client.completions.create(model="tiny", prompt="import os", **GREEDY, stream=True, extra_body=NO_EOS,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert len(chunks) > 3 and chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    # vLLM's continuous_usage_stats: every chunk carries the usage so far, counting up to the total
    running = list(client.completions.create(model="tiny", prompt="import os", **GREEDY, stream=True,
                                             extra_body=NO_EOS, stream_options={"include_usage": True,
                                                                                "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in running]
    assert counts == sorted(counts) and counts[-1] == 24 and counts[0] < 24
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in running)
    # with n > 1 each chunk's usage is its own choice's (vLLM's previous_num_tokens[i]), not the choices' sum
    pair = list(client.completions.create(model="tiny", prompt="import os", max_tokens=6, temperature=0.8, n=2,
                                          stream=True, extra_body=NO_EOS,
                                          stream_options={"include_usage": True, "continuous_usage_stats": True}))
    for i in (0, 1):
        own = [c.usage.completion_tokens for c in pair if c.choices and c.choices[0].index == i]
        assert own == sorted(own) and own[-1] == 6
    assert pair[-1].usage.completion_tokens == 12
    # vLLM's: continuous_usage_stats only beside include_usage; a chat stream's role chunk carries the prompt's
    alone = list(client.completions.create(model="tiny", prompt="import os", max_tokens=3, stream=True,
                                           stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in alone)
    chat = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                               stream=True, stream_options={"include_usage": True,
                                                                            "continuous_usage_stats": True}))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert chat[0].usage.prompt_tokens == chat[-1].usage.prompt_tokens > 0
    with stream("POST", f"{text_server.url}/v1/completions",
                      json={"prompt": "x", "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_chat_and_streaming_chat(text_server, text_ref):
    messages = [{"role": "user", "content": "hello"}]
    want = text_ref.chat(messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    client = text_server.client()
    resp = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_completion_tokens=10,
                                          extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion" and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == want.outputs[0].text
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=10,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_streamed_equals_non_streamed(text_server, text_ref):
    full = text_ref.generate("class A:", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].text
    stop = full[20:23]
    expect = full[: full.index(stop)]
    client = text_server.client()
    kw = dict(model="tiny", prompt="class A:", temperature=0, max_tokens=60, stop=[stop], extra_body=NO_EOS)
    whole = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert whole.choices[0].text == streamed == expect
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].model_extra["stop_reason"] == stop


def test_logprobs(text_server, text_ref):
    want = text_ref.generate("abc", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
                             use_tqdm=False)[0].outputs[0]
    client = text_server.client()
    lp = client.completions.create(model="tiny", prompt="abc", temperature=0, max_tokens=6, logprobs=2,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e[t].logprob for e, t in zip(want.logprobs, want.token_ids)], abs=1e-5)
    assert "".join(lp.tokens) == want.text and all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "abc"}], temperature=0,
                                          max_tokens=4, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert len(chat) == 4 and all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob for e in chat)


def test_prompt_lists_and_n(text_server, text_ref):
    params = dict(temperature=0.9, seed=3, max_tokens=8)
    want = text_ref.generate(["ab", "xyz"], SamplingParams(**params, n=2, ignore_eos=True), use_tqdm=False)
    resp = text_server.client().completions.create(model="tiny", prompt=["ab", "xyz"], n=2, **params,
                                                   extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [o.text for w in want for o in w.outputs]
    assert resp.usage.completion_tokens == 32 and resp.usage.prompt_tokens == 5


def test_sampling_fields_reach_the_engine(text_server, text_ref):
    openai_fields = {"temperature": 0.9, "top_p": 0.9, "seed": 5, "max_tokens": 12, "presence_penalty": 0.5,
                     "frequency_penalty": 0.3, "stop": ["zz"], "logit_bias": {"50": 2.0}}
    extras = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 4, "stop_token_ids": [40]}
    params = SamplingParams(**{**openai_fields, "logit_bias": {50: 2.0}}, **extras)
    want = text_ref.generate("abc", params, use_tqdm=False)[0].outputs[0]
    got = text_server.client().completions.create(model="tiny", prompt="abc", **openai_fields,
                                                  extra_body={**extras, "return_token_ids": True}).choices[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)


BAD_REQUESTS = [
    ("completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "a", "top_k": -5}, 400, "top_k"),
    ("completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("completions", {"prompt": "a", "n": 1000}, 400, "n"),
    ("completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "a", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("completions", {"prompt": "x" * (MAX_LEN + 5)}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [5, 500]}, 400, "prompt"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"prompt": "a", "stop_token_ids": [1000]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "a", "best_of": 2}, 400, "best_of"),
    ("completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": MAX_LEN}, 400,
     "max_completion_tokens"),
    # a value given under the chat field's name is named by it (they were named max_tokens and logprobs)
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 0}, 400, "max_tokens"),
]


@pytest.mark.parametrize("route, body, status, param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(text_server, route, body, status, param):
    r = post(f"{text_server.url}/v1/{route}", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    if status == 404:
        assert err["code"] == "model_not_found"


def test_malformed_json_then_server_carries_on(text_server):
    r = post(f"{text_server.url}/v1/completions", content=b'{"prompt": "a",',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        text_server.client().completions.create(model="tiny", prompt="a", temperature=-1)
    assert text_server.client().completions.create(model="tiny", prompt="a", max_tokens=2).choices[0].text is not None


# ---------------------------------------------------------------- cancellation
def test_client_leaving_a_stream_aborts_it(faulty_server):
    aborted = metric(faulty_server.metrics(), "vllm:request_success_total", finished_reason="abort")
    with stream("POST", f"{faulty_server.url}/v1/completions",
                      json={"prompt": "a", "max_tokens": 120, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    wait_until(lambda: metric(faulty_server.metrics(), "vllm:request_success_total", finished_reason="abort")
               == aborted + 1, PATIENCE, "the request to be aborted")
    after = faulty_server.metrics()
    assert metric(after, "vllm:num_requests_running") == 0 and metric(after, "vllm:kv_cache_usage_perc") == 0
    assert faulty_server.client().completions.create(model="tiny", prompt="a", max_tokens=3).usage.completion_tokens >= 1


def test_client_leaving_a_non_streaming_request_aborts_it(faulty_server):
    aborted = metric(faulty_server.metrics(), "vllm:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        post(f"{faulty_server.url}/v1/completions", json={"prompt": "a", "max_tokens": 120, "ignore_eos": True},
                   timeout=0.3)
    wait_until(lambda: metric(faulty_server.metrics(), "vllm:request_success_total", finished_reason="abort")
               == aborted + 1, PATIENCE, "the request to be aborted")
    assert metric(faulty_server.metrics(), "vllm:num_requests_running") == 0
    assert faulty_server.client().completions.create(model="tiny", prompt="b", max_tokens=3).usage.completion_tokens >= 1


def test_a_request_whose_steps_fail_fails_alone(faulty_server, text_ref):
    """Steps fail whenever a FAIL_PROMPT request runs in them: it ends in a 500 that names no internals
    and is counted as a failure, while the requests beside it finish with generate's tokens."""
    failures = metric(faulty_server.metrics(), "blockspec:request_failure_total")
    params = dict(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    prompts = ["abc", "hello", "xyz"]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=faulty_server.url, timeout=PATIENCE) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json={"prompt": p, **params,
                                                                                "return_token_ids": True})
                                          for p in [FAIL_PROMPT, *prompts]))

    bad, *good = asyncio.run(run())
    assert bad.status_code == 500
    message = bad.json()["error"]["message"]
    assert "the engine failed while serving this request (error id" in message and "simulated" not in message
    want = text_ref.generate(prompts, SamplingParams(**params), use_tqdm=False)
    assert [r.json()["choices"][0]["token_ids"] for r in good] == [o.outputs[0].token_ids for o in want]
    after = faulty_server.metrics()
    assert metric(after, "blockspec:request_failure_total") == failures + 1
    assert metric(after, "vllm:num_requests_running") == 0
    assert faulty_server.client().completions.create(model="tiny", prompt="a", max_tokens=2).usage.completion_tokens >= 1


def test_engine_process_death_fails_requests_and_health(text_dir):
    """The engine process killed mid-request: the request ends in a 500 that says so, /health turns 503
    with the reason, and the owner hears of it (`blockspec serve` exits on it)."""
    failures = []
    load = functools.partial(llm_with_faults, 0.01, **text_llm_kwargs(text_dir))
    server = served(load, "tiny", "process", on_engine_error=failures.append).wait_ready()
    try:
        with stream("POST", f"{server.url}/v1/completions",
                          json={"prompt": "a", "max_tokens": 120, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(server.app.state.engine.process_id, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "engine process exited" in rest[-2]
        wait_until(lambda: failures, PATIENCE, "the engine error to be reported")
        assert "engine process exited with code -9" in failures[0]
        r = get(f"{server.url}/health")
        assert r.status_code == 503 and "code -9" in r.json()["error"]
        assert post(f"{server.url}/v1/completions", json={"prompt": "a"}).status_code == 503
    finally:
        server.close()


# ---------------------------------------------------------------- concurrency and speculation
def token_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 95, (int(k),), generator=g).tolist() for k in torch.randint(1, 40, (n,), generator=g)]


async def fire(url: str, jobs: list[tuple[list[int], dict]]) -> list[dict]:
    """All jobs at once (staggered by a few ms, so they join a running batch); every second one streamed."""
    async with httpx.AsyncClient(base_url=url, timeout=PATIENCE) as client:
        async def one(i: int, prompt: list[int], body: dict) -> dict:
            await asyncio.sleep(0.003 * i)
            payload = {**body, "prompt": prompt, "return_token_ids": True, "ignore_eos": True}
            if i % 2:
                return (await client.post("/v1/completions", json=payload)).json()
            ids, last = [], {}
            async with client.stream("POST", "/v1/completions",
                                     json={**payload, "stream": True, "stream_options": {"include_usage": True}}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        last = json.loads(line[6:])
                        ids += last["choices"][0]["token_ids"] if last["choices"] else []
            return {"choices": [{"token_ids": ids}], "spec_decode": last["spec_decode"]}

        return await asyncio.gather(*(one(i, p, b) for i, (p, b) in enumerate(jobs)))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_concurrent_requests_are_batched_and_exact(spec_server, plain_ref, temperature):
    """12 concurrent requests on 8 slots, every other one opting out of speculation, half of them streamed:
    every output equals LLM.generate's (greedy, and seeded sampling)."""
    batch_sizes: list[float] = []  # the running-requests gauge, polled while the requests run
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            batch_sizes.append(metric(spec_server.metrics(), "vllm:num_requests_running"))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    prompts = token_prompts(6, seed=int(temperature * 10))
    base = dict(temperature=temperature, max_tokens=24, seed=17)
    jobs = [(p, {**base, "use_speculation": spec}) for p in prompts for spec in (True, False)]
    try:
        results = asyncio.run(fire(spec_server.url, jobs))
    finally:
        done.set()
        poller.join(10)
    want = plain_ref.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**base, ignore_eos=True),
                              use_tqdm=False)
    assert [r["choices"][0]["token_ids"] for r in results] == [o.outputs[0].token_ids for o in want for _ in "ab"]
    assert [r["spec_decode"]["num_drafts"] > 0 for r in results] == [b["use_speculation"] for _, b in jobs]
    assert max(batch_sizes) >= 4  # the requests really ran together


def test_requests_preempted_for_pages_stream_what_generate_gives(target_dir, plain_ref):
    """A server whose KV pool holds about one request of max_model_len, and eight concurrent requests
    that grow long (half streamed): requests are preempted and recomputed while their clients wait,
    and every client gets exactly LLM.generate's tokens, none repeated or lost; /metrics counts the
    preemptions and shows the pool's use."""
    spec = {"method": "dflash", "model": str(FIXTURES / "dflash"), "adaptive_draft_length": False}
    load = functools.partial(LLM, str(target_dir), device="cpu", max_model_len=160, max_num_seqs=8,
                             speculative_config=spec, num_kv_pages=14, kv_page_size=16)
    server = served(load, "spec", "process").wait_ready()
    try:
        prompts = token_prompts(8, seed=31)
        base = dict(temperature=0.8, max_tokens=110, seed=5)
        results = asyncio.run(fire(server.url, [(p, base) for p in prompts]))
        after = server.metrics()
    finally:
        server.close()
    want = plain_ref.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**base, ignore_eos=True),
                              use_tqdm=False)
    assert [r["choices"][0]["token_ids"] for r in results] == [o.outputs[0].token_ids for o in want]
    assert metric(after, "vllm:num_preemptions_total") > 2
    assert metric(after, "vllm:kv_cache_usage_perc") == 0  # every page back once all finished


def test_clients_leaving_mid_batch_leave_the_others_exact(spec_server, plain_ref):
    """Streams closed after their first chunk are aborted while the others run on: on the tensor-parallel
    server every rank must drop the same requests, or the ranks' batches (and collectives) part."""
    prompts = token_prompts(8, seed=4)
    base = dict(temperature=0, max_tokens=60, seed=17, ignore_eos=True)
    aborted = metric(spec_server.metrics(), "vllm:request_success_total", finished_reason="abort")

    async def run() -> list[list[int] | None]:
        async with httpx.AsyncClient(base_url=spec_server.url, timeout=PATIENCE) as client:
            async def one(i: int, prompt: list[int]) -> list[int] | None:
                payload = {**base, "prompt": prompt, "return_token_ids": True, "stream": True}
                ids = []
                async with client.stream("POST", "/v1/completions", json=payload) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            ids += json.loads(line[6:])["choices"][0]["token_ids"]
                            if i % 3 == 0:
                                return None  # leaves mid-stream
                return ids

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    got = asyncio.run(run())
    want = plain_ref.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**base), use_tqdm=False)
    assert [g for g in got if g is not None] == [o.outputs[0].token_ids for i, o in enumerate(want) if i % 3]
    wait_until(lambda: metric(spec_server.metrics(), "vllm:request_success_total", finished_reason="abort")
               >= aborted + 1, PATIENCE, "the aborts to be counted")
    assert metric(spec_server.metrics(), "vllm:num_requests_running") == 0


def test_spec_metrics_match_responses(spec_server):
    before = spec_server.metrics()
    prompt = token_prompts(1, seed=9)[0]
    resp = spec_server.client().completions.create(model="spec", prompt=prompt, temperature=0, max_tokens=20,
                                                   extra_body={"ignore_eos": True})
    spec = resp.model_extra["spec_decode"]
    after = spec_server.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert spec["num_drafts"] > 0 and spec["mean_acceptance_length"] == pytest.approx(
        1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    assert delta("vllm:spec_decode_num_drafts_total") == spec["num_drafts"]
    assert delta("vllm:spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"]
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == spec["num_accepted_tokens"]
    assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total") == spec["num_accepted_tokens"]
    assert delta("vllm:generation_tokens_total") == 20 == resp.usage.completion_tokens
    assert delta("vllm:prompt_tokens_total") == len(prompt)
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    # one per-request figure each; an inter-token latency for each later step that gave it tokens (a
    # speculative step gives several), the older time_per_output_token name holding the same
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
                 "request_inference_time", "request_time_per_output_token"):
        assert delta(f"vllm:{name}_seconds_count") == 1, name
    steps = delta("vllm:inter_token_latency_seconds_count")
    assert 1 <= steps <= 19 and delta("vllm:time_per_output_token_seconds_count") == steps
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert metric(after, f"vllm:{gauge}") == 0
    assert any(name == "vllm:spec_decode_num_accepted_tokens_per_pos_total" and ("position", "0") in labels
               for name, labels in after)
    # the draft-length policy's view (this server's policy is fixed: every decode step takes K = k_max)
    steps = {k: delta("blockspec:spec_decode_policy_steps_total", draft_length=k)
             for k in {dict(ls)["draft_length"] for n, ls in after if n == "blockspec:spec_decode_policy_steps_total"}}
    (k, n), = [(k, n) for k, n in steps.items() if n]
    assert k != "0" and spec["num_drafts"] <= n <= 20
    assert metric(after, "blockspec:spec_decode_policy_expected_tokens", draft_length=k) > 1
    assert metric(after, "blockspec:spec_decode_policy_step_seconds", draft_length=k) > 0


def test_parked_batch_buckets_and_their_requests_in_metrics():
    """The policy's parks: a gauge per batch bucket (1 while parked, back to 0 after), and a counter of
    the requests that joined a parked batch, differenced between views."""
    from blockspec.request import SpecStats
    from blockspec.engine.loop import EngineGauges, StepMetrics
    from blockspec.server.metrics import ServerMetrics
    from blockspec.speculative.policy import PolicyView

    metrics = ServerMetrics("m")

    def observe(parked: list[int], joins: int) -> dict:
        view = PolicyView({0: 3}, {(8, 0): 0.001}, {0: 1.0}, parked, joins)
        metrics.observe(StepMetrics(EngineGauges(0, 0, 0.0, 0, SpecStats(), view)))
        return {(s.name, frozenset(s.labels.items())): s.value
                for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}

    first = observe([8, 16], 3)
    assert metric(first, "blockspec:spec_decode_policy_parked", batch_bucket="8") == 1
    assert metric(first, "blockspec:spec_decode_policy_parked", batch_bucket="16") == 1
    assert metric(first, "blockspec:spec_decode_policy_parked_requests_total") == 3
    later = observe([16], 5)
    assert metric(later, "blockspec:spec_decode_policy_parked", batch_bucket="8") == 0
    assert metric(later, "blockspec:spec_decode_policy_parked", batch_bucket="16") == 1
    assert metric(later, "blockspec:spec_decode_policy_parked_requests_total") == 5


def test_deltas_that_waited_together_are_merged_per_choice():
    """A front that falls behind the engine sends one chunk per choice for all the steps it missed, with
    nothing lost or reordered; an error among them ends the request."""
    from blockspec.request import Logprob, SpecStats
    from blockspec.engine.loop import Delta, StepReport
    from blockspec.server.async_engine import AsyncEngine
    from blockspec.engine.loop import EngineGauges, StepMetrics
    from blockspec.server.metrics import ServerMetrics

    def lp(tok: int) -> dict:
        return {tok: Logprob(-float(tok), 1)}

    def report(*outputs) -> StepReport:  # deltas travel as their fields
        wire = [(rid, d if isinstance(d, BaseException) else tuple(vars(d).values())) for rid, d in outputs]
        return StepReport(wire, StepMetrics(EngineGauges(0, 0, 0.0, 0, SpecStats())))

    async def run() -> tuple[list[Delta], list[str]]:
        engine = AsyncEngine(lambda: None, ServerMetrics("m"))
        got = []
        stream = engine.generate("r", [(None, [1])], SamplingParams(n=2))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the request is registered; three steps' reports arrive before it wakes
        engine._receive(report(("r", Delta(0, "a", [1], [lp(1)])), ("r", Delta(1, "x", [7], [lp(7)]))))
        engine._receive(report(("other", Delta(0, "?", [9], None)), ("r", Delta(0, "b", [2], [lp(2)]))))
        spec = SpecStats(1, 2, 1, [1, 0])
        engine._receive(report(("r", Delta(0, "c", [3], [lp(3)], "stop", "c", None, spec)),
                               ("r", Delta(1, "y", [8], [lp(8)], "length"))))
        got.append(await first)
        got += [d async for d in stream]
        errors = []
        failing = engine.generate("s", [(None, [1])], SamplingParams())
        pending = asyncio.ensure_future(failing.__anext__())
        await asyncio.sleep(0)
        engine._receive(report(("s", Delta(0, "a", [1], None)), ("s", RuntimeError("device lost"))))
        try:
            await pending
        except RuntimeError as exc:
            errors.append(str(exc))
        return got, errors

    got, errors = asyncio.run(run())
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in got] == [(0, "abc", [1, 2, 3], "stop"),
                                                                              (1, "xy", [7, 8], "length")]
    assert got[0].logprobs == [lp(1), lp(2), lp(3)] and got[0].stop_reason == "c" and got[0].spec.num_drafts == 1
    assert got[1].spec is None and errors == ["device lost"]


def test_a_request_checked_while_the_engine_died_is_answered_with_the_error():
    """A request that passed the ready check before the engine's death was known (its prompt tokenizing, its
    constraint compiling) is failed with the engine's error, not left waiting for an engine that is gone."""
    from blockspec.server.async_engine import AsyncEngine, EngineError
    from blockspec.server.metrics import ServerMetrics

    async def run() -> str:
        engine = AsyncEngine(lambda: None, ServerMetrics("m"))
        engine._failed("the engine process exited with code -9")  # no request in flight to fail
        try:
            await asyncio.wait_for(engine.generate("late", [(None, [1])], SamplingParams()).__anext__(), 10)
        except EngineError as exc:
            return str(exc)
        return "answered"

    assert asyncio.run(run()) == "the engine stopped: the engine process exited with code -9"


def test_serving_moves_what_loading_left_alive_out_of_the_collectors_reach():
    """`blockspec serve` freezes what the load left alive, so a full collection no longer walks the
    weights' Python objects, the tokenizer and the modules while requests wait."""
    from blockspec.server.async_engine import freezing_after

    loaded = [[i] for i in range(1000)]  # container objects: ones the collector tracks
    assert any(o is loaded for o in gc.get_objects())
    try:
        assert freezing_after(lambda: loaded)() is loaded
        assert gc.get_freeze_count() >= len(loaded)
        assert not any(o is loaded for o in gc.get_objects())  # in no generation: never walked again
    finally:
        gc.unfreeze()
