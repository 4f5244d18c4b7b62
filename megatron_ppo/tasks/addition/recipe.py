"""The embedded default (data.task=addition): tokenizer → SFT policy → sampled offline dataset → PPO → table.

Every stage caches its product under `data.addition.work_dir` (tokenizer, SFT checkpoint, dataset), so a second
run with the same task goes straight to PPO. The cache lives in a folder per task fingerprint (`task_directory`): a run
with other task settings, seeds or model shape builds its own and never trains on another task's data. The PPO run
itself writes checkpoints and TensorBoard logs where `trainer.*` says (under
the rules of `checkpoint/run_start.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from megatron_ppo.checkpoint import directory, store
from megatron_ppo.checkpoint.initial_weights import InitialWeights
from megatron_ppo.config.schema import MegatronConfig, ModelConfig, PPOConfig
from megatron_ppo.data.prepare import prepared_root, prepared_rows
from megatron_ppo.data.rows import Row
from megatron_ppo.data.tokenizer import SentencePieceTokenizer, train_char_tokenizer
from megatron_ppo.models import RoleModel, build_role_model
from megatron_ppo.models.generation import generate, timed_generate
from megatron_ppo.parallel.collectives import barrier
from megatron_ppo.parallel.distributed import initialize_model_parallel, seed_everything
from megatron_ppo.runs.report import table_console
from megatron_ppo.tasks.addition.problems import AdditionProblem, corpus, demonstrate, reward, split_problems
from megatron_ppo.tasks.addition.sft import run_sft
from megatron_ppo.train.experience import check_rows_for_rollout_correction
from megatron_ppo.train.kl_coefficients import logged_tracking, tracked_kl_prefix
from megatron_ppo.train.metrics import is_logging_rank
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler
from megatron_ppo.train.ppo import PPOTrainer

MAX_NEW_TOKENS = 4  # three digits and the end marker


# Model keys that cannot change the cached tokenizer, SFT policy or dataset; every other model key is in the
# fingerprint (derived from the schema, so a new key is covered unless it is added here with its reason).
NOT_IN_FINGERPRINT = {
    "name": "a label",
    "hf_checkpoint": "the task makes its own initial policy (SFT)",
    "init_checkpoint": "the task makes its own initial policy (SFT) and starts PPO from it (`train_on_task`)",
    "allow_random_init": "the task makes its own initial policy (SFT)",
    "tokenizer": "the task trains its own character tokenizer",
    "logprob_chunk_tokens": "how many tokens a log-prob chunk holds: memory, not the numbers",
    "moe_token_dispatcher": "how tokens reach the experts: communication, not the numbers",
}
MODEL_KEYS_IN_FINGERPRINT = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in NOT_IN_FINGERPRINT)


def task_fingerprint(config: PPOConfig) -> dict[str, object]:
    """What the cached tokenizer, SFT policy and dataset depend on, as flat `key: value` pairs."""
    task = {f"data.addition.{k}": v for k, v in dataclasses.asdict(config.data.addition).items() if k != "work_dir"}
    model = {f"model.{k}": getattr(config.model, k) for k in MODEL_KEYS_IN_FINGERPRINT}
    return {**task, **model, "data.seed": config.data.seed, "trainer.seed": config.trainer.seed}


def task_directory(config: PPOConfig) -> Path:
    """`<data.addition.work_dir>/task-<hash of the fingerprint>`, its `task.json` written by the first run to use it:
    runs with other task settings, seeds or model shape build their own cache beside it and never read this one."""
    fingerprint = task_fingerprint(config)
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:10]
    work = Path(config.data.addition.work_dir) / f"task-{digest}"
    if is_logging_rank() and not (work / "task.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        (work / "task.json").write_text(json.dumps(fingerprint, indent=1, sort_keys=True))
    barrier()
    return work


def task_tokenizer(work: Path, problems: list[AdditionProblem]) -> SentencePieceTokenizer:
    """The character tokenizer of the task folder `work`, trained on `problems` by its first user (rank 0)."""
    path = work / "tokenizer.model"
    if is_logging_rank() and not path.is_file():
        train_char_tokenizer(corpus(problems), path)
    barrier()
    return SentencePieceTokenizer(path)


def score(model: RoleModel, tokenizer: SentencePieceTokenizer, problems: list[AdditionProblem]) -> dict[str, float]:
    """Greedy answers to `problems`: mean reward and exact-match accuracy."""
    generation = timed_generate(
        model, [tokenizer.encode(p.prompt) for p in problems], max_new_tokens=MAX_NEW_TOKENS,
        eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, greedy=True,
    )  # fmt: skip
    rewards = [reward(p, tokenizer.decode(tokens) if finished else None)
               for p, (tokens, finished) in zip(problems, generation.answers, strict=True)]  # fmt: skip
    return {"reward_mean": sum(rewards) / len(rewards), "accuracy": sum(r == 1.0 for r in rewards) / len(rewards),
            **generation.metrics()}  # fmt: skip


@dataclass
class HeldOutProblems:
    """The tiny task's evaluation (`train.evaluation.Evaluator`): greedy answers to the held-out problems, scored by the
    task's rule reward."""

    tokenizer: SentencePieceTokenizer
    problems: list[AdditionProblem]
    gives_reward: bool = True

    def __call__(self, actor: RoleModel, ref: RoleModel | None = None) -> dict[str, float]:
        return score(actor, self.tokenizer, self.problems)

    def describe(self) -> str:
        return f"{len(self.problems)} held-out addition problems, answered greedily → eval/reward_mean, eval/accuracy"


