"""The demo's LoRA adapter (attn/demo/lora.py)."""

from __future__ import annotations

import pytest
import torch

import attn
from attn.demo.lora import LoRALinear, adapters_enabled, add_lora, lora_parameters

from .conftest import tiny_model


def test_fresh_adapters_change_nothing_and_train_alone() -> None:
    model = tiny_model(0)
    tokens = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        expected = model(tokens)
    adapters = add_lora(model, rank=2, seed=0)
    assert len(adapters) == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    assert isinstance(model.layers[0].attn.q_proj, LoRALinear)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in lora_parameters(model)}
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)


def test_switch_turns_the_adapters_off_and_restores_them() -> None:
    model = tiny_model(1)
    tokens = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        base = model(tokens)
    add_lora(model, rank=2, seed=0)
    with torch.no_grad():
        for adapter in model.modules():
            if isinstance(adapter, LoRALinear):
                adapter.up.weight.normal_(0.0, 0.5)
        adapted = model(tokens)
        assert not torch.allclose(adapted, base)
        with adapters_enabled(model, False):
            torch.testing.assert_close(model(tokens), base, rtol=0, atol=0)
        torch.testing.assert_close(model(tokens), adapted, rtol=0, atol=0)
    with pytest.raises(ZeroDivisionError), adapters_enabled(model, False):
        1 / 0  # noqa: B018
    assert all(m.enabled for m in model.modules() if isinstance(m, LoRALinear))


def test_same_seed_same_adapters() -> None:
    first, second = tiny_model(2), tiny_model(2)
    add_lora(first, seed=5)
    add_lora(second, seed=5)
    for a, b in zip(lora_parameters(first), lora_parameters(second), strict=True):
        assert torch.equal(a, b)


def test_add_lora_errors_say_what_is_wrong() -> None:
    model = tiny_model(3)
    add_lora(model)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        add_lora(model)
    with pytest.raises(ValueError, match=r"no nn\.Linear named"):
        add_lora(tiny_model(3), targets=("nothing",))
    with pytest.raises(ValueError, match=r"LoRA rank must be an int in \[1, 32\].*got 0"):
        LoRALinear(torch.nn.Linear(32, 64), rank=0, alpha=1.0)
    with pytest.raises(ValueError, match="has no LoRA adapters"), adapters_enabled(tiny_model(3), False):
        pass


def test_adapters_leave_the_cache_policy_alone() -> None:
    model = tiny_model(4)
    add_lora(model)
    model.setup_caches(1, 16)
    with attn.cached_inference(model):
        model(torch.tensor([[1, 2, 3]]))
    assert [c.size for c in model.kv_caches()] == [3, 3]
