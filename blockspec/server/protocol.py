"""Request and response bodies of the OpenAI-compatible API.

Unknown fields are rejected (400 naming the field), as OpenAI does: a misspelt sampling option must
not be dropped silently. vLLM-style extras (top_k, min_p, repetition_penalty, ignore_eos, ...) are
ordinary top-level fields here, which is where the OpenAI client's `extra_body` puts them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
import time
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from blockspec.errors import RequestError
from blockspec.inputs import check_text, text_content
from blockspec.sampling_params import SamplingError, SamplingParams, StructuredOutputsParams


log = logging.getLogger("blockspec.server")

# Fields clients send that change nothing a response holds: accepted, dropped, and named in one log line
# per request. Fields that would change the output (suffix, audio, modalities beyond text, web search,
# verbosity) stay unknown fields, refused with a 400.
IGNORED_FIELDS = {
    "store": "OpenAI keeps the completion for its dashboard; this server stores nothing",
    "metadata": "tags for stored completions",
    "service_tier": "OpenAI's processing tier",
    "prompt_cache_key": "a caching hint",
    "safety_identifier": "an end-user id for abuse monitoring",
    "prediction": "predicted output: a latency hint that never changes the text",
    # o-series reasoning budget; the Llama / Qwen chat templates read none (Qwen3's thinking is
    # chat_template_kwargs.enable_thinking)
    "reasoning_effort": "a reasoning budget no supported chat template reads",
    "verbosity": "an answer-length hint no supported chat template reads",
    # vLLM's per-request choice of structured-output backend: this server compiles every constraint with llguidance
    "guided_decoding_backend": "a structured-output backend choice (one backend here)",
    "kv_transfer_params": "vLLM's disaggregated-prefill KV hand-off (one engine here)",
    "vllm_xargs": "vLLM's extra arguments for its plugins (none here)",
    "mm_processor_kwargs": "a multimodal processor's options (text models here)",
}


def at_default(name: str, default: Any, why: str) -> Any:
    """A validator for a vLLM field this server takes at its default only; another value is a 400 naming
    it and why."""
    def check(value: Any) -> Any:
        if value != default:
            raise PydanticCustomError(name, f"only {default!r} here: {why}")
        return value
    return field_validator(name)(classmethod(lambda cls, value: check(value)))


def drop_ignored_fields(data: Any) -> Any:
    """The request's JSON without IGNORED_FIELDS, logging the names it had (and parallel_tool_calls
    where there are no tools for it to apply to)."""
    if not isinstance(data, dict):
        return data
    named = [name for name in IGNORED_FIELDS if name in data]
    if "parallel_tool_calls" in data and not data.get("tools"):
        named.append("parallel_tool_calls")
    if named:
        log.info("request fields accepted and ignored (they change nothing in the response): %s", ", ".join(named))
        data = {k: v for k, v in data.items() if k not in IGNORED_FIELDS}
    return data


class StrictModel(BaseModel):
    """Unknown fields are refused, and values are not coerced: true is not 1, "5" is not 5. A null is a
    field left out (OpenAI's clients send unset fields as null) where the field has a default and no meaning
    for null of its own (n, stream, echo...; a null max_tokens still means no limit)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()
                or type(None) in get_args(fields[k].annotation)}


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far
    # OpenAI's: random padding on streamed events against length side channels; accepted, none is added
    include_obfuscation: bool | None = None


