"""Training data: chat/prompt-response jsonl, plain text and source trees, the stdlib corpus, a BPE tokenizer.

Everything here is deterministic (sorted paths, seeded shuffles) so that a run, a resume and a
held-out evaluation all see the same examples in the same order.
"""

from __future__ import annotations

import glob
import json
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from blockspec.config import ConfigError
from blockspec.errors import RequestError
from blockspec.inputs import jsonl_records, text_content

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN, *CHAT_TOKENS)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

HELDOUT_PACKAGES = ("json", "asyncio", "email")
TEST_DIRS = frozenset({"test", "tests", "idle_test"})


class DataError(ConfigError):
    """A data file or record cannot be used; the message names the file/record and the problem (one line
    from the command line, as every ConfigError)."""


@dataclass
class Example:
    """One training sequence; loss_mask[i] = 1 when token i is a prediction target."""

    input_ids: list[int]
    loss_mask: list[int]


# ---------------------------------------------------------------- corpora
@dataclass(frozen=True)
class StdlibSplit:
    """The running interpreter's stdlib sources, split by top-level package into train and held-out files."""

    root: Path
    train: list[Path]
    heldout: list[Path]


def stdlib_split(root: str | Path | None = None, heldout: Sequence[str] = HELDOUT_PACKAGES) -> StdlibSplit:
    """*.py under the stdlib without site-packages and test directories; `heldout` packages go to eval only."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    train: list[Path] = []
    held: list[Path] = []
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(base).parts
        if "site-packages" in parts or "dist-packages" in parts or TEST_DIRS & set(parts[:-1]):
            continue
        top = parts[0][:-3] if len(parts) == 1 else parts[0]  # a top-level module json.py counts as json
        (held if top in heldout else train).append(path)
    if not train:
        raise DataError(f"no Python sources found under {base}")
    return StdlibSplit(base, train, held)


def text_files(spec: str | Path, suffixes: Sequence[str] | None = None) -> list[Path]:
    """A file, a directory (all non-hidden files, optionally filtered by suffix) or a glob, sorted."""
    path = Path(spec)
    if path.is_file():
        return [path]
    if path.is_dir():
        found = [p for p in path.rglob("*") if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
    else:
        found = [Path(p) for p in glob.glob(str(spec), recursive=True) if Path(p).is_file()]
    if suffixes:
        found = [p for p in found if p.suffix in suffixes]
    if not found:
        raise DataError(f"{spec}: no files there" if path.exists() else
                        f"{spec}: no such file, directory or glob match")
    return sorted(found)


def read_texts(paths: Iterable[Path]) -> list[str]:
    """UTF-8 contents of each file; undecodable or empty files are skipped (they would not round-trip)."""
    texts = []
    for p in paths:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text:
            texts.append(text)
    return texts


# ---------------------------------------------------------------- tokenizer
def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, max_len: int = 4096) -> Any:
    """Byte-level BPE trained on `texts`: exact decode of any text, special tokens at ids 0..4.

    <|endoftext|> is EOS, <|pad|> pads, <|mask|> is the drafters' mask_token_id (a real row of the
    target embedding, as DFlash/DSpark require); <|im_start|>/<|im_end|> carry a minimal chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
                                   mask_token=MASK_TOKEN, additional_special_tokens=list(CHAT_TOKENS),
                                   clean_up_tokenization_spaces=False, model_max_length=max_len)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(tokenizer: Any, out_dir: str | Path) -> None:
    """tokenizer.json + tokenizer_config.json (class PreTrainedTokenizerFast, chat template inline).

    Naming the class PreTrainedTokenizerFast and inlining the template keeps the directory loadable
    by transformers 4.x as well as 5.x (which would otherwise write its own class name and a .jinja).
    """
    out = Path(out_dir)
    tokenizer.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    jinja = out / "chat_template.jinja"
    if jinja.is_file():
        cfg["chat_template"] = jinja.read_text(encoding="utf-8")
        jinja.unlink()
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- examples
def pack_documents(docs: Iterable[list[int]], max_len: int, eos_id: int, min_len: int = 2) -> list[Example]:
    """Concatenate documents (each followed by EOS) and cut into max_len sequences; loss on every token."""
    stream: list[int] = []
    for ids in docs:
        stream.extend(ids)
        stream.append(eos_id)
    out = []
    for i in range(0, len(stream), max_len):
        chunk = stream[i : i + max_len]
        if len(chunk) >= min_len:
            out.append(Example(chunk, [1] * len(chunk)))
    return out


