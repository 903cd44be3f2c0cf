"""The built-in demo behind ``python -m attn demo``: one tiny model, three kinds of pass.

A decoder learns two-number addition (``"07+45=52"``, data generated in code), then runs
the eval, PPO and LoRA-PPO patterns with its KV-caches set up throughout; every pass records
whether it used the cache, read from the caches' own fill positions and buffers.

Not part of the core API: nothing in ``attn`` imports this package.
"""
