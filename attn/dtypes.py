"""Floating-point dtypes by name: the one table of the names attn accepts and writes.

``float32`` / ``bfloat16`` / ``float16`` are the names of Hugging Face configs and of torch;
``fp32`` / ``bf16`` / ``fp16`` the short ones of the command lines and the bench.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "dtype_from_name", "long_name", "short_name"]

# dtype: (long name, short name)
DTYPES: dict[torch.dtype, tuple[str, str]] = {
    torch.float32: ("float32", "fp32"),
    torch.bfloat16: ("bfloat16", "bf16"),
    torch.float16: ("float16", "fp16"),
}
_BY_NAME = {name: dtype for dtype, names in DTYPES.items() for name in names}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"`` or ``torch.bfloat16`` -> ``torch.bfloat16``.

    Raises:
        ValueError: not one of the supported dtypes, named in the message.
    """
    if isinstance(name, torch.dtype) and name in DTYPES:
        return name
    if isinstance(name, str) and name.removeprefix("torch.") in _BY_NAME:
        return _BY_NAME[name.removeprefix("torch.")]
    choices = ", ".join(f"{long} ({short})" for long, short in DTYPES.values())
    raise ValueError(f"dtype {name!r} is not supported; use one of {choices}")


def long_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name a Hugging Face config uses)."""
    return DTYPES[dtype][0]


def short_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``."""
    return DTYPES[dtype][1]
