"""Adapters that let other tools drive attn models; each needs its own optional extra.

- ``attn.integrations.lm_eval``: an EleutherAI lm-evaluation-harness model (``AttnLM``),
  registered as ``"attn"`` when the module is imported. Needs ``pip install attn[lm-eval]``.

Nothing is imported here, so ``import attn`` never needs an optional dependency.
"""

__all__: list[str] = []
