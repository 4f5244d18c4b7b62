"""Command line: `python -m megatron_ppo <command> ...`. A thin face: parse, load the config, call one function."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import signal
import sys
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from megatron_ppo.checkpoint.verify import CheckpointError
from megatron_ppo.config import ConfigError, load_config
from megatron_ppo.config.errors import UserError
from megatron_ppo.launcher import NPROC, tell_user
from megatron_ppo.startup.early_signals import started_by_plain_torchrun, stopped_by_plain_torchrun
from megatron_ppo.startup.import_gc import imports_without_gc

if TYPE_CHECKING:
    from megatron_ppo.config.schema import PPOConfig
    from megatron_ppo.train.guards import GuardStopped


def _validate(args: argparse.Namespace) -> int:
    config = load_config(args.recipe, args.overrides)
    from megatron_ppo.checkpoint.named import resumed_checkpoint, step_directory

    # the model the checkpoints hold (training refuses others): the initial weights, and the checkpoint a resume loads
    initial = [p for p in (config.model.init_checkpoint, config.critic.model.init_checkpoint) if p]
    found = [checkpoint for checkpoint in map(step_directory, dict.fromkeys(initial)) if checkpoint is not None]
    if found or resumed_checkpoint(config.trainer) is not None:
        from megatron_ppo.checkpoint.shapes import checkpoint_problems, resume_problems  # torch's reader

        problems = [problem for checkpoint in found for problem in checkpoint_problems(checkpoint, config)]
        if problems := problems + resume_problems(config):
            raise ConfigError(problems, source=str(args.recipe))
    print(OmegaConf.to_yaml(OmegaConf.structured(config)), end="")
    return 0


def _train(args: argparse.Namespace) -> int:
    if args.nproc is not None:
        return _launch(args)
    with imports_without_gc():
        from megatron_ppo.tasks import addition
        from megatron_ppo.train.guards import GuardStopped
        from megatron_ppo.train.preemption import (
            Interrupted,
            JobStopped,
            Preempted,
            StoppedBeforeTraining,
            stopped_by_the_launcher,
            watching,
        )
        from megatron_ppo.train.run import train

    config = None
    try:
        with watching(say=tell_user):
            config = load_config(args.recipe, args.overrides)
            try:
                (addition.run if config.data.task == "addition" else train)(config)
            finally:
                _report_to_trackers(config)
    except Interrupted as stop:
        _end_as_interrupted()
        return tell_user(stop.exit_status, f"interrupted: saved {stop}; resume with: "
                                           f"{resume_command(args.recipe, args.overrides, config)}")  # fmt: skip
    except KeyboardInterrupt:  # before the training loop (nothing to save yet), or a second Ctrl-C in it
        return tell_user(_end_as_interrupted(), f"interrupted: nothing new saved ({_kept(config)}); resume with: "
                                                f"{resume_command(args.recipe, args.overrides, config)}")  # fmt: skip
    except StoppedBeforeTraining as stop:
        if stopped_by_plain_torchrun():  # most likely torchrun ending the others
            said = f"{stopped_by_the_launcher(str(stop))}: nothing new to save ({_kept(config)})"
            return tell_user(128 + signal.Signals[str(stop)].value, said)
        return tell_user(stop.exit_status, f"stopped early by {stop} before training: nothing new to save "
                                           f"({_kept(config)}); exiting with {stop.exit_status}, requeued unless it "
                                           "was cancelled")  # fmt: skip
    except JobStopped as stop:
        then = "requeued unless it was cancelled" if isinstance(stop, Preempted) else "the next job resumes from it"
        return tell_user(stop.exit_status, f"stopped early: saved {stop}; exiting with {stop.exit_status}, {then}")
    except GuardStopped as stop:
        return report_guard_stop(stop)
    return tell_user(0, "")  # the run's end, for the launcher: a stop signal that comes now is no preemption


def _report_to_trackers(config: PPOConfig) -> None:
    """The run's summary and figure to the trackers that keep artifacts (MLflow: `runs/tracking.py`), from the
    process that logged, once the job's logger has closed its TensorBoard files."""
    if "mlflow" in config.trainer.logger:
        from megatron_ppo.runs.tracking import publish_report

        publish_report(config)


