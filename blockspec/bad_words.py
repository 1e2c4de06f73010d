"""Bad words (vLLM's `SamplingParams.bad_words`): their token sequences, and the tokens they ban at a row.

A word is banned by its last token, at a row whose history (the output so far) ends with its other
tokens; a one-token word's token is banned at every row. Under speculation, verify row j of a request
follows its committed output and then drafts 1..j, so its ban is computed over that history: the
target's processed distribution at every verified position is then the one plain decoding samples
from there, and a draft that completes a bad word has probability zero and is rejected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from blockspec.sampling_params import SHORT, SamplingError

BadWords = tuple[tuple[int, ...], ...]  # token sequences, each banned by its last token
MAX_TOKENS = 1024  # of a request's words together: every sampled row compares their prefixes on the host (vLLM's)


def word_sequences(words: Sequence[str], tokenizer: Any, vocab_size: int) -> BadWords:
    """Each word's tokens as written (leading whitespace dropped), and with a leading space where that is
    another sequence of the same length (a word-initial token, as mid-sentence text tokenizes it): both
    are banned, so the word is kept out at the start of the text and after a space alike."""
    if tokenizer is None:
        raise SamplingError("SamplingParams.bad_words needs the model's tokenizer to tokenize the words; this model "
                            "has none")
    found: dict[tuple[int, ...], None] = {}
    for i, word in enumerate(words):
        try:
            word.encode("utf-8")  # JSON can carry a lone surrogate, which no tokenizer reads
        except UnicodeEncodeError:
            raise SamplingError(f"SamplingParams.bad_words[{i}] is not valid Unicode (a lone surrogate)") from None
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise SamplingError(f"SamplingParams.bad_words[{i}]={SHORT.repr(word)} tokenizes to no tokens")
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        found[bare] = None
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            found[spaced] = None
    total = sum(len(seq) for seq in found)
    if total > MAX_TOKENS:
        raise SamplingError(f"SamplingParams.bad_words tokenize to {total} tokens (both forms of each word); at most "
                            f"{MAX_TOKENS} are allowed")
    outside = sorted({t for seq in found for t in seq if not 0 <= t < vocab_size})
    if outside:
        raise SamplingError(f"SamplingParams.bad_words tokenize to ids {outside[:5]} outside the vocabulary "
                            f"[0, {vocab_size})")
    return tuple(found)


def banned_tokens(words: BadWords, output: Sequence[int], drafts: Sequence[int] = ()) -> list[int]:
    """The tokens the row after `output` + `drafts` may not take (one per matching word, repeats kept)."""
    out = []
    for seq in words:
        need = len(seq) - 1
        if need == 0:
            out.append(seq[0])
            continue
        if len(output) + len(drafts) < need:
            continue
        from_output = need - len(drafts)  # the history's last `need` tokens: drafts, then output before them
        tail = tuple(drafts[-need:]) if from_output <= 0 else tuple(output[len(output) - from_output:]) + tuple(drafts)
        if tail == seq[:-1]:
            out.append(seq[-1])
    return out
