"""One attribute set on many objects for a block, each one's own value back on exit."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["swapped_attribute"]


@contextmanager
def swapped_attribute(objects: Sequence[object], name: str, value: object) -> Iterator[None]:
    """Sets ``name`` to ``value`` on every object of ``objects`` for the block; restores each
    object's previous value on exit, also when the block raises, so blocks nest."""
    previous = [getattr(obj, name) for obj in objects]
    for obj in objects:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, before in zip(objects, previous, strict=True):
            setattr(obj, name, before)
