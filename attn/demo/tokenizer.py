"""A character-level tokenizer for the addition task: digits, ``+``, ``=``, and three specials.

Ids: ``pad`` 0, ``bos`` 1, ``eos`` 2, then ``0``-``9``, ``+`` and ``=``. ``pad`` is 0 so it
matches ``attn.generate``'s default ``pad_id``.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["CharTokenizer"]


class CharTokenizer:
    """Maps the characters of ``"37+45=82"`` to ids and back.

    Example::

        >>> tok = CharTokenizer()
        >>> tok.encode("3+4=", bos=True)
        [1, 6, 13, 7, 14]
        >>> tok.decode([6, 13, 7, 14, 10, 2])
        '3+4=7'
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2
    chars = "0123456789+="

    def __init__(self) -> None:
        self._ids = {char: i + 3 for i, char in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return 3 + len(self.chars)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of ``text``, optionally with ``bos`` in front and ``eos`` at the end.

        Raises:
            ValueError: ``text`` holds a character outside ``0-9 + =``.
        """
        unknown = sorted({char for char in text if char not in self._ids})
        if unknown:
            raise ValueError(f"cannot encode {text!r}: characters {unknown} are not in the vocabulary {self.chars!r}")
        ids = [self._ids[char] for char in text]
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids``: stops at the first ``eos``, skips ``pad`` and ``bos``."""
        text = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            text.append(self.chars[i - 3])
        return "".join(text)
