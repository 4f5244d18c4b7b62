"""Command line: `python -m megatron_ppo <command> ...`. A thin face: parse, load the config, call one function."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from megatron_ppo.config import ConfigError, load_config

if TYPE_CHECKING:
    from megatron_ppo.train.guards import GuardStopped


def _validate(args: argparse.Namespace) -> int:
    config = load_config(args.recipe, args.overrides)
    print(OmegaConf.to_yaml(OmegaConf.structured(config)), end="")
    return 0


def _train(args: argparse.Namespace) -> int:
    from megatron_ppo.tasks import addition
    from megatron_ppo.train.guards import GuardStopped
    from megatron_ppo.train.preemption import JobStopped, Preempted, watching
    from megatron_ppo.train.run import train

    try:
        with watching():
            config = load_config(args.recipe, args.overrides)
            (addition.run if config.data.task == "addition" else train)(config)
    except JobStopped as stop:
        then = "the job is requeued" if isinstance(stop, Preempted) else "the next job resumes from it"
        print(f"stopped early: saved {stop}; exiting with {stop.exit_status}, {then}", file=sys.stderr)
        return stop.exit_status
    except GuardStopped as stop:
        report_guard_stop(stop)
        return stop.exit_status
    return 0


def report_guard_stop(stop: GuardStopped) -> None:
    """A guard's stop as one line on stderr, from the first process only (every rank stops at the same guard)."""
    from megatron_ppo.parallel import dist_env_from_environment

    if dist_env_from_environment().rank == 0:
        print(f"stopped: {stop}; exiting with {stop.exit_status} (not requeued)", file=sys.stderr)


def _compare_kl(args: argparse.Namespace) -> int:
    from megatron_ppo.runs.figure import PlotError
    from megatron_ppo.tasks import addition

    try:
        addition.compare_kl(load_config(args.recipe, args.overrides), plot=args.plot)
    except PlotError as problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return 0


def _plan(args: argparse.Namespace) -> int:
    from megatron_ppo.planner.plan import format_plan, plan, suggest

    overrides = [*args.overrides, *([f"cluster.nodes={args.nodes}"] if args.nodes else [])]
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
    from megatron_ppo.convert import huggingface
    from megatron_ppo.parallel import destroy_distributed, dist_env_from_environment, init_distributed

    if args.direction == "mcore-to-hf":  # one process, no process group: it reads the checkpoint's files
        if dist_env_from_environment().world_size > 1:
            raise ConfigError(["mcore-to-hf runs in one process: python -m megatron_ppo convert mcore-to-hf ..."])
        shard = {"max_shard_bytes": int(args.max_shard_gb * 10**9)} if args.max_shard_gb else {}
        try:
            written = huggingface.mcore_to_hf(args.megatron, args.hf_config, args.out, **shard)
        except FileExistsError as exists:
            print(f"error: {exists}", file=sys.stderr)
            return 2
        print(f"wrote {written.describe()}")
        return 0
    model = huggingface.hf_model_config(args.hf)
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
            written = huggingface.hf_to_mcore(args.hf, args.out, args.dtype, layout)
            if dist_env_from_environment().rank == 0:
                print(f"wrote {written} (converted at TP {args.tp} PP {args.pp} EP {args.ep}; loads at any TP/PP/EP)")
        else:
            difference = huggingface.verify(args.hf, args.megatron, layout)
            if difference is not None:
                print(f"largest logit difference: {difference:.3e} (tolerance {args.tolerance:g})")
                return 0 if difference <= args.tolerance else 1
        return 0
    finally:
        destroy_distributed()


