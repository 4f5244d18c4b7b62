"""What the GPU check's parts share: the shapes and plans of a real and a dry run, the PPO config and synthetic rows
of part (b), the few-layer model of (c) and (i), a device-synchronised timer, the device's memory figures, and the
tiny recipe's launch through the CLI of parts (a) and (h) (every part imports it; no part imports another)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.tiny import SHORT
from gpu_check.card import Card, named_card
from gpu_check.sizing import PartShape

GIB = 1024**3
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    """A GPT shape for (b) and (c); `layers_c` layers of it are compared in (c) (a CPU fp32 forward)."""

    num_layers: int
    hidden: int
    heads: int
    groups: int
    ffn: int
    vocab: int
    layers_c: int


QWEN_1_5B = Shape(num_layers=28, hidden=1536, heads=12, groups=2, ffn=8960, vocab=151_936, layers_c=4)
TINY = Shape(num_layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=512, layers_c=2)


@dataclass(frozen=True)
class Plan:
    """What one run of the check does: the real sizes, or the dry run's. `rows` at the first sequence length; at
    the others as many rows as keep the tokens of one iteration the same (64 × 1024 = 16 × 4096), so each length
    costs about the same time and the longer one measures the longer sequences' memory and attention, not 4× the
    work. `resume_layers`: (f)'s model, the shape's width and vocabulary with this many layers (the same code path
    at a tenth of the 1.5B shape's optimizer state, which a save and a load would otherwise spend a minute on).
    `card`: the card the parts are sized to (`gpu_check.sizing`): on a GPU the one measured at the start, in a
    dry run the named one (the CPU stand-in for the tiny parts)."""

    name: str
    device: str
    dtype: str
    shape: Shape
    rows: int
    seq_lengths: tuple[int, ...]
    micro_batch: int
    recipe_steps: int
    resume_layers: int
    card: Card

    def base_shape(self, seq: int, layers: int | None = None) -> PartShape:
        """The shape a part starts its sizing from: (b)'s rows at `seq`, the plan's micro-batch, all layers."""
        return PartShape(rows=self.rows_at(seq), seq=seq, micro_batch=self.micro_batch,
                         layers=layers or self.shape.num_layers)  # fmt: skip

    def rows_at(self, seq: int) -> int:
        """The rows of (b)'s iteration at `seq` tokens: `rows × seq_lengths[0]` tokens, a multiple of the
        micro-batch."""
        rows = self.rows * self.seq_lengths[0] // seq
        return max(self.micro_batch, rows - rows % self.micro_batch)


REAL = Plan("real", "cuda", "bf16", QWEN_1_5B, rows=64, seq_lengths=(1024, 4096), micro_batch=4, recipe_steps=16,
            resume_layers=4, card=named_card("h100"))  # fmt: skip
DRY = Plan("dry", "cpu", "bf16", TINY, rows=8, seq_lengths=(32, 64), micro_batch=4, recipe_steps=0, resume_layers=2,
           card=named_card("cpu"))  # fmt: skip
PLANS = {plan.name: plan for plan in (REAL, DRY)}


SIZING_DIR = Path(tempfile.gettempdir()) / "gpu_check_sizing"  # a sized config's directories: never written


def ppo_config(plan: Plan, shape: PartShape, work: Path = SIZING_DIR, pack_sequences: bool = False):
    """The PPO config of (b) at `shape`: GAE with a KL loss (actor, reference and critic), one epoch, one mini-batch
    of `shape.rows` rows of `shape.seq` tokens, every pass (experience and update) `shape.micro_batch` rows at a time,
    `shape.layers` layers; on `plan.card` (its GPU type and memory, for the planner and the MFU), in the layers that
    run there: Transformer Engine's where it imports, else the local spec (said so, so the planner counts what runs:
    the check's GPU has no Transformer Engine). `pack_sequences` (`model.pack_sequences`, what every GPU recipe
    sets): each micro-batch enters as one THD pack (Transformer Engine's THD attention where TE is present, else one
    variable-length attention call per layer where torch has it)."""
    from megatron_ppo.config.schema import ClusterConfig, ModelConfig, PPOConfig
    from megatron_ppo.config.validate import resolve, validate
    from megatron_ppo.models.kernels import transformer_engine_importable

    s = plan.shape
    config = PPOConfig(
        model=ModelConfig(
            name="qwen2.5-1.5b-shape", num_layers=shape.layers, hidden_size=s.hidden, num_attention_heads=s.heads,
            num_query_groups=s.groups, ffn_hidden_size=s.ffn, vocab_size=s.vocab, max_position_embeddings=32768,
            rotary_base=1_000_000.0, add_qkv_bias=True, params_dtype=plan.dtype, pack_sequences=pack_sequences,
            transformer_impl="auto" if transformer_engine_importable() else "local",
        ),
    )  # fmt: skip
    config.cluster = ClusterConfig(device=plan.device, gpus_per_node=1, gpu_type=plan.card.gpu_type,
                                   gpu_memory_gib=plan.card.memory_gib)  # fmt: skip
    config.data.max_prompt_length, config.data.max_response_length = shape.seq // 4, shape.seq - shape.seq // 4
    config.data.train_batch_size = shape.rows
    for role in (config.actor, config.critic):
        role.ppo_mini_batch_size, role.ppo_micro_batch_size_per_gpu, role.ppo_epochs = shape.rows, shape.micro_batch, 1
    config.actor.log_prob_micro_batch_size_per_gpu = config.ref.log_prob_micro_batch_size_per_gpu = shape.micro_batch
    config.critic.forward_micro_batch_size_per_gpu = shape.micro_batch
    config.trainer.total_training_steps = 3
    config.trainer.logger = []
    config.trainer.default_local_dir, config.trainer.log_dir = str(work / "ckpt"), str(work / "tb")
    resolve(config)
    problems = validate(config)
    if problems:
        raise RuntimeError(f"the check's own config is invalid: {problems}")
    return config


def synthetic_rows(plan: Plan, shape: PartShape, seed: int) -> list:
    """Two batches of `shape.rows` rows of exactly `shape.seq` tokens (a quarter prompt), random tokens (never the
    pad id 0), ±1 rewards."""
    from megatron_ppo.data.rows import Row

    rng = random.Random(seed)
    seq = shape.seq
    vocab, prompt = plan.shape.vocab, seq // 4
    return [
        Row(
            [rng.randrange(1, vocab) for _ in range(prompt)],
            [rng.randrange(1, vocab) for _ in range(seq - prompt)],
            float(rng.choice([-1, 1])),
            None,
            None,
            f"g{i}",
            "gpu-check",
            f"synthetic row {i}",
        )
        for i in range(shape.rows * 2)
    ]


def logprob_model_config(plan: Plan, dtype: str):
    """The few-layer model of (c) and (i): the shape's width and vocabulary, `layers_c` layers."""
    from megatron_ppo.config.schema import ModelConfig

    s = plan.shape
    return ModelConfig(
        num_layers=s.layers_c, hidden_size=s.hidden, num_attention_heads=s.heads, num_query_groups=s.groups,
        ffn_hidden_size=s.ffn, vocab_size=s.vocab, max_position_embeddings=4096, rotary_base=1_000_000.0,
        add_qkv_bias=True, params_dtype=dtype, init_method_std=0.05,
    )  # fmt: skip


