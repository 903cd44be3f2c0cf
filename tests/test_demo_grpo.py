"""attn/demo/grpo.py: GRPO in bf16 parity mode on the demo's task."""

from __future__ import annotations

import re

import pytest
import torch

from attn.demo.grpo import GRPOConfig, grpo_pattern
from attn.demo.model import build_model
from attn.demo.patterns import train
from attn.demo.task import AdditionTask

from .conftest import assert_cache_unchanged, cache_state


@pytest.fixture(scope="module")
def trained() -> tuple[AdditionTask, torch.nn.Module]:
    task = AdditionTask(num_digits=1, num_eval=8, seed=1)
    model = build_model(task, seed=1)
    train(model, task, steps=120, batch_size=32, seed=1)
    return task, model


def test_first_ratio_is_exactly_one_and_the_model_is_left_alone(trained) -> None:
    task, model = trained
    model.setup_caches(8, 32)
    with torch.inference_mode():
        model(torch.tensor([task.prompt_ids(p) for p in task.eval_problems]))
    before = cache_state(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    result = grpo_pattern(
        model, task, task.train_problems[:4], GRPOConfig(group_size=4, rounds=2, inner_steps=2), seed=3
    )
    assert result.first_ratio_min == 1.0 == result.first_ratio_max and result.first_ratio_tokens > 0
    assert result.parity_max_abs_diff == 0.0 and result.exact
    assert result.default_max_abs_diff > 0.0  # bf16 default kernels: the mismatch parity mode removes
    assert 0.0 <= result.reward_before <= 1.0 and 0.0 <= result.reward_after <= 1.0
    assert result.to_dict()["exact"] is True
    assert_cache_unchanged(model, before)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    model.teardown_caches()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="group_size >= 2; got 1, 2, 1"):
        GRPOConfig(rounds=1, inner_steps=2, group_size=1)
    with pytest.raises(ValueError, match=re.escape("got 2.5, 2, 8")):
        GRPOConfig(rounds=2.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field, value",
    [
        ("lr", 0.0),
        ("lr", -1e-3),
        ("clip", 0.0),
        ("clip", float("nan")),
        ("kl_coef", -0.1),
        ("kl_coef", float("inf")),
        ("lr", True),
    ],
)
def test_bad_rates_are_refused(field: str, value: float) -> None:
    given = f"{field!r}: {value!r}"
    with pytest.raises(ValueError, match=f"lr > 0, clip > 0 and kl_coef >= 0, each finite; got .*{re.escape(given)}"):
        GRPOConfig(**{field: value})


def test_good_rates_are_taken() -> None:
    assert GRPOConfig(kl_coef=0.0, lr=1.0, clip=0.5).kl_coef == 0.0