def _kept(config: PPOConfig | None) -> str:
    """What an early stop leaves of the run: the checkpoint `latest` names, if any."""
    from megatron_ppo.checkpoint.directory import named_by_latest

    latest = named_by_latest(Path(config.trainer.default_local_dir)) if config is not None else None
    return f"`latest` still names {latest}" if latest else "no checkpoint of this run yet"


def _launch(args: argparse.Namespace) -> int:
    """`train --nproc N`: the config validated for N processes on this machine, then N workers under the launcher
    (`megatron_ppo/launcher.py`), which says their outcome once and exits with its status."""
    from megatron_ppo.config import world_size
    from megatron_ppo.launcher import launch

    config = load_config(args.recipe, args.overrides)
    if config.cluster.nodes != 1 or world_size(config) != args.nproc:
        raise ConfigError([f"--nproc {args.nproc} starts {args.nproc} process(es) on this machine, but the config asks "
                           f"for cluster.nodes × cluster.gpus_per_node = {config.cluster.nodes} × "
                           f"{config.cluster.gpus_per_node}; set cluster.nodes=1 cluster.gpus_per_node={args.nproc} "
                           "or launch as many processes (several nodes: slurm/ppo.sbatch)"],
                          source=str(args.recipe))  # fmt: skip
    resume = resume_command(args.recipe, args.overrides, config, nproc=args.nproc)
    return launch(args.nproc, ["train", args.recipe, *args.overrides], resume)


def _prepare(args: argparse.Namespace) -> int:
    config = load_config(args.recipe, args.overrides)
    if config.data.task == "addition" and not config.data.train_files:
        raise ConfigError(
            [
                "data.task=addition builds its rows in its first `train` run (an SFT policy samples "
                "them); `prepare` prepares data files: set data.train_files"
            ],
            source=str(args.recipe),
        )
    with imports_without_gc():
        from megatron_ppo.train.run import prepare_data

    data = prepare_data(config)
    for name, prepared in (("train", data.train), ("validation", data.val)):
        if prepared is not None:
            print(f"{name}: {prepared.line()}\n{name}: {prepared.report.summary()}")
    return 0


def _score(args: argparse.Namespace) -> int:
    from megatron_ppo.data.rows import DataError

    config = load_config(args.recipe, args.overrides)
    try:
        with imports_without_gc():
            if config.data.task == "addition":
                from megatron_ppo.tasks.addition import score
            else:
                from megatron_ppo.convert.reward_scoring import score
        score(config)
    except DataError as problem:
        return tell_user(2, f"error: {problem}")
    return 0


# Overrides a resumed job must not repeat: they start a new run (auto continues the run `latest` names)
NOT_ON_RESUME = ("trainer.resume_mode=", "trainer.resume_from_path=", "trainer.overwrite=", "+trainer.resume_mode=")


def resume_command(recipe: str, overrides: Sequence[str], config: PPOConfig | None, nproc: int | None = None) -> str:
    """The command line that continues an interrupted run: the same launch (`train --nproc N` under the launcher;
    `torchrun --standalone` with this job's processes per node when it ran under torchrun on one node) and
    overrides, less those that would start another run, with `trainer.resume_mode=auto` where the recipe resumes
    otherwise. `nproc`: the launcher's own, where this process is the launcher."""
    kept = [o for o in overrides if not o.startswith(NOT_ON_RESUME)]
    if config is not None and config.trainer.resume_mode != "auto":
        kept.append("trainer.resume_mode=auto")
    words = ["-m", "megatron_ppo", "train", recipe, *kept]
    nodes, per_node = int(os.environ.get("GROUP_WORLD_SIZE", "1")), os.environ.get("LOCAL_WORLD_SIZE")
    python = Path(sys.executable)
    if nproc := nproc or (int(os.environ[NPROC]) if NPROC in os.environ else None):
        words.insert(3, f"--nproc={nproc}")
        launch = [_as_found(python)]
    elif "TORCHELASTIC_RUN_ID" in os.environ and per_node:
        launch = [_as_found(python.with_name("torchrun")), *(["--nnodes", str(nodes)] if nodes > 1 else
                  ["--standalone"]), "--nproc_per_node", per_node]  # fmt: skip
    else:
        launch = [_as_found(python)]
    return shlex.join([*launch, *words])


