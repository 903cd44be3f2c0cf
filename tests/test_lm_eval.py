"""attn/integrations/lm_eval.py end to end with lm-evaluation-harness, fully offline.

The scenario that broke the original recipe: one ``simple_evaluate`` run with a generation
task listed before a multiple-choice log-likelihood task, so the harness calls
``generate_until`` and then ``loglikelihood`` on the same model. The log-likelihoods must
equal, exactly, those of the same tasks run alone on a fresh model, and no scoring request
may touch the cache, also when the user set up caches that generation then filled.

Task YAMLs and their JSONL data are written into a temporary directory at test time, with
absolute ``data_files`` paths (lm_eval 0.4 resolves them against the working directory);
they use only the harness's built-in metrics (``exact_match``, ``acc``, perplexities), which
need no download.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before lm_eval imports datasets / huggingface_hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
import lm_eval
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

import attn
from attn import cli
from attn.checkpoint import save_pretrained
from attn.integrations.lm_eval import AttnLM, TokenizerFile
from attn.policy import CachePolicy
from tests.conftest import assert_cache_unchanged, cache_state, tiny_model

pytestmark = pytest.mark.slow  # and its install: pip install -e '.[test,lm-eval]'

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128
EOS = 0
BATCH = 4
GEN, MC, ROLLING = "attn_test_gen", "attn_test_mc", "attn_test_rolling"


class CharTokenizer:
    """One token per ASCII character; id 0 is EOS."""

    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        ids = [ord(c) for c in text]
        if any(not 0 < i < VOCAB for i in ids):
            raise ValueError(f"CharTokenizer encodes ASCII 1-127 only, got {text!r}")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids if i != EOS)


def _model(seed: int = 0) -> attn.TransformerDecoder:
    return tiny_model(seed, vocab_size=VOCAB, embed_dim=64, hidden_dim=96, max_seq_len=128)


# ---------------------------------------------------------------------------- task files


GEN_DOCS = [
    {"question": f"Q: {a} plus {b} is", "answer": f" {a + b}"} for a, b in [(1, 2), (3, 4), (10, 5), (7, 7), (0, 9)]
]
MC_DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " loud", " seven"], "label": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "label": 0},
    {"question": "Water is", "choices": [" dry", " wet", " square"], "label": 1},
    {"question": "Cats say", "choices": [" woof", " moo", " meow"], "label": 2},
    {"question": "A year has twelve", "choices": [" months", " days", " hours", " weeks"], "label": 0},
    {"question": "Fire is", "choices": [" cold", " hot"], "label": 1},
]
ROLLING_DOCS = [
    {"text": "the quick brown fox jumps over the lazy dog"},
    {"text": "a" * 40 + " and then some more words that run past the window of the model " * 3},
]


def _task_yaml(name: str, data: Path, body: str) -> str:
    return (
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "test_split: test\n" + body
    )


@pytest.fixture(scope="module")
def task_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of three small tasks, one per request type."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    specs = {
        GEN: (
            GEN_DOCS,
            "output_type: generate_until\n"
            'doc_to_text: "{{question}}"\n'
            'doc_to_target: "{{answer}}"\n'
            "generation_kwargs:\n"
            '  until: ["\\n", "."]\n'
            "  max_gen_toks: 12\n"
            "  do_sample: false\n"
            "metric_list:\n  - metric: exact_match\n",
        ),
        MC: (
            MC_DOCS,
            "output_type: multiple_choice\n"
            'doc_to_text: "{{question}}"\n'
            'doc_to_choice: "{{choices}}"\n'
            "doc_to_target: label\n"
            "metric_list:\n  - metric: acc\n",
        ),
        ROLLING: (
            ROLLING_DOCS,
            "output_type: loglikelihood_rolling\n"
            'doc_to_text: ""\n'
            'doc_to_target: "{{text}}"\n'
            "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
        ),
    }
    for name, (docs, body) in specs.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (root / f"{name}.yaml").write_text(_task_yaml(name, data, body))
    return root


@pytest.fixture(scope="module")
def task_manager(task_root: Path) -> TaskManager:
    return TaskManager(include_path=str(task_root), include_defaults=False)


def _evaluate(model: Any, tasks: list[str], task_manager: TaskManager, **kwargs: Any) -> dict[str, Any]:
    results = lm_eval.simple_evaluate(
        model=model, tasks=tasks, task_manager=task_manager, log_samples=True, bootstrap_iters=0, **kwargs
    )
    assert results is not None
    return results


def _responses(results: dict[str, Any], task: str) -> list[Any]:
    """Each document's raw responses, in document order."""
    samples = sorted(results["samples"][task], key=lambda sample: sample["doc_id"])
    return [sample["resps"] for sample in samples]


