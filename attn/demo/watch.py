"""Did a pass use the KV-cache? Read it from the caches themselves, not from the code.

``watch`` snapshots every ``KVCache`` of a model (fill position and buffers) before a block
and compares after it. A pass used the cache iff a fill position moved or a buffer changed;
the record also says whether that was expected, and whether a buffer picked up autograd
history (which must never happen).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
from torch import nn

from attn.decoder import TransformerDecoder, decoder_of

__all__ = ["JsonResult", "PassRecord", "base_model", "fill_positions", "watch"]


def base_model(model: nn.Module) -> TransformerDecoder:
    """The ``TransformerDecoder`` behind ``model`` (unwraps a ``torch.compile`` wrapper)."""
    return decoder_of(model, "attn.demo.watch")


def fill_positions(model: nn.Module) -> list[int]:
    """Tokens held by each layer's cache: ``[c.size for c in model.kv_caches()]``."""
    return [cache.size for cache in base_model(model).kv_caches()]


class JsonResult:
    """Mixin for the demo's result dataclasses: ``to_dict`` gives every field as a JSON-ready
    value under its own name (``records`` as ``"passes"``, a dict each; tuples as lists), then
    the properties named in ``json_derived``."""

    json_derived: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, object]:
        names = [field.name for field in fields(self)] + list(self.json_derived)  # type: ignore[arg-type]
        return {"passes" if name == "records" else name: _json_value(getattr(self, name)) for name in names}


def _json_value(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return [_json_value(item) for item in value]
    to_dict = getattr(value, "to_dict", None)
    return to_dict() if callable(to_dict) else value


@dataclass(frozen=True)
class PassRecord(JsonResult):
    """What one block of forward passes did to the KV-caches.

    Attributes:
        pattern: the demo step (``"train"``, ``"eval"``, ``"ppo"``, ``"lora-ppo"``, ``"speed"``).
        kind: the kind of pass, in words.
        expect_cache: should the block use the cache?
        fill_before: each layer's fill position before the block.
        fill_after: the same, after.
        buffers_changed: did any key/value buffer change?
        autograd_history: does any cache buffer require grad or have a ``grad_fn`` after?
        count: forward passes of this kind in the block (training steps, ...).
    """

    json_derived = ("used_cache", "ok")

    pattern: str
    kind: str
    expect_cache: bool
    fill_before: tuple[int, ...]
    fill_after: tuple[int, ...]
    buffers_changed: bool
    autograd_history: bool
    count: int = 1

    @property
    def used_cache(self) -> bool:
        return self.fill_before != self.fill_after or self.buffers_changed

    @property
    def ok(self) -> bool:
        """The cache was used exactly as expected, and holds no autograd history."""
        if self.autograd_history or not self.fill_before:
            return False
        if self.expect_cache:
            # every layer advanced by the same number of tokens
            advanced = {after - before for before, after in zip(self.fill_before, self.fill_after, strict=True)}
            return len(advanced) == 1 and advanced.pop() > 0 and self.buffers_changed
        return not self.used_cache

    def problem(self) -> str | None:
        """Why the record is not ``ok``, in a sentence; ``None`` when it is."""
        if self.ok:
            return None
        where = f"{self.pattern}: {self.kind}"
        fills = (
            f"fill positions {list(self.fill_before)} -> {list(self.fill_after)}, "
            f"buffers changed: {self.buffers_changed}"
        )
        if not self.fill_before:
            return f"{where}: the model had no caches set up; the demo keeps them set up throughout"
        if self.autograd_history:
            return f"{where}: a cache buffer holds autograd history ({fills})"
        if self.expect_cache:
            return f"{where}: should have used the cache in every layer, but {fills}"
        return f"{where}: should have left the cache untouched, but {fills}"


@contextmanager
def watch(
    model: nn.Module, records: list[PassRecord], *, pattern: str, kind: str, expect_cache: bool, count: int = 1
) -> Iterator[None]:
    """Records in ``records`` what the block did to ``model``'s caches.

    Example::

        records = []
        with watch(model, records, pattern="eval", kind="scoring", expect_cache=False):
            with torch.inference_mode(), attn.disable_kv_cache(model):
                model(tokens)
        assert records[0].ok
    """
    caches = base_model(model).kv_caches()
    fill_before = tuple(cache.size for cache in caches)
    with torch.inference_mode(False), torch.no_grad():
        before = [(cache.k_cache.clone(), cache.v_cache.clone()) for cache in caches]
    yield
    caches_after = base_model(model).kv_caches()
    if [id(c) for c in caches_after] != [id(c) for c in caches]:
        raise RuntimeError(f"{pattern}: {kind}: the model's caches were replaced during the block; set them up once")
    changed = any(
        not (torch.equal(k0, cache.k_cache) and torch.equal(v0, cache.v_cache))
        for (k0, v0), cache in zip(before, caches, strict=True)
    )
    history = any(
        buffer.requires_grad or buffer.grad_fn is not None
        for cache in caches
        for buffer in (cache.k_cache, cache.v_cache, cache.cache_pos)
    )
    records.append(
        PassRecord(
            pattern=pattern,
            kind=kind,
            expect_cache=expect_cache,
            fill_before=fill_before,
            fill_after=tuple(cache.size for cache in caches),
            buffers_changed=changed,
            autograd_history=history,
            count=count,
        )
    )