def _as_found(program: Path) -> str:
    """`program` (this environment's interpreter, or a script beside it) as the user's shell runs it: its bare name
    where PATH leads to this very file, else its path — a bare `python` may be another environment's, or none."""
    found = shutil.which(program.name)
    if not program.exists():  # torchrun installed elsewhere than the interpreter
        return program.name if found is None else found
    return program.name if found is not None and os.path.samefile(found, program) else str(program)


def _end_as_interrupted() -> int:
    """Exit status 130 on every rank: torchrun sends SIGTERM to the ranks still shutting down once the first has
    exited, which would turn their 130 into -15; this one finishes its exit instead (torchrun kills at 30 s)."""
    from megatron_ppo.train.preemption import INTERRUPTED_EXIT

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return INTERRUPTED_EXIT


def report_guard_stop(stop: GuardStopped) -> int:
    """A guard's stop as one line for the user (`tell_user`: once; every rank stops at the same guard); returns its
    exit status."""
    return tell_user(stop.exit_status, f"stopped: {stop}; exiting with {stop.exit_status} (not requeued)")


def _compare_kl(args: argparse.Namespace) -> int:
    from megatron_ppo.tasks import addition

    addition.compare_kl(load_config(args.recipe, args.overrides), plot=args.plot)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from megatron_ppo.planner.plan import format_plan, plan, suggest

    overrides = [*args.overrides, *([f"cluster.nodes={args.nodes}"] if args.nodes is not None else [])]
    config = load_config(args.recipe, overrides)
    result = plan(config, recipe=args.recipe)
    if args.json:
        print(result.to_json())
        return 0 if result.fits else 1
    print(format_plan(result, config))
    if not result.fits:
        nearest = suggest(config)
        if nearest is None:
            print("no TP/PP/offload layout fits these GPUs: add nodes or shorten the sequences")
        else:
            layout, fitting = nearest
            print(f"nearest layout that fits: {fitting.layout}" + (" with CPU offload" if layout.param_offload else "")
                  + f" (peak {fitting.peak_gib:.1f} GiB)")  # fmt: skip
    return 0 if result.fits else 1


