"""LoRA on Megatron's parallel linear layers against `transformers` + `peft`: a LoRA actor (random adapters on a
converted Llama with grouped-query attention) saved at TP 1 and loaded at TP 1, TP 2 with sequence parallelism and PP 2
gives the log-probs `peft` gives on the Hugging Face base with the exported adapter; the reference (the same chunks,
adapters off) gives the base model's, and the adapters are back afterwards; with `actor.lora.merge` the export is
merged weights `transformers` alone reproduces. One PPO step through the trainer (TP 2, sequence parallel,
distributed optimizer; actor and critic with adapters) changes the actor's adapters and the critic's value head and
leaves every other weight bit for bit as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from megatron_ppo.checkpoint.weights import CheckpointWeights
from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.convert.huggingface import hf_logits, mcore_to_hf
from megatron_ppo.convert.peft_adapter import ADAPTER_CONFIG
from megatron_ppo.models.lora import is_adapter
from megatron_ppo.runs.report import find_runs
from tests.distributed import conversion_workers, lora_workers
from tests.distributed.harness import run_distributed
from tests.support.hf_models import offline_recipe, save_hf_model

LORA = {"rank": 4, "alpha": 8.0}
LAYOUTS = {
    "tp1": (1, MegatronConfig()),
    "tp2-sp": (2, MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, MegatronConfig(pipeline_model_parallel_size=2)),
}
INPUT_IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))


def _peft_logits(hf_dir: Path, adapter_dir: Path) -> torch.Tensor:
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter_dir)
    with torch.no_grad():
        return model(INPUT_IDS).logits.float()


def _token_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """log π(x_{t+1} | x_≤t) of the batch's own next tokens `[b, s − 1]`, as the trainer's log-probs are."""
    return logits.detach()[:, :-1].log_softmax(-1).gather(-1, INPUT_IDS[:, 1:, None]).squeeze(-1)


def _log_prob_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((_token_log_probs(ours) - _token_log_probs(theirs)).abs().max())


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> dict:
    """A Llama converted, random adapters on it saved at TP 1 (once exported as a peft adapter, once with `merge`),
    and the checkpoint's logits under each layout."""
    root = tmp_path_factory.mktemp("lora")
    hf_dir = save_hf_model("llama", root / "hf", tied=False)
    base = run_distributed(conversion_workers.saved_under, 1, str(hf_dir), str(root / "base"), MegatronConfig())[0]
    adapters = run_distributed(lora_workers.save_random_adapters, 1, str(hf_dir), base, str(root / "lora"), LORA)[0]
    merged = run_distributed(lora_workers.save_random_adapters, 1, str(hf_dir), base, str(root / "lora-merge"),
                             {**LORA, "merge": True})[0]  # fmt: skip
    logits = {}
    for name, (world, layout) in LAYOUTS.items():
        ranks = run_distributed(lora_workers.logits_under, world, str(hf_dir), adapters, LORA, layout, INPUT_IDS)
        logits[name] = next(report for report in ranks if report is not None)
    return {"root": root, "hf": hf_dir, "adapters": adapters, "merged": merged, "logits": logits,
            "export": mcore_to_hf(adapters, hf_dir, root / "peft").path}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_actor_log_probs_equal_peft_on_transformers(lora_run, layout: str) -> None:
    theirs = _peft_logits(lora_run["hf"], lora_run["export"])
    base = hf_logits(lora_run["hf"], INPUT_IDS)
    assert _log_prob_difference(theirs, base) > 1e-2, "the random adapters must change the model"
    ours = lora_run["logits"][layout]
    assert _log_prob_difference(ours["actor"], theirs) < 1e-5, (
        f"{layout}: LoRA log-probs differ from peft's by {_log_prob_difference(ours['actor'], theirs):.2e}"
    )
    assert torch.equal(ours["actor_again"], ours["actor"]), f"{layout}: the adapters did not come back after the ref"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_reference_is_the_base_model(lora_run, layout: str) -> None:
    difference = _log_prob_difference(lora_run["logits"][layout]["ref"], hf_logits(lora_run["hf"], INPUT_IDS))
    assert difference < 1e-5, f"{layout}: the reference (adapters off) differs from the base by {difference:.2e}"


def test_the_export_is_a_peft_adapter_on_the_hf_modules(lora_run) -> None:
    config = json.loads((lora_run["export"] / ADAPTER_CONFIG).read_text())
    assert config["r"] == LORA["rank"] and config["lora_alpha"] == LORA["alpha"]
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"])  # fmt: skip


