"""What a checkpoint holds of the run besides weights and optimizer states (`trainer_state.pt`): the step and the
skipped-step counter, each part's named state — the data order (`sampler`), the KL coefficients (`kl`), the
learning-rate schedules (`schedulers`), the reward normaliser (`normalizer`, None when off), the guards' counters
(`guards`), the out-of-memory back-off's sizes (`memory`) — the keeper's good and best checkpoints as of the save,
and the evaluation of the step saved. tests/distributed/test_run_state.py pins the key set."""

from __future__ import annotations

from typing import Any, Protocol


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Schedules:
    """The roles' learning-rate schedules as one named state."""

    def __init__(self, schedulers: dict[str, Any]) -> None:
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        return {role: scheduler.state_dict() for role, scheduler in self.schedulers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for role, scheduler in self.schedulers.items():
            scheduler.load_state_dict(state[role])


class RunState:
    """The run's counters, from the start of set-up, and — once they are built (`attach`) — the parts whose state a
    checkpoint holds (name → part, None for a part switched off) and the keeper (its `state_dict` merged in; it
    loads its own state: `resume`, `roll_back_to`)."""

    def __init__(self) -> None:
        self.step = 0
        self.skipped_steps = 0
        self.evaluations: dict[int, dict[str, float]] = {}
        self.parts: dict[str, Stateful | None] = {}
        self.keeper: Any = None

    def attach(self, parts: dict[str, Stateful | None], keeper: Any) -> None:
        self.parts, self.keeper = parts, keeper

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            **{name: part.state_dict() if part is not None else None for name, part in self.parts.items()},
            **self.keeper.state_dict(),  # as of this save, which is itself unconfirmed
            "evaluation": self.evaluations.get(self.step),
        }

    def load_state_dict(self, state: dict[str, Any], keep: tuple[str, ...] = ()) -> None:
        """Everything but the keeper's state and the parts named in `keep` (theirs stay as they are)."""
        self.step, self.skipped_steps = state["step"], state["skipped_steps"]
        for name, part in self.parts.items():
            if part is not None and state[name] is not None and name not in keep:
                part.load_state_dict(state[name])
