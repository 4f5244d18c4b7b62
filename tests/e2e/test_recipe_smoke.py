"""Every shipped GPU recipe runs on CPU through the CLI at smoke-test size (`recipe_shrink.shrink`: its layout and
feature flags kept, only sizes shrunk, GPU-only settings swapped for their CPU stand-ins): 2 iterations from random
weights on generated token-id rows with a checkpoint after each and an evaluation on validation rows at step 2
(greedy answers through the KV-cached decoder, scored; log-probs), then a resume from the first checkpoint that must
repeat the uninterrupted run's second iteration. Recipes whose shrunk layouts are the same share one run (the first
recipe's, by name); all the runs of a world size and their resumes go in one torchrun launch
(`recipe_smoke_driver`)."""

from __future__ import annotations

import functools
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ppo.checkpoint.directory import is_complete
from megatron_ppo.config.compose import load_config
from megatron_ppo.data.tokenizer import load_tokenizer
from tests.support.data_fixtures import tokenizer_dir
from tests.support.recipe_shrink import BATCH, PROMPT, RESPONSE, Shrunk, shrink
from tests.support.tensorboard import scalars

REPO = Path(__file__).resolve().parents[2]
GPU_RECIPES = sorted(p for p in (REPO / "recipes").glob("*.yaml") if not p.stem.startswith("tiny"))


@functools.cache
def shrunk_recipes() -> dict[str, Shrunk]:
    """Every GPU recipe shrunk, by name: built by the worker that runs these tests, not at every worker's collection
    (composing the recipes takes ~2 CPU-seconds)."""
    return {recipe.stem: shrink(recipe, load_config(recipe, [])) for recipe in GPU_RECIPES}


def shared_run(name: str) -> Shrunk:
    """The run recipe `name`'s layout is smoke-tested in: the first recipe (by name) with that shrunk layout."""
    layout = shrunk_recipes()[name].layout
    return next(s for s in shrunk_recipes().values() if s.layout == layout)


TIMING = ("timing/", "perf/")  # wall-clock metrics differ between any two runs
# The resumed step 2 against the uninterrupted one, every metric within 1e-6 (same layout, same processes, fp32).
# Under the distributed optimizer the update's metrics once differed by 1e-5–1e-4: the resumed Adam step counts
# were not the checkpoint's (`checkpoint._restore_adam_steps`).
TIGHT = (1e-6, 1e-9)


def write_rows(path: Path, vocab: int, rows: int = 2 * BATCH, seed: int = 0) -> Path:
    """Token-id rows as a sampler writes them (prompt and response ids, behaviour log-probs, a reward), of every
    length up to the limits, so that widths are odd and token budgets cut micro-batches unevenly."""
    rng = random.Random(seed)
    lines = []
    for _ in range(rows):
        response = [rng.randrange(vocab) for _ in range(rng.randint(1, RESPONSE))]
        lines.append(json.dumps({
            "prompt_ids": [rng.randrange(vocab) for _ in range(rng.randint(2, PROMPT))], "response_ids": response,
            "behavior_log_probs": [-rng.uniform(0.5, 8.0) for _ in response], "reward": float(rng.randint(0, 1)),
        }))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def write_validation(root: Path, vocab: int, rows: int = 5, seed: int = 1) -> tuple[Path, Path]:
    """Validation rows with verl's `reward_model.ground_truth` (prompts of 2–PROMPT tokens, so the cached decoder's
    prefill and step schedule differ by row) and a custom score function: an evaluation answers them greedily."""
    rng = random.Random(seed)
    lines = [json.dumps({
        "prompt_ids": [rng.randrange(vocab) for _ in range(rng.randint(2, PROMPT))],
        "response_ids": [rng.randrange(vocab) for _ in range(rng.randint(1, RESPONSE))],
        "reward_model": {"ground_truth": "7"},
    }) for _ in range(rows)]  # fmt: skip
    (root / "val.jsonl").write_text("\n".join(lines) + "\n")
    (root / "score.py").write_text("def score(data_source, solution_str, ground_truth, extra_info):\n"
                                   "    return float(ground_truth in solution_str)\n")  # fmt: skip
    return root / "val.jsonl", root / "score.py"


def phases(shrunk: Shrunk, root: Path, tokenizer: Path, vocab: int, rows: Path, validation: tuple[Path, Path]
           ) -> list[dict]:  # fmt: skip
    """The driver's commands for one shrunk recipe: 2 iterations with a checkpoint after each and an evaluation at
    step 2 (greedy answers through the KV cache, on the recipe's layout), then a resume from the first checkpoint
    (logging into its own folder)."""
    run = root / shrunk.name
    val_rows, score = validation
    common = [*shrunk.overrides, f"model.tokenizer={tokenizer}",
              f"data.train_files=[{rows}]", f"model.vocab_size={vocab}", f"trainer.default_local_dir={run / 'ckpt'}",
              "trainer.save_freq=1", "trainer.logger=[console,tensorboard]", f"data.val_files=[{val_rows}]",
              "trainer.test_freq=2", "trainer.val_before_train=false", "reward.score_fn=custom",
              f"reward.custom_fn.path={score}", "reward.custom_fn.name=score"]  # fmt: skip
    train = ["train", str(shrunk.recipe), *common, f"trainer.log_dir={run / 'tb'}"]
    resume = ["train", str(shrunk.recipe), *common, f"trainer.log_dir={run / 'tb-resume'}",
              "trainer.resume_mode=resume_path", f"trainer.resume_from_path={run / 'ckpt' / 'step_1'}"]  # fmt: skip
    return [{"name": shrunk.name, "argv": train}, {"name": f"{shrunk.name} resume", "argv": resume}]


