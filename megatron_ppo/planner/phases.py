"""The phases of one PPO iteration (`Phase`, one name each) and what each needs of every role on the device: the
table host offload moves state by (`models/offload.py`) and the planner counts memory by (`plan.py`).

A role keeps on its device the kinds of state (`OFFLOAD_KINDS`: weights, gradients, optimizer states) its phase
needs, plus every kind whose offload switch (`<role>.megatron.param_offload`, `grad_offload`, `optimizer_offload`)
is off; the rest waits in host memory.
"""

from __future__ import annotations

from enum import StrEnum

from megatron_ppo.config.schema import ROLES, MegatronConfig


class Phase(StrEnum):
    """The phases of one PPO iteration, in order. The value names a phase where people read it (the planner's
    table, host offload's report, the out-of-memory log); `metric` names it in the timing and MFU metrics."""

    EXPERIENCE = "experience"
    UPDATE_CRITIC = "critic update"
    UPDATE_ACTOR = "actor update"
    BETWEEN_ITERATIONS = "between iterations"

    @classmethod
    def update(cls, role: str) -> Phase:
        """The update phase of a trained role ("actor" or "critic")."""
        return cls(f"{role} update")

    @property
    def trained_role(self) -> str | None:
        """The role an update phase trains ("actor", "critic"); None for the other phases."""
        return self.value.removesuffix(" update") if self.value.endswith(" update") else None

    @property
    def metric(self) -> str:
        """The phase in metric names, as verl's timings name it: `timing/update_actor_s`, `timing/experience_s`."""
        role = self.trained_role
        return f"update_{role}" if role else self.value.replace(" ", "_")


# The rows per data-parallel replica that one batch of answers decodes at once (`models.generation`), at most, and
# the share of the device memory left between iterations that its KV cache may take (fewer rows where it would take
# more; the rest is for the passes' activations). The planner reports both.
GENERATION_BATCH_ROWS = 512
GENERATION_CACHE_SHARE = 0.5

OFFLOAD_KINDS = ("params", "grads", "optimizer")
# What each phase needs on the GPU, role by role. Between iterations every role's weights and optimizer states are
# resident: checkpoints, rollbacks and evaluation read them (gradients are zeroed before each update, so none).
PHASE_NEEDS: dict[Phase, dict[str, frozenset[str]]] = {
    Phase.EXPERIENCE: {role: frozenset({"params"}) for role in ROLES},
    Phase.UPDATE_CRITIC: {"critic": frozenset(OFFLOAD_KINDS)},
    Phase.UPDATE_ACTOR: {"actor": frozenset(OFFLOAD_KINDS)},
    Phase.BETWEEN_ITERATIONS: {role: frozenset({"params", "optimizer"}) for role in ROLES},
}


def offload_switches(layout: MegatronConfig) -> dict[str, bool]:
    """kind → whether the role moves it to host memory in the phases that do not need it."""
    return {"params": layout.param_offload, "grads": layout.grad_offload, "optimizer": layout.optimizer_offload}


def resident_kinds(phase: Phase, role: str, layout: MegatronConfig) -> frozenset[str]:
    """The kinds of `role`'s state on the GPU during `phase`: what the phase needs, plus each kind not offloaded."""
    kept = {kind for kind, offloaded in offload_switches(layout).items() if not offloaded}
    return PHASE_NEEDS[phase].get(role, frozenset()) | kept
