"""The phases of one PPO iteration and what each needs of every role on the device: the table host offload moves
state by (`models/offload.py`) and the planner counts memory by (`plan.py`).

A role keeps on its device the kinds of state (`OFFLOAD_KINDS`: weights, gradients, optimizer states) its phase
needs, plus every kind whose offload switch (`<role>.megatron.param_offload`, `grad_offload`, `optimizer_offload`)
is off; the rest waits in host memory.
"""

from __future__ import annotations

from megatron_ppo.config.schema import ROLES, MegatronConfig

OFFLOAD_KINDS = ("params", "grads", "optimizer")
# What each phase needs on the GPU, role by role. Between iterations every role's weights and optimizer states are
# resident: checkpoints, rollbacks and evaluation read them (gradients are zeroed before each update, so none).
PHASE_NEEDS: dict[str, dict[str, frozenset[str]]] = {
    "experience": {role: frozenset({"params"}) for role in ROLES},
    "critic update": {"critic": frozenset(OFFLOAD_KINDS)},
    "actor update": {"actor": frozenset(OFFLOAD_KINDS)},
    "between iterations": {role: frozenset({"params", "optimizer"}) for role in ROLES},
}


def offload_switches(layout: MegatronConfig) -> dict[str, bool]:
    """kind → whether the role moves it to host memory in the phases that do not need it."""
    return {"params": layout.param_offload, "grads": layout.grad_offload, "optimizer": layout.optimizer_offload}


def resident_kinds(phase: str, role: str, layout: MegatronConfig) -> frozenset[str]:
    """The kinds of `role`'s state on the GPU during `phase`: what the phase needs, plus each kind not offloaded."""
    kept = {kind for kind, offloaded in offload_switches(layout).items() if not offloaded}
    return PHASE_NEEDS[phase].get(role, frozenset()) | kept
