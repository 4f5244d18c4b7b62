"""The data path at the size users bring: token-id rows (≈300 prompt + ≈900 response ids, behaviour log-probs, a
reward) generated into Parquet, prepared once (`data/prepare.py`), then mapped in a fresh process and one batch
drawn; and text rows prepared beside `tokenizers`' own `encode_batch` over the same texts.

Prints, for token-id rows: preparation tokens/s; the seconds from a fresh process's start to its first batch of 512
rows once prepared (the key's file hashing included), its resident memory (all of it, and above the same process's
imports) and the bytes per token on disk, source and prepared; a second preparation (nothing to do). For text rows:
preparation tokens/s with the apart/together check (data.tokenization_check=warn, the default) and without (off),
and `encode_batch` over prompts and responses on all cores, with the ratios — for rows of the issue's shape (≈ 300 +
900 tokens) and for short ones (≈ 80 + 240), where what the check costs a row weighs more.

Run: python -m bench.bench_data [--rows N] [--text-rows N]   (or `make bench-data`; `make bench` runs it too)
Writes under outputs/bench/data (≈ 17 GB at 10⁶ token-id rows; removed at the end unless --keep).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tokenizers

from bench.common import current_rss_mib

SCRATCH = Path("outputs/bench/data")
PROMPT, RESPONSE = 300, 900  # mean tokens of a token-id row
TEXT_SHAPES = {"≈ 300 + 900 tokens, the issue's": (230, 690), "≈ 80 + 240 tokens, short": (60, 180)}  # a text row's
# prompt and response words (≈ 1.3 tokens a word); the short rows' fixed costs a row weigh more
VOCAB = 32000
ROW_GROUP = 16384
LIBRARY_CHUNK = 2048  # texts a call of the library's own `encode_batch` (as many as the preparation's calls take)


def _arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smallest", action="store_true", help="the smallest size (seconds; its numbers mean nothing)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="token-id rows (default 10^6)")
    parser.add_argument("--text-rows", type=int, default=50_000, help="text rows (default 50,000)")
    parser.add_argument("--keep", action="store_true", help="keep outputs/bench/data")
    parser.add_argument("--first-batch", metavar="ROOT", help=argparse.SUPPRESS)  # the fresh process's part
    parser.add_argument("--text-run", choices=("library", "warn", "off"), help=argparse.SUPPRESS)  # the same
    arguments = parser.parse_args(argv)
    if arguments.smallest:
        arguments.rows, arguments.text_rows = 3000, 2000
    return arguments


def _lists(lengths: np.ndarray, values: np.ndarray) -> pa.ListArray:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def write_token_id_rows(path: Path, rows: int, vocab: int, seed: int = 0) -> int:
    """`rows` token-id rows (ids in [0, vocab)) in Parquet, a row group at a time; returns the tokens written."""
    generator = np.random.default_rng(seed)
    schema = pa.schema([("prompt_ids", pa.list_(pa.int32())), ("response_ids", pa.list_(pa.int32())),
                        ("behavior_log_probs", pa.list_(pa.float32())), ("reward", pa.float64())])  # fmt: skip
    tokens = 0
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, ROW_GROUP):
            n = min(ROW_GROUP, rows - start)
            prompt = generator.integers(PROMPT // 2, PROMPT * 3 // 2, n)
            response = generator.integers(RESPONSE // 2, RESPONSE * 3 // 2, n)
            ids = generator.integers(0, vocab, int(prompt.sum() + response.sum()), dtype=np.int32)
            log_probs = -generator.exponential(0.5, int(response.sum())).astype(np.float32)
            table = pa.table({
                "prompt_ids": _lists(prompt, ids[: prompt.sum()]), "response_ids": _lists(response, ids[prompt.sum():]),
                "behavior_log_probs": _lists(response, log_probs), "reward": generator.normal(size=n),
            }, schema=schema)  # fmt: skip
            writer.write_table(table)
            tokens += int(prompt.sum() + response.sum())
    return tokens


def _words() -> np.ndarray:
    """The 20,000 words the texts are made of (the same every run): 1–4 syllables each."""
    generator = np.random.default_rng(0)
    syllables = np.array(["ka", "lo", "mi", "ra", "te", "su", "no", "vi", "de", "an", "or", "el", "is", "un", "qu",
                          "pr", "st", "b", "g", "ch"])  # fmt: skip
    picks = generator.integers(0, len(syllables), (20000, 4))
    counts = generator.integers(1, 5, 20000)
    return np.array(["".join(syllables[picks[i, : counts[i]]]) for i in range(20000)])


def write_text_rows(path: Path, rows: int, words_each: tuple[int, int], seed: int = 0) -> tuple[list[str], list[str]]:
    """`rows` text rows of about `words_each` (prompt, response) words (Zipf-distributed words of a 20,000-word
    vocabulary, some punctuation) in Parquet; returns (prompts, responses)."""
    generator = np.random.default_rng(seed)
    words = _words()
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()

    def text(count: int) -> str:
        chosen = words[generator.choice(len(words), count, p=weights)]
        return " ".join(w + ("." if i % 13 == 12 else ",") if i % 7 == 6 else w for i, w in enumerate(chosen))

    prompt_words, response_words = words_each
    prompts = [text(int(generator.integers(prompt_words // 2, prompt_words * 3 // 2))) for _ in range(rows)]
    responses = [" " + text(int(generator.integers(response_words // 2, response_words * 3 // 2)))
                 for _ in range(rows)]  # fmt: skip
    pq.write_table(pa.table({"prompt": prompts, "response": responses, "reward": generator.normal(size=rows)}), path)
    return prompts, responses


def byte_level_bpe(directory: Path, texts: list[str]) -> Path:
    """A byte-level BPE `tokenizer.json` of the usual kind (GPT-2's pre-tokenizer), trained on `texts`."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    return directory


def _config(files: list[Path], check: str = "warn"):
    from megatron_ppo.config.schema import DataConfig

    return DataConfig(train_files=[str(f) for f in files], max_prompt_length=2048, max_response_length=2048,
                      tokenization_check=check)  # fmt: skip


def first_batch(root: str) -> None:
    """In a fresh process: the imports a trainer makes, then the prepared rows mapped (the key computed, nothing
    prepared) and one batch of 512 drawn and collated; prints seconds since the process started and memory."""
    started = time.time() - time.clock_gettime(time.CLOCK_MONOTONIC) + _process_start()  # epoch seconds
    import torch  # noqa: F401 — what every rank has imported before its data

    import megatron_ppo.train.batch  # noqa: F401
    from megatron_ppo.data.prepare import prepared_rows
    from megatron_ppo.data.prepared import rows_at
    from megatron_ppo.data.tokenizer import load_tokenizer
    from megatron_ppo.train.batch import collate

    imported, imported_anon = current_rss_mib(), current_rss_mib("RssAnon")
    data = prepared_rows(sorted(Path(root).glob("ids*.parquet")), load_tokenizer(Path(root) / "tokenizer"),
                         _config(sorted(Path(root).glob("ids*.parquet"))), Path(root) / "prepared")  # fmt: skip
    order = np.random.default_rng(1).permutation(len(data.rows))[:512]
    batch = collate(rows_at(data.rows, order), pad_id=0)
    elapsed = time.time() - started
    print(
        "\t".join(
            [
                "FIRST_BATCH",
                f"{elapsed:.2f}",
                f"{current_rss_mib():.0f}",
                f"{current_rss_mib() - imported:.0f}",
                f"{current_rss_mib('RssAnon') - imported_anon:.0f}",
                data.how,
                str(tuple(batch["input_ids"].shape)),
            ]
        )
    )


def _process_start() -> float:
    """This process's start on the monotonic clock (from /proc/self/stat's start time in clock ticks)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    return ticks / os.sysconf("SC_CLK_TCK")


def _directory_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def token_id_part(rows: int) -> None:
    from megatron_ppo.data.prepare import prepared_rows
    from megatron_ppo.data.tokenizer import load_tokenizer

    source = SCRATCH / "ids.parquet"
    tokenizer = load_tokenizer(SCRATCH / "tokenizer")
    started = time.perf_counter()
    tokens = write_token_id_rows(source, rows, tokenizer.vocab_size)
    print(f"token-id rows: {rows:,} rows, {tokens / 1e9:.3f}e9 tokens (≈{PROMPT} prompt + ≈{RESPONSE} response, "
          f"behaviour log-probs), generated in {time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
    started = time.perf_counter()
    data = prepared_rows([source], tokenizer, _config([source]), SCRATCH / "prepared", say=lambda _: None)
    prepare_s = time.perf_counter() - started
    prepared_bytes = _directory_bytes(data.directory)
    print(f"  prepare (key hashing included)  : {prepare_s:8.1f} s, {tokens / prepare_s / 1e6:6.1f}M tokens/s")
    print(
        f"  on disk, bytes per token        : source Parquet {source.stat().st_size / tokens:.2f}, "
        f"prepared {prepared_bytes / tokens:.2f} (int32 ids + float32 log-probs + index)"
    )
    del data
    for attempt in (1, 2):  # the second: the page cache warm from the first
        out = subprocess.run(
            [sys.executable, "-m", "bench.bench_data", "--first-batch", str(SCRATCH)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        line = next(line for line in out.stdout.splitlines() if line.startswith("FIRST_BATCH"))
        _, seconds, rss, above, private, how, shape = line.split("\t")
        print(
            f"  fresh process → first batch ({attempt}): {float(seconds):6.1f} s from process start, resident "
            f"{rss} MiB, {above} MiB above its imports ({private} MiB of it private), {how}, batch {shape}"
        )


def text_part(rows: int, shape: str) -> None:
    """Text rows of `TEXT_SHAPES[shape]` prepared with the check and without, beside `encode_batch` over the same
    texts, `LIBRARY_CHUNK` a call: its Encodings alone (the ids left in Rust), and with each text's ids read into a
    Python list (`.ids`), which any use of them from Python pays — the floor for a preparation in Python. Each in a
    fresh process, as `megatron-ppo prepare` runs (in one process, a preparation after the library's calls took up
    to twice its time)."""
    write_text_rows(SCRATCH / "text.parquet", rows, TEXT_SHAPES[shape], seed=1)
    library_s, with_ids_s, tokens = _text_run("library")
    pieces = tokenizers.Tokenizer.from_file(str(SCRATCH / "tokenizer" / "tokenizer.json")).get_vocab_size()
    print(f"text rows ({shape}): {rows:,} rows, {tokens / 1e6:.1f}M tokens, byte-level BPE of {pieces} pieces, "
          f"{os.cpu_count()} cores")  # fmt: skip
    print(f"  tokenizers' encode_batch        : {library_s:8.1f} s, {tokens / library_s / 1e6:6.2f}M tokens/s "
          f"({with_ids_s:.1f} s with the ids read out)")  # fmt: skip
    for check in ("warn", "off"):
        shutil.rmtree(SCRATCH / "prepared", ignore_errors=True)
        elapsed = _text_run(check)[0]
        print(
            f"  prepare, tokenization_check={check:4s}: {elapsed:8.1f} s, {tokens / elapsed / 1e6:6.2f}M tokens/s, "
            f"{library_s / elapsed:.2f}× encode_batch ({with_ids_s / elapsed:.2f}× with the ids read out)"
        )


def _text_run(kind: str) -> tuple[float, float, int]:
    out = subprocess.run([sys.executable, "-m", "bench.bench_data", "--text-run", kind], capture_output=True,
                         text=True, check=True)  # fmt: skip
    line = next(line for line in out.stdout.splitlines() if line.startswith("TEXT_RUN"))
    _, seconds, with_ids, tokens = line.split("\t")
    return float(seconds), float(with_ids), int(tokens)


def text_run(kind: str) -> None:
    """In a fresh process: "library" — `encode_batch` over the texts of the scratch `text.parquet` (read first, not
    timed), `LIBRARY_CHUNK` a call, the ids read out or not; "warn" / "off" — the file prepared with that check.
    Prints the seconds (and for the library, with the ids read out, and the tokens with each response's eos)."""
    from megatron_ppo.data.prepare import prepared_rows
    from megatron_ppo.data.tokenizer import load_tokenizer

    source, tokenizer = SCRATCH / "text.parquet", load_tokenizer(SCRATCH / "tokenizer")
    if kind != "library":
        started = time.perf_counter()
        prepared_rows([source], tokenizer, _config([source], kind), SCRATCH / "prepared", say=lambda _: None)
        print(f"TEXT_RUN\t{time.perf_counter() - started}\t0\t0")
        return
    table = pq.read_table(source)
    texts = table.column("prompt").to_pylist() + table.column("response").to_pylist()
    library_s = with_ids_s = 0.0
    tokens = table.num_rows  # + the eos each response gets
    for first in range(0, len(texts), LIBRARY_CHUNK):
        started = time.perf_counter()
        encoded = tokenizer.tokenizer.encode_batch(texts[first : first + LIBRARY_CHUNK], add_special_tokens=False)
        library_s += time.perf_counter() - started
        ids = [encoding.ids for encoding in encoded]
        with_ids_s += time.perf_counter() - started
        tokens += sum(map(len, ids))
    print(f"TEXT_RUN\t{library_s}\t{with_ids_s}\t{tokens}")


def main(argv=None) -> None:
    arguments = _arguments(argv)
    if arguments.first_batch:
        first_batch(arguments.first_batch)
        return
    if arguments.text_run:
        text_run(arguments.text_run)
        return
    shutil.rmtree(SCRATCH, ignore_errors=True)
    SCRATCH.mkdir(parents=True)
    prompts, responses = write_text_rows(SCRATCH / "sample.parquet", 4000, TEXT_SHAPES["≈ 80 + 240 tokens, short"], 2)
    byte_level_bpe(SCRATCH / "tokenizer", prompts + responses)
    try:
        token_id_part(arguments.rows)
        for shape in TEXT_SHAPES:
            text_part(arguments.text_rows, shape)
    finally:
        if not arguments.keep:
            shutil.rmtree(SCRATCH, ignore_errors=True)


if __name__ == "__main__":
    main()
