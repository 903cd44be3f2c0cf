"""Argument checks that many entry points share, each with one wording for its error.

Python counts ``True`` as an int; attn never takes a bool as a count, a size or an id.
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral, Real
from typing import Any

__all__ = ["bad_ids", "check_positive_int", "head_shape", "is_int", "is_number"]


def is_int(value: Any) -> bool:
    """A Python int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number (int, float, numpy scalar) that is not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool)


def check_positive_int(value: Any, name: str, *, or_none: bool = False) -> None:
    """Raises ``ValueError("{name} must be a positive int, got {value!r}")`` unless ``value``
    is an int > 0 (or ``None``, where ``or_none``)."""
    if or_none and value is None:
        return
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int{' or None' if or_none else ''}, got {value!r}")


def head_shape(embed_dim: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None) -> tuple[int, int]:
    """``(num_kv_heads, head_dim)`` with their defaults (``num_heads``, ``embed_dim //
    num_heads``) filled in; raises ``ValueError`` unless the query heads group evenly over the
    key/value heads and, without a ``head_dim``, split ``embed_dim`` evenly."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if head_dim is None:
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) is not divisible by num_heads ({num_heads}); pass head_dim")
        head_dim = embed_dim // num_heads
    return num_kv_heads, head_dim


def bad_ids(ids: Iterable[Any], vocab_size: int) -> list[Any]:
    """The entries of ``ids`` that are not integer ids in ``[0, vocab_size)`` (numpy ints are ids)."""
    return [t for t in ids if isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < vocab_size]