def _convert(args: argparse.Namespace) -> int:
    with imports_without_gc():
        from megatron_ppo.convert import huggingface, peft_adapter
        from megatron_ppo.models.hf_conversion import hf_params_dtype
        from megatron_ppo.parallel import destroy_distributed, dist_env_from_environment, init_distributed

    needed = {
        "hf-to-mcore": ("hf", "out"),
        "mcore-to-hf": ("megatron", "hf_config", "out"),
        "verify": ("hf", "megatron"),
    }
    if missing := [f"--{name.replace('_', '-')}" for name in needed[args.direction] if not getattr(args, name)]:
        raise ConfigError([f"convert {args.direction} needs {' and '.join(missing)} (python -m megatron_ppo convert "
                           "--help)"])  # fmt: skip
    if args.direction == "mcore-to-hf":  # one process, no process group: it reads the checkpoint's files
        if dist_env_from_environment().world_size > 1:
            raise ConfigError(["mcore-to-hf runs in one process: python -m megatron_ppo convert mcore-to-hf ..."])
        shard = {"max_shard_bytes": int(args.max_shard_gb * 10**9)} if args.max_shard_gb else {}
        written = huggingface.mcore_to_hf(args.megatron, args.hf_config, args.out, **shard, merge_lora=args.merge_lora)
        print(f"wrote {written.describe()}")
        return 0
    if args.direction == "hf-to-mcore":
        huggingface.check_new_output(args.out)
    model = huggingface.hf_model_config(peft_adapter.adapter_base(args.hf) or args.hf)  # verify: an adapter's base
    layout = huggingface.conversion_layout(model, args.tp, args.pp, args.ep)
    problems = huggingface.layout_problems(model, layout)
    if problems:
        raise ConfigError(problems, source=str(args.hf))
    world = dist_env_from_environment().world_size
    if world % (args.tp * args.pp * args.ep):
        needed = args.tp * args.pp * args.ep  # EP splits the data-parallel ranks: at least EP of them
        raise ConfigError([f"--tp {args.tp} --pp {args.pp} --ep {args.ep} needs a multiple of {needed} processes, "
                           f"not {world}: torchrun --nproc_per_node {needed} -m megatron_ppo convert ..."])  # fmt: skip
    init_distributed(layout, seed=0)
    try:
        if args.direction == "hf-to-mcore":
            hf_dtype = hf_params_dtype(args.hf)
            dtype = args.dtype or hf_dtype or "bf16"
            written = huggingface.hf_to_mcore(args.hf, args.out, dtype, layout)
            how = (f"cast from the Hugging Face model's {hf_dtype} by --dtype" if args.dtype and args.dtype != hf_dtype
                   else "the Hugging Face model's dtype" if hf_dtype else "its config.json names no dtype")  # fmt: skip
            if dist_env_from_environment().rank == 0:
                print(f"wrote {written} as {dtype} ({how}; converted at TP {args.tp} PP {args.pp} EP {args.ep}; loads "
                      "at any TP/PP/EP)")  # fmt: skip
        else:
            verdict = huggingface.verify(args.hf, args.megatron, layout)
            if verdict is not None:
                ok, line = verdict.line(args.tolerance)
                print(line)
                return 0 if ok else 1
        return 0
    finally:
        destroy_distributed()


def _verify_checkpoint(args: argparse.Namespace) -> int:
    from megatron_ppo.checkpoint.directory import checked

    lines, damaged = checked(Path(args.checkpoint))
    print("\n".join(lines))
    if damaged:
        raise CheckpointError(f"{damaged} of the checkpoints under {args.checkpoint} cannot be trusted (above)")
    return 0


def _report(args: argparse.Namespace) -> int:
    from megatron_ppo.runs.report import print_report

    # further runs and key=value overrides share the positional tail: an existing path is a run (or a recipe)
    targets = [args.run_or_recipe, *(t for t in args.overrides if "=" not in t or Path(t).exists())]
    overrides = [t for t in args.overrides if t not in targets]
    log_dirs = [t if Path(t).is_dir() else load_config(t, overrides).trainer.log_dir for t in targets]
    if args.plot is None:
        for log_dir in log_dirs:
            print_report(log_dir)
        return 0
    from megatron_ppo.runs.figure import plot_runs

    print(f"figure: {plot_runs(log_dirs, args.plot or None)}")
    return 0


