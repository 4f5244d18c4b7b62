"""`megatron-ppo score`: rewards from a reward model for every row of the dataset files, before PPO.

The reward model (`reward_model.model.*`) is a Hugging Face `*ForSequenceClassification` with one label — converted
on first use under `reward_model.megatron`, as the critic's init is (`critic_init.converted_critic_checkpoint`:
the trunk through the conversion table, its `score` as the value head), into
`<trainer.default_local_dir>/hf_init_reward_model/<hash>` — or a megatron-ppo checkpoint holding a value head (its
"critic"). It runs forward-only and frozen under its own TP/PP, data-parallel over the other ranks, in micro-batches
as the trainer's: `micro_batch_size_per_gpu` rows, or `forward_max_token_len_per_gpu` tokens with `use_dynamic_bsz`.
A row of P prompt and R response tokens (a text row's R counts the eos appended to it) gets

    r = w·h_{P+R−1} + b

the value head at its last token: the last non-pad token that transformers' sequence classifiers pool.

Each input file (data.train_files, then data.val_files) is written to `<reward_model.output_dir, else its folder>/
<stem>.scored.parquet`: the same rows in the same order (a preference pair as its two rows, `data/pairs.py`: the
reward model scores both unless `data.pair_reward` gives their rewards), every column kept, `data.reward_key` set
to the reward. Never over the input, and atomically: written as `.<name>.partial` beside it and renamed when
complete, so a killed job leaves nothing under the final name. The Parquet metadata (`data.rows.SCORED_BY_KEY`)
names the reward model, the hash of its checkpoint's files and the source file. Bad rows follow `data.on_bad_row`:
the first stops the job naming its file and line (error), or each goes with its reason to `<output>.rejects.jsonl`
and is left out (skip).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from megatron_ppo.checkpoint import directory, store
from megatron_ppo.checkpoint.run_identity import RunIdentity
from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.layout import world_size
from megatron_ppo.config.schema import DataConfig, ModelConfig, PPOConfig, RewardModelConfig
from megatron_ppo.convert.critic_init import HF_SCORE, converted_critic_checkpoint, holds_role
from megatron_ppo.convert.huggingface import hf_model_config, layout_problems
from megatron_ppo.data.batching import dynamic_micro_batches, fixed_micro_batches
from megatron_ppo.data.pairs import expand_records, is_pair, of_side
from megatron_ppo.data.parse import TOKEN_REWARDS_KEY, Tokenizer, row_tokens
from megatron_ppo.data.rows import SCORED_BY_KEY, DataError, decode_json_line, format_of, records_of, scored_by
from megatron_ppo.data.values import BadRow
from megatron_ppo.models import RoleModel, build_role_model, eval_mode, run_micro_batches
from megatron_ppo.models.gpt import REWARD_MODEL
from megatron_ppo.models.hf_conversion import SafetensorsReader
from megatron_ppo.parallel.collectives import (
    barrier,
    broadcast_from_rank0,
    data_parallel_share,
    gather_rows_data_parallel,
    global_rank,
    is_last_stage,
)
from megatron_ppo.parallel.device import current_device
from megatron_ppo.parallel.ranks import is_first_of_last_stage

SCORED_SUFFIX = ".scored.parquet"
PASS_ROWS = 4096  # rows per pass over the model: bounds the rewards gathered and the micro-batches held at once
HASH_CHUNK = 1 << 24


@dataclass(frozen=True)
class RewardModelSource:
    """The reward model a scoring job runs: the path the recipe names, whether it is a Hugging Face directory, and
    its architecture (the layout is checked against it before any model is built)."""

    path: str
    hf: bool
    model: ModelConfig

    @classmethod
    def of(cls, config: PPOConfig) -> RewardModelSource:
        """From `reward_model.model.*`; `ConfigError` naming the key when it names nothing usable."""
        weights = config.reward_model.model
        if weights.path:
            if not (Path(weights.path) / "config.json").is_file():
                raise ConfigError([f"reward_model.model.path={weights.path!r} holds no config.json; give a Hugging "
                                   "Face *ForSequenceClassification directory"])  # fmt: skip
            model = hf_model_config(weights.path, config.model.params_dtype)
            reader = SafetensorsReader(weights.path)
            if HF_SCORE not in reader or reader.shape(HF_SCORE) != [1, model.hidden_size]:
                found = reader.shape(HF_SCORE) if HF_SCORE in reader else "none"
                raise ConfigError([f"reward_model.model.path={weights.path!r}: a reward model is a sequence classifier "
                                   f"with one label ({HF_SCORE} [1, {model.hidden_size}]); its {HF_SCORE} is "
                                   f"{found}"])  # fmt: skip
            return cls(weights.path, True, model)
        if weights.init_checkpoint:
            try:
                resolved = directory.resolve(weights.init_checkpoint)
            except FileNotFoundError as missing:
                raise ConfigError([f"reward_model.model.init_checkpoint: {missing}"]) from None
            if not holds_role(resolved, "critic"):
                raise ConfigError([f"reward_model.model.init_checkpoint={weights.init_checkpoint!r} holds no value "
                                   "head (no critic): give a PPO run's checkpoint, or a reward model as "
                                   "reward_model.model.path"])  # fmt: skip
            return cls(str(resolved), False, _checkpoint_model(resolved, config.model))
        raise ConfigError(["score needs a reward model: set reward_model.model.path=<Hugging Face "
                           "*ForSequenceClassification dir> or reward_model.model.init_checkpoint=<megatron-ppo "
                           "checkpoint with a critic>"])  # fmt: skip


@dataclass(frozen=True)
class FileScores:
    """What scoring one file did."""

    source: Path
    output: Path
    rows: int
    rejected: int
    rewards: torch.Tensor  # [rows] float
    tokens: int  # Σ prompt + response tokens the model read
    seconds: float

    def summary(self) -> str:
        r = self.rewards.double()
        stats = (f"reward mean {float(r.mean()):.4g}, std {float(r.std(correction=0)):.4g}, min {float(r.min()):.4g}, "
                 f"max {float(r.max()):.4g}")  # fmt: skip
        rejected = f", {self.rejected} rejected (see {rejects_path(self.output)})" if self.rejected else ""
        return (f"scored {self.rows} rows of {self.source} → {self.output}{rejected}: {stats}; {self.seconds:.1f} s, "
                f"{self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s")  # fmt: skip


def score(config: PPOConfig) -> list[FileScores]:
    """Score every row of data.train_files and data.val_files (module docstring): checks the reward model, its
    layout and the output paths first, then starts the process groups under `reward_model.megatron`."""
    from megatron_ppo.data.tokenizer import load_tokenizer
    from megatron_ppo.parallel import destroy_distributed, dist_env_from_environment, init_distributed

    source = RewardModelSource.of(config)
    check_layout(config, source)
    outputs = planned_outputs(config)
    tokenizer_path = config.reward_model.model.tokenizer or config.model.tokenizer
    if not tokenizer_path:
        raise ConfigError(["score needs a tokenizer: set reward_model.model.tokenizer (or model.tokenizer)"])
    started = dist_env_from_environment().world_size
    if started != world_size(config):
        raise ConfigError([f"{started} process(es) started, but cluster.nodes × cluster.gpus_per_node = "
                           f"{world_size(config)}; launch with `torchrun --nproc_per_node {world_size(config)} -m "
                           "megatron_ppo score ...` or set cluster.gpus_per_node"])  # fmt: skip
    tokenizer = load_tokenizer(tokenizer_path)
    init_distributed(config.reward_model.megatron, seed=config.trainer.seed, device=config.cluster.device)
    try:
        return score_files(config, source, tokenizer, outputs)
    finally:
        destroy_distributed()


def check_layout(config: PPOConfig, source: RewardModelSource) -> None:
    """The reward model's heads and layers against `reward_model.megatron` (`ConfigError` before anything is built)."""
    problems = layout_problems(source.model, config.reward_model.megatron)
    if problems:
        raise ConfigError([f"reward_model.megatron for {source.path}: {p}" for p in problems])


