"""Text rows tokenized a chunk at a time: the tokenizer's batch call (`tokenizers`' `encode_batch`, SentencePiece's
list encode) over every text a chunk of records will ask for, on every core, then each row parsed on its own as
before (`parse.parse_row`), its `encode` calls answered from what the batch call gave.

The texts are those `parse_row` encodes for a text row: the prompt (a string, or chat messages rendered as it renders
them), the response, and — when the apart/together check is asked (`data.tokenization_check` is not off, or the row
carries behaviour log-probs) — the prompt and response together. A text not encoded ahead (a record that fails before
it is tokenized, the characters `_unknown_characters` looks up) is encoded on its own, so the ids are the tokenizer's
either way; only where the work runs changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from megatron_ppo.config.schema import DataConfig
from megatron_ppo.data.parse import BEHAVIOR_LOG_PROBS_KEY, PROMPT_IDS_KEY, RESPONSE_IDS_KEY, Tokenizer, render_prompt


class BatchEncoded:
    """A `Tokenizer` whose `encode` answers from the last `encode_ahead` batch; everything else is `tokenizer`'s."""

    def __init__(self, tokenizer: Tokenizer, config: DataConfig) -> None:
        self.tokenizer, self.config = tokenizer, config
        self.batched = getattr(tokenizer, "encode_batch", None)  # None: a tokenizer without one encodes row by row
        self.encoded: dict[str, list[int]] = {}

    def __getattr__(self, name: str) -> Any:  # eos_id, unk_id, chat_template, vocab_size, decode, ...
        return getattr(self.tokenizer, name)

    def encode(self, text: str) -> list[int]:
        ids = self.encoded.get(text)
        return self.tokenizer.encode(text) if ids is None else list(ids)

    def encode_ahead(self, records: Iterable[Any]) -> None:
        """Encode, in one batch call, the texts `parse_row` will ask of these records."""
        if self.batched is None:
            return
        texts = dict.fromkeys(text for record in records for text in self._texts(record))
        texts = [text for text in texts if text not in self.encoded]
        if texts:
            self.encoded.update(zip(texts, self.batched(texts), strict=True))

    def forget(self) -> None:
        """Drop the batch's ids (called after each chunk: the memory is one chunk's)."""
        self.encoded.clear()

    def _texts(self, record: Any) -> list[str]:
        if not isinstance(record, dict) or record.get(PROMPT_IDS_KEY) is not None:
            return []
        if record.get(RESPONSE_IDS_KEY) is not None:
            return []
        prompt, response = record.get(self.config.prompt_key), record.get(self.config.response_key)
        if not isinstance(response, str) or not response or prompt is None:
            return []
        try:
            text, _ = render_prompt(prompt, self.tokenizer)
        except Exception:
            return []
        if not isinstance(text, str):
            return []
        texts = [text, response]
        if self.config.tokenization_check != "off" or record.get(BEHAVIOR_LOG_PROBS_KEY) is not None:
            texts.append(text + response)
        return texts
