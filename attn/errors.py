"""How attn quotes another library's error inside its own: one line of it."""

from __future__ import annotations

__all__ = ["first_line"]


def first_line(error: BaseException) -> str:
    """``error`` as ``Type: first line of its message`` (tracebacks and long messages span
    many lines; the message that quotes it says what to do)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