class RecordingLM(AttnLM):
    """Records the order of request types, and checks each scoring call leaves the caches alone."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        self.calls.append("generate_until")
        return super().generate_until(requests, disable_tqdm)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self.calls.append("loglikelihood")
        before = cache_state(self.model)
        results = super().loglikelihood(requests, disable_tqdm)
        assert_cache_unchanged(self.model, before)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        self.calls.append("loglikelihood_rolling")
        before = cache_state(self.model)
        results = super().loglikelihood_rolling(requests, disable_tqdm)
        assert_cache_unchanged(self.model, before)
        return results


CHECKPOINT_SEED = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``_model(CHECKPOINT_SEED)`` saved as a Hugging Face directory, with a tokenizer.json
    that tokenizes as ``CharTokenizer`` does, and EOS in config.json."""
    tokenizers = pytest.importorskip("tokenizers")  # AttnLM's TokenizerFile reads tokenizer.json with it
    directory = save_pretrained(_model(seed=CHECKPOINT_SEED), tmp_path_factory.mktemp("ckpt"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": EOS}))
    vocab = {"<eos>": EOS, **{chr(i): i for i in range(1, VOCAB)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")  # one token per character
    tokenizer.decoder = tokenizers.decoders.Fuse()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


# ---------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("user_caches", [False, True], ids=["no-caches", "user-caches"])
def test_generation_first_leaves_loglikelihoods_equal(
    policy: CachePolicy, user_caches: bool, task_manager: TaskManager
) -> None:
    model = _model()
    if user_caches:
        model.setup_caches(BATCH, model.config.max_seq_len)
    lm = RecordingLM(model, CharTokenizer(), batch_size=BATCH)
    together = _evaluate(lm, [GEN, MC, ROLLING], task_manager)
    assert lm.calls == ["generate_until", "loglikelihood", "loglikelihood_rolling"]
    generated = [resp[0] for resp in _responses(together, GEN)]
    assert len(generated) == len(GEN_DOCS) and any(generated), generated
    if user_caches:  # generation used the user's caches and left them filled
        assert all(int(cache.cache_pos) > 0 for cache in model.kv_caches())
    else:
        assert not model.caches_are_setup()

    # With user caches, scoring takes full passes (shared contexts need caches of their own).
    fresh = AttnLM(_model(), CharTokenizer(), batch_size=BATCH, shared_context=not user_caches)
    alone = _evaluate(fresh, [MC, ROLLING], task_manager)
    for task in (MC, ROLLING):
        assert _responses(together, task) == _responses(alone, task), task  # exact: the same passes
        assert together["results"][task] == alone["results"][task]


def test_scoring_ignores_a_filled_cache(policy: CachePolicy) -> None:
    model = _model(seed=1)
    model.setup_caches(2, 64)
    lm = AttnLM(model, CharTokenizer(), batch_size=3)
    texts = lm.generate_until(
        [
            Instance("generate_until", {}, ("Hello", {"until": ["\n"], "max_gen_toks": 20}), 0),
            Instance("generate_until", {}, ("Hi there", {"until": ["\n"], "max_gen_toks": 20}), 1),
        ]
    )
    assert len(texts) == 2
    fill = [int(cache.cache_pos) for cache in model.kv_caches()]
    assert all(pos > len("Hi there") for pos in fill), fill
    before = cache_state(model)

    pairs = [("Hello", " world"), ("", "Start"), ("The cat sat on the", " mat"), ("x", "y" * 30)]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    rolling = [Instance("loglikelihood_rolling", {}, (text,), 0) for text in ("some text", "z" * 200)]
    scored, rolled = lm.loglikelihood(requests), lm.loglikelihood_rolling(rolling)
    assert_cache_unchanged(model, before)

    fresh = AttnLM(_model(seed=1), CharTokenizer(), batch_size=3, shared_context=False)
    assert scored == fresh.loglikelihood(requests)
    assert rolled == fresh.loglikelihood_rolling(rolling)


def test_without_disable_the_hazard_is_real(restore_policy: None) -> None:
    """The control: a scoring pass under plain inference mode does use a filled cache here,
    and says so."""
    attn.policy.set_cache_policy(CachePolicy.INFERENCE)
    attn.policy._reset_warnings()
    model = _model(seed=2)
    model.setup_caches(1, 64)
    tokens = torch.tensor([[ord(c) for c in "Hello there"]])
    attn.generate(model, tokens, max_new_tokens=5)
    with torch.inference_mode():
        clean = _score_alone(model, tokens)
        with pytest.warns(attn.CompatWarning, match="already holds 15 tokens of an earlier sequence"):
            stale = model(tokens)  # continues from the cache: positions and keys of the last generation
    assert not torch.allclose(stale, clean)


def _score_alone(model: attn.TransformerDecoder, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(), attn.disable_kv_cache(model):
        return model(tokens)


# ---------------------------------------------------------------------------- against references


def test_loglikelihood_matches_a_plain_forward() -> None:
    model = _model(seed=3)
    tok = CharTokenizer()
    lm = AttnLM(model, tok, batch_size=3)
    pairs = [("Hello", " world"), ("A much longer context here", "!"), ("x", "yz"), ("", "Start")]
    results = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    for (context, continuation), (logprob, greedy) in zip(pairs, results, strict=True):
        prefix = tok.encode(context) if context else [EOS]  # the harness's prefix for an empty context
        target = tok.encode(continuation)
        tokens = torch.tensor([prefix + target])
        with torch.no_grad():
            logprobs = model(tokens[:, :-1]).float().log_softmax(-1)[0, -len(target) :]  # (n, v)
        expected = logprobs.gather(-1, torch.tensor(target)[:, None]).sum().item()
        assert logprob == pytest.approx(expected, abs=1e-4)  # fp32, padded batch vs lone row
        assert greedy == bool((logprobs.argmax(-1) == torch.tensor(target)).all())
    rolled = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("Hello world",), 0)])
    assert rolled[0] == pytest.approx(_logprob(model, [EOS], tok.encode("Hello world")), abs=1e-4)


def _logprob(model: attn.TransformerDecoder, context: list[int], target: list[int]) -> float:
    tokens = torch.tensor([context + target])
    with torch.no_grad():
        logprobs = model(tokens[:, :-1]).float().log_softmax(-1)[0, -len(target) :]  # (n, v)
    return logprobs.gather(-1, torch.tensor(target)[:, None]).sum().item()


def test_rolling_windows_cover_long_text() -> None:
    lm = AttnLM(_model(seed=4), CharTokenizer(), batch_size=2, max_length=16)
    short, long = "abc", "abcdefghij" * 5
    totals = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), 0) for t in (short, long)])
    assert all(t < 0 and torch.isfinite(torch.tensor(t)) for t in totals)
    assert totals[1] < totals[0]  # every one of the 50 tokens is scored once


