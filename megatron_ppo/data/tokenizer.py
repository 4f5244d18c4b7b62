"""Tokenizers: a SentencePiece model file (trained here for the tiny task, or a model's own `.model`)."""

from __future__ import annotations

import io
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm


class SentencePieceTokenizer:
    """encode/decode text with a SentencePiece model; `eos_id` ends responses, `pad_id` fills batches."""

    def __init__(self, model_path: str | Path) -> None:
        self.path = str(model_path)
        self.processor = spm.SentencePieceProcessor(model_file=self.path)
        self.eos_id = self.processor.eos_id()
        self.pad_id = self.processor.pad_id() if self.processor.pad_id() >= 0 else self.eos_id
        if self.eos_id < 0:
            raise ValueError(f"{self.path} defines no end-of-sequence piece; responses need one to end")

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.processor.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.processor.decode([i for i in ids if i != self.eos_id])


def train_char_tokenizer(texts: Iterable[str], model_path: str | Path) -> SentencePieceTokenizer:
    """Train a character-level SentencePiece model on `texts` (no dummy-prefix space), with pad/bos/eos/unk."""
    model_path = Path(model_path)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts)),
        model_writer=buffer,
        model_type="char",
        vocab_size=4 + len(set("".join(texts))),
        character_coverage=1.0,
        add_dummy_prefix=False,
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    temporary = model_path.with_suffix(".tmp")
    temporary.write_bytes(buffer.getvalue())
    temporary.replace(model_path)
    return SentencePieceTokenizer(model_path)
