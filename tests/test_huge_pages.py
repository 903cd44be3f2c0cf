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
from hypothesis import example, given, settings
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


# -- KV-caches (TransformerDecoder.setup_caches) and huge_page_zeros ------------------------


def _caches(model: attn.TransformerDecoder) -> list[torch.Tensor]:
    """Every layer's keys and values, in the order a step reads them."""
    return [t for layer in model.layers for t in (layer.attn.kv_cache.k_cache, layer.attn.kv_cache.v_cache)]


@needs_huge_pages
def test_setup_caches_puts_every_layers_keys_and_values_in_one_huge_page_mapping() -> None:
    model = tiny_model(8, max_seq_len=128, embed_dim=128)  # 2 layers of (64, 2, 128, 32) fp32: 8 MiB of caches
    with torch.inference_mode():  # generate sets its caches up so: they must still be normal tensors
        model.setup_caches(64, 128)
    caches = _caches(model)
    assert caches[0].data_ptr() % HUGE_PAGE == 0
    assert {_mapping(t.data_ptr()) for t in caches} == {_mapping(caches[0].data_ptr())}
    assert len({t.untyped_storage().data_ptr() for t in caches}) == len(caches)  # a storage each
    for t in caches:
        assert not t.is_inference() and t.is_contiguous() and t.dtype == torch.float32 and not t.any()
    caches[0].fill_(1.0)  # a written page of the mapping is a huge one
    assert huge_page_bytes(caches[0]) >= HUGE_PAGE
    model.setup_caches(64, 128, huge_pages=False)
    assert all(_mapping(t.data_ptr()) != _mapping(caches[0].data_ptr()) for t in _caches(model))
    assert huge_page_bytes(_caches(model)[0]) == 0


@needs_huge_pages
def test_caches_under_a_huge_page_stay_ordinary_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model(9)
    model.setup_caches(2, 16)  # KiB
    assert all(t.data_ptr() % HUGE_PAGE != 0 or huge_page_bytes(t) == 0 for t in _caches(model))
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    model = tiny_model(9, max_seq_len=128, embed_dim=128)
    model.setup_caches(64, 128)  # MiB, but no huge pages on offer
    assert huge_page_bytes(_caches(model)[0].fill_(1.0)) == 0


@needs_huge_pages
def test_a_refused_cache_mapping_warns_and_allocates_as_usual(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    model = tiny_model(10, max_seq_len=128, embed_dim=128)
    with pytest.warns(huge_pages.HugePageWarning, match=r"setup_caches: the system refused a \d+ MiB mapping"):
        model.setup_caches(64, 128)
    assert all(t.shape == (64, 2, 128, 32) and not t.any() for t in _caches(model))


@needs_huge_pages
@settings(max_examples=examples(6), deadline=None)
@example(rows=40, prompt=20, new=12, dtype=torch.bfloat16, seed=0)  # 5 MiB of caches: placed
@given(
    rows=st.integers(1, 40),
    prompt=st.integers(1, 20),
    new=st.integers(1, 12),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_generation_over_huge_page_caches_equals_ordinary_ones(
    rows: int, prompt: int, new: int, dtype: torch.dtype, seed: int
) -> None:
    """The same tokens, log-probs and logits bit for bit, and the same cache contents after,
    whichever memory the caches are in (they are placed where they take a huge page or more)."""
    model = tiny_model(seed % 7, max_seq_len=256, num_layers=4, embed_dim=64, num_heads=4).to(dtype)  # heads of 16
    prompts = torch.randint(0, model.config.vocab_size, (rows, prompt), generator=torch.Generator().manual_seed(seed))
    results = []
    for placed in (True, False):
        model.setup_caches(rows, 256, huge_pages=placed)
        with torch.inference_mode():
            out = attn.generate(model, prompts, max_new_tokens=new, return_logits=True)
        results.append((out, [t.clone() for t in _caches(model)]))
        if placed:
            total = sum(t.numel() * t.element_size() for t in _caches(model))
            assert (huge_page_bytes(_caches(model)[0]) > 0) == (total >= HUGE_PAGE)
    (a, caches_a), (b, caches_b) = results
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs) and torch.equal(a.logits, b.logits)
    assert all(torch.equal(x, y) for x, y in zip(caches_a, caches_b, strict=True))


@needs_huge_pages
@settings(max_examples=examples(10), deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 700), min_size=1, max_size=3), min_size=1, max_size=6),
    dtypes=st.lists(st.sampled_from([torch.float32, torch.bfloat16, torch.int8]), min_size=6, max_size=6),
)
def test_huge_page_zeros_are_disjoint_aligned_zeros_of_each_shape(shapes: list[list[int]], dtypes: list) -> None:
    wanted = [((HUGE_PAGE // 4,), torch.float32)] + [(tuple(s), dtypes[i]) for i, s in enumerate(shapes)]
    tensors = huge_pages.huge_page_zeros(wanted, "a test")
    assert tensors is not None
    windows = []
    for t, (shape, dtype) in zip(tensors, wanted, strict=True):
        assert t.shape == shape and t.dtype == dtype and not t.any() and not t.is_inference()
        windows.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    assert windows[0][0] % HUGE_PAGE == 0 and all(start % 64 == 0 for start, _ in windows)
    windows.sort()
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(windows))
    assert huge_pages.huge_page_zeros([((16,), torch.float32)], "a test") is None  # under a huge page
