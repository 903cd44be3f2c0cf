"""Parity mode on a CUDA device: bf16 log-probs from attn.generate equal the training
forward's bit for bit (issue 26), or the exact figures where they do not.

Run on a machine with a CUDA GPU, from the repository root::

    python compat/cuda_parity_check.py [DEVICE]   (default cuda; cpu runs the same check here)

Prints, per mode (default kernels, parity mode), the largest |log-prob difference| and the
share of tokens whose ratio leaves [0.99, 1.01] and [0.9, 1.1]. Exit status 0 when parity
mode's difference is exactly 0.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attn
from attn.bench.rl import SMOLLM2_135M

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def gap(
    model: attn.TransformerDecoder, prompts: list[list[int]], samples: int, new_tokens: int
) -> tuple[float, float, float]:
    generator = torch.Generator(DEVICE).manual_seed(1)
    out = attn.generate(
        model, prompts, max_new_tokens=new_tokens, temperature=1.0, num_samples=samples, generator=generator
    )
    model.train()
    trained = attn.completion_logprobs(model, *out.groups(samples), width=new_tokens)
    model.eval()
    diff = (trained.logprobs.detach() - out.logprobs)[trained.mask]
    ratio = diff.exp()
    outside_1, outside_10 = ((ratio - 1).abs() > 0.01).float().mean(), ((ratio - 1).abs() > 0.1).float().mean()
    return float(diff.abs().max()), float(outside_1), float(outside_10)


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    torch.manual_seed(0)
    config = dataclasses.replace(SMOLLM2_135M, max_seq_len=512)
    model = attn.TransformerDecoder(config).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.05)
    prompts = torch.randint(1, config.vocab_size, (2, 48)).tolist()
    exact = False
    for parity in (False, True):
        attn.set_parity_mode(model, parity)
        max_abs, outside_1, outside_10 = gap(model, prompts, samples=4, new_tokens=48)
        mode = "parity" if parity else "default"
        bands = f"outside [0.99, 1.01] {100 * outside_1:.1f}%, outside [0.9, 1.1] {100 * outside_10:.1f}%"
        print(f"{DEVICE} bf16 {mode:<8} max |diff| {max_abs:.3g}; {bands}")
        exact = parity and max_abs == 0.0
    print("parity mode: bitwise" if exact else "parity mode: NOT bitwise on this device")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