def test_generate_until_is_attn_generate_cut_at_stops() -> None:
    model = _model(seed=5)
    tok = CharTokenizer()
    lm = AttnLM(model, tok, batch_size=2)
    contexts = ["Once upon", "The end", "Q: 1 plus 1 is"]
    kwargs = {"until": ["q"], "max_gen_toks": 16, "do_sample": False}
    texts = lm.generate_until([Instance("generate_until", {}, (c, dict(kwargs)), i) for i, c in enumerate(contexts)])
    for context, text in zip(contexts, texts, strict=True):
        out = attn.generate(model, [tok.encode(context)], max_new_tokens=16, stop_tokens=[EOS], pad_id=EOS)
        expected = tok.decode(out.generated[0][out.generated_mask[0]].tolist()).split("q", 1)[0]
        assert text == expected
    assert not model.caches_are_setup()


@pytest.mark.slow
def test_registered_name_loads_a_checkpoint(
    tmp_path: Path,
    checkpoint: Path,
    task_root: Path,
    task_manager: TaskManager,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model, directory = _model(seed=CHECKPOINT_SEED), checkpoint
    file_tokenizer = TokenizerFile(directory)
    assert file_tokenizer.encode("Hi there") == CharTokenizer().encode("Hi there")

    by_name = _evaluate("attn", [MC], task_manager, model_args=f"pretrained={directory}", batch_size=BATCH)
    by_object = _evaluate(AttnLM(model, CharTokenizer(), batch_size=BATCH), [MC], task_manager)
    assert _responses(by_name, MC) == _responses(by_object, MC)

    # The command line: lm-eval's own, with attn registered.
    output = tmp_path / "out"
    args = ["run", "--model", "attn", "--model_args", f"pretrained={directory}", "--tasks", MC]
    args += ["--include_path", str(task_root), "--batch_size", str(BATCH), "--output_path", str(output)]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device 'cuda:0' asks for CUDA.*pass --device cpu"):
            cli.main(["lm-eval", *args])  # the harness's default device
    assert cli.main(["lm-eval", *args, "--device", "cpu"]) == 0
    assert MC in capsys.readouterr().out  # the results table
    (written,) = output.rglob("results_*.json")
    accuracy = json.loads(written.read_text())["results"][MC]["acc,none"]
    assert accuracy == by_object["results"][MC]["acc,none"]


@pytest.mark.slow
def test_the_documented_command_in_a_process_of_its_own(
    tmp_path: Path, checkpoint: Path, task_root: Path, task_manager: TaskManager
) -> None:
    """README's command, batch_size in --model_args, in a subprocess: the harness passes its
    own batch_size (1) beside it, which once raised "got multiple values for keyword argument"."""
    output = tmp_path / "out"
    command = [sys.executable, "-m", "attn", "lm-eval", "run", "--model", "attn"]
    command += ["--model_args", f"pretrained={checkpoint},batch_size={BATCH}", "--tasks", f"{MC},{GEN}"]
    command += ["--include_path", str(task_root), "--device", "cpu", "--output_path", str(output)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert MC in proc.stdout and GEN in proc.stdout  # the results table
    (written,) = output.rglob("results_*.json")
    results = json.loads(written.read_text())["results"]
    expected = _evaluate(
        AttnLM(_model(seed=CHECKPOINT_SEED), CharTokenizer(), batch_size=BATCH), [MC, GEN], task_manager
    )
    assert results[MC]["acc,none"] == expected["results"][MC]["acc,none"]
    assert results[GEN]["exact_match,none"] == expected["results"][GEN]["exact_match,none"]


def test_batch_size_from_model_args_or_from_the_harness(checkpoint: Path) -> None:
    """What lm-eval's command line passes: model_args, and its own batch_size (1 when not
    given), max_batch_size and device (cuda:0 when not given)."""
    create = lm_eval.api.registry.get_model("attn").create_from_arg_string
    harness_default = {"batch_size": 1, "max_batch_size": None, "device": "cpu"}
    assert create(f"pretrained={checkpoint},batch_size=8", harness_default).batch_size == 8  # model_args wins
    assert create(f"pretrained={checkpoint}", {**harness_default, "batch_size": "4"}).batch_size == 4
    assert create(f"pretrained={checkpoint},batch_size=4", {**harness_default, "batch_size": "4"}).batch_size == 4
    assert create(f"pretrained={checkpoint}", {}).batch_size == 8  # AttnLM's own default
    lm = AttnLM.create_from_arg_obj({"pretrained": checkpoint, "device": "cpu"}, {"batch_size": 1, "device": "cuda:0"})
    assert lm.batch_size == 1 and lm._device == torch.device("cpu")  # the harness's default device gives way
    with pytest.raises(ValueError, match=r"batch_size is given twice, 8 in model_args and '4' by the harness"):
        create(f"pretrained={checkpoint},batch_size=8", {**harness_default, "batch_size": "4"})
    with pytest.raises(ValueError, match=r"max_batch_size \(16\) applies to batch_size 'auto', which AttnLM does not"):
        create(f"pretrained={checkpoint}", {**harness_default, "max_batch_size": 16})


def test_batch_size_in_model_args_reaches_the_batches(
    checkpoint: Path, task_manager: TaskManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes: list[int] = []
    score_batch = AttnLM._score_batch

    def recording(self: AttnLM, rows: list[Any]) -> list[tuple[float, bool]]:
        sizes.append(len(rows))
        return score_batch(self, rows)

    monkeypatch.setattr(AttnLM, "_score_batch", recording)
    _evaluate(
        "attn",
        [MC],
        task_manager,
        model_args=f"pretrained={checkpoint},batch_size=3,shared_context=False",
        batch_size=1,
        device="cpu",
    )
    choices = sum(len(doc["choices"]) for doc in MC_DOCS)
    assert max(sizes) == 3 and sum(sizes) == choices, sizes


def test_shared_context_scores_equal_full_passes_and_keep_the_accuracy(
    task_manager: TaskManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A multiple-choice task scored with each context run once: every loglikelihood within
    fp32 rounding of the full passes (abs 1e-4 on sums of a few log-probabilities), the same
    greedy flags and the same accuracy; a generation task first changes nothing."""
    contexts: list[int] = []
    shared = attn.integrations.lm_eval.score_continuations

    def counting(model: Any, context: list[int], continuations: list[list[int]], **kwargs: Any) -> Any:
        contexts.append(len(continuations))
        return shared(model, context, continuations, **kwargs)

    monkeypatch.setattr(attn.integrations.lm_eval, "score_continuations", counting)
    fast = _evaluate(AttnLM(_model(), CharTokenizer(), batch_size=2), [GEN, MC], task_manager)
    assert sorted(contexts) == sorted(len(doc["choices"]) for doc in MC_DOCS)  # each question once, all choices
    full = _evaluate(AttnLM(_model(), CharTokenizer(), batch_size=2, shared_context=False), [MC], task_manager)
    for got, expected in zip(_responses(fast, MC), _responses(full, MC), strict=True):  # per question
        pairs = (zip(*(r[0] for r in x), strict=True) for x in (got, expected))  # (logprobs, greedy flags)
        (logprobs, greedy), (full_logprobs, full_greedy) = pairs
        assert list(logprobs) == pytest.approx(list(full_logprobs), abs=1e-4) and greedy == full_greedy
    assert fast["results"][MC]["acc,none"] == full["results"][MC]["acc,none"]


def test_tokenizer_file_comes_from_attn_tokenizer(checkpoint: Path) -> None:
    import attn.tokenizer

    assert TokenizerFile is attn.tokenizer.TokenizerFile
    lm = AttnLM(pretrained=checkpoint)
    assert isinstance(lm.tokenizer, attn.tokenizer.TokenizerFile) and lm.eot_token_id == EOS
    assert lm.tok_encode("Hi") == [ord("H"), ord("i")]  # no BOS: the file names none


class StopsAndBos(CharTokenizer):
    """A CharTokenizer with a second stop id, a BOS, and BOS on by default (as a Llama TokenizerFile)."""

    bos_token_id = 1
    add_bos_token = True

    def __init__(self, second_stop: int) -> None:
        self.eos_token_ids = [EOS, second_stop]


def test_generation_stops_at_any_eos_id_and_bos_follows_the_tokenizer() -> None:
    model = _model(seed=7)
    prompt = "Once upon"
    ids = [1, *CharTokenizer().encode(prompt)]
    free = attn.generate(model, [ids], max_new_tokens=16).generated[0].tolist()
    stop = free[4]
    tokenizer = StopsAndBos(stop)
    lm = AttnLM(model, tokenizer, batch_size=2)
    assert lm.add_bos_token and lm.tok_encode(prompt) == ids
    assert AttnLM(model, tokenizer, add_bos_token=False).tok_encode(prompt)[0] != 1
    (text,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 16}), 0)])
    assert text == tokenizer.decode(free[: free.index(stop)])


def test_requests_are_batched_by_their_options_and_come_back_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """lm-eval's Collator: equal options share a batch, longest prompt first; the results
    are in the harness's order and equal each request generated alone."""
    model = _model(seed=8)
    tok = CharTokenizer()
    lm = AttnLM(model, tok, batch_size=2)
    first, second = {"until": ["q"], "max_gen_toks": 8}, {"until": ["z"], "max_gen_toks": 5}
    requests = [("Hi", first), ("Hello there", second), ("Once upon a time", first), ("Yo", second), ("ab", first)]
    calls: list[tuple[list[int], int]] = []
    generate_batch = AttnLM._generate

    def recording(self: AttnLM, prompts: list[list[int]], max_new: int, options: Any) -> list[str]:
        calls.append(([len(p) for p in prompts], max_new))
        return generate_batch(self, prompts, max_new, options)

    monkeypatch.setattr(AttnLM, "_generate", recording)
    texts = lm.generate_until([Instance("generate_until", {}, (c, dict(k)), i) for i, (c, k) in enumerate(requests)])
    assert calls == [([16, 2], 8), ([2], 8), ([11, 2], 5)]
    for (context, options), text in zip(requests, texts, strict=True):
        out = attn.generate(model, [tok.encode(context)], max_new_tokens=options["max_gen_toks"], stop_tokens=[EOS])
        expected = tok.decode(out.generated[0][out.generated_mask[0]].tolist()).split(options["until"][0], 1)[0]
        assert text == expected


# ---------------------------------------------------------------------------- errors


def test_bad_arguments() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"batch_size must be a positive int, got 'auto' \(AttnLM has no 'auto'"):
        AttnLM(model, CharTokenizer(), batch_size="auto")
    with pytest.raises(ValueError, match=r"needs exactly one of model= \(a TransformerDecoder\) and pretrained="):
        AttnLM(tokenizer=CharTokenizer())
    with pytest.raises(ValueError, match=r"tokenizer must have encode\(str\)"):
        AttnLM(model, object())
    with pytest.raises(ValueError, match=r"max_length \(500\) exceeds the model's max_seq_len \(128\)"):
        AttnLM(model, CharTokenizer(), max_length=500)
    lm = AttnLM(model, CharTokenizer())
    for options, match in [
        ({"until": ["\n"], "top_p": 0.9, "do_sample": True, "temperature": 1.0}, r"top_p \(0.9\) is not supported"),
        ({"until": ["\n"], "num_beams": 4}, r"generation options \['num_beams'\] are not supported"),
    ]:
        with pytest.raises(ValueError, match=match):
            lm.generate_until([Instance("generate_until", {}, ("Hi", options), 0)])