def test_a_merged_export_gives_the_adapted_model_in_transformers(lora_run) -> None:
    merged = mcore_to_hf(lora_run["merged"], lora_run["hf"], lora_run["root"] / "merged-hf").path
    # the same adapters as the peft export (drawn from the same seeds); W + s·BA rounded once to fp32 computes in
    # another order than W x + s·B(A x): 1.5e-5 measured, against the adapters' own effect of > 1e-2
    difference = _log_prob_difference(hf_logits(merged, INPUT_IDS), _peft_logits(lora_run["hf"], lora_run["export"]))
    assert difference < 1e-4, f"merged weights differ from base + adapter by {difference:.2e}"


def test_merge_lora_writes_any_lora_checkpoint_as_merged_weights(lora_run) -> None:
    """`mcore-to-hf --merge-lora` on the checkpoint that trained without `actor.lora.merge` writes what the run with
    it writes: the same adapters (drawn from the same seeds), the same merged tensors bit for bit."""
    from safetensors.torch import load_file

    asked = mcore_to_hf(lora_run["adapters"], lora_run["hf"], lora_run["root"] / "merge-lora", merge_lora=True)
    from_the_run = lora_run["root"] / "merged-by-the-run"
    mcore_to_hf(lora_run["merged"], lora_run["hf"], from_the_run)
    ours, theirs = load_file(asked.path / "model.safetensors"), load_file(from_the_run / "model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_verify_compares_a_lora_checkpoint_with_its_adapters_on(lora_run) -> None:
    """`convert verify` of the LoRA checkpoint: against its peft adapter export (on the base it names) and against
    its merged export it passes, saying the adapters were on; against the base model it fails (before, it passed
    against the base, 3e-7, and failed against its own merged export: it ignored the adapters)."""
    merged = mcore_to_hf(lora_run["adapters"], lora_run["hf"], lora_run["root"] / "verify-merged", merge_lora=True)
    folders = [str(lora_run["export"]), str(merged.path), str(lora_run["hf"])]
    (peft_ok, peft_line), (merged_ok, merged_line), (base_ok, base_line) = next(
        found for found in run_distributed(lora_workers.verdicts, 1, lora_run["adapters"], folders) if found
    )
    assert peft_ok and "LoRA adapters on (rank 4, alpha 8)" in peft_line and "against the peft adapter" in peft_line
    assert merged_ok and "LoRA adapters on" in merged_line, merged_line
    assert not base_ok and "FAILED" in base_line, base_line


def test_one_ppo_step_changes_only_adapters_and_value_head(tmp_path: Path) -> None:
    hf_dir = save_hf_model("llama", tmp_path / "hf", tied=False)
    base = Path(run_distributed(conversion_workers.saved_under, 1, str(hf_dir), str(tmp_path / "base"),
                                MegatronConfig())[0])  # fmt: skip
    recipe = str(offline_recipe(tmp_path, hf_dir, tp=2))
    layout = [f"{role}.megatron.{key}=true" for role in ("actor", "ref")
              for key in ("sequence_parallel", "use_distributed_optimizer")]  # fmt: skip
    lora = [f"{role}.lora.{key}={value}" for role in ("actor", "critic") for key, value in LORA.items()]
    assert run_distributed(conversion_workers.train_recipe, 2, recipe, [*layout, *lora]) == [1, 1]
    events = EventAccumulator(str(find_runs(tmp_path / "tb")[-1]))
    events.Reload()
    said = [
        tensor_util.make_ndarray(e.tensor_proto).reshape(-1)[0].decode() for e in events.Tensors("lora/text_summary")
    ]
    for role in ("actor", "critic"):  # the run's log says the adapters are on, and what it trains
        assert any(line.startswith(f"LoRA on the {role}: rank 4, alpha 8 (scale 2)") and "parameters trained" in line
                   for line in said), said  # fmt: skip
    initial = CheckpointWeights(base, "actor")
    before = {name: tensor for group in initial.groups for name, tensor in initial.read(group).items()}
    for role in ("actor", "critic"):
        trained = CheckpointWeights(tmp_path / "ckpt" / "step_1", role)
        after = {name: tensor for group in trained.groups for name, tensor in trained.read(group).items()}
        adapters = {name for name in after if is_adapter(name)}
        assert len(adapters) == 2 * 4 * 4, f"{role}: {len(adapters)} adapter tensors, expected 2 × 4 targets × 4 layers"
        head = {name for name in after if name.startswith("output_layer.")} if role == "critic" else set()
        frozen = set(after) - adapters - head
        changed = sorted(name for name in frozen if not torch.equal(after[name], before[name]))
        assert not changed, f"{role}: frozen weights changed in the step: {changed}"
        if role == "actor":  # the critic's B get no gradient in its first step: its value head starts at zero
            still_zero = sorted(name for name in adapters if "lora_B" in name and not after[name].abs().sum() > 0)
            assert not still_zero, f"actor: adapters B still zero after the step: {still_zero}"
        if role == "critic":
            assert after["output_layer.weight"].abs().sum() > 0, "the critic's value head (zero at first) must train"
