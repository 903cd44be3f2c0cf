"""``attn.swap.swapped_attribute``: each object gets its own value back, also after a raise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attn.swap import swapped_attribute


@given(before=st.lists(st.integers(), min_size=1, max_size=6), outer=st.integers(), inner=st.integers())
def test_nested_blocks_restore_each_object(before: list[int], outer: int, inner: int) -> None:
    objects = [SimpleNamespace(flag=value) for value in before]
    with swapped_attribute(objects, "flag", outer):
        assert [o.flag for o in objects] == [outer] * len(before)
        with pytest.raises(KeyError), swapped_attribute(objects, "flag", inner):
            assert [o.flag for o in objects] == [inner] * len(before)
            raise KeyError("the block fails")
        assert [o.flag for o in objects] == [outer] * len(before)
    assert [o.flag for o in objects] == before


def test_a_missing_attribute_changes_nothing() -> None:
    objects = [SimpleNamespace(flag=1), SimpleNamespace()]
    with pytest.raises(AttributeError), swapped_attribute(objects, "flag", 2):
        pass
    assert objects[0].flag == 1 and not hasattr(objects[1], "flag")
