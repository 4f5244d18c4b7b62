"""The tiny recipe's task: two-digit addition, a noisy demonstrator, and a rule-based reward.

Prompts are "a+b=" with a, b in 10..99; the correct response is the decimal sum. The demonstrator is right
about two times in three: on problems whose units digits carry it forgets the carry 65 % of the time
(17+25= → 32), and any answer gets a random one-digit typo 10 % of the time. The reward of a response is
1 if it is the sum, 0 if it is a number but wrong, and −1 if it is malformed (empty, not digits, unfinished).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FORGET_CARRY_PROB = 0.65
TYPO_PROB = 0.10


@dataclass(frozen=True)
class AdditionProblem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    @property
    def carries(self) -> bool:
        return self.a % 10 + self.b % 10 >= 10

    @property
    def uid(self) -> str:
        return self.prompt


def split_problems(num_train: int, num_heldout: int, seed: int) -> tuple[list[AdditionProblem], list[AdditionProblem]]:
    """Disjoint train and held-out prompt sets drawn from the 8100 problems, deterministic per seed."""
    problems = [AdditionProblem(a, b) for a in range(10, 100) for b in range(10, 100)]
    if num_train + num_heldout > len(problems):
        raise ValueError(f"only {len(problems)} distinct problems; asked for {num_train} + {num_heldout}")
    random.Random(seed).shuffle(problems)
    return problems[:num_train], problems[num_train : num_train + num_heldout]


def demonstrate(problem: AdditionProblem, rng: random.Random) -> str:
    """The noisy demonstrator's answer."""
    value = problem.a + problem.b
    if problem.carries and rng.random() < FORGET_CARRY_PROB:
        value -= 10
    answer = list(str(value))
    if rng.random() < TYPO_PROB:
        answer[rng.randrange(len(answer))] = str(rng.randrange(10))
    return "".join(answer)


def reward(problem: AdditionProblem, response: str | None) -> float:
    """1 exact, 0 a wrong number, −1 malformed (`None` marks a response that never ended)."""
    if response is None or not response.isdigit():
        return -1.0
    return 1.0 if response == problem.answer else 0.0


def corpus(problems: list[AdditionProblem]) -> list[str]:
    """Text the tokenizer is trained on: every prompt and its answer."""
    return [problem.prompt + problem.answer for problem in problems]
