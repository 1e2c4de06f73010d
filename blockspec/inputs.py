"""User input turned into checked token ids, before any work starts: prompts (text, token ids, chat
conversations), their lengths against the context, their ids against the vocabulary, and the
sampling parameters that go with them. It needs the tokenizer and the model's limits, not its
weights: the server's front process, which holds no weights, checks requests with a copy of it.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, NotRequired, Required, TypedDict

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from blockspec.bad_words import word_sequences
from blockspec.config import ConfigError
from blockspec.errors import ConversationError, RequestError
from blockspec.reasoning import ThinkTokens
from blockspec.sampling_params import SamplingError, SamplingParams, is_int, plain_ints
from blockspec.structured import new_matcher


class TextPrompt(TypedDict):
    """A text prompt as vLLM's `vllm.inputs.TextPrompt` spells it (`cache_salt`: see `Prompt`)."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict, total=False):
    """A prompt of token ids as vLLM's `vllm.inputs.TokensPrompt` spells it (`prompt`: its text, if known)."""

    prompt_token_ids: Required[list[int]]
    prompt: str
    cache_salt: str


PromptType = str | TextPrompt | TokensPrompt | dict[str, Any]
PROMPT_FIELDS = ("prompt", "prompt_token_ids")  # a prompt dict's text or ids
PROMPT_KEYS = (*PROMPT_FIELDS, "cache_salt")


class Prompt(NamedTuple):
    """A checked prompt: its text (None for token ids), its ids, and its cache salt: the prefix cache
    shares pages only between prompts of the same salt (vLLM's `cache_salt`: a secret per tenant keeps
    one from learning another's prompts by the time a cache hit saves)."""

    text: str | None
    ids: list[int]
    cache_salt: str | None = None


def check_salt(salt: Any, where: str) -> str | None:
    """A cache salt is a non-empty string, or None."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RequestError(f"{where}: cache_salt must be a non-empty string, got {salt!r}")
    return salt


def check_text(text: str, where: str) -> None:
    """Text must be valid Unicode to be tokenized: JSON can carry a lone surrogate (\\ud800) that no
    encoding represents, and Python reads a byte that is not UTF-8 (command line, stdin) as one of U+DC80-U+DCFF."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        byte = f" (what Python reads for byte 0x{code - 0xDC00:02x} of input that is not UTF-8)" if code >= 0xDC80 else ""
        raise RequestError(f"{where}: not valid Unicode: a lone surrogate {text[exc.start]!r} at character "
                           f"{exc.start}{byte}") from None


