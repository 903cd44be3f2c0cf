"""The demo's task: add two numbers, written as characters (``"07+45=52"``).

Shapes: n = problems, k = candidates per problem, b = rows, T = padded sequence length.

Every problem is generated in code. Operands are written with a fixed number of digits (a
zero-padded ``7`` is ``07``), which lets a tiny decoder learn the task in seconds; the sum is
written plainly. A fixed set of problems is held out for evaluation and never trained on.

Two ways to measure the model, as an eval harness would:

- the generation task: greedy completion of ``"07+45="``, scored by exact match;
- the log-likelihood task: choose among candidate answers by summed log-probability.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from attn.demo.tokenizer import CharTokenizer

__all__ = ["AdditionTask", "Problem"]

IGNORE_INDEX = -100
"""Target id for positions that do not count in the loss (``F.cross_entropy``'s default)."""


@dataclass(frozen=True)
class Problem:
    """One addition problem, ``a + b``."""

    a: int
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b


class AdditionTask:
    """Addition problems, their token ids, and the two ways to score a model on them.

    Args:
        num_digits: digits of each operand (operands are in ``[0, 10**num_digits)``).
        num_eval: problems held out for evaluation, never trained on.
        num_candidates: answers offered per problem in the log-likelihood task (one right).
        seed: which problems are held out, and which wrong candidates are offered.

    Example::

        task = AdditionTask(num_digits=2, num_eval=64)
        task.text(Problem(7, 45))                  # '07+45=52'
        tokens, targets = task.training_batch(32, torch.Generator().manual_seed(0))
    """

    def __init__(self, *, num_digits: int = 2, num_eval: int = 64, num_candidates: int = 4, seed: int = 0) -> None:
        if not isinstance(num_digits, int) or not 1 <= num_digits <= 2:
            raise ValueError(f"num_digits must be 1 or 2 (every problem is built up front), got {num_digits!r}")
        num_problems = (10**num_digits) ** 2
        if not isinstance(num_eval, int) or not 0 < num_eval <= num_problems // 2:
            raise ValueError(
                f"num_eval must be an int in [1, {num_problems // 2}] (half of the {num_problems} "
                f"problems with {num_digits}-digit operands), got {num_eval!r}"
            )
        if not isinstance(num_candidates, int) or not 2 <= num_candidates <= 6:
            raise ValueError(f"num_candidates must be an int in [2, 6], got {num_candidates!r}")
        self.tokenizer = CharTokenizer()
        self.num_digits = num_digits
        self.num_candidates = num_candidates
        self.seed = seed
        top = 10**num_digits
        problems = [Problem(a, b) for a in range(top) for b in range(top)]
        random.Random(seed).shuffle(problems)
        self.eval_problems: list[Problem] = problems[:num_eval]
        self.train_problems: list[Problem] = problems[num_eval:]
        self._train_tokens, self._train_targets = self.teacher_forcing(self.train_problems)

    # -- text and ids ------------------------------------------------------------------

    @property
    def seq_len(self) -> int:
        """T: ``bos``, both operands, ``+``, ``=``, the longest sum and ``eos``."""
        return 1 + 2 * self.num_digits + 2 + (self.num_digits + 1) + 1

    @property
    def max_answer_len(self) -> int:
        """Tokens a complete answer takes at most: the digits of the largest sum and ``eos``."""
        return self.num_digits + 2

    def prompt_text(self, problem: Problem) -> str:
        d = self.num_digits
        return f"{problem.a:0{d}d}+{problem.b:0{d}d}="

    def text(self, problem: Problem) -> str:
        """The whole problem with its answer: ``'07+45=52'``."""
        return self.prompt_text(problem) + str(problem.answer)

    def prompt_ids(self, problem: Problem) -> list[int]:
        """``bos`` and the prompt: what a model completes."""
        return self.tokenizer.encode(self.prompt_text(problem), bos=True)

    def is_correct(self, problem: Problem, completion: str) -> bool:
        """Exact match of a decoded completion (text up to ``eos``) with the sum."""
        return completion == str(problem.answer)

    # -- training ----------------------------------------------------------------------

    def teacher_forcing(self, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and next-token targets of the problems with their right answers.

        Returns:
            ``(tokens, targets)``, each (n, T) long, right-padded: targets hold the next token
            at positions whose next token is part of the answer (its digits and ``eos``), and
            ``IGNORE_INDEX`` elsewhere: the model learns to answer, not to guess operands.
        """
        return self._rows([(problem, problem.answer) for problem in problems])

    def _rows(self, pairs: list[tuple[Problem, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded rows of ``prompt + answer + eos`` and their targets, each (n, T)."""
        tok = self.tokenizer
        tokens = torch.full((len(pairs), self.seq_len), tok.pad_id, dtype=torch.long)  # (n, T)
        targets = torch.full((len(pairs), self.seq_len), IGNORE_INDEX, dtype=torch.long)  # (n, T)
        for i, (problem, answer) in enumerate(pairs):
            prompt = self.prompt_ids(problem)
            ids = torch.tensor(prompt + tok.encode(str(answer), eos=True))
            tokens[i, : ids.numel()] = ids
            # position t predicts token t + 1; the answer starts at len(prompt)
            targets[i, len(prompt) - 1 : ids.numel() - 1] = ids[len(prompt) :]
        return tokens, targets

    def training_batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A random batch of training problems: ``(tokens, targets)``, each (batch_size, T)."""
        rows = torch.randint(0, len(self.train_problems), (batch_size,), generator=generator)
        return self._train_tokens[rows], self._train_targets[rows]

    # -- the log-likelihood task -------------------------------------------------------

    def candidates(self, problem: Problem) -> tuple[list[int], int]:
        """Candidate answers for ``problem`` and the index of the right one.

        The wrong ones are near misses (off by one in a digit, a dropped carry), chosen and
        ordered by a generator seeded from the task seed and the problem, so every run offers
        the same candidates.
        """
        rng = random.Random(f"{self.seed}:{problem.a}+{problem.b}")
        right = problem.answer
        near = [right + delta for delta in (1, -1, 10, -10, 11, -11, 9, -9, 2, -2, 100, -100)]
        longest = 10 ** (self.num_digits + 1)  # a candidate must fit in T like any sum
        wrong = sorted({value for value in near if 0 <= value < longest and value != right})
        options = [right, *rng.sample(wrong, self.num_candidates - 1)]
        rng.shuffle(options)
        return options, options.index(right)

    def candidate_batch(self, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every (problem, candidate) pair as one right-padded row, for scoring.

        Returns:
            ``tokens`` (n * k, T) long, row ``i * k + j`` is problem i with candidate j;
            ``targets`` (n * k, T) long, the candidate's tokens (digits and ``eos``) at the
            positions that predict them, ``IGNORE_INDEX`` elsewhere; ``right`` (n,) long, the
            index of the right candidate of each problem.
        """
        pairs, right = [], []
        for problem in problems:
            options, index = self.candidates(problem)
            pairs += [(problem, option) for option in options]
            right.append(index)
        tokens, targets = self._rows(pairs)
        return tokens, targets, torch.tensor(right, dtype=torch.long)