def text_examples(texts: Iterable[str], tokenizer: Any, max_len: int) -> list[Example]:
    """Plain text or source files as packed full-loss sequences (batch-encoded in Rust when possible)."""
    return pack_documents(encode_texts(texts, tokenizer), max_len, tokenizer.eos_token_id)


def encode_texts(texts: Iterable[str], tokenizer: Any) -> list[list[int]]:
    """Token ids of each text without special tokens; uses the fast backend's parallel batch encode."""
    texts = list(texts)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _assistant_spans(tokenizer: Any, messages: list[dict[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of assistant turns (content + end-of-turn).

    A turn's span is what rendering it adds after the generation prompt; templates that rewrite
    earlier turns (so prefixes do not nest) are rejected rather than silently mis-masked.
    """
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        after = _render(tokenizer, messages[: i + 1], False)
        if not (after.startswith(before) and full.startswith(after)):
            raise DataError(f"{where}: the chat template does not render conversation prefixes as prefixes; "
                            "cannot locate assistant tokens")
        spans.append((len(before), len(after)))
    return full, spans


JSON_TYPES = {str: "a string", bool: "a boolean", int: "a number", float: "a number", list: "an array",
              dict: "an object", type(None): "null"}


def json_type(value: Any) -> str:
    """What `value` is, in JSON's words (a Python type's name for a value JSON has no word for)."""
    return JSON_TYPES.get(type(value), type(value).__name__)


def record_messages(record: Any, where: str) -> list[dict[str, str]]:
    """The conversation of a {"prompt","response"} or {"messages"} record, every role and content checked to
    be a string: a chat template renders a number or a list as its Python repr, which would be trained on as
    if it were the text."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object, got {json_type(record)}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                    for m in messages):
            raise DataError(f"{where}: 'messages' must be a list of {{'role', 'content'}}")
        messages = [{"role": m["role"], "content": _content_text(m["content"], f"{where}: messages[{i}]")}
                    for i, m in enumerate(messages)]
        fields = {f"messages[{i}].{key}": m[key] for i, m in enumerate(messages) for key in ("role", "content")}
    elif "prompt" in record and "response" in record:
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
        fields = {key: record[key] for key in ("prompt", "response")}
    else:
        raise DataError(f"{where}: needs 'messages', both 'prompt' and 'response', or 'text'; has {sorted(record)}")
    for name, value in fields.items():
        if not isinstance(value, str):
            raise DataError(f"{where}: field {name} must be a string, got {json_type(value)}")
    return messages


def _content_text(content: Any, where: str) -> Any:
    """A message's content as its text: OpenAI content parts joined as inference joins them
    (`inputs.text_content`), so a record trains on the prompt a request of it would be served."""
    if not isinstance(content, list):
        return content
    try:
        return text_content(content, where)
    except RequestError as err:
        raise DataError(str(err)) from None


def record_example(record: Any, tokenizer: Any, max_len: int, where: str = "record") -> Example | None:
    """A {"prompt","response"} or {"messages"} record; loss only on response / assistant tokens.

    Returns None when truncation leaves fewer than 2 loss tokens (nothing useful to learn from).
    """
    messages = record_messages(record, where)
    if getattr(tokenizer, "chat_template", None):
        text, spans = _assistant_spans(tokenizer, messages, where)
    else:  # no template: plain concatenation, the response followed by EOS
        if [m["role"] for m in messages] != ["user", "assistant"]:
            raise DataError(f"{where}: tokenizer has no chat template; only one user + one assistant turn works")
        eos = tokenizer.eos_token or ""
        text = messages[0]["content"] + messages[1]["content"] + eos
        spans = [(len(messages[0]["content"]), len(text))]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])[:max_len]
    starts = [s for s, _ in enc["offset_mapping"]][:max_len]
    mask = [int(any(a <= s < b for a, b in spans)) for s in starts]
    if sum(mask) < 2:
        return None
    return Example(ids, mask)


CONVERSATION_FIELDS = ("messages", "prompt", "response")


