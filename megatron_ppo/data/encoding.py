"""Text rows tokenized a chunk at a time: the tokenizer's batch call (`tokenizers`' `encode_batch`, SentencePiece's
list encode) over every text a chunk of records will ask for, on every core, then each row parsed on its own as
before (`parse.parse_row`), its `encode` calls answered from what the batch call gave.

The texts are those `parse_row` encodes for a text row: the prompt (a string, or chat messages rendered as it renders
them), the response, and — when the apart/together check is asked (`data.tokenization_check` is not off, or the row
carries behaviour log-probs) — the prompt and response together. A text not encoded ahead (a record that fails before
it is tokenized, the characters `_unknown_characters` looks up) is encoded on its own, so the ids are the tokenizer's
either way; only where the work runs changes.

The together text of the check (`warn`) is read off the apart encodings where the tokenizer says which word
(pre-token) each id came from (`HFTokenizer.encodings`), not encoded whole: only the join's window is — from the start
of the prompt's word at its `WINDOW_CHARS`-th character from the end to the end of the response's word at its
`WINDOW_CHARS`-th character — and compared with the apart ids of that span, and its last word's start with the
response's (`_Window.answers`). Equal, `encode(prompt + response)` is answered with the apart ids: a pre-tokenizer
splits by a pattern without look-behind, so the words after a word boundary depend only on the text from it — the
joined text is split as the response from the window's last word on — and the words before the window are the
prompt's own unless one run of characters the pattern takes whole (a word, a run of spaces and newlines) reaches from
before the window to the join. Different, the joined text is encoded whole, so the count and the message are exact.
Where a row's fate hangs on the check (`strict`, a row with behaviour log-probs) the joined text is always encoded
whole. `tests/unit/test_tokenization_window.py` holds it to the whole encoding on adversarial text, with this window and
with one of a single character.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from megatron_ppo.config.schema import DataConfig
from megatron_ppo.data.parse import BEHAVIOR_LOG_PROBS_KEY, PROMPT_IDS_KEY, RESPONSE_IDS_KEY, Tokenizer, render_prompt

WINDOW_CHARS = 16  # characters of the prompt's end and the response's start encoded together (whole words)


class _Texts(NamedTuple):
    """What `parse_row` will encode of one text record; `check`: how its together text is found (None: not asked)."""

    prompt: str
    response: str
    check: str | None  # "window" (read off the apart encodings where it can be) | "whole"


class _Window(NamedTuple):
    """The joined text around the join, the ids the apart encodings give that span, and where its last word (the
    response's) starts in it — None when the window runs to the response's end."""

    text: str
    ids: list[int]
    last_word: int | None

    def answers(self, encoding: Any) -> bool:
        """Whether the window encoded together (`encoding`) is its apart ids, split into words at its last word's
        start as apart: equal ids alone can hide a shifted boundary (" |" + "'d" and " |'" + "d" are the same ids,
        and the joined text's next word differs), after which the joined text and the response are split alike."""
        if encoding.ids != self.ids:
            return False
        return self.last_word is None or encoding.word_to_chars(encoding.token_to_word(len(self.ids) - 1))[0] == (
            self.last_word
        )


class Encoded(NamedTuple):
    """`encode_texts`' answer: each distinct text's ids, and the together ids of the checked rows whose joined text
    was encoded whole (by row index); a checked row absent from `together` encodes together as its apart ids."""

    ids: dict[str, list[int]]
    together: dict[int, list[int]]

    def joined(self, prompt: str, response: str, row: int) -> list[int]:
        """The ids of `prompt + response` (row `row`) encoded together."""
        found = self.together.get(row)
        return self.ids[prompt] + self.ids[response] if found is None else found


def encode_texts(tokenizer: Tokenizer, prompts: list[str], responses: list[str], checks: list[str | None]) -> Encoded:
    """Each distinct prompt and response encoded once, in the tokenizer's batch calls; for the rows whose `checks`
    entry is "window" the joined text read off the apart encodings where it can be (module docstring), for "whole"
    rows (and where the tokenizer gives no words) the joined text encoded whole; None: not checked."""
    batched, encodings = tokenizer.encode_batch, getattr(tokenizer, "encodings", None)
    texts = list(dict.fromkeys(prompts + responses))  # a GRPO group's prompt is encoded once
    windowed = [i for i, check in enumerate(checks) if check == "window" and encodings is not None]
    if windowed:
        found = dict(zip(texts, encodings(texts), strict=True))
        ids = {text: encoding.ids for text, encoding in found.items()}
        windows = [_window(prompts[i], responses[i], found, ids) for i in windowed]
        together = iter(encodings([window.text for window in windows if window is not None]))
        read_off = {i for i, window in zip(windowed, windows, strict=True)
                    if window is not None and window.answers(next(together))}  # fmt: skip
    else:
        ids, read_off = dict(zip(texts, batched(texts), strict=True)), set()
    whole = [i for i, check in enumerate(checks) if check is not None and i not in read_off]
    together = batched([prompts[i] + responses[i] for i in whole]) if whole else []
    return Encoded(ids, dict(zip(whole, together, strict=True)))


class BatchEncoded:
    """A `Tokenizer` whose `encode` answers from the last `encode_ahead` batch; everything else is `tokenizer`'s."""

    def __init__(self, tokenizer: Tokenizer, config: DataConfig) -> None:
        self.tokenizer, self.config = tokenizer, config
        self.batched = hasattr(tokenizer, "encode_batch")  # False: a tokenizer without one encodes row by row
        self.encoded: dict[str, list[int]] = {}

    def __getattr__(self, name: str) -> Any:  # eos_id, unk_id, chat_template, vocab_size, decode, ...
        return getattr(self.tokenizer, name)

    def encode(self, text: str) -> list[int]:
        ids = self.encoded.get(text)
        return self.tokenizer.encode(text) if ids is None else list(ids)

    def encode_ahead(self, records: Iterable[Any]) -> None:
        """Encode, in batch calls, the texts `parse_row` will ask of these records."""
        if not self.batched:
            return
        rows = [texts for record in records if (texts := self._texts(record)) is not None]
        prompts, responses = [row.prompt for row in rows], [row.response for row in rows]
        encoded = encode_texts(self.tokenizer, prompts, responses, [row.check for row in rows])
        self.encoded.update(encoded.ids)
        for i, row in enumerate(rows):
            if row.check is not None:
                self.encoded[row.prompt + row.response] = encoded.joined(row.prompt, row.response, i)

    def forget(self) -> None:
        """Drop the batch's ids (called after each chunk: the memory is one chunk's)."""
        self.encoded.clear()

    def _texts(self, record: Any) -> _Texts | None:
        if not isinstance(record, dict) or record.get(PROMPT_IDS_KEY) is not None:
            return None
        if record.get(RESPONSE_IDS_KEY) is not None:
            return None
        prompt, response = record.get(self.config.prompt_key), record.get(self.config.response_key)
        if not isinstance(response, str) or not response or prompt is None:
            return None
        try:
            text, _ = render_prompt(prompt, self.tokenizer)
        except Exception:
            return None
        if not isinstance(text, str):
            return None
        if record.get(BEHAVIOR_LOG_PROBS_KEY) is not None or self.config.tokenization_check == "strict":
            return _Texts(text, response, "whole")
        return _Texts(text, response, None if self.config.tokenization_check == "off" else "window")


def _window(
    prompt_text: str, response_text: str, encodings: dict[str, Any], ids: dict[str, list[int]]
) -> _Window | None:
    """The join's window of a prompt and response (whole words each side), or None where the encodings cannot
    place it."""
    prompt, response = encodings[prompt_text], encodings[response_text]
    start, first = 0, 0  # the window's first character of the prompt, and its first id
    if len(prompt_text) > WINDOW_CHARS:
        word = prompt.char_to_word(len(prompt_text) - WINDOW_CHARS)
        if word is None:
            return None
        start, first = prompt.word_to_chars(word)[0], prompt.word_to_tokens(word)[0]
    end, last = len(response_text), len(ids[response_text])  # the window's end in the response, and its id count
    last_word = None  # where the window's last word starts in it
    if len(response_text) > WINDOW_CHARS:
        word = response.char_to_word(WINDOW_CHARS - 1)
        if word is None:
            return None
        (begin, end), last = response.word_to_chars(word), response.word_to_tokens(word)[1]
        last_word = len(prompt_text) - start + begin
    return _Window(prompt_text[start:] + response_text[:end], ids[prompt_text][first:] + ids[response_text][:last],
                   last_word)  # fmt: skip