def _command(commands, name: str, help_text: str, example: str) -> argparse.ArgumentParser:
    """A subcommand whose --help ends with one example command line (kept unwrapped)."""
    return commands.add_parser(name, help=help_text, description=help_text, epilog=f"example:\n  {example}",
                               formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip


def _recipe_command(commands, name: str, help_text: str, run, example: str) -> argparse.ArgumentParser:
    """A subcommand taking a recipe and key=value overrides."""
    command = _command(commands, name, help_text, example)
    command.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny-cpu.yaml")
    command.add_argument("overrides", nargs="*", help="key=value overrides (verl-style paths accepted)")
    command.set_defaults(run=run)
    return command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron_ppo", description="Offline RLHF with PPO on Megatron-Core.")
    commands = parser.add_subparsers(dest="command", required=True)
    _recipe_command(
        commands,
        "validate",
        "compose, validate and print a recipe's resolved config",
        _validate,
        "megatron-ppo validate recipes/qwen2.5-7b.yaml actor.optim.lr=5e-7 algorithm.kl_ctrl.type=adaptive",
    )
    trainer = _recipe_command(
        commands,
        "train",
        "run a recipe (--nproc N: in N processes on this machine; several nodes: slurm/ppo.sbatch)",
        _train,
        "megatron-ppo train --nproc 2 recipes/tiny-cpu.yaml algorithm.kl_ctrl.max_coef=1.0",
    )
    trainer.add_argument("--nproc", type=int, metavar="N", help="start N worker processes on this machine (torch's "
                         "elastic agent, as torchrun --standalone does) and say their outcome once, with its exit "
                         "status; the config must ask for N (cluster.nodes=1, cluster.gpus_per_node=N)")  # fmt: skip
    _recipe_command(
        commands,
        "prepare",
        "read, check, score and tokenize the data files once into files (data.prepared_dir) that every rank of "
        "`train` reads in place: run it on a CPU node before the job",
        _prepare,
        "megatron-ppo prepare recipes/qwen2.5-32b.yaml data.train_files=/data/train.parquet "
        "data.prepared_dir=/shared/prepared",
    )
    _recipe_command(
        commands,
        "score",
        "rewards from reward_model.* for every row of the data files, written to new "
        "Parquet files (under torchrun for several processes)",
        _score,
        "torchrun --nproc_per_node 8 -m megatron_ppo score recipes/qwen2.5-7b.yaml "
        "reward_model.model.path=/models/Skywork-RM data.train_files=pairs.parquet",
    )
    comparer = _recipe_command(
        commands,
        "compare-kl",
        "the tiny recipe with KL off, fixed, adaptive and staged",
        _compare_kl,
        "torchrun --nproc_per_node 2 -m megatron_ppo compare-kl recipes/tiny-cpu.yaml --plot",
    )
    comparer.add_argument("--plot", nargs="?", const="", metavar="FILE", help="also draw the four runs on one figure "
                          "(default: compare-kl.png in the comparison's directory)")  # fmt: skip
    planner = _recipe_command(
        commands,
        "plan",
        "layout check, per-GPU memory and step-time estimate",
        _plan,
        "megatron-ppo plan recipes/qwen2.5-32b.yaml --nodes 4",
    )
    planner.add_argument("--nodes", type=int, help="plan for this many nodes instead of cluster.nodes")
    planner.add_argument("--json", action="store_true", help="machine-readable output")
    reporter = _command(
        commands,
        "report",
        "a run's TensorBoard metrics and events as tables, or a figure",
        "megatron-ppo report outputs/tiny/tensorboard --plot",
    )
    reporter.add_argument("run_or_recipe", help="a TensorBoard log directory, or a recipe (its trainer.log_dir)")
    reporter.add_argument("overrides", nargs="*", help="more runs or recipes, then key=value overrides of the recipes")
    reporter.add_argument("--plot", nargs="?", const="", metavar="FILE", help="draw the runs on one figure (.png, "
                          ".pdf, .svg; default: <trainer.log_dir>/<run id>.png, beside the first run)")  # fmt: skip
    reporter.set_defaults(run=_report)
    verifier = _command(
        commands,
        "verify-checkpoint",
        "check that a checkpoint (or each one under a checkpoint directory) holds every file its save wrote, with "
        "its size and bytes (the digests in its manifest.json, every file read back)",
        "megatron-ppo verify-checkpoint outputs/tiny/checkpoints/step_20",
    )
    verifier.add_argument("checkpoint", help="a step_N checkpoint, or trainer.default_local_dir (each step_N in it)")
    verifier.set_defaults(run=_verify_checkpoint)
    converter = _command(
        commands,
        "convert",
        "Hugging Face <-> megatron-ppo checkpoints, and a logit check",
        "torchrun --nproc_per_node 4 -m megatron_ppo convert hf-to-mcore --hf /models/Qwen2.5-7B-Instruct "
        "--out ckpt/qwen7b-init --tp 4",
    )
    converter.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf", "verify"])
    converter.add_argument("--hf", help="Hugging Face directory (config.json + safetensors); verify: also a peft "
                           "adapter export (compared on the base it names)")  # fmt: skip
    converter.add_argument("--megatron", help="megatron-ppo checkpoint directory (mcore-to-hf, verify)")
    converter.add_argument("--hf-config", help="Hugging Face directory whose config.json describes the model")
    converter.add_argument("--out", help="output directory")
    converter.add_argument("--tp", type=int, default=1, help="hf-to-mcore, verify: run at this TP (under torchrun)")
    converter.add_argument("--pp", type=int, default=1, help="hf-to-mcore, verify: run at this PP (under torchrun)")
    converter.add_argument("--ep", type=int, default=1, help="hf-to-mcore, verify: expert parallel size (MoE)")
    converter.add_argument(
        "--dtype",
        default=None,
        choices=["bf16", "fp16", "fp32"],
        help="hf-to-mcore: the weights' dtype (default: the Hugging Face model's torch_dtype)",
    )
    converter.add_argument("--merge-lora", action="store_true", help="mcore-to-hf: a LoRA checkpoint's actor as "
                           "merged weights W + (alpha/r)·BA (default: a peft adapter, unless the run set "
                           "actor.lora.merge)")  # fmt: skip
    converter.add_argument("--max-shard-gb", type=float, help="mcore-to-hf: largest safetensors file in GB (10^9 "
                           "bytes; default huggingface_hub's 5); a larger tensor gets a file of its own")  # fmt: skip
    converter.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="verify: largest allowed logit difference "
        "(default: 1e-3 for an fp32 checkpoint, 2^-5 of the largest logit for a 16-bit one)",
    )
    converter.set_defaults(run=_convert)
    return parser