class JsonSchemaFormat(StrictModel):
    """OpenAI's `response_format.json_schema`: the schema the output must match."""

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class GenerationRequest(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI names plus vLLM extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias, clamped to [-100, 100]
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = Field(None, description="the only tokens the output may hold (vLLM extra)")
    thinking_token_budget: int | None = Field(None, description="with a reasoning parser, the tokens the think "
                                                                "block may take before it is closed (vLLM extra)")
    truncate_prompt_tokens: int | None = Field(None, description="keep the prompt's last k tokens; -1: as many as "
                                                                 "the context holds (vLLM extra)")
    prompt_logprobs: int | None = Field(None, description="the prompt tokens' logprobs with this many alternatives "
                                                          "(vLLM extra; not with stream)")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = Field(True, description="accepted as vLLM accepts it; the text does not "
                                                                  "depend on it (vLLM extra)")
    use_speculation: bool = Field(True, description="False: decode this request without drafting")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for the same constraints
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    return_token_ids: bool = Field(False, description="also return prompt and output token ids (vLLM extra)")
    return_tokens_as_token_ids: bool = Field(False, description="logprobs name tokens as 'token_id:N' (vLLM extra)")
    request_id: str | None = Field(None, description="the response's id is the endpoint's prefix and this (vLLM "
                                                     "extra; default: a random one)")
    cache_salt: str | None = Field(None, description="prefix-cache pages are shared only with requests of the same "
                                                     "salt: a secret per tenant (vLLM extra)")
    # vLLM extras taken at their defaults (this server schedules first come, first served, and samples; it
    # has no beam search or whitespace pattern for JSON)
    priority: int = 0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    guided_whitespace_pattern: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    drop_ignored = model_validator(mode="before")(drop_ignored_fields)
    priority_at_default = at_default("priority", 0, "requests are served first come, first served")
    beams_at_default = at_default("use_beam_search", False, "this server samples; it has no beam search")
    length_penalty_at_default = at_default("length_penalty", 1.0, "it weighs beam search's candidates, which this server lacks")
    whitespace_at_default = at_default("guided_whitespace_pattern", None, "JSON constraints take the grammar's whitespace")

    @field_validator("stop")
    @classmethod
    def _valid_unicode(cls, stop: str | list[str] | None) -> str | list[str] | None:
        for s in [stop] if isinstance(stop, str) else stop or []:
            try:
                check_text(s, "stop")
            except RequestError as exc:
                raise PydanticCustomError("stop", str(exc).removeprefix("stop: ")) from None
        return stop

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:
            raise PydanticCustomError("cache_salt", "must be a non-empty string if given (vLLM's rule)")
        return salt

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and options.model_fields_set and not info.data.get("stream", False):  # {}: vLLM's too
            raise PydanticCustomError("stream_options", "only with stream: true (OpenAI's and vLLM's rule)")
        return options

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           defaults: Mapping[str, Any] | None = None,
                           fields: Mapping[str, str] | None = None,
                           model: tuple[int, int] | None = None) -> SamplingParams:
        """SamplingParams validates every value. A field the request leaves unset takes the model's
        default (`defaults`: generation_config.json's values, as vLLM's server applies them), else
        SamplingParams' own (OpenAI-equal) default. `fields`: the request's name of a value given under
        another (max_tokens: "max_completion_tokens"), which its errors name. `model`: its vocabulary size
        and max_logprobs, which the token ids and logprobs asked for are checked against."""
        try:
            params = self._sampling_params(max_tokens, logprobs, defaults)
            if model is not None:
                params.check_model(*model)
            return params
        except SamplingError as exc:
            message = str(exc)
            for ours, theirs in (fields or {}).items():
                message = message.replace(f"SamplingParams.{ours}=", f"SamplingParams.{theirs}=")
            named = self.constraint_field
            if named is not None and named.startswith("guided_"):  # StructuredOutputsParams names its own field
                message = message.replace(f"SamplingParams.structured_outputs.{named.removeprefix('guided_')}=",
                                          f"SamplingParams.{named}=")
            raise SamplingError(message) from None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         defaults: Mapping[str, Any] | None) -> SamplingParams:
        given = dict(defaults or {})
        given.update({name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
            if getattr(self, name) is not None})
        if max_tokens is not None or "max_tokens" not in given:
            given["max_tokens"] = max_tokens
        return SamplingParams.from_optional(  # vLLM's: logit_bias clamped to [-100, 100]
            n=self.n, seed=self.seed, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=self.wanted_prompt_logprobs, bad_words=self.bad_words,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens, thinking_token_budget=self.thinking_token_budget,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens, use_speculation=self.use_speculation,
            structured_outputs=self.structured(), **given)

    def structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever of response_format, structured_outputs or the
        guided_* fields it gives (at most one)."""
        found = self._constraints()
        if len(found) > 1:
            raise SamplingError(f"SamplingParams.{found[1][0]}: give one output constraint, not "
                                f"{' and '.join(name for name, _ in found)}")
        return StructuredOutputsParams(**found[0][1]) if found else None

    @property
    def constraint_field(self) -> str | None:
        """The field the request's output constraint came from (where its errors point)."""
        found = self._constraints()
        return found[0][0] if found else None

    def _constraints(self) -> list[tuple[str, dict[str, Any]]]:
        found: list[tuple[str, dict[str, Any]]] = []
        if self.response_format is not None and self.response_format.type != "text":
            if self.response_format.type == "json_object":
                found.append(("response_format", {"json_object": True}))
            else:
                fmt = self.response_format.json_schema
                if fmt is None or fmt.json_schema is None:
                    raise SamplingError("SamplingParams.response_format: type json_schema needs json_schema.schema")
                found.append(("response_format", {"json": fmt.json_schema}))
        if self.structured_outputs is not None:
            given = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            found.append(("structured_outputs", given))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found.append((f"guided_{name}", {name: value}))
        return found

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: continuous_usage_stats, which vLLM honours only beside include_usage."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens 0: the prompt's text and (with logprobs) its tokens' logprobs, nothing generated
        (vLLM's, OpenAI's legacy way of scoring a text)."""
        return self.echo and self.max_tokens == 0

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine computes (None: no prompt logprobs)."""
        return self.prompt_logprobs


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = Field(False, description="the prompt's text before each choice's output (with logprobs: its "
                                          "tokens' logprobs before the output's, the first null)")
    best_of: int | None = Field(None, description="only n (or unset): every sample is returned, none is ranked")
    add_special_tokens: bool = Field(True, description="the tokenizer's special tokens (BOS) around a text prompt "
                                                       "(vLLM extra)")

    @property
    def wanted_prompt_logprobs(self) -> int | None:
        """With echo and logprobs the echoed prompt tokens carry logprobs too, as the output's do, unless
        prompt_logprobs says how many (vLLM)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise PydanticCustomError("best_of", "must equal n ({n}) or be left out: this server returns all n samples "
                                                 "and ranks none (vLLM's rule)", {"n": n})
        return best_of


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message as the chat template sees it; extra keys (name, tool fields) pass through to it."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[TextPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """An image, audio or file part is refused by name (app.validation_error adds its index to the
        location), not as a type mismatch."""
        for i, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise PydanticCustomError("content_part", "{kind} parts are not supported; this server serves a text "
                                                          "model", {"kind": kind, "part": i})
        return content

    def for_template(self) -> dict[str, Any]:
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            msg["content"] = text_content([part.model_dump() for part in self.content], "message")
        return msg


class FunctionDefinition(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="continue the last message instead of opening a new "
                                                            "assistant turn (vLLM extra; with add_generation_prompt "
                                                            "false)")
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool = True
    chat_template: str | None = Field(None, description="a template of the request's own (only where the server "
                                                        "trusts request templates)")
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = Field(True, description="with a reasoning parser, return the think block as "
                                                      "reasoning_content (vLLM's; false drops it)")
    documents: list[dict[str, str]] | None = Field(None, description="documents for a retrieval chat template, "
                                                                     "each a dict of strings (vLLM extra)")
    add_special_tokens: bool = Field(False, description="the tokenizer's special tokens (BOS) before the chat "
                                                        "template's text (vLLM extra)")
    echo: bool = False  # vLLM's: the last message repeated before the reply; not here
    echo_at_default = at_default("echo", False, "the reply holds only the generated message")


# ---------------------------------------------------------------- responses
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class SpecDecodeStats(BaseModel):
    """Per-request speculation counters (vLLM's meanings): drafts = verify steps that drafted."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]
    acceptance_rate: float
    mean_acceptance_length: float


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V the prefix cache held (0 without prefix caching)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs; an echoed prompt's first token has none (null: nothing comes before it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token of a prompt position's `prompt_logprobs` entry, as vLLM writes it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # per prompt token (the first: null), token id -> logprob


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ResponseBase(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None
    spec_decode: SpecDecodeStats | None = None


class CompletionResponse(ResponseBase):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class WithoutNulls(BaseModel):
    """Written without its null fields: a later piece of a streamed call names no id, type or name (OpenAI's and
    vLLM's chunks leave them out; the openai SDK's stream accumulator takes a `"type": null` as the call's type
    and then refuses the call)."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunction(WithoutNulls):
    name: str | None = None
    arguments: str | None = None  # a piece of the JSON text


class DeltaToolCall(WithoutNulls):
    """A streamed call, or a piece of one: the first piece carries its id, type and name, later ones more of
    its arguments (OpenAI's and vLLM's streaming)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class WithReasoning(BaseModel):
    """A message with its thinking (a reasoning parser's), written under both names clients read: `reasoning`
    (vLLM's since its rename, OpenRouter's) and `reasoning_content` (DeepSeek's, vLLM's before)."""

    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _both_names(self, handler: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        data = handler(self)
        return {"role": data.pop("role"), "reasoning": data.get("reasoning_content"), **data}


class AssistantMessage(WithReasoning):
    role: str = "assistant"  # ServerConfig.response_role, or the continued message's
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(ResponseBase):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    # vLLM's place for them: every choice has the one prompt
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(WithReasoning):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(ResponseBase):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    prompt_token_ids: list[int] | None = None  # on each choice's first chunk, with return_token_ids


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "blockspec"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- vLLM's /tokenize, /detokenize, /version
class TokenizeCompletionRequest(StrictModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's BOS and the like, as /v1/completions adds them
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatCompletionRequest):
    """A conversation, tokenized as /v1/chat/completions renders it (template, tools, kwargs alike)."""

    return_token_strs: bool | None = False


def tokenize_kind(body: Any) -> str:
    """Which /tokenize body this is: a conversation has messages."""
    return "TokenizeChatRequest" if isinstance(body, dict) and "messages" in body else "TokenizeCompletionRequest"


TokenizeRequest = Annotated[Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")]
                            | Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")],
                            Discriminator(tokenize_kind)]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
