"""The demo's tokenizer and addition task (attn/demo/tokenizer.py, attn/demo/task.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attn.demo.task import IGNORE_INDEX, AdditionTask, Problem
from attn.demo.tokenizer import CharTokenizer


@pytest.fixture(scope="module")
def task() -> AdditionTask:
    return AdditionTask(num_digits=2, num_eval=32, seed=3)


@given(st.text(alphabet="0123456789+=", max_size=20))
def test_tokenizer_round_trip(text: str) -> None:
    tok = CharTokenizer()
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([*ids, 5, 6]) == text  # stops at eos


def test_tokenizer_rejects_unknown_characters_by_name() -> None:
    with pytest.raises(ValueError, match=r"\['a', 'x'\]"):
        CharTokenizer().encode("1+ax")


def test_tokenizer_pad_matches_generate_default() -> None:
    assert CharTokenizer().pad_id == 0  # attn.generate's default pad_id


def test_held_out_problems_are_never_trained_on(task: AdditionTask) -> None:
    held_out = set(task.eval_problems)
    assert len(held_out) == 32
    assert held_out.isdisjoint(task.train_problems)
    assert len(task.train_problems) + 32 == 100 * 100
    assert AdditionTask(num_eval=32, seed=3).eval_problems == task.eval_problems  # seeded


def test_text_format(task: AdditionTask) -> None:
    assert task.text(Problem(7, 45)) == "07+45=52"
    assert task.text(Problem(99, 99)) == "99+99=198"
    assert task.is_correct(Problem(7, 45), "52") and not task.is_correct(Problem(7, 45), "052")


def test_training_batch_targets_are_the_answer_only(task: AdditionTask) -> None:
    tokens, targets = task.training_batch(16, torch.Generator().manual_seed(0))  # each (16, T)
    assert tokens.shape == targets.shape == (16, task.seq_len)
    tok = task.tokenizer
    for row_tokens, row_targets in zip(tokens.tolist(), targets.tolist(), strict=True):
        counted = [(t, target) for t, target in enumerate(row_targets) if target != IGNORE_INDEX]
        # each counted position predicts the next token: the answer's digits and eos
        assert all(row_tokens[t + 1] == target for t, target in counted)
        text = tok.decode(row_tokens)
        a, rest = text.split("+")
        b, answer = rest.split("=")
        assert int(a) + int(b) == int(answer)
        assert tok.decode([target for _, target in counted]) == answer
        assert counted[-1][1] == tok.eos_id


def test_candidates_hold_the_right_answer_once(task: AdditionTask) -> None:
    for problem in task.eval_problems:
        options, right = task.candidates(problem)
        assert len(options) == len(set(options)) == task.num_candidates
        assert options[right] == problem.answer
        assert all(0 <= option < 1000 for option in options)
        assert task.candidates(problem) == (options, right)  # the same every time


def test_candidate_batch_rows(task: AdditionTask) -> None:
    problems = task.eval_problems[:3]
    tokens, targets, right = task.candidate_batch(problems)
    k = task.num_candidates
    assert tokens.shape == targets.shape == (3 * k, task.seq_len)
    tok = task.tokenizer
    for i, problem in enumerate(problems):
        options, index = task.candidates(problem)
        assert int(right[i]) == index
        for j, option in enumerate(options):
            assert tok.decode(tokens[i * k + j].tolist()) == f"{task.prompt_text(problem)}{option}"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_digits": 3}, r"num_digits must be 1 or 2.*got 3"),
        ({"num_eval": 0}, r"num_eval must be an int in \[1, 5000\].*got 0"),
        ({"num_candidates": 9}, r"num_candidates must be an int in \[2, 6\], got 9"),
    ],
)
def test_bad_task_arguments_name_the_value(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdditionTask(**kwargs)


def test_one_digit_task_fits(task: AdditionTask) -> None:
    small = AdditionTask(num_digits=1, num_eval=10, num_candidates=6)
    tokens, _, _ = small.candidate_batch(small.eval_problems)
    assert tokens.shape == (60, small.seq_len)
