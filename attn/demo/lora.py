"""A minimal LoRA adapter with an on/off switch, for the demo's LoRA-PPO pattern.

Shapes: b = batch, s = sequence, i = in features, o = out features, r = rank.

``add_lora`` wraps the attention and MLP projections of a ``TransformerDecoder`` in place:
each ``nn.Linear`` becomes ``base(x) + scaling * up(down(x))``, the base weights are frozen
and only the adapters train. ``adapters_enabled(model, False)`` switches every adapter off
for a block (the reference model of PPO, for free). Not part of the core API.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from attn.checks import is_int
from attn.swap import swapped_attribute

__all__ = ["TARGETS", "LoRALinear", "adapters_enabled", "add_lora", "lora_parameters"]

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Names of the linear layers ``add_lora`` wraps by default."""


class LoRALinear(nn.Module):
    """``base(x) + scaling * up(down(x))``, with the low-rank path switchable.

    ``up`` starts at zero, so a fresh adapter changes nothing.

    Args:
        base: the linear layer to adapt (frozen by ``add_lora``, not here).
        rank: r, the width of the low-rank path.
        alpha: the low-rank path is scaled by ``alpha / rank``.
        generator: random generator for ``down``'s initial weights.
    """

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, generator: torch.Generator | None = None) -> None:
        super().__init__()
        if not is_int(rank) or not 0 < rank <= min(base.in_features, base.out_features):
            raise ValueError(
                f"LoRA rank must be an int in [1, {min(base.in_features, base.out_features)}] for a "
                f"{base.in_features} -> {base.out_features} linear layer, got {rank!r}"
            )
        self.base = base
        weight = base.weight
        self.down = nn.Linear(base.in_features, rank, bias=False, device=weight.device, dtype=weight.dtype)
        self.up = nn.Linear(rank, base.out_features, bias=False, device=weight.device, dtype=weight.dtype)
        nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5), generator=generator)  # nn.Linear's init
        nn.init.zeros_(self.up.weight)
        self.scaling = alpha / rank
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # (b, s, o)
        if self.enabled:
            out = out + self.scaling * self.up(self.down(x))  # (b, s, r) -> (b, s, o)
        return out


def add_lora(
    model: nn.Module, *, rank: int = 4, alpha: float = 8.0, seed: int = 0, targets: tuple[str, ...] = TARGETS
) -> list[LoRALinear]:
    """Wraps every ``nn.Linear`` named in ``targets`` in a ``LoRALinear``, in place.

    Freezes every parameter of ``model`` that is not an adapter's. The adapters' initial
    weights depend on ``seed`` only.

    Returns:
        The adapters, in module order.

    Raises:
        ValueError: the model already has adapters, or no layer matched ``targets``.
    """
    if any(isinstance(module, LoRALinear) for module in model.modules()):
        raise ValueError(f"{type(model).__name__} already has LoRA adapters; add_lora wraps a model once")
    found = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if name in targets and isinstance(child, nn.Linear)
    ]
    if not found:
        raise ValueError(f"no nn.Linear named any of {list(targets)} in {type(model).__name__}")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    generator = torch.Generator(device=found[0][2].weight.device).manual_seed(seed)
    adapters = []
    for parent, name, child in found:
        adapter = LoRALinear(child, rank=rank, alpha=alpha, generator=generator)
        setattr(parent, name, adapter)
        adapters.append(adapter)
    return adapters


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable adapter parameters of ``model`` (what the LoRA optimizer steps)."""
    return [p for m in model.modules() if isinstance(m, LoRALinear) for p in (*m.down.parameters(), *m.up.parameters())]


@contextmanager
def adapters_enabled(model: nn.Module, enabled: bool) -> Iterator[nn.Module]:
    """Switches every adapter of ``model`` on or off for a block; restores them on exit.

    Example::

        with torch.no_grad(), adapters_enabled(model, False):
            reference_logits = model(tokens)   # the base model: PPO's reference policy
    """
    adapters = [m for m in model.modules() if isinstance(m, LoRALinear)]
    if not adapters:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters; call add_lora(model) first")
    with swapped_attribute(adapters, "enabled", enabled):
        yield model