def task_layout(layout: MegatronConfig) -> MegatronConfig:
    """The layout the task's SFT and sampling run at, whatever the PPO run's (`layout`): every process a
    data-parallel replica (no tensor, pipeline or context split, no host offload), the experts of a mixture-of-experts
    model split over the run's expert-parallel ranks (carved out of the data-parallel ones). At this model's size the
    splits only add communication: one SFT step of the tiny recipe on 2 CPU processes took 159 ms at its TP 2 and 78
    ms data-parallel (`bench/bench_task_sft.py`). The checkpoint it saves loads at any layout (Megatron's sharded
    state dicts), so the cache stays free of the PPO run's layout."""
    return dataclasses.replace(
        layout, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1, expert_tensor_parallel_size=None, sequence_parallel=False, param_offload=False,
        optimizer_offload=False, grad_offload=False,
    )  # fmt: skip


@contextmanager
def in_task_layout(config: PPOConfig) -> Iterator[MegatronConfig]:
    """Megatron's process groups at `task_layout` for the body, then back at the run's (the actor's) layout, seeded
    again with `trainer.seed` either way: what the PPO run draws next does not depend on whether the task was built
    or found cached. A body that raises (a stop signal during the SFT above all) leaves the task's groups as they
    are: making groups is a collective, which the other processes, stopped elsewhere, may never join."""
    layout = task_layout(config.actor.megatron)
    initialize_model_parallel(layout)
    seed_everything(config.trainer.seed)
    yield layout
    initialize_model_parallel(config.actor.megatron)
    seed_everything(config.trainer.seed)


