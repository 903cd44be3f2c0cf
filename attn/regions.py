"""Compile regions: ``torch.compile`` traces a decoder layer once and reuses it for every layer.

Inside ``compile_regions()`` (``attn.compile_for_decode``'s step), a graph compiled for a call
of a ``compile_region`` function traces it once, as one region
(``torch.compiler.nested_compile_region``), and calls that code for every call in the graph:
inductor compiles one layer, not all of them. Everywhere else, eager or compiled, the function
runs as written. Where the release cannot (``attn.compat.compile_regions_supported``), the
decorator returns the function unchanged.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from attn.compat import compile_regions_supported

__all__ = ["compile_region", "compile_regions"]

_regions_on = False


def compile_region(fn: Any) -> Any:
    """Decorator: ``fn`` is compiled once for all its calls in a graph compiled inside
    ``compile_regions()``, where the release supports it; otherwise it runs as written."""
    if not compile_regions_supported():
        return fn
    region = torch.compiler.nested_compile_region(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _regions_on and torch.compiler.is_compiling():
            return region(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def compile_regions() -> Iterator[None]:
    """Graphs compiled for calls inside compile each ``compile_region`` function once; a graph
    compiled outside never does. Dynamo guards on the switch: a graph is never reused across it."""
    global _regions_on
    before, _regions_on = _regions_on, True
    try:
        yield
    finally:
        _regions_on = before