def planned_outputs(config: PPOConfig) -> list[tuple[Path, Path]]:
    """(input, output) for every data file; refuses an output that is an input, that two inputs share, or that
    exists and was not written by `score` (a scored file is replaced by a new scoring)."""
    inputs = [Path(p) for p in (*config.data.train_files, *config.data.val_files)]
    if not inputs:
        raise ConfigError(["score reads data.train_files and data.val_files; set data.train_files"])
    out_dir = config.reward_model.output_dir
    pairs = [(path, Path(out_dir or path.parent) / f"{path.name.split('.')[0]}{SCORED_SUFFIX}") for path in inputs]
    problems = []
    resolved_inputs = {path.resolve() for path in inputs}
    seen: dict[Path, Path] = {}
    for source, output in pairs:
        if not source.is_file():
            problems.append(f"data file {source} does not exist (or is not a file)")
        if output.resolve() in resolved_inputs:
            problems.append(f"{source}: its scored file {output} would be an input; set reward_model.output_dir")
        elif output.resolve() in seen:
            problems.append(f"{source} and {seen[output.resolve()]} would both be scored into {output}; give them "
                            "distinct names, or leave reward_model.output_dir unset")  # fmt: skip
        elif output.exists() and scored_by(output) is None:
            problems.append(f"{output} exists and is not a file `score` wrote: move it, or set reward_model.output_dir")
        seen[output.resolve()] = source
    if problems:
        raise ConfigError(problems)
    return pairs