def demonstrations(config: PPOConfig, tokenizer, train: list[AdditionProblem]) -> list[Row]:
    """The SFT data: the noisy demonstrator's answers to the training prompts, enough for `sft_steps` batches."""
    task = config.data.addition
    rng = random.Random(config.trainer.seed)
    rows = []
    for problem in train:
        for _ in range(task.sft_steps * task.sft_batch_size // len(train) + 1):
            answer = demonstrate(problem, rng)
            response = [*tokenizer.encode(answer), tokenizer.eos_id]
            rows.append(Row(tokenizer.encode(problem.prompt), response, 0.0, None, None, problem.uid,
                            "addition-demonstrator", "demonstrator"))  # fmt: skip
    return rows


def sft(config: PPOConfig, layout: MegatronConfig, rows: list[Row], pad_id: int, steps: int | None = None) -> RoleModel:
    """A fresh actor at `layout` trained on `rows` for `steps` (default `data.addition.sft_steps`) steps of the
    task's SFT (its learning rate, a cosine schedule over `sft_steps`)."""
    task = config.data.addition
    actor = build_role_model("actor", config.model, layout)
    optim = dataclasses.replace(config.actor.optim, lr=task.sft_lr, lr_decay_style="cosine", lr_warmup_steps=20)
    optimizer = build_optimizer(actor, optim, layout)
    scheduler = build_scheduler(optimizer, optim, task.sft_steps)
    console = Console(stderr=True)

    def report(step: int, nll: float) -> None:
        if is_logging_rank() and (step + 1) % 100 == 0:
            console.log(f"sft step {step + 1}/{task.sft_steps}: nll/token {nll:.4f}")

    run_sft(actor, optimizer, scheduler, rows, steps=task.sft_steps if steps is None else steps,
            batch_size=task.sft_batch_size,
            micro_batch_size=config.actor.ppo_micro_batch_size_per_gpu or task.sft_batch_size,
            clip_grad=optim.clip_grad, pad_id=pad_id, seed=config.trainer.seed, on_step=report)  # fmt: skip
    return actor


def _sft_checkpoint(
    config: PPOConfig, layout: MegatronConfig, tokenizer, train: list[AdditionProblem], root: Path
) -> Path:
    """The task's SFT policy, trained at `layout` and saved under `root`."""
    actor = sft(config, layout, demonstrations(config, tokenizer, train), tokenizer.pad_id)
    steps = config.data.addition.sft_steps
    return store.save_checkpoint(root, steps, {"actor": actor}, {}, {"step": steps})


def _offline_dataset(config, layout: MegatronConfig, tokenizer, train, sft_path: Path, path: Path) -> None:
    """`data.addition.samples_per_prompt` answers of the SFT policy to each training prompt, scored by the rule
    reward, written to `path` (by rank 0)."""
    task = config.data.addition
    actor = build_role_model("ref", config.model, layout)
    store.load_weights(actor, sft_path, "actor")
    prompts = [p for p in train for _ in range(task.samples_per_prompt)]
    responses = generate(
        actor, [tokenizer.encode(p.prompt) for p in prompts], max_new_tokens=MAX_NEW_TOKENS, eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id, temperature=task.sample_temperature, seed=config.trainer.seed,
    )  # fmt: skip
    if is_logging_rank():
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        empty = 0
        with temporary.open("w") as out:
            for problem, (tokens, finished) in zip(prompts, responses, strict=True):
                text = tokenizer.decode(tokens)
                if not text:  # ended at once: nothing to train on, and not representable as a row
                    empty += 1
                    continue
                out.write(json.dumps({"prompt": problem.prompt, "response": text,
                                      "reward": reward(problem, text if finished else None),
                                      "uid": problem.uid, "data_source": "addition-sft-samples"}) + "\n")  # fmt: skip
        temporary.replace(path)
        Console(stderr=True).log(f"offline dataset: {len(prompts) - empty} samples in {path} ({empty} empty dropped)")
    barrier()


@dataclass
class AdditionTask:
    """What the PPO runs of the tiny recipe need: tokenizer, held-out prompts, the offline rows, and the SFT start."""

    tokenizer: SentencePieceTokenizer
    heldout: list[AdditionProblem]
    rows: Sequence[Row]  # the prepared dataset, opened (`PreparedRows`)
    data_line: str
    sft_checkpoint: str
    data_path: Path  # the sampled dataset with its rule rewards (the rows, unless data.train_files names others)


def prepare_addition_task(config: PPOConfig) -> AdditionTask:
    """Tokenizer, SFT policy and offline dataset (each built once and cached in data.addition.work_dir); the rows
    are the dataset's, or those of `data.train_files` when set."""
    task = config.data.addition
    work = task_directory(config)
    train, heldout = split_problems(task.num_prompts, task.num_heldout, seed=config.data.seed)
    tokenizer = task_tokenizer(work, train + heldout)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} pieces but model.vocab_size={config.model.vocab_size}"
        )
    data_path = work / "data" / "train.jsonl"
    sft_path = directory.find_resumable(work / "sft")
    if sft_path is None or not data_path.is_file():  # to build: at the task's own layout
        with in_task_layout(config) as layout:
            if sft_path is None:
                sft_path = _sft_checkpoint(config, layout, tokenizer, train, work / "sft")
            if not data_path.is_file():
                _offline_dataset(config, layout, tokenizer, train, sft_path, data_path)
    # data.train_files: the task's rows scored another way (`make score`: by a reward model), trained on instead
    paths = config.data.train_files or [data_path]
    data = prepared_rows(paths, tokenizer, config.data, prepared_root(config))
    check_rows_for_rollout_correction(config, data.rows)  # before the PPO run builds its models
    return AdditionTask(tokenizer, heldout, data.rows, f"{data.line()}; {data.report.summary()}", str(sft_path),
                        data_path)  # fmt: skip


