"""The demo's model: a tiny ``attn.TransformerDecoder`` sized for the addition task."""

from __future__ import annotations

import torch

from attn.decoder import DecoderConfig, TransformerDecoder
from attn.demo.task import AdditionTask

__all__ = ["build_model", "demo_config"]


def demo_config(task: AdditionTask) -> DecoderConfig:
    """Two layers, GQA (4 query heads, 2 key/value heads), 64 wide; about 76k parameters."""
    return DecoderConfig(
        vocab_size=task.tokenizer.vocab_size,
        embed_dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        hidden_dim=128,
        max_seq_len=64,
    )


def build_model(task: AdditionTask, *, seed: int) -> TransformerDecoder:
    """A freshly initialised demo model; the same ``seed`` gives the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TransformerDecoder(demo_config(task))
