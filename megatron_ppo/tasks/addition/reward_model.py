"""The tiny task's reward model and `megatron-ppo score` on its dataset (`make score`).

The reward model is a small Llama sequence classifier (`transformers`' `LlamaForSequenceClassification`, one label),
trained in seconds on the task's own labels — the rule reward (1 right, 0 wrong, −1 malformed) of each sampled answer
of the offline dataset — by least squares on its score at the last token, and saved the way transformers saves it.
`score` then converts and runs it as it would any Hugging Face reward model, under `reward_model.megatron`, and
writes the dataset with the model's rewards beside the rule's (`<reward_model.output_dir>/train.scored.parquet`),
which `make train OVERRIDES="data.train_files=..."` trains on.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch
from rich.console import Console

from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.frozen import with_changes
from megatron_ppo.config.layout_rules import SHARED_LAYOUT_KEYS
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.convert import reward_scoring
from megatron_ppo.convert.reward_scoring import FileScores, RewardModelSource
from megatron_ppo.data.rows import Row, read_rows
from megatron_ppo.parallel.collectives import barrier
from megatron_ppo.tasks.addition.recipe import prepare_addition_task, task_directory
from megatron_ppo.train.metrics import is_logging_rank

# The reward model's shape (its own: a Llama, which the conversion table maps), and its training: a few seconds of
# one CPU core.
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4}  # fmt: skip
STEPS, BATCH, LR = 300, 256, 3e-3


def train_reward_model(rows: list[Row], vocab_size: int, pad_id: int, out: Path, seed: int) -> dict[str, float]:
    """Fit r̂(prompt, response) = the classifier's score at the last token to each row's reward (least squares) and
    save the classifier at `out` (written beside it, then renamed). Returns its fit on the rows: the mean squared
    error, the correlation with the labels, and the seconds it took."""
    import transformers

    started = time.perf_counter()
    torch.manual_seed(seed)
    longest = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    config = transformers.LlamaConfig(vocab_size=vocab_size, max_position_embeddings=longest, pad_token_id=pad_id,
                                      num_labels=1, tie_word_embeddings=False, **SHAPE)  # fmt: skip
    model = transformers.LlamaForSequenceClassification(config)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        ids = row.prompt_ids + row.response_ids
        input_ids[i, : len(ids)] = torch.tensor(ids)
    labels = torch.tensor([float(r.reward) for r in rows])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        batch = torch.randint(0, len(rows), (BATCH,), generator=generator)
        loss = torch.nn.functional.mse_loss(model(input_ids[batch]).logits[:, 0], labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()
    with torch.no_grad():
        fitted = torch.cat([model(part).logits[:, 0] for part in input_ids.split(1024)])
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    partial.rename(out)
    correlation = float(torch.corrcoef(torch.stack([fitted, labels]))[0, 1])
    return {"mse": float(((fitted - labels) ** 2).mean()), "correlation": correlation,
            "seconds": time.perf_counter() - started}  # fmt: skip


def score(config: PPOConfig) -> list[FileScores]:
    """`megatron-ppo score` on the tiny recipe: the task (tokenizer, SFT policy, dataset: cached), its reward model
    (trained once, cached beside them), then the dataset scored by it. The task's stages run under the actor's
    layout, so the scoring shares it (`reward_model.megatron` must hold the same TP/PP)."""
    from megatron_ppo.train.run import distributed_run

    layout, actor = config.reward_model.megatron, config.actor.megatron
    differing = [key for key in SHARED_LAYOUT_KEYS if getattr(layout, key) != getattr(actor, key)]
    if differing:
        raise ConfigError([f"reward_model.megatron.{key}={getattr(layout, key)}: the tiny task scores under the "
                           f"layout its stages run in, actor.megatron.{key}={getattr(actor, key)}; set them equal"
                           for key in differing])  # fmt: skip
    with distributed_run(config):
        task = prepare_addition_task(config)
        reward_model = task_directory(config) / "reward_model"
        if is_logging_rank() and not reward_model.is_dir():
            labelled, _ = read_rows([task.data_path], task.tokenizer, config.data)
            fit = train_reward_model(labelled, config.model.vocab_size, task.tokenizer.pad_id, reward_model,
                                     config.trainer.seed)  # fmt: skip
            Console(stderr=True).log(
                f"reward model {reward_model}: trained {STEPS} steps in {fit['seconds']:.1f} s on {len(labelled)} "
                f"rows' rule rewards; fit mse {fit['mse']:.3f}, correlation with the labels {fit['correlation']:.3f}"
            )
        barrier()
        files = config.data.train_files or [str(task.data_path)]
        scoring = with_changes(config, {"reward_model.model.path": str(reward_model), "data.train_files": files})
        source = RewardModelSource.of(scoring)
        reward_scoring.check_layout(scoring, source)
        return reward_scoring.score_files(scoring, source, task.tokenizer, reward_scoring.planned_outputs(scoring))