def train_on_task(
    config: PPOConfig, task: AdditionTask, weights: InitialWeights | None = None
) -> tuple[PPOTrainer, list[dict[str, float]], dict, dict]:
    """One PPO run from the SFT policy: (trainer, history, held-out scores before, after). `weights`: the run's
    initial weights (`distributed_run`'s), whose actor is the task's SFT policy here."""
    weights = dataclasses.replace(weights or InitialWeights.of(config), actor=task.sft_checkpoint)
    heldout = HeldOutProblems(task.tokenizer, task.heldout)
    trainer = PPOTrainer(config, task.rows, task.tokenizer.pad_id, evaluate=heldout, weights=weights)
    evaluated_at_start = config.trainer.val_before_train and trainer.run.resume_from is None  # by fit, at step 0
    before = None if evaluated_at_start else heldout(trainer.actor)
    trainer.resume()
    try:
        history = trainer.fit()
        before = before or {k.removeprefix("eval/"): v for k, v in trainer.evaluations[0].items()}
        after = heldout(trainer.actor)
    finally:
        trainer.close()
    return trainer, history, before, after


def run_addition_recipe(config: PPOConfig, weights: InitialWeights | None = None) -> dict[str, float]:
    """The whole embedded default; returns the summary numbers it prints."""
    task = prepare_addition_task(config)
    trainer, history, before, after = train_on_task(config, task, weights)
    return _summary(config, trainer, history, before, after, task.data_line)


def _summary(config: PPOConfig, trainer: PPOTrainer, history, before, after, data_line: str) -> dict[str, float]:
    max_grad_norm = max((h.get("actor/grad_norm_max", 0.0) for h in history), default=float("nan"))
    summary = {"reward_before": before["reward_mean"], "reward_after": after["reward_mean"],
               "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
               "skipped_steps": float(trainer.skipped_steps), "max_grad_norm": max_grad_norm}  # fmt: skip
    if not is_logging_rank():
        return summary
    table = Table(title="megatron-ppo · tiny recipe (two-digit addition, offline PPO)")
    table.add_column("")
    table.add_column("SFT start", justify="right")
    table.add_column("after PPO", justify="right")
    table.add_row("held-out reward (mean)", f"{before['reward_mean']:.3f}", f"{after['reward_mean']:.3f}")
    table.add_row("held-out accuracy", f"{before['accuracy']:.3f}", f"{after['accuracy']:.3f}")
    tracked = tracked_kl_prefix(config) + "mean"
    stages: dict[float, list[float]] = {}
    for h in history:
        if tracked in h:
            stages.setdefault(h.get("kl/stage", 0.0), []).append(h[tracked])
    for stage, values in sorted(stages.items()):
        target = next((h["kl/target"] for h in history if h.get("kl/stage") == stage and "kl/target" in h), None)
        table.add_row(f"KL per token ({tracked}), stage {int(stage)}",
                      "warm-up" if target is None else f"target {target:.4g}",
                      f"{sum(values) / len(values):.4g}")  # fmt: skip
    for prefix in dict.fromkeys((tracked_kl_prefix(config), "kl/")):
        tracking = logged_tracking(history, prefix)
        if tracking is None:
            continue
        table.add_row(f"{prefix}mean within ±10 % of its target", "after each stage's first 2 steps",
                      f"{tracking.hits}/{tracking.judged} steps (max {tracking.max_ratio:.2f}× target)")  # fmt: skip
        if prefix == "kl/":
            table.add_row("  a kl/mean exactly on target", "measured with each batch's noise",
                          f"{tracking.noise_hits:.1f}/{tracking.judged} steps (kl/stderr)")  # fmt: skip
    table.add_row("max actor grad norm", "", f"{summary['max_grad_norm']:.3g}")
    table.add_row("skipped steps", "", f"{trainer.skipped_steps}")
    table.add_row("data", "", data_line)
    table.add_row("run", "", trainer.run.identity.run_id)
    table.add_row("checkpoints", "", config.trainer.default_local_dir)
    table.add_row("TensorBoard", "", str(trainer.run.log_dir))
    table_console().print(table)
    return summary
