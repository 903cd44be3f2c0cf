"""attn.generate on a CUDA device: greedy tokens equal a no-cache loop, sampled groups are
reproducible, and a YaRN-scaled model runs past its original context.

Run on a machine with a CUDA GPU, from the repository root::

    python compat/cuda_generate_check.py [DEVICE]   (default cuda; cpu tries the script)

Exit status 0 when every check held.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attn
from attn.bench.baseline import greedy_without_cache
from attn.rope import RopeScaling

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def sampled(model: attn.TransformerDecoder, prompts: list[list[int]]) -> attn.GenerationOutput:
    generator = torch.Generator(DEVICE).manual_seed(3)
    return attn.generate(model, prompts, max_new_tokens=12, temperature=1.0, num_samples=4, generator=generator)


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    problems = []
    yarn = RopeScaling("yarn", 4.0, original_max_seq_len=16)
    for name, scaling in (("plain RoPE", None), ("yarn x4 over 16", yarn)):
        torch.manual_seed(0)
        config = attn.DecoderConfig(
            vocab_size=512,
            embed_dim=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            hidden_dim=256,
            max_seq_len=128,
            rope_scaling=scaling,
        )
        model = attn.TransformerDecoder(config).to(DEVICE).eval()
        prompts = [[5, 9, 3, 7, 1], [2, 8]]
        out = attn.generate(model, prompts, max_new_tokens=40)
        for row, prompt in enumerate(prompts):
            got = out.generated[row].tolist()
            want = greedy_without_cache(model, [prompt], max_new_tokens=40)[0, len(prompt) :].tolist()
            print(f"{name}: row {row} greedy == no-cache loop: {got == want}")
            if got != want:
                problems.append(f"{name}: row {row} greedy tokens differ")

        first, second = (sampled(model, prompts) for _ in range(2))
        same = torch.equal(first.tokens, second.tokens)
        in_range = bool(((first.generated >= 0) & (first.generated < 512)).all())
        print(
            f"{name}: sampled groups reproducible: {same}; ids in range: {in_range}; rows {tuple(first.tokens.shape)}"
        )
        if not (same and in_range):
            problems.append(f"{name}: sampling")
    print("problems:", problems or "none")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
