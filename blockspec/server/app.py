"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics, and vLLM's /tokenize, /detokenize and /version, over an AsyncEngine.

Requests are validated completely on the event loop (sampling values, prompt length against the
context, token ids against the vocabulary) before anything reaches the engine, so a bad request
costs a 400 and nothing else. A client that goes away aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from blockspec import __version__
from blockspec.config import ServerConfig
from blockspec.request import Logprob, SpecStats, TokenStrings
from blockspec.errors import USER_ERRORS, ConstraintError, ConversationError, RequestError
from blockspec.inputs import ModelInputs, Prompt, chat_ids, check_text, engine_template_arguments
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams
from blockspec.engine.loop import Delta
from blockspec.engine.output import NO_TOKEN
from blockspec.server.async_engine import AsyncEngine, EngineError
from blockspec.server.metrics import ServerMetrics
from blockspec.server.middleware import APIKey, BodyLimit, InternalErrors
from blockspec.server.reasoning import ReasoningStream, split_reasoning
from blockspec.server.tools import PARSERS, ToolStream, ToolUse
from blockspec.server.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChatLogprobs, CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage,
    DeltaToolCall, DetokenizeRequest, DetokenizeResponse, ErrorInfo, ErrorResponse, GenerationRequest, ModelCard,
    ModelList, NamedToolChoice, PromptLogprob, PromptLogprobs, PromptTokensDetails, ResponseBase, SpecDecodeStats,
    TokenizeChatRequest, TokenizeRequest, TokenizeResponse, TokenLogprob, ToolCall, TopLogprob, Usage, VersionResponse,
)

log = logging.getLogger("blockspec.server")


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with a status."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.info = status, ErrorInfo(message=message, type=type, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status)


def request_failed(message: str) -> APIError:
    """The error a request ended with: a 400 where its own masks left no token to sample (the request's fault,
    whatever the model does), else a 500."""
    if message.startswith(NO_TOKEN):
        return APIError(400, message)
    return APIError(500, message, type="internal_server_error")


def user_error(exc: Exception, param: str | None = None) -> APIError:
    """A 400 for a user error; the field is read from SamplingParams' message when it names one."""
    named = re.search(r"SamplingParams\.(\w+)", str(exc))
    return APIError(400, str(exc).replace("SamplingParams.", ""), named.group(1) if named else param)


# how pydantic names a union's member in an error's location: a type, not one of the user's fields
UNION_MEMBER = re.compile(r"(str|int|float|bool|none|list|dict|tuple|literal)(\[.*\])?|function-.*|[A-Z]\w*")


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic complaint as one readable line (malformed JSON, wrong type, unknown field);
    `param` is the top-level field it is about."""
    err = exc.errors()[0]
    # a union's members appear in the location as type names ("str", "list[int]"): not the user's words
    loc = [str(x) for x in err.get("loc", ())[1:] if not UNION_MEMBER.fullmatch(str(x))]
    if err.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
    if err.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: {'.'.join(loc)!r}", param=loc[0])
    if err.get("type") == "content_part":  # the refused part's index: messages.0.content.1
        loc.append(str(err["ctx"]["part"]))
    return APIError(400, f"{'.'.join(loc) or 'body'}: {err.get('msg')}", param=loc[0] if loc else None)


def api_error_of(exc: Exception) -> APIError:
    """The API's answer to an exception that ends a request: a user error is a 400, an engine failure a
    500 with its own words; anything else a 500 that names no internals (logged with its id)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, USER_ERRORS):
        return user_error(exc)
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), type="internal_server_error")
    error_id = uuid.uuid4().hex[:12]
    log.error("a request failed (error id %s)", error_id, exc_info=exc)
    return APIError(500, f"internal server error (error id {error_id}; the server log has the details)",
                    type="internal_server_error")