def record_text(record: Any, where: str) -> str | None:
    """A {"text"} record's document (a jsonl of plain text, as text datasets ship), or None for a record that
    is a conversation or no object (`record_messages` checks those)."""
    if not isinstance(record, dict) or "text" not in record or any(k in record for k in CONVERSATION_FIELDS):
        return None
    if not isinstance(record["text"], str):
        raise DataError(f"{where}: field text must be a string, got {json_type(record['text'])}")
    return record["text"]


def jsonl_examples(path: str | Path, tokenizer: Any, max_len: int) -> list[Example]:
    """Every usable record of a jsonl file: the conversations in file order (loss on the responses), then the
    {"text"} records packed with full loss, as text files are."""
    out, texts = [], []
    for n, record in jsonl_records(path, DataError):
        text = record_text(record, f"{path}:{n}")
        if text is not None:
            texts.append(text)
            continue
        ex = record_example(record, tokenizer, max_len, f"{path}:{n}")
        if ex is not None:
            out.append(ex)
    if texts:
        out += text_examples(texts, tokenizer, max_len)
    if not out:
        raise DataError(f"{path}: no usable records")
    return out


def load_examples(spec: str | Path, tokenizer: Any, max_len: int) -> list[Example]:
    """The files of `spec` (a file, a directory or a glob): each .jsonl one's records (conversations, or {"text"}
    documents), and the other files as text packed with full loss. A .json file is refused: read as text its
    records' syntax would be trained on."""
    files = text_files(spec)
    arrays = [str(p) for p in files if p.suffix == ".json"]
    if arrays:
        raise DataError(f"{arrays[0]}: a .json file is not read (as text its JSON would be trained on); give records "
                        "as .jsonl, one object a line")
    out = [ex for p in files if p.suffix == ".jsonl" for ex in jsonl_examples(p, tokenizer, max_len)]
    texts = [p for p in files if p.suffix != ".jsonl"]
    if texts:
        read = read_texts(texts)
        if not read and not out:
            raise DataError(f"{spec}: no text to train on ({len(texts)} file(s), each empty or not UTF-8)")
        out += text_examples(read, tokenizer, max_len)
    return out


def split_examples(examples: list[Example], eval_frac: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Seeded split into (train, eval); at least one eval example when eval_frac > 0, never the last one
    left to train on (a single example trains, with nothing held out)."""
    if eval_frac <= 0:
        return examples, []
    perm = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = min(max(1, int(len(examples) * eval_frac)), len(examples) - 1)
    return [examples[i] for i in sorted(perm[n_eval:])], [examples[i] for i in sorted(perm[:n_eval])]


# ---------------------------------------------------------------- batching
def collate(examples: Sequence[Example], pad_id: int, length: int | None = None) -> tuple[Tensor, Tensor]:
    """Right-pad to `length` (default: longest); padding has loss_mask 0 and is never attended by real rows."""
    n = length or max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(examples), n), dtype=torch.int64)
    for i, e in enumerate(examples):
        k = min(n, len(e.input_ids))
        ids[i, :k] = torch.tensor(e.input_ids[:k])
        mask[i, :k] = torch.tensor(e.loss_mask[:k])
    return ids, mask


class ShuffledEpochs:
    """Endless seeded epochs of shuffled index batches (the ragged tail dropped: static batch shapes),
    with a state_dict so a resume continues the exact order. Subclasses turn indices into tensors."""

    def __init__(self, size: int, batch_size: int, seed: int) -> None:
        self.size = size
        self.batch_size = min(batch_size, size)
        self.seed = seed
        self.epoch = 0
        self.pos = 0
        self._perm = self._permutation()

    def __len__(self) -> int:
        return self.size

    def _permutation(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self

    def next_indices(self) -> list[int]:
        if self.pos + self.batch_size > len(self._perm):
            self.epoch += 1
            self.pos = 0
            self._perm = self._permutation()
        idx = self._perm[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return idx

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.pos = int(state["pos"])
        self._perm = self._permutation()


class Batches(ShuffledEpochs):
    """(ids, loss_mask) batches of examples, padded with `pad_id`."""

    def __init__(self, examples: list[Example], batch_size: int, pad_id: int, seed: int) -> None:
        if not examples:
            raise DataError("no training examples")
        self.examples = examples
        self.pad_id = pad_id
        super().__init__(len(examples), batch_size, seed)

    def __next__(self) -> tuple[Tensor, Tensor]:
        return collate([self.examples[i] for i in self.next_indices()], self.pad_id)