def read_chat_template(value: str) -> str:
    """A chat template given as a file or as the Jinja text itself (vLLM's `--chat-template`): text with
    a brace or a newline is a template; anything else must be a file."""
    if any(c in value for c in "{}\n"):
        return checked_template(value, "chat_template")
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"chat_template {value!r} is neither a file nor a Jinja template")
    try:
        text = path.read_text(encoding="utf-8")  # as transformers reads a model's chat_template.jinja
    except UnicodeDecodeError as exc:
        raise ConfigError(f"chat_template {path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    return checked_template(text, f"chat_template {path}")


def checked_template(text: str, where: str) -> str:
    """A chat template that Jinja can parse (in the sandbox and with the loop controls transformers renders
    templates with), else a ConfigError naming its line: before any model loads, not at the first chat."""
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{where}: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None
    return text


def read_text_lines(path: str | Path, error: type[Exception], where: str = "") -> list[str]:
    """A UTF-8 file's lines (split at newlines only: a JSON string may hold U+2028); a file that cannot be read
    raises `error` naming it, after `where` (the option that gave it)."""
    try:
        return Path(path).read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as exc:
        raise error(f"{where}{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise error(f"{where}{path}: {exc.strerror or exc}") from None


def jsonl_records(path: str | Path, error: type[Exception], where: str = "") -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a .jsonl file; a line that is not JSON raises `error`
    naming the file and line, after `where` (`read_text_lines`)."""
    for n, line in enumerate(read_text_lines(path, error, where), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}{path}:{n}: not valid JSON ({exc.msg}); a .jsonl file holds one object a line") \
                from None


def read_prompts_file(path: str, flag: str) -> list[PromptType]:
    """A prompts file (`flag` names the option that gave it): a .jsonl file holds one JSON object a line with
    'prompt' (text) or 'prompt_token_ids'; any other file's lines are each one prompt as written (a line of
    code may start with a brace). Blank lines are skipped."""
    if not path.endswith(".jsonl"):
        return [line for line in read_text_lines(path, ConfigError, f"{flag} ") if line.strip()]
    prompts: list[PromptType] = []
    for n, record in jsonl_records(path, ConfigError, f"{flag} "):
        if isinstance(record, dict) and "prompt_token_ids" in record:
            prompts.append({"prompt_token_ids": record["prompt_token_ids"]})
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        else:
            raise ConfigError(f"{flag} {path}:{n}: give 'prompt' (text) or 'prompt_token_ids' (a list of token ids)")
    return prompts


def text_content(parts: list[Any], where: str) -> str:
    """A message's content given as OpenAI content parts, as a chat template takes it: the text parts'
    texts joined by newlines (vLLM's rule); any other part is refused by name (a text model)."""
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RequestError(f"{where}, content part {k}: {kind!r} parts are not supported; a text model takes "
                               "{'type': 'text', 'text': ...}")
        texts.append(part["text"])
    return "\n".join(texts)


TEMPLATE_ARGUMENTS = ("add_generation_prompt", "continue_final_message")
"""apply_chat_template's own arguments that chat_template_kwargs may set, over the call's (vLLM merges the
kwargs over them too); its others (tokenize, return_dict, ...) are the engine's."""


def engine_template_arguments(tokenizer: Any, kwargs: dict[str, Any]) -> list[str]:
    """The keys of `kwargs` that are apply_chat_template's own arguments, which the engine sets (not a template
    variable, nor tools, documents or a template, which pass to it as given, nor TEMPLATE_ARGUMENTS)."""
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters)
    return sorted((own - {"kwargs", "chat_template", "tools", "documents", *TEMPLATE_ARGUMENTS}) & set(kwargs))


def template_messages(messages: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Messages as chat templates take them, as vLLM hands them over: an assistant's tool calls with their
    arguments as objects (OpenAI clients send JSON text, which a template's `tojson` would quote again; none
    given, {}), an empty tool_calls list left out (a template may take the key for a call), and its thinking
    sent back as `reasoning` (vLLM's name) also as `reasoning_content`, the name chat templates read (Qwen3's)."""
    out = []
    for j, m in enumerate(messages):
        if m.get("role") != "assistant":
            out.append(m)
            continue
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            if not calls:
                m = {k: v for k, v in m.items() if k != "tool_calls"}
            else:
                m = {**m, "tool_calls": [with_object_arguments(c, f"{where}, message {j}: tool_calls[{i}]")
                                         for i, c in enumerate(calls)]}
        if isinstance(m.get("reasoning"), str) and m.get("reasoning_content") is None:
            m = {**m, "reasoning_content": m["reasoning"]}
        out.append(m)
    return out


def with_object_arguments(call: Any, where: str) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or isinstance(fn.get("arguments"), (dict, list)):
        return call
    text = fn.get("arguments")
    try:
        arguments = json.loads(text) if text else {}
    except (json.JSONDecodeError, TypeError) as exc:
        raise ConversationError(f"{where}.function.arguments is not JSON ({getattr(exc, 'msg', exc)}): "
                                f"{str(text)[:80]!r}") from None
    return {**call, "function": {**fn, "arguments": arguments}}


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final_message: bool,
             where: str, **template_kwargs: Any) -> list[int]:
    """A conversation's token ids through the chat template: with a new assistant turn opened
    (`add_generation_prompt`), or with the final message left open for the model to continue
    (`continue_final_message`: a reply's first words given, as vLLM takes them), not both. A template that
    fails on the messages is the request's error (`ConversationError`), whatever it raised."""
    taken = engine_template_arguments(tokenizer, template_kwargs)
    if taken:
        raise RequestError(f"chat_template_kwargs.{taken[0]} is set by blockspec, not a template variable")
    if add_generation_prompt and continue_final_message:
        raise RequestError(f"{where}: continue_final_message and add_generation_prompt cannot both be true (vLLM's "
                           "rule): set add_generation_prompt to false to continue the final message")
    for j, m in enumerate(messages):  # a lone surrogate (undecodable bytes read from stdin) breaks the tokenizer
        if isinstance(m, dict) and isinstance(m.get("content"), str):
            try:
                check_text(m["content"], f"{where}, message {j}")
            except RequestError as exc:  # the messages' fault, as a template failing on them is
                raise ConversationError(str(exc)) from None
    messages = template_messages(messages, where)
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, **template_kwargs)
    except ValueError as exc:
        if continue_final_message and "final message" in str(exc):
            raise RequestError(f"{where}: continue_final_message: the chat template does not render the final "
                               "message's content as written, so it cannot be left open") from None
        raise ConversationError(f"{where}: the chat template failed on these messages: {exc}") from None
    except (jinja2.TemplateError, TypeError, KeyError, AttributeError, IndexError, ArithmeticError) as exc:
        # the template's raise_exception, or its code failing on these messages (None + 'a', a missing key)
        detail = exc if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: {exc}"
        raise ConversationError(f"{where}: the chat template failed on these messages: {detail}") from None
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@dataclass
class ModelInputs:
    """What turning user input into checked token ids needs of a loaded model, without its weights:
    the tokenizer, the context length and the vocabulary. The offline API checks with it before any
    work starts, and the server's front process, which holds no weights, gets a copy of it."""

    model_dir: Path
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    speculative: bool
    eos_ids: tuple[int, ...] = ()
    max_logprobs: int = 20  # EngineConfig.max_logprobs
    # SamplingParams fields the model's generation_config.json sets (engine/build.py reads it)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    think: ThinkTokens | None = None  # the engine's reasoning parser (EngineConfig.reasoning_parser)

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """Characters past which a text prompt cannot fit in max_model_len tokens, known without tokenizing
        it: a token stands for at most the longest token's characters, times 4 for normalisers that
        compose several characters into one. A prompt longer than this is refused before the
        tokenizer spends time and memory on it."""
        tokens = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        return self.max_model_len * 4 * max(len(t) for t in tokens if t)

    def prompt_ids(self, prompt: PromptType, where: str, truncating: bool = False,
                   add_special_tokens: bool = True) -> Prompt:
        """A prompt's text, ids and cache salt. A text too long for the context is refused before it is
        tokenized, unless the request truncates its prompt (`truncating`: truncate_prompt_tokens keeps its
        last tokens); `add_special_tokens` as the tokenizer takes it (the server's vLLM field)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{where}: text prompt given but {self.model_dir} has no tokenizer; "
                                   "pass {'prompt_token_ids': [...]} instead")
            if not prompt:
                raise RequestError(f"{where}: the prompt is empty")
            check_text(prompt, where)
            if len(prompt) > self.max_prompt_chars and not truncating:
                raise RequestError(f"{where}: the prompt has {len(prompt)} characters, more than max_model_len "
                                   f"({self.max_model_len}) tokens can hold (at most {self.max_prompt_chars})")
            return Prompt(prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        if (isinstance(prompt, dict) and set(prompt) & set(PROMPT_FIELDS)
                and (other := sorted(map(str, set(prompt) - set(PROMPT_KEYS))))):
            raise RequestError(f"{where}: a prompt dict takes {', '.join(PROMPT_KEYS)} only; {other} is not "
                               "supported (blockspec serves text models)")
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(is_int(t) for t in ids):
                raise RequestError(f"{where}: prompt_token_ids must be a list of ints")
            return Prompt(prompt.get("prompt"), plain_ints(ids), check_salt(prompt.get("cache_salt"), where))
        if isinstance(prompt, dict) and "prompt" in prompt:
            text, ids, _ = self.prompt_ids(prompt["prompt"], where, truncating, add_special_tokens)
            return Prompt(text, ids, check_salt(prompt.get("cache_salt"), where))
        got = f"a dict with keys {sorted(map(str, prompt))}" if isinstance(prompt, dict) else type(prompt).__name__
        raise RequestError(f"{where}: a prompt is a string or a dict with 'prompt' or 'prompt_token_ids'; got {got}")

    def check_prompt(self, ids: list[int], params: SamplingParams, where: str) -> list[int]:
        """The prompt's ids as the engine takes them (the last truncate_prompt_tokens where the request
        asks for left truncation), every one of its and its parameters' limits checked."""
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"{where}: sampling_params must be SamplingParams, got {type(params).__name__}")
        limit = self.max_model_len
        if not ids:
            raise RequestError(f"{where}: the prompt is empty (no tokens)")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            if keep > limit - 1:
                raise RequestError(f"{where}: truncate_prompt_tokens={keep} leaves no room for an output token in "
                                   f"max_model_len ({limit}); allowed: -1 or 1..{limit - 1}")
            ids = ids[-(limit - 1 if keep == -1 else keep):]
        if len(ids) >= limit:
            raise RequestError(f"{where}: prompt has {len(ids)} tokens; at most {limit - 1} fit (max_model_len {limit} "
                               "less one for an output token); truncate_prompt_tokens keeps the last ones")
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        params.check_model(vocab, self.max_logprobs)
        if params.stop_strings and self.tokenizer is None:  # matched in the text, which nothing decodes
            raise RequestError(f"{where}: stop strings are matched in the output's text and {self.model_dir} has no "
                               "tokenizer to decode it; use stop_token_ids")
        if params.allowed_token_ids and params.min_tokens:  # every allowed token banned until min_tokens
            ends = set(params.stop_token_ids or []) | set(self.eos_ids)
            if set(params.allowed_token_ids) <= ends:
                raise RequestError(f"{where}: allowed_token_ids {sorted(set(params.allowed_token_ids))[:5]} are all "
                                   f"EOS or stop_token_ids, which min_tokens={params.min_tokens} bans: no token can "
                                   "be sampled")
        if params.thinking_token_budget is not None and self.think is None:
            raise RequestError(f"{where}: thinking_token_budget needs the engine's reasoning_parser, which reads the "
                               "think block")
        if params.structured_outputs is not None:  # compiles it: a grammar that cannot fails here
            new_matcher(params.structured_outputs, self.tokenizer, vocab, self.eos_ids, where)
        if params.bad_words:  # tokenized as the engine will: no tokenizer, or ids past the vocabulary, fail here
            word_sequences(params.bad_words, self.tokenizer, vocab)
        return ids

    def default_sampling_params(self) -> SamplingParams:
        """What a call that passes no SamplingParams decodes with: the model's generation_config.json
        sampling values over SamplingParams' defaults (as vLLM's LLM does)."""
        return SamplingParams(**self.sampling_defaults)

    def prepare(self, prompts: PromptType | Sequence[PromptType],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> tuple[list[Prompt],
                                                                                              list[SamplingParams]]:
        """Every prompt tokenized and checked with its parameters (one each, or one for all), so that one
        bad prompt fails the call before any work starts."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise RequestError("prompts must be a string, a dict with 'prompt_token_ids', or a list of them; got "
                               f"{type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
        else:
            raise ConfigError("sampling_params must be SamplingParams or a list of them; got "
                              f"{type(sampling_params).__name__}")
        if len(params) != len(prompts):
            raise ConfigError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one each")
        prepared = [self.prompt_ids(p, f"prompt {i}", getattr(q, "truncate_prompt_tokens", None) is not None)
                    for i, (p, q) in enumerate(zip(prompts, params))]
        for i, prompt in enumerate(prepared):
            try:
                if isinstance(params[i], SamplingParams):
                    params[i].verify()  # a field set after construction is checked here, not met mid-run
                prepared[i] = prompt._replace(ids=self.check_prompt(prompt.ids, params[i], f"prompt {i}"))
            except SamplingError as exc:
                raise SamplingError(f"prompt {i}: {exc}") from None
        return prepared, params

    def chat_prompts(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
                     add_generation_prompt: bool = True, chat_template: str | None = None,
                     chat_template_kwargs: dict[str, Any] | None = None,
                     continue_final_message: bool = False) -> list[PromptType]:
        """One conversation or a list of them, each through the tokenizer's chat template (or
        `chat_template`), with `chat_template_kwargs` as the template's extra variables (Qwen3's
        enable_thinking, for one); `continue_final_message`: see `chat_ids`."""
        if self.tokenizer is None:
            raise RequestError(f"{self.model_dir} has no tokenizer; use generate() with prompt_token_ids")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(f"{self.model_dir} has no tokenizer chat template; use generate() with plain text")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = dict(chat_template_kwargs or {})  # vLLM's merge: the kwargs' apply_chat_template arguments win
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
        prompts: list[PromptType] = []
        for i, conv in enumerate(conversations):
            # content may be left out of a message that carries tool calls (OpenAI's and vLLM's rule)
            if not isinstance(conv, (list, tuple)) or not conv or not all(
                    isinstance(m, dict) and "role" in m and ("content" in m or m.get("tool_calls")) for m in conv):
                raise RequestError(f"conversation {i}: messages must be a non-empty list of {{'role', 'content'}}")
            conv = [m if "content" in m else {**m, "content": None} for m in conv]
            for j, m in enumerate(conv):  # a dict or a number would reach the template as its Python text
                if not isinstance(m["content"], str | list | None):
                    raise RequestError(f"conversation {i}, message {j}: content must be text or a list of text parts, "
                                       f"got {type(m['content']).__name__}")
            conv = [{**m, "content": text_content(m["content"], f"conversation {i}, message {j}")}
                    if isinstance(m["content"], list) else m for j, m in enumerate(conv)]
            ids = chat_ids(self.tokenizer, conv, add_generation_prompt, continue_final_message, f"conversation {i}",
                           chat_template=read_chat_template(chat_template) if chat_template is not None else None,
                           **kwargs)
            prompts.append({"prompt_token_ids": ids})
        return prompts
