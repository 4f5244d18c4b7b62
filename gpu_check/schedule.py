"""Which parts of the GPU check run together, and which fit the time the check is given.

One rule admits a part (`admits`), used by the driver as it starts parts and by `simulate`, which plays the
driver's loop forward on the parts' estimated times: at most `jobs` parts at once; an `exclusive` part (its timings
are the check's measurements) starts only on an idle card and nothing starts beside it; any other part starts only
while the planned peaks of the parts running and its own fit the card's budget together. The parts start in their
order, and an exclusive part that must wait holds back those behind it.

`within_budget` leaves parts out, least valued first (`VALUE_ORDER`), until the simulated run fits `--budget`
seconds; `overcommitted` checks a simulated run against the budget in GiB (the dry run's verdict for a card)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

# Most valued first: what a run cut short must have measured (the order; `key_rank` maps part keys to it)
VALUE_ORDER = ("a", "b@0", "c", "g", "i", "f", "d", "e", "j", "b@1", "h", "h_recipe")


class Schedulable(Protocol):
    key: str
    exclusive: bool


def admits(part: Schedulable, running: Sequence[Schedulable], planned_gib: Callable[[str], float], jobs: int,
           budget_gib: float) -> bool:  # fmt: skip
    """Whether `part` may start beside `running` (module docstring)."""
    if len(running) >= jobs:
        return False
    if part.exclusive:
        return not running
    if any(other.exclusive for other in running):
        return False
    return planned_gib(part.key) + sum(planned_gib(other.key) for other in running) <= budget_gib


@dataclass(frozen=True)
class Slot:
    key: str
    start_s: float
    end_s: float


def simulate(parts: Sequence[Schedulable], seconds: Callable[[str], float], planned_gib: Callable[[str], float],
             jobs: int, budget_gib: float) -> list[Slot]:  # fmt: skip
    """The driver's loop played on estimated times: each part's start and end. A part that fits beside nothing
    (planned over the budget alone) starts on an idle card, as the driver starts it."""
    pending, running, slots, now = list(parts), [], [], 0.0
    while pending or running:
        for part in list(pending):
            alone = not running and planned_gib(part.key) > budget_gib
            if alone or admits(part, [p for p, _ in running], planned_gib, jobs, budget_gib):
                pending.remove(part)
                running.append((part, now + seconds(part.key)))
                slots.append(Slot(part.key, now, now + seconds(part.key)))
            elif part.exclusive:
                break
        if not running:
            continue
        now = min(end for _, end in running)
        running = [(part, end) for part, end in running if end > now]
    return slots


def overcommitted(slots: Sequence[Slot], planned_gib: Callable[[str], float], budget_gib: float) -> list[str]:
    """Each moment of `slots` when the parts running together plan more than `budget_gib`, as a line."""
    problems = []
    for slot in slots:
        together = [s for s in slots if s.start_s <= slot.start_s < s.end_s]
        total = sum(planned_gib(s.key) for s in together)
        if total > budget_gib:
            names = " + ".join(f"({s.key}) {planned_gib(s.key):.1f}" for s in together)
            problems.append(f"at {slot.start_s:.0f} s {names} = {total:.1f} GiB > {budget_gib:.1f} GiB")
    return problems


def makespan(slots: Sequence[Slot]) -> float:
    return max((slot.end_s for slot in slots), default=0.0)


def key_rank(key: str, first_iteration_key: str) -> int:
    """`key`'s place in `VALUE_ORDER`: (b) at its first length is `b@0`, at the others `b@1`."""
    if key.startswith("b") and key != "b":
        key = "b@0" if key == first_iteration_key else "b@1"
    return VALUE_ORDER.index(key) if key in VALUE_ORDER else len(VALUE_ORDER)


def within_budget(parts: Sequence[Schedulable], budget_s: float, run: Callable[[Sequence[Schedulable]], list[Slot]],
                  rank: Callable[[str], int]) -> tuple[list[Schedulable], list[str]]:  # fmt: skip
    """The parts kept (in their order) and the keys left out, least valued first out, until `run`'s simulated
    makespan is within `budget_s`."""
    kept, left_out = list(parts), []
    while kept and makespan(run(kept)) > budget_s:
        least = max(kept, key=lambda part: rank(part.key))
        kept.remove(least)
        left_out.append(least.key)
    return kept, left_out