def device_memory(plan: Plan) -> dict[str, float]:
    """This process's GPU memory in GiB: the allocator's peaks, and its measured peak on the device — the peak
    reservation plus its CUDA context as the card's reading measured it alone (`Card.context_gib`); not from
    `mem_get_info`, which counts every process on the card (a neighbouring part's too). Empty on the CPU."""
    if not torch.cuda.is_available():
        return {}
    reserved = torch.cuda.max_memory_reserved() / GIB
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB, "peak_reserved_gib": reserved,
            "context_gib": plan.card.context_gib, "measured_peak_gib": reserved + plan.card.context_gib}  # fmt: skip


def backoff_record(trainer) -> dict[str, Any]:
    """The trainer's out-of-memory back-offs so far (`train/memory_backoff.py`): how many, and the micro-batch sizes
    they lowered (config key → size). A part that reports a figure measured after one says so and fails."""
    state = trainer.memory.state_dict()
    return {"retries": state["retries"], "lowered": dict(state["overrides"])}


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    _synchronize()
    start = time.perf_counter()
    fn()
    _synchronize()
    return time.perf_counter() - start


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment for a child process of the check: the source tree first on its path, unbuffered output."""
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1", **extra}


# --- the tiny recipe through the CLI: (a) at TP=1 on one GPU, (h) at TP=2 with sequence parallelism on two --------
TINY_ON_CUDA = ["cluster.device=cuda", "cluster.gpu_type=h100-80gb", "model.params_dtype=bf16",
                *SHORT]  # the shortened recipe of the end-to-end tests  # fmt: skip


def _tiny_layout(tensor_parallel: int, sequence_parallel: bool) -> list[str]:
    """The overrides that lay every role of the tiny recipe out over `tensor_parallel` GPUs of one node."""
    return [f"cluster.gpus_per_node={tensor_parallel}",
            *(f"{role}.megatron.{key}={value}" for role in ("actor", "ref", "critic")
              for key, value in (("tensor_model_parallel_size", tensor_parallel),
                                 ("sequence_parallel", str(sequence_parallel).lower())))]  # fmt: skip


# The dry run's tiny recipe: the same program on the CPU with what CUDA changes forced where a setting can (the
# width bucket, models.widths), on a task shrunk to seconds (an SFT of 4 steps, 64 prompts, 16 held out, one PPO step
# of 128 rows): it trains, evaluates and exits, but its accuracy is not judged. In fp32: a CPU without bf16 matrix
# units multiplies bf16 some 30× slower (128·64 × 512 by 512 × 128: 0.44 s against 0.017 s), which made this part
# 110 s of the dry run's 217; the bf16 trainer runs in (b) (its tiny iterations: 5 s).
DRY_TINY = ["cluster.device=cpu", "model.params_dtype=fp32", "data.addition.num_prompts=64",
            "data.addition.num_heldout=16", "data.addition.sft_steps=4", "data.train_batch_size=128",
            "trainer.save_freq=0",
            *(f"{role}.megatron.make_sequence_length_divisible_by=128"
              for role in ("actor", "ref", "critic"))]  # fmt: skip


def tiny_recipe(plan: Plan, work: Path, name: str, tensor_parallel: int, sequence_parallel: bool) -> dict[str, Any]:
    """The tiny recipe with every role at `tensor_parallel` (and `sequence_parallel`) through the real CLI under
    torchrun, one process per GPU, `plan.recipe_steps` PPO steps, its checkpoints and logs under `work/name`;
    held-out accuracy from its TensorBoard events (step 0, last): ok when it exits 0 and the accuracy rises. Its task
    (tokenizer, SFT policy, dataset) is built in `work/tiny_task`, the part's own folder: parts (a) and (h) may run
    at once. The dry run (CPU) runs the same command on `DRY_TINY`'s shrunk
    task, one PPO step, on as many CPU processes: ok when it exits 0 and evaluated (accuracy not judged)."""
    layout = _tiny_layout(tensor_parallel, sequence_parallel)
    dirs = [f"data.addition.work_dir={work / 'tiny_task'}", f"trainer.default_local_dir={work / name / 'ckpt'}",
            f"trainer.log_dir={work / name / 'tb'}"]  # fmt: skip
    dry = plan.device == "cpu"
    steps = 1 if dry else plan.recipe_steps
    overrides = TINY_ON_CUDA
    if dry:  # CUDA's device and dtype give way to the dry run's
        cuda_only = ("cluster.device", "model.params_dtype")
        overrides = [*(o for o in TINY_ON_CUDA if not o.startswith(cuda_only)), *DRY_TINY]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tensor_parallel}",
               "--standalone", "-m", "megatron_ppo", "train", "recipes/tiny-cpu.yaml",
               *overrides, *layout, f"trainer.total_training_steps={steps}", *dirs]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, check=False)
    out: dict[str, Any] = {"exit_code": result.returncode, "seconds": time.perf_counter() - started,
                           "processes": tensor_parallel}  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"exit {result.returncode}:\n{(result.stdout + result.stderr)[-3000:]}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_ppo.runs.report import find_runs

    events = EventAccumulator(str(find_runs(work / name / "tb")[-1]))  # the run's own folder
    events.Reload()
    accuracy = [(e.step, e.value) for e in events.Scalars("eval/accuracy")]
    out |= {"accuracy_before": accuracy[0][1], "accuracy_after": accuracy[-1][1], "accuracy_judged": not dry}
    out["ok"] = dry or out["accuracy_after"] > out["accuracy_before"]
    return out
