"""The README's cluster path at tiny size, on the local Slurm, so that it cannot rot: a Qwen2-shaped Hugging Face
model in fp32 and a tokenizer made here, and offline rows; then each command as the README gives it, from the
repository: `convert hf-to-mcore` → `convert verify` → `validate` → `plan --nodes 2` → `slurm/submit.py --dry-run`
→ `slurm/submit.py` (LoRA on the actor, TP 2 across the two nodes, a task each) → `report` and `report --plot` →
`convert mcore-to-hf` (a peft adapter, and with `--merge-lora` merged weights). Last, what a user does with the
export: `peft` loads the adapter on the original model, and its logits equal the merged export's within 1e-5 of
the largest logit (fp32)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megatron_ppo.runs.report import read_run
from slurm.local_cluster import LocalSlurm
from tests.slurm.jobs import REPO, job_log, submitted_until_done
from tests.support.hf_models import offline_recipe, save_hf_model

# the adapters move the policy far enough in 2 steps that the adapter's effect on the logits shows (≫ 1e-5)
LORA = ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=2e-3"]
INPUT_IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(5))


def megatron_ppo(*args: object) -> str:
    """`python -m megatron_ppo ARGS` from the repository; its output (it must exit 0)."""
    command = [sys.executable, "-m", "megatron_ppo", *map(str, args)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, f"{' '.join(command[2:])} exited {result.returncode}:\n{result.stderr[-3000:]}"
    return result.stdout + result.stderr


def logits(hf_dir: Path, adapter: Path | None = None) -> torch.Tensor:
    """`transformers`' fp32 logits for `INPUT_IDS`, with `peft`'s `adapter` on the model when given."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(INPUT_IDS).logits


@pytest.fixture(scope="module")
def path(cluster: LocalSlurm, tmp_path_factory) -> dict:
    """Every step of the path, in order; what each printed or wrote."""
    root = tmp_path_factory.mktemp("cluster-path")
    hf = save_hf_model("qwen2", root / "hf", tied=False)
    recipe = offline_recipe(root, hf, tp=2)  # its tokenizer.json and rows.jsonl beside it
    described = yaml.safe_load(recipe.read_text())
    described["cluster"] = {"nodes": 2, "gpus_per_node": 1}  # the recipe's cluster: two nodes of one device
    recipe.write_text(yaml.safe_dump(described))
    init, logs, ckpt = root / "init", root / "logs", root / "ckpt"
    steps = {"convert": megatron_ppo("convert", "hf-to-mcore", "--hf", hf, "--out", init)}
    steps["verify"] = megatron_ppo("convert", "verify", "--megatron", init, "--hf", hf)
    overrides = ["model.hf_checkpoint=null", f"model.init_checkpoint={init}", f"model.tokenizer={root}/tokenizer.json",
                 f"data.train_files=[{root}/rows.jsonl]", *LORA, "trainer.total_training_steps=2"]  # fmt: skip
    steps["validate"] = megatron_ppo("validate", recipe, *overrides)
    steps["plan"] = megatron_ppo("plan", recipe, "--nodes", 2, *overrides)
    submit = [sys.executable, "slurm/submit.py", str(recipe), "--nodes", "2", "--log-dir", str(logs), *overrides]
    dry_run = subprocess.run([*submit, "--dry-run"], cwd=REPO, env=cluster.env, capture_output=True, text=True)
    assert dry_run.returncode == 0, dry_run.stderr
    steps["dry run"] = dry_run.stdout

    job_id, job = submitted_until_done(cluster, logs, submit, timeout_s=600)
    steps["report"] = megatron_ppo("report", recipe, *overrides)
    steps["plot"] = megatron_ppo("report", recipe, *overrides, "--plot")
    megatron_ppo("convert", "mcore-to-hf", "--megatron", ckpt, "--hf-config", hf, "--out", root / "adapter")
    megatron_ppo("convert", "mcore-to-hf", "--megatron", ckpt, "--hf-config", hf, "--out", root / "merged",
                 "--merge-lora")  # fmt: skip
    return {"root": root, "hf": hf, "job": job, "log": job_log(logs, job_id), "steps": steps}


def test_the_fp32_model_converts_as_fp32_and_verifies(path: dict) -> None:
    steps = path["steps"]
    assert "as fp32 (the Hugging Face model's dtype" in steps["convert"], steps["convert"]
    verdicts = [line for line in steps["verify"].splitlines() if line.startswith("convert verify")]
    assert len(verdicts) == 1 and verdicts[0].startswith("convert verify passed"), steps["verify"]
    assert "(fp32 against fp32)" in verdicts[0]


def test_validate_plan_and_the_dry_run_agree_on_two_nodes_of_one_task(path: dict) -> None:
    steps = path["steps"]
    assert yaml.safe_load(steps["validate"])["actor"]["lora"]["rank"] == 4
    assert "2 node(s) × 1" in steps["plan"] and "layout TP2" in steps["plan"] and "fits" in steps["plan"]
    assert "--nodes=2 --ntasks-per-node=1" in steps["dry run"] and "submitted job" not in steps["dry run"]


def test_the_job_trains_the_converted_model_with_adapters_across_the_two_nodes(path: dict) -> None:
    job, log, root = path["job"], path["log"], path["root"]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and job["NumNodes"] == "2", (job, log[-3000:])
    assert "trainer exited with status 0" in log
    assert (root / "ckpt" / "latest").read_text().strip() == "step_2"
    _, events = read_run(root / "tb")
    said = " | ".join(event.message for event in events)
    assert "LoRA on the actor: rank 4, alpha 8" in said and f"critic from the actor trunk of {root}/init" in said
    assert re.search(r"actor/pg_loss\s*│\s*2 ", path["steps"]["report"]), path["steps"]["report"]
    figure = re.search(r"figure: (\S+)", path["steps"]["plot"])
    assert figure and Path(figure[1]).stat().st_size > 0, path["steps"]["plot"]


def test_peft_on_the_original_model_equals_the_merged_export(path: dict) -> None:
    root, hf = path["root"], path["hf"]
    adapter_config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(hf) and adapter_config["r"] == 4
    adapted, merged, base = logits(hf, root / "adapter"), logits(root / "merged"), logits(hf)
    assert float((adapted - base).abs().max()) > 1e-3, "the trained adapters must change the model"
    # the merged weights are W + s·BA rounded once to fp32, peft computes W·x + s·B(A·x): they differ by fp32's
    # rounding, carried through the layers (measured 1.3e-5 on logits up to 6.6: 2.0e-6 of the largest)
    difference = float((adapted - merged).abs().max()) / float(merged.abs().max())
    assert difference < 1e-5, f"peft (base + adapter) and the merged export differ by {difference:.2e} of the logits"