def _report(args: argparse.Namespace) -> int:
    from megatron_ppo.runs.report import print_report

    # further runs and key=value overrides share the positional tail: an existing path is a run (or a recipe)
    targets = [args.run_or_recipe, *(t for t in args.overrides if "=" not in t or Path(t).exists())]
    overrides = [t for t in args.overrides if t not in targets]
    try:
        log_dirs = [t if Path(t).is_dir() else load_config(t, overrides).trainer.log_dir for t in targets]
        if args.plot is None:
            for log_dir in log_dirs:
                print_report(log_dir)
            return 0
        from megatron_ppo.runs.figure import PlotError, plot_runs

        try:
            print(f"figure: {plot_runs(log_dirs, args.plot or None)}")
        except PlotError as problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    except FileNotFoundError as missing:
        print(f"error: {missing} (has the run started? see trainer.log_dir)", file=sys.stderr)
        return 1
    return 0


def _recipe_command(commands, name: str, help_text: str, run) -> argparse.ArgumentParser:
    """A subcommand taking a recipe and key=value overrides."""
    command = commands.add_parser(name, help=help_text)
    command.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny-cpu.yaml")
    command.add_argument("overrides", nargs="*", help="key=value overrides (verl-style paths accepted)")
    command.set_defaults(run=run)
    return command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron_ppo", description="Offline RLHF with PPO on Megatron-Core.")
    commands = parser.add_subparsers(dest="command", required=True)
    _recipe_command(commands, "validate", "compose, validate and print a recipe's resolved config", _validate)
    _recipe_command(commands, "train", "run a recipe (under torchrun for several processes)", _train)
    comparer = _recipe_command(commands, "compare-kl", "the tiny recipe with KL off, fixed, adaptive and staged",
                               _compare_kl)  # fmt: skip
    comparer.add_argument("--plot", nargs="?", const="", metavar="FILE", help="also draw the four runs on one figure "
                          "(default: compare-kl.png in the comparison's directory)")  # fmt: skip
    planner = _recipe_command(commands, "plan", "layout check, per-GPU memory and step-time estimate", _plan)
    planner.add_argument("--nodes", type=int, help="plan for this many nodes instead of cluster.nodes")
    planner.add_argument("--json", action="store_true", help="machine-readable output")
    reporter = commands.add_parser("report", help="a run's TensorBoard metrics and events as tables, or a figure")
    reporter.add_argument("run_or_recipe", help="a TensorBoard log directory, or a recipe (its trainer.log_dir)")
    reporter.add_argument("overrides", nargs="*", help="more runs or recipes, then key=value overrides of the recipes")
    reporter.add_argument("--plot", nargs="?", const="", metavar="FILE", help="draw the runs on one figure (.png, "
                          ".pdf, .svg; default: <trainer.log_dir>/<run id>.png, beside the first run)")  # fmt: skip
    reporter.set_defaults(run=_report)
    converter = commands.add_parser("convert", help="Hugging Face <-> megatron-ppo checkpoints, and a logit check")
    converter.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf", "verify"])
    converter.add_argument("--hf", help="Hugging Face directory (config.json + safetensors)")
    converter.add_argument("--megatron", help="megatron-ppo checkpoint directory (mcore-to-hf, verify)")
    converter.add_argument("--hf-config", help="Hugging Face directory whose config.json describes the model")
    converter.add_argument("--out", help="output directory")
    converter.add_argument("--tp", type=int, default=1, help="hf-to-mcore, verify: run at this TP (under torchrun)")
    converter.add_argument("--pp", type=int, default=1, help="hf-to-mcore, verify: run at this PP (under torchrun)")
    converter.add_argument("--ep", type=int, default=1, help="hf-to-mcore, verify: expert parallel size (MoE)")
    converter.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    converter.add_argument("--max-shard-gb", type=float, help="mcore-to-hf: largest safetensors file in GB (10^9 "
                           "bytes; default huggingface_hub's 5); a larger tensor gets a file of its own")  # fmt: skip
    converter.add_argument("--tolerance", type=float, default=1e-3, help="verify: largest allowed logit difference")
    converter.set_defaults(run=_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also follow options (`plan RECIPE --json k=v`): argparse leaves those over
    if extra and (not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