def unparsable_body(body: bytes) -> str:
    """Why a body the framework could not parse as JSON is not JSON: bytes that are not UTF-8 (the first
    one named), or arrays and objects nested deeper than a parser follows."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"the request body is not valid UTF-8 (byte {err.start}: {body[err.start:err.start + 1]!r})"
    try:
        json.loads(text)
    except RecursionError:
        return "the request body nests arrays or objects too deeply to parse"
    except ValueError as err:
        return f"malformed JSON body: {err}"
    return "the request body could not be parsed as JSON"


def http_error(request: Request, exc: HTTPException, body: bytes = b"") -> APIError:
    """Starlette's own errors (no such route, method not allowed, a body it could not parse: `body`) in
    the OpenAI format."""
    if exc.status_code == 404:
        return APIError(404, f"no such route: {request.method} {request.url.path}", code="not_found")
    if exc.status_code == 405:
        return APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                        code="method_not_allowed")
    if exc.status_code == 400:
        return APIError(400, unparsable_body(body))
    return APIError(exc.status_code, str(exc.detail))


# ---------------------------------------------------------------- inputs
def completion_prompts(inputs: ModelInputs, prompt: str | list[str] | list[int] | list[list[int]],
                       truncating: bool = False, add_special_tokens: bool = True) -> list[Prompt]:
    """One (text, ids) per prompt: a string, a list of strings, token ids or a list of token-id lists
    (`truncating`: the request keeps its prompts' last tokens, so a long text is not refused untokenized;
    `add_special_tokens`: a text's ids with the tokenizer's special tokens, e.g. a BOS)."""
    single = isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))
    items = [prompt] if single else list(prompt)
    if not items:
        raise APIError(400, "prompt is empty", param="prompt")
    out = []
    for i, p in enumerate(items):
        where = "prompt" if single else f"prompt[{i}]"
        try:
            out.append(inputs.prompt_ids(p if isinstance(p, str) else {"prompt_token_ids": p}, where, truncating,
                                         add_special_tokens))
        except RequestError as exc:
            raise user_error(exc, "prompt") from None
    return out


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """/tokenize's ids of a text prompt (valid Unicode only)."""
    check_text(text, "prompt")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_strings(value: Any, where: str) -> None:
    """Every string in a message (content, name, tool fields) must be valid Unicode."""
    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_strings(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_strings(item, f"{where}.{i}")


def template_arguments(tokenizer: Any, body: ChatCompletionRequest, trusted: bool,
                       defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The chat template's extra variables from `chat_template_kwargs` over the server's `defaults`, and the
    request's own template where the server trusts request templates. Arguments of apply_chat_template itself
    (tokenize, conversation, ...) are the server's to set, not a template variable."""
    kwargs = {**(defaults or {}), **(body.chat_template_kwargs or {})}
    if body.documents is not None:  # vLLM's: to the template as its `documents`, as transformers takes them
        kwargs["documents"] = body.documents
    template = kwargs.pop("chat_template", None) or body.chat_template
    if template is not None:
        if not trusted:
            raise APIError(400, "this server does not render chat templates sent with a request (start it with "
                                "--trust-request-chat-template to allow them)", param="chat_template")
        if not isinstance(template, str):
            raise APIError(400, "chat_template must be a string", param="chat_template")
        kwargs["chat_template"] = template
    taken = engine_template_arguments(tokenizer, kwargs)
    if taken:
        raise APIError(400, f"chat_template_kwargs.{taken[0]} is set by the server, not by a request",
                       param="chat_template_kwargs")
    return kwargs


def tool_use(body: ChatCompletionRequest, parser_name: str | None, hide_when_none: bool = False,
             generating: bool = True) -> ToolUse | None:
    """The request's tools and tool choice (None without tools); a choice that needs tools, or "auto"
    without a parser configured where the output is `generating` (/tokenize only renders the tools), is a
    400. `hide_when_none`: ServerConfig.exclude_tools_when_tool_choice_none."""
    choice = body.tool_choice
    named = {"name": choice.function.name} if isinstance(choice, NamedToolChoice) else None
    if not body.tools:
        if named is not None or choice == "required":
            raise APIError(400, "tool_choice asks for a tool call, but the request has no tools", param="tool_choice")
        return None
    use = ToolUse([t.function.model_dump(exclude_none=True) for t in body.tools], named or choice or "auto",
                  body.parallel_tool_calls, PARSERS[parser_name] if parser_name else None, hide_when_none)
    if use.choice == "auto" and use.parser is None and generating:
        raise APIError(400, 'tool_choice "auto" needs the server started with --tool-call-parser (hermes for Qwen, '
                            'llama3_json for Llama 3); "required" or a named function work without one',
                       param="tool_choice")
    return use


def chat_prompt(inputs: ModelInputs, body: ChatCompletionRequest, config: ServerConfig,
                tools: ToolUse | None = None) -> Prompt:
    """The conversation rendered by the chat template (with the tools the model may call, and the server's
    template variables and trust in request templates) and tokenized (in a worker thread: a template's loops
    and a long conversation's tokens are no work for the event loop)."""
    tok = inputs.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    if not body.messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    messages = [m.for_template() for m in body.messages]
    try:
        check_strings(messages, "messages")
    except RequestError as exc:
        raise user_error(exc, "messages") from None
    chars = sum(len(m.get("content") or "") for m in messages)
    if chars > inputs.max_prompt_chars and body.truncate_prompt_tokens is None:  # truncating keeps the last tokens
        raise APIError(400, f"messages have {chars} characters, more than max_model_len ({inputs.max_model_len}) "
                            f"tokens can hold (at most {inputs.max_prompt_chars})", param="messages")
    kwargs = template_arguments(tok, body, config.trust_request_chat_template, config.default_chat_template_kwargs)
    if tools is not None and tools.template_tools() is not None:
        kwargs["tools"] = tools.template_tools()
    # vLLM's merge: chat_template_kwargs' apply_chat_template arguments win over the request's fields
    add_prompt = kwargs.pop("add_generation_prompt", body.add_generation_prompt)
    continue_final = kwargs.pop("continue_final_message", body.continue_final_message)
    try:
        ids = chat_ids(tok, messages, add_prompt, continue_final, "messages", **kwargs)
    except ConversationError as exc:
        raise user_error(exc, "messages") from None
    except RequestError as exc:
        raise user_error(exc, "continue_final_message") from None
    except Exception as exc:  # template errors (jinja raise_exception, bad kwargs) are the request's fault
        raise APIError(400, f"the chat template failed on these messages: {exc}", param="messages") from None
    if body.add_special_tokens:  # vLLM's: the tokenizer's leading special tokens (a BOS) before the template's
        ids = tok.encode("", add_special_tokens=True) + ids
    return Prompt(None, ids)


def check_prompts(inputs: ModelInputs, prompts: list[Prompt], params: SamplingParams,
                  constraint_field: str = "response_format", prompt_field: str = "prompt",
                  max_tokens_field: str = "max_tokens", cache_salt: str | None = None) -> list[Prompt]:
    """The prompts as the engine takes them (`ModelInputs.check_prompt`), with the request's cache salt,
    everything the engine would refuse refused here with a 400; plus prompt + max_tokens <= context. Errors
    name the request's fields: the prompt's (`prompt_field`: messages for a chat), and the one a constraint
    that does not compile came from."""
    limit = inputs.max_model_len
    checked = []
    for i, (text, given, _) in enumerate(prompts):
        where = prompt_field if len(prompts) == 1 else f"{prompt_field}[{i}]"
        try:
            ids = inputs.check_prompt(given, params, where)
        except ConstraintError as exc:
            raise APIError(400, f"{constraint_field}: {exc.reason}", param=constraint_field) from None
        except RequestError as exc:
            raise user_error(exc, prompt_field) from None
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; {where} has {len(ids)} "
                                f"tokens and {max_tokens_field} is {params.max_tokens}: reduce one of them",
                           param=max_tokens_field)
        # cut by truncate_prompt_tokens: the prompt the model reads (and echo returns) is the kept ids' text
        checked.append(Prompt(text if len(ids) == len(given) else None, ids, cache_salt))
    return checked


# ---------------------------------------------------------------- outputs
@dataclass
class Choice:
    """One choice's output, accumulated from its deltas (the text as their pieces, joined when read: a `str`
    grown by `+=` would be copied whole at every delta)."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    cached_tokens: int | None = None

    @property
    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    def add(self, d: Delta) -> None:
        if d.text:
            self.parts.append(d.text)
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs or []
        self.prompt_logprobs = self.prompt_logprobs or d.prompt_logprobs
        self.finish_reason, self.stop_reason, self.error = d.finish_reason, d.stop_reason, d.error
        if d.spec is not None:
            self.spec = d.spec
        if d.cached_tokens is not None:
            self.cached_tokens = d.cached_tokens


LOWEST_LOGPROB = -9999.0
"""What a logprob of -inf (a token the processors masked: processed logprobs) is shown as, as vLLM and OpenAI
show it: JSON has no infinity."""


def shown_logprob(lp: Logprob) -> float:
    return max(lp.logprob, LOWEST_LOGPROB)


class Renderer:
    """Builds one endpoint's response, stream chunks and usage from choices and deltas."""

    prefix = ""
    chunk_type: type[ResponseBase]

    def __init__(self, body: GenerationRequest, model: str, prompts: list[Prompt], params: SamplingParams,
                 strings: TokenStrings, with_spec: bool) -> None:
        self.id = f"{self.prefix}-{body.request_id or uuid.uuid4().hex}"
        self.created = int(time.time())  # one timestamp for every chunk of a stream (OpenAI's, vLLM's)
        self.body, self.model, self.prompts, self.params = body, model, prompts, params
        self.strings, self.with_spec = strings, with_spec

    @property
    def head(self) -> dict[str, Any]:
        """The fields every response and chunk of this request opens with."""
        return {"id": self.id, "created": self.created, "model": self.model}

    def prompt_ids(self, index: int) -> list[int] | None:
        return self.prompts[index // self.params.n].ids if self.body.return_token_ids else None

    def token_ids(self, ids: list[int]) -> list[int] | None:
        return ids if self.body.return_token_ids else None

    def token_text(self, tok: int, lp: Logprob | None) -> str:
        """A logprob token's text: 'token_id:N' where the request asks so (return_tokens_as_token_ids), the
        decoded_token the engine gave it, else (no tokenizer: 'token_id:N'; an echoed prompt's first token,
        which has no entry) from the token strings."""
        if self.body.return_tokens_as_token_ids:
            return f"token_id:{tok}"
        return lp.decoded_token if lp is not None and lp.decoded_token is not None else self.strings(tok)

    def prompt_logprobs(self, entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
        """The prompt's logprobs as vLLM returns them (each token with its text), where the
        request asked for them."""
        if entries is None or self.params.prompt_logprobs is None:
            return None
        return [None if entry is None else {
            t: PromptLogprob(logprob=shown_logprob(lp), rank=lp.rank, decoded_token=self.token_text(t, lp))
            for t, lp in entry.items()} for entry in entries]

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def chunks(self, d: Delta) -> list[BaseModel]:
        """What a delta streams as: one chunk."""
        return [self.chunk(d)]

    def chunk(self, d: Delta) -> BaseModel:
        raise NotImplementedError

    def response(self, choices: list[Choice]) -> BaseModel:
        raise NotImplementedError

    def usage(self, choices: list[Choice], index: int | None = None) -> tuple[Usage, SpecDecodeStats | None]:
        """The request's usage, or (`index`) one choice's so far with its prompt's, as vLLM's
        continuous_usage_stats gives each chunk."""
        prompts = range(len(self.prompts)) if index is None else [index // self.params.n]
        counted = choices if index is None else [choices[index]]
        prompt = sum(len(self.prompts[i].ids) for i in prompts)
        completion = sum(len(c.token_ids) for c in counted)
        spec = None
        if self.with_spec:
            total = SpecStats()
            for c in counted:
                total.merge(c.spec)
            spec = SpecDecodeStats(**total.as_dict())
        # a prompt's n choices share its prefill: its first one's count stands for the prompt
        cached = [choices[i * self.params.n].cached_tokens for i in prompts]
        details = None if None in cached else PromptTokensDetails(cached_tokens=sum(cached))
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=details), spec

    def usage_chunk(self, choices: list[Choice]) -> BaseModel:
        usage, spec = self.usage(choices)
        return self.chunk_type(**self.head, choices=[], usage=usage, spec_decode=spec)


class CompletionRenderer(Renderer):
    prefix = "cmpl"
    chunk_type = CompletionResponse

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.offsets: dict[int, int] = {}  # per choice: text offset of its next logprobs token
        # with echo, each prompt's text, which its choices' text starts with
        self.echoed = [self.prompt_text(p.text, p.ids) for p in self.prompts] if self.body.echo else None
        self.opened: set[int] = set()  # streamed choices whose echo went out
        self.ids_sent: set[int] = set()  # streamed choices whose prompt ids went out

    def prompt_text(self, text: str | None, ids: list[int]) -> str:
        """A prompt as text: as given, or its token ids decoded."""
        if text is not None:
            return text
        if self.strings.tokenizer is None:
            raise APIError(400, "echo of a token-id prompt needs a tokenizer; this model has none", param="echo")
        return self.strings.tokenizer.decode(ids)

    def echo(self, index: int) -> str:
        return self.echoed[index // self.params.n] if self.echoed is not None else ""

    def echoed_logprobs(self, index: int, prompt_entries: list[dict[int, Logprob] | None] | None
                        ) -> tuple[list[dict[int, Logprob] | None], list[int]]:
        """With echo and logprobs, the entries and ids of a choice's prompt, which its logprobs start with."""
        if self.echoed is None or self.params.logprobs is None:
            return [], []
        return list(prompt_entries or []), self.prompts[index // self.params.n].ids

    def first_prompt_ids(self, index: int) -> list[int] | None:
        """The prompt's ids on a streamed choice's first chunk only (vLLM's, with return_token_ids)."""
        if index in self.ids_sent:
            return None
        self.ids_sent.add(index)
        return self.prompt_ids(index)

    def chunks(self, d: Delta) -> list[BaseModel]:
        """With echo, a streamed choice opens with its prompt's text (and its logprobs with logprobs) once
        the first delta brings them, as vLLM sends it."""
        if self.echoed is None or d.index in self.opened:
            return [self.chunk(d)]
        self.opened.add(d.index)
        echo = CompletionChoice(index=d.index, text=self.echo(d.index),
                                logprobs=self.logprobs(d.index, *self.echoed_logprobs(d.index, d.prompt_logprobs)),
                                prompt_token_ids=self.first_prompt_ids(d.index))
        return [CompletionResponse(**self.head, choices=[echo]), self.chunk(d)]

    def logprobs(self, index: int, entries: list[dict[int, Logprob] | None] | None,
                 ids: list[int]) -> CompletionLogprobs | None:
        """The legacy logprobs of `ids` (an echoed prompt's first has no entry: null); alternatives up to
        the request's logprobs."""
        if entries is None or self.params.logprobs is None:
            return None
        out, top = CompletionLogprobs(), self.params.logprobs
        offset = self.offsets.get(index, 0)
        for tok, entry in zip(ids, entries):
            s = self.token_text(tok, entry[tok] if entry is not None else None)
            out.tokens.append(s)
            out.token_logprobs.append(shown_logprob(entry[tok]) if entry is not None else None)
            out.top_logprobs.append(None if entry is None else {
                self.token_text(t, lp): shown_logprob(lp) for t, lp in entry.items()
                if t == tok or top < 0 or (lp.rank or 0) <= top})  # -1: the whole vocabulary
            out.text_offset.append(offset)
            offset += len(s)
        self.offsets[index] = offset
        return out

    def chunk(self, d: Delta) -> BaseModel:
        choice = CompletionChoice(index=d.index, text=d.text, logprobs=self.logprobs(d.index, d.logprobs, d.token_ids),
                                  finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                                  token_ids=self.token_ids(d.token_ids),
                                  prompt_token_ids=self.first_prompt_ids(d.index))
        return CompletionResponse(**self.head, choices=[choice])

    def response(self, choices: list[Choice]) -> BaseModel:
        usage, spec = self.usage(choices)
        out = []
        for i, c in enumerate(choices):
            entries, ids = self.echoed_logprobs(i, c.prompt_logprobs)
            out.append(CompletionChoice(index=i, text=self.echo(i) + c.text,
                                        logprobs=self.logprobs(i, entries + c.logprobs, ids + c.token_ids),
                                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                        token_ids=self.token_ids(c.token_ids), prompt_token_ids=self.prompt_ids(i),
                                        prompt_logprobs=self.prompt_logprobs(c.prompt_logprobs)))
        return CompletionResponse(**self.head, usage=usage, spec_decode=spec, choices=out)


class ChatRenderer(Renderer):
    """Chat responses; with tools, each choice's text is split into content and tool calls. Streamed, a named
    function's arguments go as they come; under "auto", content while no call can have begun, and the calls
    when the choice ends (a call is known only once its text is whole); "required" calls when it ends."""

    prefix = "chatcmpl"
    chunk_type = ChatCompletionChunk

    def __init__(self, *args: Any, tools: ToolUse | None = None, role: str = "assistant",
                 phase: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.role = role
        self.tools = tools if tools is not None and tools.calls_possible else None
        self.streams: dict[int, ToolStream] = {}  # with tools: each streamed choice's output so far
        # with a reasoning parser: where the output starts (`ThinkTokens.phase`), its think block reasoning_content
        self.phase = phase
        self.thoughts: dict[int, ReasoningStream] = {}  # with a reasoning parser: each streamed choice's reader

    def message(self, text: str) -> AssistantMessage:
        """A choice's whole text as its message: reasoning, content, tool calls (looked for in the content)."""
        reasoning, content = split_reasoning(text, self.phase) if self.phase is not None else (None, text)
        reasoning = reasoning if self.body.include_reasoning else None  # vLLM's include_reasoning false: dropped
        calls = []
        if self.tools is not None and content is not None:
            said, calls = self.tools.split(content)
            content = said if calls else content
        return AssistantMessage(role=self.role, reasoning_content=reasoning, content=content,
                                tool_calls=[ToolCall(**c.as_openai()) for c in calls] or None)

    def logprobs(self, entries: list[dict[int, Logprob]] | None, ids: list[int]) -> ChatLogprobs | None:
        if entries is None or self.params.logprobs is None:
            return None

        def top(tok: int, lp: Logprob) -> TopLogprob:
            s = self.token_text(tok, lp)
            return TopLogprob(token=s, logprob=shown_logprob(lp), bytes=list(s.encode()))

        content, k = [], self.params.logprobs if self.params.logprobs >= 0 else None  # -1: the whole vocabulary
        for tok, entry in zip(ids, entries):
            ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
            content.append(TokenLogprob(**top(tok, entry[tok]).model_dump(),
                                        top_logprobs=[top(t, lp) for t, lp in ranked]))
        return ChatLogprobs(content=content)

    def opening_chunks(self) -> list[BaseModel]:
        return [ChatCompletionChunk(**self.head, prompt_token_ids=self.prompt_ids(i),
                                    choices=[ChatChunkChoice(index=i, delta=DeltaMessage(role=self.role, content=""))])
                for i in range(len(self.prompts) * self.params.n)]

    def chunk(self, d: Delta) -> BaseModel:
        thought, text = "", d.text
        if self.phase is not None:
            reader = self.thoughts.setdefault(d.index, ReasoningStream.starting(self.phase))
            thought, text = reader.feed(d.text)
            if d.finish_reason is not None:
                more, rest = reader.finish()
                thought, text = thought + more, text + rest
                del self.thoughts[d.index]
            thought = thought if self.body.include_reasoning else ""
        delta, finish_reason = DeltaMessage(content=text if text or not thought else None), d.finish_reason
        if self.tools is not None:
            stream = self.streams.setdefault(d.index, ToolStream(self.tools))
            content, named = stream.feed(text)
            calls = [DeltaToolCall(index=0, **named)] if named else []
            if d.finish_reason is not None:
                rest, found = stream.finish()
                content += rest or ""
                calls += [DeltaToolCall(index=i, **c.as_openai()) for i, c in enumerate(found)]
                if stream.call_id is not None or found:
                    finish_reason = self.tools.finish_reason(d.finish_reason)
                del self.streams[d.index]
            delta = DeltaMessage(content=content if content or not (calls or thought) else None,
                                 tool_calls=calls or None)
        delta.reasoning_content = thought or None
        choice = ChatChunkChoice(index=d.index, delta=delta, logprobs=self.logprobs(d.logprobs, d.token_ids),
                                 finish_reason=finish_reason, stop_reason=d.stop_reason,
                                 token_ids=self.token_ids(d.token_ids))
        return ChatCompletionChunk(**self.head, choices=[choice])

    def response(self, choices: list[Choice]) -> BaseModel:
        usage, spec = self.usage(choices)
        out = []
        for i, c in enumerate(choices):
            message = self.message(c.text)
            finish_reason = self.tools.finish_reason(c.finish_reason) if message.tool_calls else c.finish_reason
            out.append(ChatChoice(index=i, message=message,
                                  logprobs=self.logprobs(c.logprobs, c.token_ids), finish_reason=finish_reason,
                                  stop_reason=c.stop_reason, token_ids=self.token_ids(c.token_ids)))
        return ChatCompletionResponse(**self.head, usage=usage, spec_decode=spec, choices=out,
                                      prompt_logprobs=self.prompt_logprobs(choices[0].prompt_logprobs),
                                      prompt_token_ids=self.prompt_ids(0))


async def prompt_only(deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """A scoring request's deltas (`CompletionRequest.scores_only`): the one token it generated dropped, so its
    choices hold the echoed prompt alone."""
    async with contextlib.aclosing(deltas):
        async for d in deltas:
            yield dataclasses.replace(d, text="", token_ids=[], logprobs=None if d.logprobs is None else [])


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, engine: AsyncEngine, request_id: str) -> AsyncIterator[None]:
    """Abort the request when the client disconnects, also while it waits with nothing to send."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        engine.abort(request_id)

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


# ---------------------------------------------------------------- app
def create_app(load: Callable[[], LLM], served_model_name: str | Sequence[str],
               on_engine_error: Callable[[str], None] | None = None, engine_process: bool = False,
               config: ServerConfig = ServerConfig(), on_ready: Callable[[ModelInputs], None] | None = None) -> FastAPI:
    """An app that loads its model (`load()`, on the engine's thread, or in the engine process with
    `engine_process`) when it starts serving; /health answers 503 until the model is ready.
    `on_engine_error` hears why the engine cannot serve: it failed to load, or its process died;
    `on_ready`, that it is loaded. `served_model_name`: the names requests may give (one, or several: a response
    carries the one its request gave, else the first)."""
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    served_model_name = names[0]
    metrics = ServerMetrics(served_model_name, config.metrics_prefix)
    engine = AsyncEngine(load, metrics, on_engine_error, process=engine_process, on_ready=on_ready)
    # tokenizing and template rendering run in threads, so the event loop answers others meanwhile; chat
    # templates have threads of their own, so a slow one (a request's own, where trusted) never holds up
    # the tokenizing of completions
    tokenizing = ThreadPoolExecutor(max_workers=2, thread_name_prefix="blockspec-tokenize")
    templating = ThreadPoolExecutor(max_workers=2, thread_name_prefix="blockspec-template")

    async def log_stats(interval: float) -> None:
        """vLLM's periodic lines while the server is busy: throughput, queue, KV usage, speculation."""
        while True:
            await asyncio.sleep(interval)
            for line in metrics.interval_summary():
                log.info("%s", line)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        interval = config.log_stats_interval_s
        stats = asyncio.create_task(log_stats(interval)) if interval is not None else None
        yield
        if stats is not None:
            stats.cancel()
        engine.shutdown()
        for pool in (tokenizing, templating):
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="blockspec", lifespan=lifespan)
    app.state.engine = engine
    app.add_middleware(InternalErrors)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    if config.api_key is not None:
        app.add_middleware(APIKey, key=config.api_key)
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),  # outermost: preflights need no key
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allowed_credentials)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        kind = request.headers.get("content-type", "")
        if request.method == "POST" and kind.split(";")[0].strip().lower() != "application/json":
            # the body was never read as JSON (curl -d sends a form): say so, not that it is no object
            return APIError(415, f"Unsupported Media Type: the body must be JSON sent as application/json (got "
                                 f"Content-Type {kind or 'none'!r})", code="unsupported_media_type").response()
        return validation_error(exc).response()

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return api_error_of(exc).response()

    @app.exception_handler(HTTPException)
    async def starlette_error(request: Request, exc: HTTPException) -> JSONResponse:
        body = await request.body() if exc.status_code == 400 else b""  # read already: the framework keeps it
        return http_error(request, exc, body).response()

    for error_type in USER_ERRORS:
        @app.exception_handler(error_type)
        async def bad_value(_: Request, exc: Exception) -> JSONResponse:
            return user_error(exc).response()

    async def in_thread(pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def ready_inputs(model: str | None = None) -> ModelInputs:
        if engine.inputs is None:
            message = f"the model failed to load: {engine.load_error}" if engine.load_error else "the model is loading"
            raise APIError(503, message, type="service_unavailable")
        if model is not None and model not in names:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{' or '.join(map(repr, names))}", param="model", code="model_not_found")
        return engine.inputs

    async def generate(request: Request, body: GenerationRequest, inputs: ModelInputs, prompts: list[Prompt],
                       params: SamplingParams, renderer_type: type[Renderer]) -> Response:
        if body.stream and body.prompt_logprobs:
            raise APIError(400, "prompt_logprobs are not streamed (as in vLLM): drop stream, or on /v1/completions "
                                "use echo with logprobs", param="prompt_logprobs")
        # a constraint the request did not give is a forced tool call's; off the event loop, as it compiles
        # the constraint (a large choice or schema takes a large part of a second)
        chat = isinstance(body, ChatCompletionRequest)
        prompts = await in_thread(tokenizing, check_prompts, inputs, prompts, params,
                                  body.constraint_field or "tool_choice", "messages" if chat else "prompt",
                                  "max_completion_tokens" if chat and body.max_completion_tokens is not None
                                  else "max_tokens", body.cache_salt)
        name = body.model if body.model in names else served_model_name
        renderer = renderer_type(body, name, prompts, params, TokenStrings(inputs.tokenizer), inputs.speculative)
        choices = [Choice() for _ in range(len(prompts) * params.n)]
        # the engine's id: the response's, made unique (clients may send one request_id twice, or "a" and "a-0")
        engine_id = f"{renderer.id}-{uuid.uuid4().hex[:12]}"
        deltas = engine.generate(engine_id, prompts, params)
        if isinstance(body, CompletionRequest) and body.scores_only:
            deltas = prompt_only(deltas)
        if body.stream:
            return StreamingResponse(stream(request, engine_id, renderer, deltas, choices),
                                     media_type="text/event-stream")
        async with abort_on_disconnect(request, engine, engine_id), contextlib.aclosing(deltas):
            async for d in deltas:
                choices[d.index].add(d)
        errors = [c.error for c in choices if c.error]
        if errors:
            raise request_failed(errors[0])
        return JSONResponse(renderer.response(choices).model_dump())

    async def stream(request: Request, engine_id: str, renderer: Renderer, deltas: AsyncIterator[Delta],
                     choices: list[Choice]) -> AsyncIterator[str]:
        async with abort_on_disconnect(request, engine, engine_id), contextlib.aclosing(deltas):
            for chunk in renderer.opening_chunks():
                if renderer.body.continuous_usage:  # vLLM's: the role chunk too, its prompt and no output yet
                    chunk.usage, chunk.spec_decode = renderer.usage(choices, chunk.choices[0].index)
                yield sse(chunk)
            try:
                async for d in deltas:
                    choices[d.index].add(d)
                    if d.error:
                        raise request_failed(d.error)
                    for chunk in renderer.chunks(d):
                        if renderer.body.continuous_usage:  # the chunk's choice's usage so far, on every chunk
                            chunk.usage, chunk.spec_decode = renderer.usage(choices, d.index)
                        yield sse(chunk)
            except Exception as exc:
                yield sse(ErrorResponse(error=api_error_of(exc).info))
            else:
                if renderer.body.include_usage:
                    yield sse(renderer.usage_chunk(choices))
            yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        inputs = ready_inputs(body.model)
        params = body.to_sampling_params(1 if body.scores_only else body.max_tokens, body.logprobs, inputs.sampling_defaults,
                                         model=(inputs.vocab_size, inputs.max_logprobs))
        prompts = await in_thread(tokenizing, completion_prompts, inputs, body.prompt,
                                  params.truncate_prompt_tokens is not None, body.add_special_tokens)
        return await generate(request, body, inputs, prompts, params, CompletionRenderer)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        inputs = ready_inputs(body.model)
        if body.top_logprobs and not body.logprobs:  # 0 asks for nothing: accepted, as OpenAI does
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        fields = {"logprobs": "top_logprobs"} | (
            {"max_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None else {})
        params = body.to_sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                                         inputs.sampling_defaults, fields, (inputs.vocab_size, inputs.max_logprobs))
        tools = tool_use(body, config.tool_call_parser, config.exclude_tools_when_tool_choice_none)
        if tools is not None:
            try:
                constraint = tools.constraint()
            except ValueError as exc:
                raise APIError(400, str(exc), param="tool_choice") from None
            if constraint is not None:
                if params.structured_outputs is not None:
                    raise APIError(400, "a tool choice that forces a call constrains the output already: give it or "
                                        "response_format / structured_outputs, not both", param="tool_choice")
                params = dataclasses.replace(params, structured_outputs=constraint)
        prompt = await in_thread(templating, chat_prompt, inputs, body, config, tools)
        # vLLM's rule: a new turn is the server's response role's; a continued message keeps its own role
        role = config.response_role if body.add_generation_prompt else body.messages[-1].role
        # the engine's reasoning parser: where the output starts, its think block reasoning_content
        phase = inputs.think.phase(prompt.ids, inputs.tokenizer.decode) if inputs.think is not None else None
        return await generate(request, body, inputs, [prompt], params,
                              functools.partial(ChatRenderer, tools=tools, role=role, phase=phase))

    def model_card(inputs: ModelInputs, name: str) -> ModelCard:
        return ModelCard(id=name, root=str(inputs.model_dir), max_model_len=inputs.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        inputs = ready_inputs()
        return ModelList(data=[model_card(inputs, name) for name in names])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        return model_card(ready_inputs(model_id), model_id)

    def tokenizer_of(inputs: ModelInputs) -> Any:
        if inputs.tokenizer is None:
            raise APIError(400, f"{served_model_name} has no tokenizer: this server takes and returns token ids only")
        return inputs.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's /tokenize: a prompt's ids, or a conversation's as /v1/chat/completions renders it."""
        inputs = ready_inputs(body.model)
        tok = tokenizer_of(inputs)
        if isinstance(body, TokenizeChatRequest):
            ids = (await in_thread(templating, chat_prompt, inputs, body, config,
                                   tool_use(body, config.tool_call_parser, config.exclude_tools_when_tool_choice_none,
                                            generating=False))).ids
        else:
            ids = await in_thread(tokenizing, encode, tok, body.prompt, body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=inputs.max_model_len, tokens=ids,
                                token_strs=tok.convert_ids_to_tokens(ids) if body.return_token_strs else None)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's /detokenize: the text of token ids."""
        inputs = ready_inputs(body.model)
        tok = tokenizer_of(inputs)
        bad = [t for t in body.tokens if not 0 <= t < inputs.vocab_size]
        if bad:
            raise APIError(400, f"tokens: ids {bad[:5]} outside the vocabulary [0, {inputs.vocab_size})", param="tokens")
        return DetokenizeResponse(prompt=await in_thread(tokenizing, tok.decode, body.tokens))

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's health check)
    async def health() -> Response:
        if not engine.ready:
            status = {"status": "failed", "error": engine.load_error} if engine.load_error else {"status": "loading"}
            return JSONResponse(status, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app

