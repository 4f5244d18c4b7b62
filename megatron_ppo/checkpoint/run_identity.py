"""Which run wrote a checkpoint, and with which config.

A run is one training from its first step to its last, across every job that resumes it. It is named once, when it
starts fresh (`20261201-004445-3fa9c1`: UTC start time and six random hex digits), and every checkpoint it saves
holds `run.json`: the run id, the resolved config flattened to dotted keys, and a hash of that config without the
keys meant to change between the jobs of one run (`meant_to_change`). Two checkpoints with the same run id belong
to the same training; equal hashes mean the same experiment. The run's TensorBoard folder holds a copy written at
each job's start, with the run's planned number of steps added (`total_steps`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from megatron_ppo.checkpoint.verify import CheckpointError
from megatron_ppo.config.fields import PER_JOB, tagged_keys
from megatron_ppo.config.frozen import nested
from megatron_ppo.config.schema import PPOConfig

RUN_FILE = "run.json"
# What a run id read from a checkpoint may be (it names the run's TensorBoard folder): one path component, never
# `.`/`..` or hidden; `new_run_id` makes `YYYYmmdd-HHMMSS-xxxxxx`
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

# dotted key → why the jobs of one run may change it: the fields the schema marks `per_job` (run control, the run's
# length, micro-batching)
PER_JOB_KEYS: dict[str, str] = tagged_keys(PPOConfig(), PER_JOB)


def meant_to_change(key: str) -> bool:
    """Whether a resumed run may change `key` (dotted) without being a different experiment: the schema's `per_job`
    keys (`PER_JOB_KEYS`), and the parallel layout (`*.megatron.*`, `cluster.*`)."""
    return key in PER_JOB_KEYS or key.startswith("cluster.") or ".megatron." in key


def new_run_id(now: float | None = None) -> str:
    """`YYYYmmdd-HHMMSS-xxxxxx`: the UTC start time (so ids sort by start) and 24 random bits (two runs started in
    the same second differ)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{secrets.token_hex(3)}"


def flatten_config(config: PPOConfig) -> dict[str, Any]:
    """The config as {dotted key: JSON value}; lists (KL stages, loggers) stay whole values."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else key, inner)
        else:
            flat[prefix] = value

    walk("", dataclasses.asdict(config))
    return json.loads(json.dumps(flat))  # the form it has after a round trip through run.json


def config_hash(flat: dict[str, Any]) -> str:
    """sha256 (first 12 hex digits) of the keys that define the experiment: everything not `meant_to_change`."""
    defining = {key: value for key, value in flat.items() if not meant_to_change(key)}
    return hashlib.sha256(json.dumps(defining, sort_keys=True).encode()).hexdigest()[:12]


def unflatten_config(flat: dict[str, Any]) -> PPOConfig:
    """The typed config back from `flatten_config`'s form (as read from a `run.json`); it was resolved and
    validated when saved, so it is only type-checked against the schema here."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PPOConfig), nested(flat)))


@dataclass(frozen=True)
class RunIdentity:
    run_id: str
    config_hash: str
    config: dict[str, Any]  # flatten_config of the resolved config
    # the run's planned number of steps; in the copy beside its TensorBoard events only (what `report --plot` reads
    # the KL stages' steps from), since a checkpoint's identity must not change with the run's length
    total_steps: int | None = None

    @classmethod
    def of(cls, run_id: str, config: PPOConfig, total_steps: int | None = None) -> RunIdentity:
        flat = flatten_config(config)
        return cls(run_id, config_hash(flat), flat, total_steps)

    def write(self, directory: str | Path) -> Path:
        """Write the identity into a checkpoint directory; returns the file written."""
        payload = {"run_id": self.run_id, "config_hash": self.config_hash, "config": self.config}
        if self.total_steps is not None:
            payload["total_steps"] = self.total_steps
        path = Path(directory) / RUN_FILE
        path.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
        return path

    @classmethod
    def read(cls, directory: str | Path) -> RunIdentity | None:
        """The identity saved in a checkpoint directory; None when it has none (an initialisation such as the SFT
        start or a converted Hugging Face model, or a checkpoint from before run ids)."""
        path = Path(directory) / RUN_FILE
        if not path.is_file():
            return None
        try:
            payload = json.loads(path.read_text())
            identity = cls(payload["run_id"], payload["config_hash"], payload["config"], payload.get("total_steps"))
        except (ValueError, KeyError, TypeError) as error:
            raise UnreadableIdentity(f"{path} is unreadable ({type(error).__name__}: {error}); the checkpoint is "
                                     "damaged: use another one") from error  # fmt: skip
        if not isinstance(identity.run_id, str) or not RUN_ID.fullmatch(identity.run_id):
            raise CheckpointError(
                f"{path} names the run {identity.run_id!r}, which is no run id (letters, digits, '-', '_', '.', not "
                "starting with '.'): it would be used as a folder name (the run's TensorBoard folder), so it is "
                "refused; the checkpoint's run.json was edited or damaged: use another checkpoint"
            )
        return identity


class UnreadableIdentity(CheckpointError):
    """A checkpoint's run.json that is not the JSON a save writes (damaged bytes): the checkpoint is damaged, and
    skipped where checkpoints are looked for (an identity that reads but names no run id is refused instead)."""


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Keys whose values differ between a checkpoint's config and the current one, as `key: old → new`, split into
    (meant to change, the others). A key present on one side only shows as `(absent)` on the other."""
    absent = "(absent)"
    expected, other = [], []
    for key in sorted(saved.keys() | current.keys()):
        old, new = saved.get(key, absent), current.get(key, absent)
        if old != new:
            (expected if meant_to_change(key) else other).append(f"{key}: {old!r} → {new!r}")
    return expected, other
