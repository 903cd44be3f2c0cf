"""attn/regions.py: one compiled decoder layer for every layer, only inside compile_regions()."""

from __future__ import annotations

import contextlib

import torch

from attn import compat
from attn.regions import compile_regions

from .conftest import tiny_model


def test_compile_regions_compile_one_layer_for_all_only_when_asked() -> None:
    """Inside ``compile_regions()`` a supporting release traces the decoder layer once, as one
    region every layer calls; outside, the same compiled model gets a graph of its own without
    (dynamo guards on the switch), each reused; eager results throughout."""
    model = tiny_model(3, num_layers=3)
    subgraphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        subgraphs.append(sum(isinstance(m, torch.fx.GraphModule) for m in gm.modules()) - 1)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for regions in (True, False, True, False):
            with compile_regions() if regions else contextlib.nullcontext():
                torch.testing.assert_close(compiled(tokens), model(tokens))
    torch._dynamo.reset()
    # where the release cannot, the layer is a plain function: one graph serves every call
    assert subgraphs == ([1, 0] if compat.compile_regions_supported() else [0])
