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
`WINDOW_CHARS`-th character — and compared with the apart ids of that span. Equal, `encode(prompt + response)` is
answered with the apart ids: a pre-tokenizer splits by a pattern without look-behind, so the words after a word
boundary depend only on the text from it, and the words before the window are the prompt's own unless one run of
characters the pattern takes whole (a word, a run of spaces and newlines) reaches from before the window to the join.
Different, the joined text is encoded whole, so the count and the message are exact. Where a row's fate hangs on the
check (`strict`, a row with behaviour log-probs) the joined text is always encoded whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

from megatron_ppo.config.schema import DataConfig
from megatron_ppo.data.parse import BEHAVIOR_LOG_PROBS_KEY, PROMPT_IDS_KEY, RESPONSE_IDS_KEY, Tokenizer, render_prompt

WINDOW_CHARS = 64  # characters of the prompt's end and the response's start encoded together (whole words)


class _Texts(NamedTuple):
    """What `parse_row` will encode of one text record; `check`: how its together text is found (None: not asked)."""

    prompt: str
    response: str
    check: str | None  # "window" (read off the apart encodings where it can be) | "whole"


class _Window(NamedTuple):
    """The joined text around the join and the ids the apart encodings give that span."""

    text: str
    ids: list[int]


class BatchEncoded:
    """A `Tokenizer` whose `encode` answers from the last `encode_ahead` batch; everything else is `tokenizer`'s."""

    def __init__(self, tokenizer: Tokenizer, config: DataConfig) -> None:
        self.tokenizer, self.config = tokenizer, config
        self.batched = getattr(tokenizer, "encode_batch", None)  # None: a tokenizer without one encodes row by row
        self.encodings = getattr(tokenizer, "encodings", None)  # None: no words given, the check encodes whole
        self.encoded: dict[str, list[int]] = {}

    def __getattr__(self, name: str) -> Any:  # eos_id, unk_id, chat_template, vocab_size, decode, ...
        return getattr(self.tokenizer, name)

    def encode(self, text: str) -> list[int]:
        ids = self.encoded.get(text)
        return self.tokenizer.encode(text) if ids is None else list(ids)

    def encode_ahead(self, records: Iterable[Any]) -> None:
        """Encode, in batch calls, the texts `parse_row` will ask of these records."""
        if self.batched is None:
            return
        rows = [texts for record in records if (texts := self._texts(record)) is not None]
        read_off = self.encodings is not None
        windowed = [row for row in rows if row.check == "window" and read_off]
        whole = [row.prompt + row.response for row in rows if row.check == "whole" or (row.check and not read_off)]
        apart = [text for row in rows for text in (row.prompt, row.response)]
        if not windowed:
            self._encode(apart + whole)
            return
        encodings = dict(zip(texts := self._new(apart), self.encodings(texts), strict=True))
        self.encoded.update((text, encoding.ids) for text, encoding in encodings.items())
        self._encode(whole)
        windows = [(row, _window(row, encodings, self.encoded)) for row in windowed]
        found = iter(self.batched([window.text for _, window in windows if window is not None]))
        unequal = []
        for row, window in windows:
            if window is not None and next(found) == window.ids:
                self.encoded[row.prompt + row.response] = self.encoded[row.prompt] + self.encoded[row.response]
            else:
                unequal.append(row.prompt + row.response)
        self._encode(unequal)

    def forget(self) -> None:
        """Drop the batch's ids (called after each chunk: the memory is one chunk's)."""
        self.encoded.clear()

    def _new(self, texts: list[str]) -> list[str]:
        return [text for text in dict.fromkeys(texts) if text not in self.encoded]

    def _encode(self, texts: list[str]) -> None:
        if texts := self._new(texts):
            self.encoded.update(zip(texts, self.batched(texts), strict=True))

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


def _window(row: _Texts, encodings: dict[str, Any], ids: dict[str, list[int]]) -> _Window | None:
    """The join's window of `row` (whole words each side), or None where the encodings cannot place it."""
    prompt, response = encodings[row.prompt], encodings[row.response]
    start, first = 0, 0  # the window's first character of the prompt, and its first id
    if len(row.prompt) > WINDOW_CHARS:
        word = prompt.char_to_word(len(row.prompt) - WINDOW_CHARS)
        if word is None:
            return None
        start, first = prompt.word_to_chars(word)[0], prompt.word_to_tokens(word)[0]
    end, last = len(row.response), len(ids[row.response])  # the window's end in the response, and its id count
    if len(row.response) > WINDOW_CHARS:
        word = response.char_to_word(WINDOW_CHARS - 1)
        if word is None:
            return None
        end, last = response.word_to_chars(word)[1], response.word_to_tokens(word)[1]
    return _Window(row.prompt[start:] + row.response[:end], ids[row.prompt][first:] + ids[row.response][:last])