def score_files(
    config: PPOConfig, source: RewardModelSource, tokenizer: Tokenizer, outputs: list[tuple[Path, Path]]
) -> list[FileScores]:
    """Under process groups holding `reward_model.megatron`: load the reward model, then score and write each
    (input, output) file. Returns, on every rank, what each file's scoring did (the reporting rank prints it)."""
    digest = broadcast_from_rank0(checkpoint_hash(source.path) if global_rank() == 0 else None)
    path = Path(source.path)
    if source.hf:
        cache = Path(config.trainer.default_local_dir) / "hf_init_reward_model" / digest
        path = converted_critic_checkpoint(source.path, cache, source.model, config.reward_model.megatron)
    model = build_role_model(REWARD_MODEL, source.model, config.reward_model.megatron)
    store.load_weights(model, path, "critic")
    scored_with = {"reward_model": str(Path(source.path).resolve()), "checkpoint_hash": digest,
                   "converted": str(path) if source.hf else None}  # fmt: skip
    results = []
    for input_path, output in outputs:
        result = score_file(config, model, tokenizer, input_path, output, scored_with, source.model)
        if is_first_of_last_stage():
            print(result.summary(), flush=True)
        results.append(result)
    return results


def score_file(
    config: PPOConfig,
    model: RoleModel,
    tokenizer: Tokenizer,
    input_path: Path,
    output: Path,
    scored_with: dict[str, Any],
    architecture: ModelConfig,
) -> FileScores:
    """Read `input_path`'s rows, score those the reward model must, write `output` (module docstring)."""
    started = time.perf_counter()
    rows, rejects = _readable_rows(config, tokenizer, input_path, architecture.max_position_embeddings)
    wanted = [i for i, row in enumerate(rows) if row.needs_model]
    rewards = _rewards(model, [rows[i].ids for i in wanted], tokenizer.pad_id, config.reward_model)
    tokens = sum(len(rows[i].ids) for i in wanted)
    scores = torch.tensor([0.0 if row.needs_model else float(row.record[config.data.reward_key]) for row in rows])
    if rewards is not None:  # the last pipeline stage
        scores[wanted] = rewards.cpu().float()
    if is_first_of_last_stage():
        key = config.data.reward_key
        records = [{**row.record, key: value} for row, value in zip(rows, scores.tolist(), strict=True)]
        info = {**scored_with, "source": str(input_path.resolve()), "rows": len(rows), "scored_by_model": len(wanted),
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
        write_parquet_atomically(records, output, {SCORED_BY_KEY: json.dumps(info)})
        if rejects:
            _write_rejects(rejects, rejects_path(output))
    barrier()
    return FileScores(input_path, output, len(rows), len(rejects), scores, tokens, time.perf_counter() - started)


@dataclass(frozen=True)
class _ScoringRow:
    record: dict[str, Any]  # the row as it is written back (a pair's rows as `expand_records` makes them)
    ids: list[int]  # prompt then response ids, as the trainer reads the row
    needs_model: bool  # False: a pair whose rewards `data.pair_reward` gives (given, preference)


def _readable_rows(
    config: PPOConfig, tokenizer: Tokenizer, path: Path, max_tokens: int
) -> tuple[list[_ScoringRow], list[dict[str, Any]]]:
    """Each row of `path` the model can read, in order; and the rejected ones (data.on_bad_row=skip; error raises
    `DataError` naming the row). A pair is rejected whole when either of its rows is bad."""
    data = config.data
    rows, rejects = [], []
    for where, raw in records_of(path, format_of(path, data.format)):
        try:
            record = decode_json_line(raw) if isinstance(raw, bytes) else raw
            by_model = not is_pair(record, data) or data.pair_reward == "model"
            expanded = []
            for side, one in expand_records(record, where, data, scoring=True):
                try:
                    expanded.append(_scoring_row(one, tokenizer, data, by_model, max_tokens))
                except BadRow as bad:
                    raise of_side(bad, side, where) from None
        except BadRow as bad:
            if data.on_bad_row == "error":
                raise DataError(f"{where}: {bad.problem}") from None
            shown = raw.decode("utf-8", "replace").rstrip("\r\n") if isinstance(raw, bytes) else raw
            rejects.append({"source": where, "kind": bad.kind, "reason": bad.problem, "row": shown})
            continue
        rows.extend(expanded)
    if not rows:
        raise DataError(f"no rows to score in {path} ({len(rejects)} rejected)")
    return rows, rejects


def _scoring_row(record: Any, tokenizer: Tokenizer, data: DataConfig, by_model: bool, max_tokens: int) -> _ScoringRow:
    prompt, response = row_tokens(record, tokenizer, data)
    if record.get(TOKEN_REWARDS_KEY) is not None:
        raise BadRow("token_rewards", f"the row gives '{TOKEN_REWARDS_KEY}'; a reward model gives a sequence reward: "
                     "drop the column to score the row")  # fmt: skip
    if by_model and len(prompt) + len(response) > max_tokens:
        raise BadRow("too_long", f"{len(prompt) + len(response)} tokens, more than the reward model's "
                     f"max_position_embeddings={max_tokens}")  # fmt: skip
    return _ScoringRow(record, prompt + response, by_model)


@torch.no_grad()
def _rewards(
    model: RoleModel, sequences: list[list[int]], pad_id: int, settings: RewardModelConfig
) -> torch.Tensor | None:
    """r_i = the value head at the last token of `sequences[i]`, for every sequence: each data-parallel replica runs
    its strided share of each pass in micro-batches; the rewards are gathered over the replicas on the last pipeline
    stage (None on the others)."""
    last = is_last_stage()
    parts = []
    with eval_mode(model):
        for start in range(0, len(sequences), PASS_ROWS):
            chunk = sequences[start : start + PASS_ROWS]
            share = data_parallel_share(len(chunk))
            lengths = [len(chunk[i]) for i in share]
            if not lengths:  # fewer rows than replicas in the last pass
                groups = []
            elif settings.use_dynamic_bsz:
                groups = dynamic_micro_batches(lengths, settings.forward_max_token_len_per_gpu)
            else:
                groups = fixed_micro_batches(lengths, settings.micro_batch_size_per_gpu)
            micro_batches = [_collate([chunk[share[i]] for i in group], pad_id) for group in groups]
            outputs = run_micro_batches(model, micro_batches, _last_token_value, forward_only=True) if groups else []
            if not last:
                continue
            own = torch.zeros(len(share), device=current_device())
            for group, output in zip(groups, outputs, strict=True):
                own[group] = output["reward"].float()
            parts.append(gather_rows_data_parallel(own, len(chunk)))
    if not last:
        return None
    return torch.cat(parts) if parts else torch.zeros(0)


def _collate(sequences: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids` `[b, W]` and `lengths` `[b]`."""
    lengths = torch.tensor([len(s) for s in sequences])
    input_ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for i, sequence in enumerate(sequences):
        input_ids[i, : len(sequence)] = torch.tensor(sequence)
    return {"input_ids": input_ids, "lengths": lengths}


def _last_token_value(batch: dict[str, torch.Tensor], values: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The head's output `[b, s, 1]` at each row's last token → {"reward": [b]}."""
    rows = torch.arange(values.shape[0], device=values.device)
    return values.new_zeros(()), {"reward": values[rows, batch["lengths"] - 1, 0].detach()}


def write_parquet_atomically(records: list[dict[str, Any]], output: Path, metadata: dict[bytes, str]) -> None:
    """`records` as a Parquet file at `output`, with `metadata` added to its schema's: written to
    `.<name>.partial` in the same folder, then renamed over `output` (a rename within a file system is atomic)."""
    try:
        table = pa.Table.from_pylist(records)
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise DataError(f"the scored rows of {output} cannot be one Parquet table ({e}): a column holds values of "
                        "different types in different rows; make each column one type") from e  # fmt: skip
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    pq.write_table(table, partial)
    os.replace(partial, output)


def rejects_path(output: Path) -> Path:
    return output.with_name(output.name.removesuffix(".parquet") + ".rejects.jsonl")


def _write_rejects(rejects: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", encoding="utf-8") as out:
        for entry in rejects:
            out.write(json.dumps(entry, default=str) + "\n")


def checkpoint_hash(path: str | Path) -> str:
    """sha256 (first 16 hex digits) over the relative name and bytes of every file under `path`, in name order: which
    weights scored a file. Reads the whole checkpoint once (a 70B model in bf16: ~140 GB)."""
    root = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(root)).encode() + b"\0")
        with file.open("rb") as f:
            while block := f.read(HASH_CHUNK):
                digest.update(block)
    return digest.hexdigest()[:16]


def _checkpoint_model(path: Path, fallback: ModelConfig) -> ModelConfig:
    """The architecture a megatron-ppo checkpoint was saved with: a conversion's `hf_model`, else the run's
    `model.*` (run.json), else `fallback` (the recipe's model: a task's initialisation saves neither)."""
    state = torch.load(path / directory.TRAINER_STATE, weights_only=True)
    if "hf_model" in state:
        return ModelConfig(**json.loads(state["hf_model"]))
    identity = RunIdentity.read(path)
    if identity is not None:
        flat = identity.config
        return ModelConfig(**{key.removeprefix("model."): v for key, v in flat.items() if key.startswith("model.")})
    return fallback
