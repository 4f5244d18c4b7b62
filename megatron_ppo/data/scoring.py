"""Rule rewards for rows that carry none: verl's `default_compute_score` or a user function, as verl calls them.

A scorer maps (data_source, response text, ground_truth, extra_info) to a finite sequence reward. verl's reward
loop calls its score function with the keywords `data_source`, `solution_str`, `ground_truth`, `extra_info` and
takes `result["score"]` when the result is a dict; a scorer built here does the same, so a verl
`custom_reward_function` file works unchanged. Used when reading rows (`read_rows(..., scorer=...)`) and reusable
wherever a response is to be scored.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.schema import RewardConfig

ScoreFunction = Callable[..., Any]


class ScoreError(ValueError):
    """A score function gave something that is not a finite number (or a dict with a finite "score")."""


@dataclass(frozen=True)
class Scorer:
    """(data_source, response, ground_truth, extra_info) → the finite reward `function` gives; `name` says which."""

    function: ScoreFunction
    name: str
    source: str | None = None  # the file that defines `function` (a custom one), whose content keys prepared data

    def __call__(self, data_source: str, response: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
        """Raises what the function raises (e.g. verl's NotImplementedError for an unknown data_source), or
        `ScoreError` when its result is not a finite number."""
        result = self.function(
            data_source=data_source, solution_str=response, ground_truth=ground_truth, extra_info=extra_info
        )
        value = result.get("score") if isinstance(result, dict) else result
        if isinstance(value, bool | int | float) and math.isfinite(value):
            return float(value)
        raise ScoreError(f"{self.name} returned {result!r}; expected a finite number or a dict with a finite 'score'")


def build_scorer(reward: RewardConfig) -> Scorer | None:
    """The scorer `reward.score_fn` names: None (rows carry their rewards), "verl" (verl's
    `default_compute_score`, chosen by data_source), or "custom" (`reward.custom_fn.name` in the file
    `reward.custom_fn.path`). Raises `ConfigError` saying what to change when it cannot be loaded."""
    if reward.score_fn is None:
        return None
    if reward.score_fn == "verl":
        return Scorer(_verl_default_compute_score(), "verl.utils.reward_score.default_compute_score")
    if reward.score_fn == "custom":
        path, name = reward.custom_fn.path, reward.custom_fn.name
        return Scorer(load_function(path, name), f"{name} from {path}", source=path)
    raise ConfigError([f"reward.score_fn={reward.score_fn!r} is not one of None, 'verl', 'custom'"])


def load_function(path: str | None, name: str) -> ScoreFunction:
    """The callable `name` defined in the Python file `path` (imported under a private module name)."""
    if not path or not Path(path).is_file():
        raise ConfigError([f"reward.custom_fn.path={path!r} is not a file; give the .py file defining {name}"])
    spec = importlib.util.spec_from_file_location(f"megatron_ppo_custom_reward_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ConfigError([f"reward.custom_fn.path={path!r} cannot be imported as a Python module; give a .py file"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    function = getattr(module, name, None)
    if not callable(function):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ConfigError(
            [f"reward.custom_fn.name={name!r} is not a function in {path} (functions there: {defined}); set it to one"]
        )
    return function


def _verl_default_compute_score() -> ScoreFunction:
    try:
        from verl.utils.reward_score import default_compute_score
    except ImportError as e:
        raise ConfigError(
            [f"reward.score_fn='verl' needs verl, which does not import here ({e}); install it with "
             "`pip install -e '.[verl]'` (verl==0.9.1), or use reward.score_fn=custom with reward.custom_fn.path"]
        ) from e  # fmt: skip
    return default_compute_score