def launch(world: int, root: Path) -> dict[str, dict]:
    """Every shared run at `world` processes and its resume in one torchrun launch; the driver's results."""
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer_dir(root / "tokenizer", "chatml")
    vocab = load_tokenizer(tokenizer).vocab_size
    rows = write_rows(root / "rows.jsonl", vocab)
    validation = write_validation(root, vocab)
    shared = {shared_run(name).name for name in shrunk_recipes()}
    runs = [shrunk_recipes()[name] for name in sorted(shared) if shrunk_recipes()[name].world == world]
    plan = [command for shrunk in runs for command in phases(shrunk, root, tokenizer, vocab, rows, validation)]
    (root / "plan.json").write_text(json.dumps(plan, indent=1))
    torchrun = Path(sys.executable).with_name("torchrun")
    log = root / "launch.log"
    with log.open("w") as out:
        result = subprocess.run(
            [str(torchrun), f"--nproc_per_node={world}", "--standalone", "-m", "tests.e2e.recipe_smoke_driver",
             str(root / "plan.json"), str(root / "results.json")],
            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, stdout=out,
            stderr=subprocess.STDOUT, timeout=900, check=False,
        )  # fmt: skip
    results = json.loads((root / "results.json").read_text()) if (root / "results.json").exists() else {}
    assert result.returncode == 0, (
        f"the launch at world {world} exited {result.returncode}; {results}; log tail:\n{log.read_text()[-6000:]}"
    )
    return results


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[int, tuple[Path, dict[str, dict]]]:
    """The launch of each world size, run when a test first needs it: (its directory, the driver's results)."""
    done: dict[int, tuple[Path, dict[str, dict]]] = {}
    root = tmp_path_factory.mktemp("recipe-smoke")

    def at(world: int) -> tuple[Path, dict[str, dict]]:
        if world not in done:
            done[world] = (root / f"world{world}", launch(world, root / f"world{world}"))
        return done[world]

    return at  # type: ignore[return-value]


@pytest.mark.parametrize("recipe", sorted(recipe.stem for recipe in GPU_RECIPES), ids=str)
def test_recipe_trains_saves_and_resumes_through_the_cli(recipe: str, launches) -> None:
    shrunk = shared_run(recipe)
    swapped = list(shrunk.swapped)
    where = f"{recipe} (run {shrunk.name}, world {shrunk.world}, swapped: {swapped or 'none'})"
    root, results = launches(shrunk.world)
    run = root / shrunk.name
    assert results[shrunk.name]["exit"] == 0 and results[f"{shrunk.name} resume"]["exit"] == 0, where
    first, resumed = scalars(run / "tb"), scalars(run / "tb-resume")
    assert set(first["actor/pg_loss"]) == {1, 2}, f"{where}: the run logged steps {set(first['actor/pg_loss'])}"
    for tag, by_step in first.items():
        assert all(math.isfinite(value) for value in by_step.values()), f"{where}: {tag} = {by_step}"
    # the evaluation at step 2: greedy answers to the 5 validation prompts, through the cached decoder
    assert set(first["eval/reward_mean"]) == {2} and set(first["eval/log_prob_mean"]) == {2}, where
    assert first["perf/eval_generation_prompts"][2] == 5 and first["perf/eval_generation_tokens"][2] > 0, where
    ckpt = run / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step_2", where
    assert all(is_complete(ckpt / f"step_{step}") for step in (1, 2)), f"{where}: {sorted(ckpt.iterdir())}"
    # the resume continues the run at step 2 (no step 1 again, no new run) and repeats its step 2
    assert set(resumed["actor/pg_loss"]) == {2}, f"{where}: the resume logged steps {set(resumed['actor/pg_loss'])}"
    assert [p.name for p in (run / "tb-resume").iterdir()] == [p.name for p in (run / "tb").iterdir()], where
    compared = {tag for tag in resumed if not tag.startswith(TIMING)}
    assert {"actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm", "actor/lr"} <= compared
    for tag in sorted(compared):
        assert resumed[tag][2] == pytest.approx(first[tag][2], rel=TIGHT[0], abs=TIGHT[1]), (
            f"{where}: {tag} at step 2 is {resumed[tag][2]} after the resume, {first[tag][2]} uninterrupted"
        )
