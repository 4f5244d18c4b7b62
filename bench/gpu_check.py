"""The GPU check: one script, one CUDA GPU (two for part (h)), no network, about 8 minutes on an H100/H200.

    (a) the tiny recipe end to end on CUDA through the real CLI (TP=1, bf16): exit 0, held-out accuracy rises;
    (b) a Qwen2.5-1.5B-shaped PPO iteration (28 layers, hidden 1536, 12 heads / 2 query groups, FFN 8960,
        vocabulary 151,936, bf16; 64 rows × 1024 and × 4096 tokens, micro-batch 4, one epoch of actor and critic)
        through the trainer's own `PPOTrainer.iteration()`, packed as every GPU recipe runs (`model.pack_sequences`:
        each micro-batch one `[1, 4·seq]` THD pack, Transformer Engine's THD attention): tokens/s, MFU of the
        iteration and of its bare (packed) forward/backward passes, their ratio, computed / real tokens, peak memory
        beside the planner's prediction, and (at the first length) the same batch's iteration padded against it
        (rows of one length: no padding to remove, so this ratio is what the THD path itself costs);
    (c) log-probs of the same weights, GPU bf16 against CPU fp32 (a subprocess with the GPUs hidden);
    (d) the (b) iteration at its first length with host offload off and on: peak memory beside the planner's
        (`bench/offload_check.py`);
    (e) one actor mini-batch's gradient norm cut into 1, 2 and 4 micro-batches: equal within 1e-3 relative
        (`bench/grad_cut_check.py`);
    (f) two (b) iterations straight, and the second again after a save and a resume (same layout): every metric
        bitwise equal (`bench/resume_check.py`);
    (g) the first (b) iteration, whose only actor update scores its own experience (actor = behaviour policy):
        |PPO KL| < 1e-6, clip fraction 0, critic grad norm < 10 (`bench/first_update_check.py`);
    (h) with 2 GPUs visible (else skipped, not failed): the (b) model at TP2 + sequence parallelism and at PP2 from
        TP1's initial weights, experience log-probs and values, one iteration's losses and grad norms, and the
        weights after its step equal TP1's within bf16 tolerance; the tiny recipe at TP2 + SP through the CLI
        (`bench/layout_check.py`);
    (i) greedy decoding with the KV cache against the uncached decoder: tokens/s of each (`bench/decode_check.py`).
It prints one table, writes JSON (`--out`), names the path that ran (Transformer Engine or local + SDPA) and exits
1 when a part failed. `--dry-run` runs every part's code on the CPU with a tiny model in a minute or two (CI); (h)
there runs its layouts on 2 CPU processes (gloo, fp32).

Run: make gpu-check   (or: python -m bench.gpu_check [--dry-run] [--out FILE]); the README's GPU check section.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.decode_check import check_decode
from bench.decode_check import table_lines as decode_table_lines
from bench.first_update_check import check_first_update
from bench.first_update_check import table_lines as first_update_table_lines
from bench.gpu_plan import (
    DRY,
    GIB,
    REAL,
    REPO,
    Plan,
    ppo_config,
    subprocess_env,
    synthetic_rows,
    timed,
    tiny_recipe,
)
from bench.grad_cut_check import check_grad_norm_by_cut
from bench.grad_cut_check import table_lines as grad_cut_table_lines
from bench.layout_check import check_layouts, check_tiny_recipe_tp2_sp
from bench.layout_check import table_lines as layout_table_lines
from bench.offload_check import check_offload
from bench.offload_check import table_lines as offload_table_lines
from bench.ports import free_port
from bench.resume_check import check_resume
from bench.resume_check import table_lines as resume_table_lines


# --- (a) the tiny recipe through the CLI -----------------------------------------------------------------------
def check_tiny_recipe(plan: Plan, work: Path) -> dict[str, Any]:
    """The real CLI under torchrun, one process at TP=1; held-out accuracy from its TensorBoard events."""
    return tiny_recipe(plan, work, "tiny", tensor_parallel=1, sequence_parallel=False)


# --- (b) the PPO iteration at a 1.5B shape ---------------------------------------------------------------------
def bare_passes(trainer, plan: Plan, seq: int) -> None:
    """What the iteration must compute, nothing else: forwards of actor, reference (log-probs) and critic (values),
    then one forward+backward epoch of actor and critic over the same micro-batches (no optimizer step)."""
    from megatron_ppo.models import run_micro_batches, vocab_parallel_log_probs
    from megatron_ppo.models.packing import labels_of, per_row

    gen = torch.Generator().manual_seed(0)
    micro = []
    for _ in range(plan.rows // plan.micro_batch):
        ids = torch.randint(1, plan.shape.vocab, (plan.micro_batch, seq), generator=gen)
        lengths = torch.full((plan.micro_batch,), seq)  # packed like the iteration's when the models pack
        micro.append({"input_ids": ids, "labels": torch.roll(ids, -1, dims=1), "lengths": lengths})

    def log_probs(model):
        def fn(batch, logits):
            lp, _ = vocab_parallel_log_probs(
                logits, labels_of(batch), vocab_size=model.vocab_size, with_entropy=model.is_trained,
                chunk_tokens=model.logprob_chunk_tokens,
            )  # fmt: skip
            return -per_row(batch, lp).mean(), {}

        return fn

    def values(batch, output):
        return per_row(batch, output.float()).square().mean(), {}

    for model in (trainer.actor, trainer.ref):
        run_micro_batches(model, micro, log_probs(model), forward_only=True)
    run_micro_batches(trainer.critic, micro, values, forward_only=True)
    for model, loss in ((trainer.actor, log_probs(trainer.actor)), (trainer.critic, values)):
        for chunk in model.chunks:
            chunk.zero_grad_buffer()
        run_micro_batches(model, micro, loss, forward_only=False)


def check_ppo_iteration(plan: Plan, seq: int, work: Path) -> dict[str, Any]:
    from megatron_ppo.config.gpus import gpu_spec
    from megatron_ppo.planner import plan as planner
    from megatron_ppo.train.ppo import PPOTrainer
    from megatron_ppo.train.throughput import throughput_metrics

    config = ppo_config(plan, seq, work / f"ppo{seq}", pack_sequences=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer = PPOTrainer(config, synthetic_rows(plan, seq, seed=seq), pad_id=0)
    build_s = time.perf_counter() - started
    models = [model for model in (trainer.actor, trainer.ref, trainer.critic) if model is not None]
    try:
        warmup_s = timed(trainer.iteration)  # kernels chosen, allocator warmed, optimizer states created
        state = trainer.sampler.state_dict()
        metrics: dict[str, float] = {}
        iteration_s = timed(lambda: metrics.update(trainer.iteration()))
        packed_passes = sorted(note for model in models for note in model.pass_notes)
        bare_passes(trainer, plan, seq)  # warm
        bare_s = timed(lambda: bare_passes(trainer, plan, seq))
        padded_metrics: dict[str, float] = {}
        padded_s = float("nan")
        if seq == plan.seq_lengths[0]:  # the same batch again padded (warmed first): what packing costs here
            for model in models:
                model.pack_sequences = False
            trainer.iteration()
            trainer.sampler.load_state_dict(state)
            padded_s = timed(lambda: padded_metrics.update(trainer.iteration()))
    finally:
        trainer.close()
    lengths = [seq] * plan.rows
    roles = ("actor", "ref", "critic")
    iteration = throughput_metrics(config, roles, lengths, {"iteration": iteration_s, **_all_phases(iteration_s)})
    bare = throughput_metrics(config, roles, lengths, {"iteration": bare_s, **_all_phases(bare_s)})
    peak = gpu_spec(config.cluster.gpu_type).peak_bf16_tflops
    out = {
        "seq": seq, "rows": plan.rows, "build_models_s": build_s, "first_iteration_s": warmup_s,
        "iteration_s": iteration_s, "bare_passes_s": bare_s, "tokens_per_s": plan.rows * seq / iteration_s,
        "mfu_iteration": iteration["perf/tflops_per_gpu"] / peak, "mfu_bare": bare["perf/tflops_per_gpu"] / peak,
        "iteration_over_bare": iteration_s / bare_s, "planned_peak_gib": planner.plan(config).peak_gib,
        "actor_parameters": sum(p.numel() for c in trainer.actor.chunks for p in c.parameters()),
        "pass_notes": packed_passes,
        "computed_over_real": metrics["perf/padded_over_real_tokens"],
        "padded_iteration_s": padded_s, "packed_over_padded": iteration_s / padded_s,
        "padded_computed_over_real": padded_metrics.get("perf/padded_over_real_tokens", float("nan")),
    }  # fmt: skip
    if torch.cuda.is_available():
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    out["ok"] = True
    return out


def _all_phases(seconds: float) -> dict[str, float]:
    return {"experience": seconds, "update_actor": seconds, "update_critic": seconds}


# --- (c) log-probs on the device against CPU fp32 --------------------------------------------------------------
def logprob_model_config(plan: Plan, dtype: str):
    from megatron_ppo.config.schema import ModelConfig

    s = plan.shape
    return ModelConfig(
        num_layers=s.layers_c, hidden_size=s.hidden, num_attention_heads=s.heads, num_query_groups=s.groups,
        ffn_hidden_size=s.ffn, vocab_size=s.vocab, max_position_embeddings=4096, rotary_base=1_000_000.0,
        add_qkv_bias=True, params_dtype=dtype, init_method_std=0.05,
    )  # fmt: skip


def logprobs_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    from megatron_ppo.models import run_micro_batches, vocab_parallel_log_probs

    labels = torch.roll(input_ids, -1, dims=1)

    def fn(batch, logits):
        return torch.zeros(()), {"lp": vocab_parallel_log_probs(logits, batch["labels"])[0].float().cpu()}

    (out,) = run_micro_batches(model, [{"input_ids": input_ids, "labels": labels}], fn, forward_only=True)
    return out["lp"][:, :-1]


def check_logprobs(plan: Plan, work: Path) -> dict[str, Any]:
    """The same weights (a dist checkpoint, so TE and local specs read it alike) in `plan.dtype` on this device
    and in fp32 on the CPU; the difference of per-token log-probs must stay within bf16 rounding."""
    from megatron_ppo.checkpoint import store
    from megatron_ppo.config.schema import MegatronConfig
    from megatron_ppo.models import build_role_model

    model = build_role_model("actor", logprob_model_config(plan, plan.dtype), MegatronConfig())
    root = work / "logprob_weights"
    store.save_checkpoint(root, 0, {"actor": model}, {}, {"step": 0})
    input_ids = torch.randint(1, plan.shape.vocab, (2, 512), generator=torch.Generator().manual_seed(1))
    torch.save(input_ids, work / "logprob_input.pt")
    device_lp = logprobs_of(model, input_ids)
    del model
    command = [
        sys.executable,
        "-m",
        "bench.gpu_check",
        "--cpu-logprobs",
        str(work),
        "--shape",
        "dry" if plan is DRY else "real",
    ]
    env = subprocess_env(CUDA_VISIBLE_DEVICES="", MASTER_PORT=str(free_port()))
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"CPU fp32 subprocess exit {result.returncode}:\n{(result.stdout + result.stderr)[-3000:]}")
    cpu_lp = torch.load(work / "logprob_cpu.pt")
    # relative to the log-prob (≈ −log V for a fresh model), in units of bf16's precision 2⁻⁸: bf16 activations
    # and logits carry that rounding through every layer. Measured on CPU (bf16 vs fp32, this 4-layer shape):
    # mean 0.004 ≈ 1 ulp, max 0.02, correlation 0.9995.
    relative = (device_lp - cpu_lp).abs() / cpu_lp.abs().clamp(min=1.0)
    correlation = float(torch.corrcoef(torch.stack([device_lp.flatten(), cpu_lp.flatten()]))[0, 1])
    ulp = 2.0**-8 if plan.dtype != "fp32" else 2.0**-23
    tolerance = {"mean_relative": 2 * ulp, "max_relative": 16 * ulp, "correlation": 0.999 if ulp > 1e-6 else 0.999999}
    out = {"mean_relative_diff": float(relative.mean()), "max_relative_diff": float(relative.max()),
           "mean_abs_diff": float((device_lp - cpu_lp).abs().mean()), "correlation": correlation,
           "tolerance": tolerance, "logprob_mean": float(cpu_lp.mean()), "logprob_std": float(cpu_lp.std()),
           "tokens": relative.numel()}  # fmt: skip
    out["ok"] = (
        out["mean_relative_diff"] <= tolerance["mean_relative"]
        and out["max_relative_diff"] <= tolerance["max_relative"]
        and correlation >= tolerance["correlation"]
    )
    return out


def cpu_logprobs(work: Path, shape: str) -> None:
    """The CPU side of (c), in its own process: the saved weights in fp32, log-probs of the saved input."""
    from megatron_ppo.checkpoint import store
    from megatron_ppo.config.schema import MegatronConfig
    from megatron_ppo.models import build_role_model
    from megatron_ppo.parallel import destroy_distributed, init_distributed

    plan = REAL if shape == "real" else DRY
    init_distributed(MegatronConfig(), seed=0, device="cpu")
    model = build_role_model("actor", logprob_model_config(plan, "fp32"), MegatronConfig())
    store.load_weights(model, work / "logprob_weights", "actor")
    torch.save(logprobs_of(model, torch.load(work / "logprob_input.pt")), work / "logprob_cpu.pt")
    destroy_distributed()


# --- the run ---------------------------------------------------------------------------------------------------
def _part(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    started = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as error:  # a failed part is reported, the others still run
        results[name] = {"ok": False, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
        print(results[name]["trace"], file=sys.stderr, flush=True)
    results[name]["wall_s"] = time.perf_counter() - started


def table(results: dict[str, Any]) -> str:
    lines = [f"GPU check · {results['device']} · {results['kernels']}", ""]
    a = results["a_tiny_recipe"]
    verdict = "ok" if a.get("ok") else f"FAILED {a.get('error', '')[:200]}"
    detail = f"accuracy {a['accuracy_before']:.3f} → {a['accuracy_after']:.3f}" if "accuracy_after" in a else ""
    lines.append(f"(a) tiny recipe via the CLI          {verdict}  {detail}  ({a['wall_s']:.0f} s)")
    lines.append(f"(b) PPO iteration, {results['shape']:<18}tokens  iter s  tokens/s  MFU iter  MFU bare  iter/bare  "
                 "peak GiB  planned GiB  computed/real  padded s  packed/padded")  # fmt: skip
    for b in results["b_ppo_iteration"]:
        if not b.get("ok"):
            lines.append(f"    FAILED {b.get('error', '')[:300]}")
            continue
        lines.append(
            f"    {b['rows']} rows × {b['seq']:<5}                {b['rows'] * b['seq']:>7} {b['iteration_s']:7.2f} "
            f"{b['tokens_per_s']:9,.0f} {b['mfu_iteration']:8.1%} {b['mfu_bare']:9.1%} "
            f"{b['iteration_over_bare']:10.2f} "
            f"{b.get('peak_allocated_gib', float('nan')):9.1f} {b['planned_peak_gib']:12.1f} "
            f"{b['computed_over_real']:14.3f} {b['padded_iteration_s']:9.2f} {b['packed_over_padded']:14.3f}"
        )  # fmt: skip
    c = results["c_logprobs"]
    if "mean_relative_diff" in c:
        tol = c["tolerance"]
        lines.append(f"(c) log-probs {results['dtype']} vs CPU fp32        {'ok' if c['ok'] else 'FAILED'}  relative "
                     f"|Δ| mean {c['mean_relative_diff']:.1e} (≤ {tol['mean_relative']:.1e}), max "
                     f"{c['max_relative_diff']:.1e} (≤ {tol['max_relative']:.1e}); correlation "
                     f"{c['correlation']:.5f} (≥ {tol['correlation']}); "
                     f"mean |Δ| {c['mean_abs_diff']:.3f} nats")  # fmt: skip
    else:
        lines.append(f"(c) log-probs                       FAILED {c.get('error', '')[:300]}")
    lines += offload_table_lines(results["d_offload"])
    lines += grad_cut_table_lines(results["e_grad_norm_by_cut"])
    lines += resume_table_lines(results["f_resume"])
    lines += first_update_table_lines(results["g_first_update"])
    lines += layout_table_lines(results["h_layouts"], results["h_tiny_recipe_tp2_sp"])
    lines += decode_table_lines(results["i_decode"])
    return "\n".join(lines)


def run(plan: Plan, out_path: Path, work: Path) -> int:
    from megatron_ppo.models.kernels import describe_kernels
    from megatron_ppo.parallel import destroy_distributed, init_distributed

    shape = "tiny (dry run)" if plan is DRY else "1.5B shape"
    results: dict[str, Any] = {"dry_run": plan is DRY, "dtype": plan.dtype, "shape": shape}
    _part(results, "a_tiny_recipe", lambda: check_tiny_recipe(plan, work))
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    config = ppo_config(plan, plan.seq_lengths[0], work, pack_sequences=True)  # (b)'s, for the kernels line
    init_distributed(config.actor.megatron, seed=0, device=plan.device)
    results["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results["torch"] = torch.__version__
    results["kernels"] = describe_kernels(config)
    results["b_ppo_iteration"] = []
    for seq in plan.seq_lengths:
        part: dict[str, Any] = {}
        _part(part, "b", lambda seq=seq: check_ppo_iteration(plan, seq, work))
        results["b_ppo_iteration"].append(part["b"])
        gc.collect()  # the trainer of this length, before the next one is built
    _part(results, "c_logprobs", lambda: check_logprobs(plan, work))
    _part(results, "d_offload", lambda: check_offload(plan, work))
    _part(results, "e_grad_norm_by_cut", lambda: check_grad_norm_by_cut(plan, work))
    _part(results, "f_resume", lambda: check_resume(plan, work))
    _part(results, "g_first_update", lambda: check_first_update(plan, work))
    _part(results, "h_layouts", lambda: check_layouts(plan, work))
    _part(results, "i_decode", lambda: check_decode(plan, work))
    destroy_distributed()
    _part(results, "h_tiny_recipe_tp2_sp", lambda: check_tiny_recipe_tp2_sp(plan, work))
    print(table(results), flush=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2, default=str))
    print(f"results: {out_path}")
    parts = [results["a_tiny_recipe"], *results["b_ppo_iteration"], results["c_logprobs"], results["d_offload"],
             results["e_grad_norm_by_cut"], results["f_resume"], results["g_first_update"], results["h_layouts"],
             results["h_tiny_recipe_tp2_sp"], results["i_decode"]]  # fmt: skip
    return 0 if all(p.get("ok") for p in parts) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model: every part's code, in minutes")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (default outputs/gpu_check[_dry].json)")
    parser.add_argument("--cpu-logprobs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=("real", "dry"), default="real", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cpu_logprobs:
        cpu_logprobs(args.cpu_logprobs, args.shape)
        return 0
    plan = DRY if args.dry_run else REAL
    if plan is REAL and not torch.cuda.is_available():
        print("the GPU check needs a CUDA GPU (torch.cuda.is_available() is False); use --dry-run on CPU",
              file=sys.stderr)  # fmt: skip
        return 2
    out = args.out or REPO / "outputs" / ("gpu_check_dry.json" if args.dry_run else "gpu_check.json")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        return run(plan, out, Path(work))


if __name__ == "__main__":
    sys.exit(main())
