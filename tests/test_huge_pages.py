"""attn/huge_pages.py: parameters moved into one huge-page mapping keep their objects, values
and storages of their own; what cannot move stays; the mapping goes with the last of them."""

from __future__ import annotations

import copy
import gc
import io
import itertools
import mmap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

import attn
from attn import huge_pages
from attn.checkpoint import load_pretrained, save_pretrained
from attn.huge_pages import HUGE_PAGE, huge_page_bytes, huge_pages_available, place_in_huge_pages
from tests.conftest import examples, tiny_model

needs_huge_pages = pytest.mark.skipif(
    not huge_pages_available(), reason="this system offers no transparent huge pages (THP mode never, or not Linux)"
)


def _big_model(seed: int = 0) -> attn.TransformerDecoder:
    """A model of a few MiB: more than one huge page of parameters (a tiny one has less)."""
    return tiny_model(seed, vocab_size=4096, embed_dim=128, hidden_dim=256)


def _mapping(address: int) -> tuple[int, int] | None:
    """The (start, end) of the mapping in /proc/self/maps that holds ``address``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(bound, 16) for bound in line.split()[0].split("-"))
        if low <= address < high:
            return low, high
    return None


@needs_huge_pages
def test_parameters_move_with_their_objects_and_values_into_huge_pages() -> None:
    model = _big_model()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    tokens = torch.randint(0, 4096, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens)
    moved = place_in_huge_pages(model)
    assert moved >= sum(p.numel() * p.element_size() for p in params)
    assert list(model.parameters()) == params  # the same objects: an optimizer's references hold
    for p, old in zip(params, before, strict=True):
        assert isinstance(p, nn.Parameter) and p.requires_grad
        assert p.dtype == old.dtype and p.shape == old.shape and torch.equal(p, old)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), logits, rtol=0, atol=0)
    first = params[0].data_ptr()
    assert first % HUGE_PAGE == 0
    windows = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in params)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(windows))  # no two overlap
    assert all(start % 64 == 0 for start, _ in windows)
    assert len({p.untyped_storage().data_ptr() for p in params}) == len(params)  # a storage each
    assert huge_page_bytes(params[0]) >= HUGE_PAGE  # the kernel backs the mapping with huge pages


@needs_huge_pages
def test_moved_parameters_train_and_save_as_separate_tensors(tmp_path: Path) -> None:
    model = _big_model(1)
    place_in_huge_pages(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 4096, (2, 7), generator=torch.Generator().manual_seed(1))
    before = model.tok_embeddings.weight.detach().clone()
    model(tokens).float().logsumexp(-1).mean().backward()
    optimizer.step()  # in place, into the mapping
    assert not torch.equal(model.tok_embeddings.weight, before)
    state = {name: p.detach() for name, p in model.named_parameters()}
    save_file(state, tmp_path / "w.safetensors")  # refuses tensors that share a storage
    for name, value in load_file(tmp_path / "w.safetensors").items():
        assert torch.equal(value, state[name]), name


@needs_huge_pages
def test_the_mapping_is_unmapped_with_its_last_parameter() -> None:
    model = _big_model(2)
    place_in_huge_pages(model)
    address = next(model.parameters()).data_ptr()
    assert _mapping(address) is not None
    keep = model.layers[0].attn.q_proj.weight.detach().clone()
    kept = model.layers[0].attn.q_proj.weight.detach()  # one window keeps the whole mapping
    del model
    gc.collect()
    assert _mapping(address) is not None and torch.equal(kept, keep)  # still mapped, still its values
    del kept
    gc.collect()
    assert _mapping(address) is None


@needs_huge_pages
def test_parameters_that_cannot_move_stay() -> None:
    module = nn.Module()
    module.big = nn.Parameter(torch.randn(1024, 1024))  # 4 MiB: moves
    base = torch.randn(64, 64)
    module.first = nn.Parameter(base)  # two parameters on one storage: both stay, still shared
    module.second = nn.Parameter(base.view(-1))
    module.strided = nn.Parameter(torch.randn(64, 32).t())  # not contiguous
    module.part = nn.Parameter(torch.randn(100)[10:60])  # a window of a larger storage
    stay = {name: (p.data_ptr(), p.detach().clone()) for name, p in module.named_parameters() if name != "big"}
    big = module.big.detach().clone()
    assert place_in_huge_pages(module) == 4 << 20
    assert torch.equal(module.big, big) and module.big.data_ptr() % HUGE_PAGE == 0
    for name, (pointer, value) in stay.items():
        p = getattr(module, name)
        assert p.data_ptr() == pointer and torch.equal(p, value), name


def test_nothing_moves_without_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    model = _big_model(3)
    pointers = [p.data_ptr() for p in model.parameters()]
    assert place_in_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == pointers


@needs_huge_pages
@pytest.mark.parametrize("refused", ["mmap", "madvise"])
def test_a_refused_mapping_warns_and_moves_nothing(refused: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    class Unadvised(mmap.mmap):  # a kernel built without THP: EINVAL
        madvise = refuse

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse if refused == "mmap" else Unadvised)
    model = _big_model(7)
    pointers = [p.data_ptr() for p in model.parameters()]
    with pytest.warns(huge_pages.HugePageWarning, match=r"refused a \d+ MiB mapping .*Cannot allocate memory"):
        assert place_in_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == pointers


@needs_huge_pages
def test_less_than_a_huge_page_stays_where_it_is() -> None:
    model = tiny_model(4)  # a few KiB: an arena of 4 KiB pages would read no faster
    assert sum(p.numel() * p.element_size() for p in model.parameters()) < HUGE_PAGE
    pointers = [p.data_ptr() for p in model.parameters()]
    assert place_in_huge_pages(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == pointers


@needs_huge_pages
@settings(max_examples=examples(10), deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 700), min_size=1, max_size=3), min_size=1, max_size=6),
    dtypes=st.lists(
        st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int8]), min_size=6, max_size=6
    ),
)
def test_any_parameters_keep_their_values_in_disjoint_aligned_windows(shapes: list[list[int]], dtypes: list) -> None:
    module = nn.Module()
    module.anchor = nn.Parameter(torch.zeros(HUGE_PAGE // 4))  # enough to make a mapping
    generator = torch.Generator().manual_seed(len(shapes))
    for i, shape in enumerate(shapes):
        value = torch.randn(shape, generator=generator).mul(50).to(dtypes[i])
        setattr(module, f"p{i}", nn.Parameter(value, requires_grad=value.is_floating_point()))
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    place_in_huge_pages(module)
    windows = []
    for name, p in module.named_parameters():
        assert p.dtype == before[name].dtype and torch.equal(p, before[name]), name
        windows.append((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()))
    windows.sort()
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(windows))
    assert all(start % 64 == 0 for start, _ in windows)


@needs_huge_pages
def test_load_pretrained_reads_into_huge_pages_unless_asked_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _big_model(5)
    directory = save_pretrained(model, tmp_path / "ckpt")
    loaded = load_pretrained(directory)
    first = loaded.tok_embeddings.weight.data_ptr()
    assert first % HUGE_PAGE == 0 and huge_page_bytes(loaded.tok_embeddings.weight) >= HUGE_PAGE
    assert _mapping(first) == _mapping(loaded.layers[-1].mlp.down_proj.weight.data_ptr())  # one mapping
    calls = []
    monkeypatch.setattr("attn.checkpoint.place_in_huge_pages", lambda *args, **kwargs: calls.append(args))
    plain = load_pretrained(directory, huge_pages=False)
    assert calls == []
    for (name, a), b, c in zip(model.named_parameters(), loaded.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), name


@needs_huge_pages
def test_moved_parameters_copy_pickle_and_share_as_any() -> None:
    model = _big_model(6)
    place_in_huge_pages(model)
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    twin = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    model.share_memory()  # torch.multiprocessing moves each storage into shared memory
    for name, p in model.named_parameters():
        assert p.is_shared() and torch.equal(p, values[name]), name
        assert torch.equal(dict(twin.named_parameters())[name], values[name])
        assert torch.equal(loaded[name], values[name])
