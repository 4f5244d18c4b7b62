"""Command line: `python -m megatron_ppo <command> ...`. A thin face: parse, load the config, call one function."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from omegaconf import OmegaConf

from megatron_ppo.config import ConfigError, load_config


def _validate(args: argparse.Namespace) -> int:
    config = load_config(args.recipe, args.overrides)
    print(OmegaConf.to_yaml(OmegaConf.structured(config)), end="")
    return 0


def _train(args: argparse.Namespace) -> int:
    from megatron_ppo.train.run import train

    train(load_config(args.recipe, args.overrides))
    return 0


def _compare_kl(args: argparse.Namespace) -> int:
    from megatron_ppo.train.run import compare_kl

    compare_kl(load_config(args.recipe, args.overrides))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from megatron_ppo.plan import format_plan, plan, suggest

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron_ppo", description="Offline RLHF with PPO on Megatron-Core.")
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="compose, validate and print a recipe's resolved config")
    validate.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny-cpu.yaml")
    validate.add_argument("overrides", nargs="*", help="key=value overrides (verl-style paths accepted)")
    validate.set_defaults(run=_validate)
    train = commands.add_parser("train", help="run a recipe (under torchrun for several processes)")
    train.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny-cpu.yaml")
    train.add_argument("overrides", nargs="*", help="key=value overrides (verl-style paths accepted)")
    train.set_defaults(run=_train)
    compare = commands.add_parser("compare-kl", help="the tiny recipe with KL off, fixed, adaptive and staged")
    compare.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny-cpu.yaml")
    compare.add_argument("overrides", nargs="*", help="key=value overrides")
    compare.set_defaults(run=_compare_kl)
    planner = commands.add_parser("plan", help="layout check, per-GPU memory and step-time estimate for a recipe")
    planner.add_argument("recipe", help="recipe YAML, e.g. recipes/qwen2.5-32b.yaml")
    planner.add_argument("overrides", nargs="*", help="key=value overrides")
    planner.add_argument("--nodes", type=int, help="plan for this many nodes instead of cluster.nodes")
    planner.add_argument("--json", action="store_true", help="machine-readable output")
    planner.set_defaults(run=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