# What Megatron-Core and torch tell their own developers, not a user of a run (each kept in the debug log):
# - optional kernels not found when imported, and at the first asynchronous save that Megatron's own writer is
#   deprecated for NVRx's (a CUDA-only package): the run's first lines already say which layer spec, attention kernel,
#   fusions and optimizer run (`describe_kernels`);
# - Megatron-Core's notes on its own API: GPTModel's deprecation for HybridModel (per model built), its experimental
#   MiMo config (a class defined at import), the `cuda_graph_scope` default it renames itself (per config copied);
# - torch's distributed-checkpoint notes on how Megatron calls it (a load without a process group, its argument
#   order, ShardedTensor's deprecation for DTensor), and torch 2.13's renaming of `all_gather_into_tensor` (to
#   `all_gather_single`, which torch < 2.13 lacks), which Megatron-Core's parameter buffers and tensor-parallel
#   gathers call (0.16.1–0.19; nothing of ours does);
# - Megatron's background checkpoint writer's own lines about a failed write ("Local worker 0 encountered an error:
#   [enforce fail at inline_container.cc:672] …", "An error is caught while starting worker 0 …"), printed before the
#   failure reaches the rank: the save's failure is then said once, by our line (the cause — a full disk, an errno —
#   what was kept and what to do, `checkpoint/verify.py`) or, when it is not the user's, by its traceback.
LIBRARY_NOTICES = ("Apex is not installed", "Transformer Engine and Apex are not installed",
                   "No CUDA runtime is found", "MCore's async save is deprecated", "GPTModel IS DEPRECATED",
                   "MimoModelConfig is experimental", "full scope is deprecated",
                   "torch.distributed is disabled, unavailable or uninitialized",
                   "The argument order of load has been changed",
                   "Please use DTensor instead and we are deprecating ShardedTensor",
                   "`torch.distributed.all_gather_into_tensor` is deprecated", "Local worker ",
                   "An error is caught while starting worker ")  # fmt: skip
# the loggers that log some of them (the others are Python warnings)
NOTICE_LOGGERS = ("torch.utils.cpp_extension", "megatron.core.dist_checkpointing.strategies.torch",
                  "megatron.core.dist_checkpointing.strategies.filesystem_async",
                  "megatron.core.models.gpt.gpt_model")  # fmt: skip
LOG_LEVEL = "MEGATRON_PPO_LOG_LEVEL"  # e.g. DEBUG: the notices above, and every library's debug log


NOTICES = logging.getLogger("megatron_ppo.notices")


def _demote(record: logging.LogRecord) -> bool:
    """A logging filter: an import notice goes to the debug log instead."""
    if record.getMessage().startswith(LIBRARY_NOTICES):
        NOTICES.debug("%s", record.getMessage())
        return False
    return True


