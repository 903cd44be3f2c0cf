"""The policy contract: which kinds of pass use the cache, under each policy and flag.

Every cell of (policy x kind of pass x flag) is checked against the cache's own fill
position and buffers, not against what the code meant to do.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import warnings
from collections.abc import Iterator

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import attn
from attn.compat import parse_torch_version
from attn.policy import CachePolicy, CompatWarning

from .conftest import assert_cache_unchanged, cache_state, tiny_model


@contextlib.contextmanager
def _grad_inside_inference_mode() -> Iterator[None]:
    with torch.inference_mode(), torch.enable_grad():
        yield


PASSES = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "grad": contextlib.nullcontext,
    "enable_grad inside inference_mode": _grad_inside_inference_mode,
}
GRAD_KINDS = {"grad", "enable_grad inside inference_mode"}
FLAGS = {
    "no flag": lambda model: contextlib.nullcontext(),
    "flag on": lambda model: attn.kv_cache_mode(model, True),
    "disabled": attn.disable_kv_cache,
}


def expected_outcome(policy: CachePolicy, kind: str, flag: str) -> str:
    """The contract, restated independently of the implementation: 'cache', 'none' or 'error'."""
    if flag == "flag on" and kind in GRAD_KINDS:
        return "error"
    if flag == "disabled" or kind in GRAD_KINDS:
        return "none"
    if flag == "flag on":
        return "cache"
    return "cache" if policy is CachePolicy.INFERENCE and kind == "inference_mode" else "none"


@pytest.mark.parametrize(("kind", "flag"), list(itertools.product(PASSES, FLAGS)))
def test_policy_table(policy: CachePolicy, kind: str, flag: str) -> None:
    model = tiny_model()
    model.setup_caches(2, 16)
    with attn.cached_inference(model):
        model(torch.randint(0, 61, (2, 3)))  # something in the cache to corrupt
    before = cache_state(model)
    tokens = torch.randint(0, 61, (2, 4))
    outcome = expected_outcome(policy, kind, flag)
    # Inference mode alone: under FLAG it does not cache, and says so; under INFERENCE it is
    # appended to the prefill above, which the flag ended: the scoring trap. Each warns.
    warns = contextlib.nullcontext()
    if kind == "inference_mode" and flag == "no flag":
        attn.policy._reset_warnings()
        says = "did not use or change the cache" if policy is CachePolicy.FLAG else "already holds 3 tokens"
        warns = pytest.warns(attn.CompatWarning, match=says)
    with FLAGS[flag](model), PASSES[kind]():
        assert model.caches_are_enabled() is (outcome == "cache")
        if outcome == "error":
            with pytest.raises(RuntimeError, match="grad-enabled forward pass ran with the KV-cache flag on"):
                model(tokens)
        else:
            with warns:
                model(tokens)
    if outcome == "cache":
        assert all(c.size == 7 for c in model.kv_caches())
    else:
        assert_cache_unchanged(model, before)


def test_inference_tensor_ids_in_a_no_grad_pass_do_not_use_the_cache(policy: CachePolicy) -> None:
    model = tiny_model()
    model.setup_caches(1, 16)
    with torch.inference_mode():
        tokens = torch.randint(0, 61, (1, 4))
    before = cache_state(model)
    with torch.no_grad():
        model(tokens)
    assert_cache_unchanged(model, before)


def test_training_step_never_touches_the_cache(policy: CachePolicy) -> None:
    model = tiny_model()
    model.setup_caches(2, 16)
    with attn.cached_inference(model):
        model(torch.randint(0, 61, (2, 5)))
    before = cache_state(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 61, (2, 6))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    assert_cache_unchanged(model, before)


def test_cached_inference_caches_under_every_policy(policy: CachePolicy) -> None:
    model = tiny_model()
    model.setup_caches(1, 16)
    with attn.cached_inference(model):
        assert model.caches_are_enabled()
        model(torch.randint(0, 61, (1, 4)))
        model(torch.randint(0, 61, (1, 1)))
    assert model.kv_caches()[0].size == 5


def test_no_caches_means_nothing_is_enabled(policy: CachePolicy) -> None:
    model = tiny_model()
    with torch.inference_mode():
        assert not model.caches_are_enabled()
        model(torch.randint(0, 61, (1, 4)))


def test_the_readme_loop_uses_the_cache_by_default(restore_policy: None) -> None:
    """With no policy set, plain torch.inference_mode() decodes with the cache: the tokens of
    a loop that recomputes the whole sequence every step, and a cache that holds it all."""
    attn.policy.set_cache_policy(None)
    model = tiny_model(9)
    prompt = torch.randint(0, 61, (1, 6), generator=torch.Generator().manual_seed(1))
    reference = prompt.clone()
    with torch.no_grad():
        for _ in range(10):
            reference = torch.cat((reference, model(reference)[:, -1:].argmax(-1)), 1)
    model.setup_caches(batch_size=1, max_seq_len=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eager code doing the right thing gets no warning
        with torch.inference_mode():
            logits = model(prompt)
            generated = []
            for _ in range(10):
                token = logits[:, -1:].argmax(-1)
                generated.append(int(token))
                logits = model(token)
    assert generated == reference[0, 6:].tolist()
    assert model.kv_caches()[0].size == 16


def _compat_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, attn.CompatWarning)]


def test_scoring_under_inference_mode_after_a_generation_warns_once_at_the_users_line(
    restore_policy: None,
) -> None:
    attn.policy.set_cache_policy(None)
    attn.policy._reset_warnings()
    model = tiny_model(10)
    model.setup_caches(2, 32)
    batch = torch.randint(0, 61, (2, 5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.inference_mode():
            logits = model(batch[:, :3])  # a prefill: no warning
            logits = model(batch[:, 3:])  # a second prefill chunk: no warning
            logits = model(logits[:, -1:].argmax(-1))  # a decode step: no warning
        assert not _compat_warnings(caught)
        with torch.inference_mode():
            model(batch)  # scoring by mistake: appended to the 6 tokens above
            model(batch)  # once per process
        line = inspect.currentframe().f_lineno - 2
    notes = _compat_warnings(caught)
    assert len(notes) == 1
    message = str(notes[0].message)
    assert "5 tokens per row" in message and "already holds 6 tokens" in message
    assert "torch.no_grad()" in message and "disable_kv_cache" in message and "reset_caches()" in message
    assert (notes[0].filename, notes[0].lineno) == (__file__, line)  # the first model(batch) above
    assert model.kv_caches()[0].size == 16  # it still did what inference mode means


def test_generate_gives_no_warning(restore_policy: None) -> None:
    attn.policy.set_cache_policy(None)
    attn.policy._reset_warnings()
    model = tiny_model(11)
    model.setup_caches(2, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attn.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=6)
        attn.generate(model, [[1, 2, 3, 4, 5], [4, 5]], max_new_tokens=6)  # again, on the filled cache
        with torch.no_grad():
            model(torch.randint(0, 61, (2, 4)))


# The scoring trap's rule, restated as a state machine: a pass of several tokens under plain
# inference mode continues the cache's sequence silently only while that sequence is "open",
# i.e. the latest thing that changed the cache was such a pass (a prefill in chunks).
TRAP_OPS = st.one_of(
    st.tuples(st.sampled_from(["plain", "flag", "no_grad"]), st.integers(1, 3)),
    st.tuples(st.sampled_from(["generate"]), st.integers(1, 2)),
    st.tuples(st.sampled_from(["rewind", "reset", "select"]), st.just(0)),
)


@example(ops=[("generate", 1), ("plain", 2)])  # max_new_tokens=1 leaves the prompt alone
@example(ops=[("flag", 3), ("plain", 4)])  # a prefill alone, under the flag
@example(ops=[("plain", 3), ("rewind", 0), ("plain", 2)])
@example(ops=[("plain", 3), ("plain", 1), ("plain", 2)])  # the 2-token boundary after a step
@example(ops=[("plain", 3), ("plain", 2), ("no_grad", 3), ("plain", 3)])  # chunks; scoring between
@example(ops=[("plain", 3), ("reset", 0), ("flag", 3), ("plain", 2)])  # reset clears the state
@given(ops=st.lists(TRAP_OPS, min_size=1, max_size=8))
def test_the_scoring_trap_warns_exactly_when_a_finished_sequence_is_continued(
    ops: list[tuple[str, int]], restore_policy: None
) -> None:
    attn.policy.set_cache_policy(None)
    model = tiny_model(12)
    model.setup_caches(2, 64)
    sequence_open = False
    for op, n in ops:
        filled = model.kv_caches()[0].size
        tokens = torch.randint(0, 61, (2, n)) if n else None
        attn.policy._reset_warnings()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if op == "plain":
                with torch.inference_mode():
                    model(tokens)
            elif op == "flag":
                with attn.cached_inference(model):
                    model(tokens)
            elif op == "no_grad":
                with torch.no_grad():
                    model(tokens)
            elif op == "generate":
                attn.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=n)
            elif op == "rewind":
                model.rewind_caches(filled // 2)
            elif op == "reset":
                model.reset_caches()
            else:
                model.select_caches([1, 0])
        expected = op == "plain" and n > 1 and filled > 0 and not sequence_open
        trap = [w for w in _compat_warnings(caught) if "earlier sequence" in str(w.message)]
        assert len(trap) == expected, (op, n, filled, sequence_open)
        if op != "no_grad":
            sequence_open = op == "plain" and n > 1


def test_a_stop_on_the_first_token_ends_the_sequence(restore_policy: None) -> None:
    attn.policy.set_cache_policy(None)
    attn.policy._reset_warnings()
    model = tiny_model(13)
    model.setup_caches(1, 32)
    first = attn.generate(model, [[1, 2, 3]], max_new_tokens=1).tokens[0, -1].item()
    out = attn.generate(model, [[1, 2, 3]], max_new_tokens=8, stop_tokens=[first])
    assert out.padding_mask[0, 3:].tolist() == [True] + [False] * 7  # it stopped on the first token
    trap = pytest.warns(attn.CompatWarning, match="already holds 3 tokens of an earlier sequence")
    with trap, torch.inference_mode():
        model(torch.randint(0, 61, (1, 4)))


# -- the policy in force, and its warnings ---------------------------------------------------


def test_default_policy_is_inference_on_every_release(monkeypatch: pytest.MonkeyPatch, restore_policy: None) -> None:
    monkeypatch.delenv(attn.policy.ENV_VAR, raising=False)
    decision = attn.policy.set_cache_policy(None)
    assert decision.source == "default"
    assert decision.policy is CachePolicy.INFERENCE
    assert decision.torch_version == parse_torch_version(torch.__version__)


@pytest.mark.parametrize("value", ["inference", "FLAG", " flag "])
def test_policy_from_environment(monkeypatch: pytest.MonkeyPatch, restore_policy: None, value: str) -> None:
    monkeypatch.setenv(attn.policy.ENV_VAR, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompatWarning)
        decision = attn.policy.set_cache_policy(None)
    assert decision.source == "environment"
    assert decision.policy is CachePolicy(value.strip().lower())
    assert attn.policy.cache_policy() == decision


def test_bad_environment_value_is_an_error(monkeypatch: pytest.MonkeyPatch, restore_policy: None) -> None:
    monkeypatch.setenv(attn.policy.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=r"ATTN_CACHE_POLICY is 'sometimes'.*'inference', 'flag'"):
        attn.policy.set_cache_policy(None)


def test_override_beats_environment(monkeypatch: pytest.MonkeyPatch, restore_policy: None) -> None:
    monkeypatch.setenv(attn.policy.ENV_VAR, "inference")
    decision = attn.policy.set_cache_policy("flag")
    assert (decision.policy, decision.source) == (CachePolicy.FLAG, "override")
    with pytest.raises(ValueError, match="not a cache policy"):
        attn.policy.set_cache_policy("never")
    assert attn.policy.cache_policy().policy is CachePolicy.FLAG  # a failed call changes nothing


@pytest.mark.parametrize("policy_value", [None, "flag", "inference"])
def test_setting_up_caches_never_warns(
    monkeypatch: pytest.MonkeyPatch, restore_policy: None, policy_value: str | None
) -> None:
    monkeypatch.delenv(attn.policy.ENV_VAR, raising=False)
    attn.policy.set_cache_policy(policy_value)
    attn.policy._reset_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_model().setup_caches(1, 8)
    assert not [w for w in caught if issubclass(w.category, CompatWarning)]


def test_flag_policy_warns_once_when_inference_mode_is_ignored(restore_policy: None) -> None:
    attn.policy.set_cache_policy("flag")
    attn.policy._reset_warnings()
    model = tiny_model()
    model.setup_caches(1, 16)
    tokens = torch.randint(0, 61, (1, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.inference_mode():
            model(tokens)
            model(tokens)
    messages = [str(w.message) for w in caught if issubclass(w.category, CompatWarning)]
    assert len(messages) == 1 and "did not use or change the cache" in messages[0]
    assert model.kv_caches()[0].size == 0
    attn.policy._reset_warnings()
    with warnings.catch_warnings(record=True) as caught:  # disable_kv_cache is a deliberate choice
        warnings.simplefilter("always")
        with torch.inference_mode(), attn.disable_kv_cache(model):
            model(tokens)
    assert not [w for w in caught if issubclass(w.category, CompatWarning)]


def test_compat_warning_is_a_filterable_user_warning() -> None:
    assert issubclass(CompatWarning, UserWarning)


def test_report_names_the_policy_its_source_and_the_override() -> None:
    report = attn.policy.policy_report()
    decision = attn.policy.cache_policy()
    assert decision.policy.value in report and decision.reason in report and attn.policy.ENV_VAR in report
