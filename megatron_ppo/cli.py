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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