def quiet_library_notices() -> None:
    """Keep the libraries' notices (`LIBRARY_NOTICES`) off a user's screen: logged at debug level
    (`megatron_ppo.notices`) instead of printed, the warnings and the log records (`NOTICE_LOGGERS`) alike; anything
    else is shown as before."""
    if level := os.environ.get(LOG_LEVEL):
        logging.basicConfig(level=level.upper())
    show = warnings.showwarning

    def show_or_demote(message, category, filename, lineno, file=None, line=None) -> None:
        if str(message).startswith(LIBRARY_NOTICES):
            NOTICES.debug("%s (%s:%d)", message, filename, lineno)
        else:
            show(message, category, filename, lineno, file, line)

    if getattr(show, "__name__", "") != show_or_demote.__name__:  # once per process (tests call main many times)
        warnings.showwarning = show_or_demote
    for name in NOTICE_LOGGERS:
        if _demote not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_demote)


def main(argv: Sequence[str] | None = None) -> int:
    quiet_library_notices()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also follow options (`plan RECIPE --json k=v`): argparse leaves those over
    if extra and (not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return run_reporting_errors(args)


BUG = "this is a bug in megatron-ppo, not in your config or data: please report it with the traceback above"


# plain torchrun: how long a rank other than 0 leaves rank 0 to say the error they both met (`_say_error`)
RANK_0_SAYS_WITHIN_S = 10.0


def _say_error(text: str) -> int:
    """A user error's `error:` block, said once, and exit 2. Plain torchrun SIGTERMs every other rank as soon as one
    exits: a rank other than 0 that met the error first would leave rank 0 — the one that says it — stopped in its
    set-up with the error unsaid. So such a rank waits for that SIGTERM (sent once rank 0 has said the same error and
    exited) up to `RANK_0_SAYS_WITHIN_S`, and says the error itself if none comes (rank 0 did not meet it). A rank
    that says it ignores SIGTERM from then on: it finishes its exit."""
    from megatron_ppo.parallel import dist_env_from_environment

    if not started_by_plain_torchrun() or dist_env_from_environment().rank == 0:
        if "TORCHELASTIC_RUN_ID" in os.environ:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return tell_user(2, text)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    if signal.sigtimedwait({signal.SIGTERM}, RANK_0_SAYS_WITHIN_S) is None:
        tell_user(2, text, every_rank=True)
    return 2


# what gloo and the TCP store say when the process on the other end of a connection has gone (killed, or ended by
# its own error): this process's collective failed because of that one
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _peer_lost(error: BaseException) -> str | None:
    """The library's line, when `error` is a collective's or the store's lost connection to a peer (`PEER_LOST`, or
    torch's `DistNetworkError`), else None."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if type(error).__name__ == "DistNetworkError" or any(words in text for words in PEER_LOST):
        return f"{type(error).__name__}: {text}"
    return None


def run_reporting_errors(args: argparse.Namespace) -> int:
    """Run the subcommand under the one error contract: a `UserError` (config, data, checkpoint, conversion,
    directory, launch) is one `error:` block on stderr, said once (`tell_user`: by the launcher under
    `train --nproc`, by rank 0 under plain torchrun: `_say_error`), and every process exits 2; a collective that lost
    its peer (`_peer_lost`) is one line saying another process ended, exit 1; anything else is a bug: its traceback,
    a line saying so, exit 1."""
    try:
        return args.run(args)
    except UserError as error:
        return _say_error(f"error: {error}")
    except KeyboardInterrupt:  # Ctrl-C in any other command: one line, no traceback
        return tell_user(_end_as_interrupted(), "interrupted")
    except Exception as error:
        if lost := _peer_lost(error):
            return tell_user(1, f"a process of this job died or stopped ({lost}): its own output, above or in its log, "
                                "says why; this one ends with it", every_rank=True)  # fmt: skip
        return tell_user(1, f"{traceback.format_exc()}{BUG}", every_rank=True)
