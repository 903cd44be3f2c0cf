"""An lm-evaluation-harness model for attn: ``AttnLM``, registered as ``"attn"``.

Shapes: b = batch, s = sequence, n = scored tokens of one row, v = vocab.

How each request type treats the KV-cache:

- ``generate_until`` runs ``attn.generate``, which works under ``attn.cached_inference``
  (inference mode plus the explicit flag): it uses the cache, eager or compiled. Without caches
  on the model, each batch gets a cache of its own size, torn down after; with caches the
  user set up, batches are sized to them (short batches are filled with copies of a row).
- ``loglikelihood``: continuations that share a context (the choices of a multiple-choice
  question) go to ``attn.score_continuations``, which prefills the context once on caches
  of its own, set up and torn down for the group: the model's caches are never used (opt
  out with ``shared_context=False``; a model with caches set up by the user is scored the
  other way). Scores equal the full passes within fp32 rounding (tests/test_scoring.py).
- The other ``loglikelihood`` requests and ``loglikelihood_rolling`` run one uncached forward
  per batch, under ``torch.inference_mode()`` (fast: no version counters; ``torch.no_grad()``
  for a sharded model that cannot take it) inside ``attn.disable_kv_cache(model)``, since
  plain inference mode would use the cache: they
  never read or write it, whatever ran before (a generation task first, a cache the user set up).
  Left-padded batches use ``attn.padded_causal_mask`` and ``attn.padding_positions``.

Requests are ordered and batched by lm-eval's own ``Collator`` (longest first; generation
requests grouped by their options), and results come back in the harness's order.

Example::

    import lm_eval
    from attn.integrations.lm_eval import AttnLM

    lm = AttnLM(attn.load_pretrained("/models/my-llama"), my_tokenizer, batch_size=8)
    results = lm_eval.simple_evaluate(model=lm, tasks=["my_task"])

    # or by name, with the checkpoint directory's tokenizer (attn.tokenizer.TokenizerFile):
    results = lm_eval.simple_evaluate(model="attn", model_args="pretrained=/models/my-llama,batch_size=8")
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import lm_eval.models  # noqa: F401 (fills the registry's built-in names before ours is added)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from attn.checkpoint import load_pretrained
from attn.context import uncached_passes
from attn.decoder import TransformerDecoder
from attn.generation import generate
from attn.masks import left_pad, padded_causal_mask, padding_positions
from attn.scoring import score_continuations
from attn.tokenizer import TokenizerFile  # re-exported: attn.integrations.lm_eval.TokenizerFile still works

__all__ = ["AttnLM", "Tokenizer", "TokenizerFile"]


@runtime_checkable
class Tokenizer(Protocol):
    """What ``AttnLM`` needs from a tokenizer (``attn.tokenizer.TokenizerFile`` is one).

    ``encode`` adds no special tokens (``AttnLM`` adds BOS itself when asked). Optional
    attributes: ``bos_token_id`` (may be missing or None), ``eos_token_ids`` (more ids that
    end a generation) and ``add_bos_token`` (the default of ``AttnLM(add_bos_token=)``).
    """

    eos_token_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``."""
        ...


@dataclass(frozen=True)
class _Scored:
    """One row to score: the model's inputs, and the tokens whose log-probability is summed."""

    inputs: list[int]  # (s,)
    targets: list[int]  # (n,), the last n tokens of inputs[1:] + [next]


@dataclass(frozen=True)
class _GenerationOptions:
    until: list[str]
    max_gen_toks: int
    temperature: float
    top_k: int | None


@dataclass(frozen=True)
class _Prompt:
    """One generation request, ready to batch."""

    ids: list[int]  # (s,) the context's last tokens that fit
    gen_kwargs: dict[str, Any]  # the task's options as given: requests with equal ones share a batch
    options: _GenerationOptions
    max_new: int
    args: tuple[str, dict[str, Any]]  # the request's arguments, for the harness's cache


_GENERATION_KEYS = frozenset({"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"})

# The settings lm-eval's command line always passes, with its defaults when not given.
_HARNESS_DEFAULTS = {"batch_size": 1, "device": "cuda:0"}


@register_model("attn")
class AttnLM(TemplateLM):
    """Evaluates a ``TransformerDecoder`` with lm-evaluation-harness.

    Pass a model and a tokenizer object, or ``pretrained=`` a checkpoint directory (loaded
    with ``attn.load_pretrained``; its tokenizer files, read by ``attn.tokenizer.TokenizerFile``,
    are the tokenizer unless ``tokenizer`` says otherwise). The second form is what
    ``model="attn"`` with ``model_args="pretrained=/path,batch_size=8"`` builds.

    From the harness (``--model attn``), ``batch_size`` and ``device`` may come from
    ``--model_args`` or from the harness's own ``--batch_size`` / ``--device``. The harness
    always passes its own, with its defaults (1, cuda:0) when they were not given, so a
    value in ``--model_args`` wins; a harness value that differs from it and from the
    harness's default is refused as a conflict (see ``create_from_arg_obj``).

    Args:
        model: a ``TransformerDecoder``, or a ``torch.compile`` of one.
        tokenizer: an object with ``encode``, ``decode`` and ``eos_token_id`` (see
            ``Tokenizer``), or a checkpoint directory or ``tokenizer.json`` path (read with
            ``TokenizerFile``). Generation stops at any of its ``eos_token_ids``.
        pretrained: a checkpoint directory, instead of ``model``.
        batch_size: rows per forward pass (scoring) and per ``generate`` call.
        device: where to load ``pretrained``; must be None with a model object.
        dtype: dtype to load ``pretrained`` in (default: the checkpoint's).
        max_gen_toks: tokens to generate when a task names no limit.
        max_length: longest sequence a request may use (default: the model's
            ``max_seq_len``); longer contexts keep their last tokens.
        add_bos_token: prepend the tokenizer's ``bos_token_id`` to every context. None:
            the tokenizer's ``add_bos_token`` (a ``TokenizerFile`` reads it from the
            checkpoint: True for Llama), False for a tokenizer without one.
        seed: seed of the generator used when a task samples (``do_sample``).
        shared_context: score continuations of one context with the context run once
            (``attn.score_continuations``, at most ``batch_size`` rows a pass); False: every
            continuation in a full pass of its own.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
        *,
        pretrained: str | os.PathLike[str] | None = None,
        batch_size: int | str = 8,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_gen_toks: int = 256,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        seed: int = 1234,
        shared_context: bool = True,
    ) -> None:
        super().__init__()
        if (model is None) == (pretrained is None):
            raise ValueError("AttnLM needs exactly one of model= (a TransformerDecoder) and pretrained= (a path)")
        if pretrained is not None:
            if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
                raise ValueError(
                    f"device {str(device)!r} asks for CUDA, which this torch build or machine does not have "
                    "(lm-eval's command line defaults to cuda:0); pass --device cpu or device='cpu'"
                )
            model = load_pretrained(pretrained, dtype=dtype, device=device)
            if tokenizer is None:
                tokenizer = pretrained
        elif device is not None or dtype is not None:
            raise ValueError(
                f"device ({device!r}) and dtype ({dtype!r}) apply to pretrained= only; move the model "
                "object yourself (model.to(...)) before wrapping it"
            )
        decoder = getattr(model, "_orig_mod", model)
        if not isinstance(decoder, TransformerDecoder):
            raise ValueError(
                f"AttnLM wraps an attn.TransformerDecoder (or a torch.compile of one), got {type(model).__name__}"
            )
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = TokenizerFile(tokenizer)
        if not isinstance(tokenizer, Tokenizer):
            raise ValueError(
                f"tokenizer must have encode(str) -> list[int], decode(ids) -> str and eos_token_id, got "
                f"{type(tokenizer).__name__}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        limit = decoder.config.max_seq_len
        self._max_length = limit if max_length is None else _positive_int("max_length", max_length)
        if self._max_length > limit:
            raise ValueError(f"max_length ({self._max_length}) exceeds the model's max_seq_len ({limit})")
        if add_bos_token is None:
            add_bos_token = getattr(tokenizer, "add_bos_token", False)
        self.add_bos_token = bool(add_bos_token)
        eos_ids = [tokenizer.eos_token_id, *(getattr(tokenizer, "eos_token_ids", None) or [])]
        self._stop_ids = list(dict.fromkeys(int(i) for i in eos_ids))
        self._device = decoder.tok_embeddings.weight.device
        self._vocab_size = decoder.config.vocab_size
        self._generator = torch.Generator(device=self._device).manual_seed(int(seed))
        if not isinstance(shared_context, bool):
            raise ValueError(f"shared_context must be true or false, got {shared_context!r}")
        self.shared_context = shared_context

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> AttnLM:
        """``model_args`` as a string (``"pretrained=DIR,batch_size=8"``); see ``create_from_arg_obj``."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: Mapping[str, Any], additional_config: Mapping[str, Any] | None = None
    ) -> AttnLM:
        """Builds the model from ``model_args`` and the harness's own settings.

        The harness passes ``batch_size``, ``max_batch_size`` and ``device`` beside
        ``model_args`` (lm-eval's own merge passes a key given in both twice, a TypeError).
        Here a ``model_args`` value wins over the harness's default (batch size 1, device
        cuda:0: the command line passes them when not given); two different explicit values
        are refused. ``max_batch_size`` is for ``batch_size=auto``, which AttnLM has not.
        """
        args = dict(arg_dict)
        harness = {key: value for key, value in (additional_config or {}).items() if value is not None}
        max_batch_size = harness.pop("max_batch_size", None)
        if max_batch_size is not None:
            raise ValueError(
                f"max_batch_size ({max_batch_size}) applies to batch_size 'auto', which AttnLM does not have; "
                "drop --max_batch_size and pass a batch size (--batch_size N or model_args batch_size=N)"
            )
        for key, value in harness.items():
            if key not in args:
                args[key] = value
            elif str(value) not in (str(args[key]), str(_HARNESS_DEFAULTS.get(key))):
                raise ValueError(
                    f"{key} is given twice, {args[key]!r} in model_args and {value!r} by the harness "
                    f"(--{key}); give it once"
                )
        return cls(**args)

    # -- the harness's hooks -----------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        """Context of a request with an empty context: BOS if the tokenizer has one, else EOS."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return self.eot_token_id if bos is None else int(bos)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return type(self.tokenizer).__name__

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        ids = list(self.tokenizer.encode(string))
        add_bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [int(bos), *ids]
        return ids

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        results = self._score([(context, continuation) for _, context, continuation in requests], disable_tqdm)
        for (key, _, _), result in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        windows: list[tuple[list[int], list[int]]] = []
        owners: list[int] = []
        for i, request in enumerate(requests):
            (text,) = request.args
            tokens = self.tok_encode(text, add_special_tokens=False)
            for window in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1):
                windows.append(make_disjoint_window(window))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score(windows, disable_tqdm), strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        prompts = []
        for request in requests:
            context, gen_kwargs = request.args
            options = self._generation_options(gen_kwargs)
            max_new, budget = self._generation_budget(options.max_gen_toks)
            prompts.append(_Prompt(self._prompt(context, budget), gen_kwargs, options, max_new, request.args))
        # Equal options in a batch, longest prompt first (ties in the harness's order).
        collator = Collator(
            prompts, sort_fn=lambda prompt: -len(prompt.ids), group_by="gen_kwargs", group_fn=lambda p: p.gen_kwargs
        )
        texts: list[str] = []
        progress = tqdm(total=len(requests), desc="attn generate_until", disable=disable_tqdm)
        for batch in collator.get_batched(n=self._generation_batch_size()):
            first = batch[0]
            for prompt, text in zip(
                batch, self._generate([p.ids for p in batch], first.max_new, first.options), strict=True
            ):
                texts.append(text)
                self.cache_hook.add_partial("generate_until", prompt.args, text)
            progress.update(len(batch))
        progress.close()
        return collator.get_original(texts)

    # -- scoring -----------------------------------------------------------------------

    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of log-probabilities, is greedy) of each continuation after its context."""
        results = self._score_shared(pairs, disable_tqdm)
        alone = [i for i in range(len(pairs)) if i not in results]
        for i, result in zip(alone, self._score_alone([pairs[i] for i in alone], disable_tqdm), strict=True):
            results[i] = result
        return [results[i] for i in range(len(pairs))]

    def _score_shared(
        self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool
    ) -> dict[int, tuple[float, bool]]:
        """Scores the pairs that share their context with another, one context at a time."""
        if not self.shared_context or self.model.caches_are_setup():
            return {}
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (context, continuation) in enumerate(pairs):
            if context and continuation and len(context) + len(continuation) <= self.max_length + 1:  # no truncation
                groups.setdefault(tuple(context), []).append(i)
        shared = {context: members for context, members in groups.items() if len(members) > 1}
        results: dict[int, tuple[float, bool]] = {}
        for context, members in tqdm(
            shared.items(), desc="attn loglikelihood (shared contexts)", disable=disable_tqdm or not shared
        ):
            scores = score_continuations(
                self.model, list(context), [pairs[i][1] for i in members], max_rows=self.batch_size
            )
            results.update((i, (score.logprob, score.greedy)) for i, score in zip(members, scores, strict=True))
        return results

    def _score_alone(
        self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """Each pair in a full, uncached pass, batched longest first."""
        rows = [self._scored_row(context, continuation) for context, continuation in pairs]
        # Longest first, ties by content: the batches depend only on the set of requests.
        collator = Collator(rows, sort_fn=lambda row: (-len(row.inputs), row.inputs))
        results: list[tuple[float, bool]] = []
        batches = -(-len(rows) // self.batch_size)
        for batch in tqdm(
            collator.get_batched(n=self.batch_size),
            total=batches,
            desc="attn loglikelihood",
            disable=disable_tqdm or not rows,
        ):
            results.extend(self._score_batch(batch))
        return collator.get_original(results)

    def _scored_row(self, context: list[int], continuation: list[int]) -> _Scored:
        if not context:
            raise ValueError("a scored continuation needs at least one context token (the harness adds a prefix)")
        whole = (context + continuation)[-(self.max_length + 1) :]
        inputs = whole[:-1]
        count = min(len(continuation), len(inputs))
        return _Scored(inputs=inputs, targets=whole[len(whole) - count :])

    def _score_batch(self, rows: list[_Scored]) -> list[tuple[float, bool]]:
        tokens, present = left_pad([row.inputs for row in rows], self.eot_token_id, self._device)  # each (b, s)
        with uncached_passes(self.model):
            logits = self.model(
                tokens, input_pos=padding_positions(present), mask=padded_causal_mask(present)
            )  # (b, s, v)
            results = []
            s = tokens.shape[1]
            for r, row in enumerate(rows):
                n = len(row.targets)
                if n == 0:
                    results.append((0.0, True))
                    continue
                logprobs = logits[r, s - n :].float().log_softmax(-1)  # (n, v)
                targets = torch.tensor(row.targets, dtype=torch.long, device=self._device)  # (n,)
                picked = logprobs.gather(-1, targets[:, None]).squeeze(-1)  # (n,)
                greedy = bool((logprobs.argmax(-1) == targets).all())
                results.append((float(picked.sum()), greedy))
        return results

    # -- generation --------------------------------------------------------------------

    def _generation_options(self, gen_kwargs: dict[str, Any]) -> _GenerationOptions:
        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"generate_until expects a dict of generation options, got {gen_kwargs!r}")
        options = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks))
        unknown = sorted(set(options) - _GENERATION_KEYS)
        if unknown:
            raise ValueError(
                f"generation options {unknown} are not supported by AttnLM (it supports "
                f"{sorted(_GENERATION_KEYS)}); remove them from the task's generation_kwargs"
            )
        top_p = options.get("top_p")
        if top_p is not None and float(top_p) != 1.0:
            raise ValueError(f"top_p ({top_p}) is not supported by attn.generate: use top_k, or top_p 1.0")
        until = [stop for stop in options["until"] if stop]
        if not all(isinstance(stop, str) for stop in until):
            raise ValueError(f"generation option 'until' must be strings, got {options['until']!r}")
        do_sample = bool(options.get("do_sample"))
        temperature = float(options.get("temperature") or 0.0) if do_sample else 0.0
        top_k = options.get("top_k")
        return _GenerationOptions(
            until=until,
            max_gen_toks=_positive_int("max_gen_toks", options["max_gen_toks"]),
            temperature=temperature,
            top_k=None if top_k is None or temperature == 0.0 else int(top_k),
        )

    def _cache_limits(self) -> tuple[int, int] | None:
        """(batch_size, max_seq_len) of the caches the user set up, or None."""
        decoder = getattr(self.model, "_orig_mod", self.model)
        caches = decoder.kv_caches()
        return (caches[0].batch_size, caches[0].max_seq_len) if caches else None

    def _generation_batch_size(self) -> int:
        limits = self._cache_limits()
        return self.batch_size if limits is None else limits[0]

    def _generation_budget(self, max_gen_toks: int) -> tuple[int, int]:
        """(tokens to generate, longest prompt) that fit the model, or the user's caches."""
        limits = self._cache_limits()
        length = self.max_length if limits is None else min(self.max_length, limits[1])
        if length < 2:
            raise ValueError(f"generation needs room for a prompt token and a new one; the limit is {length}")
        max_new = min(max_gen_toks, length - 1)
        return max_new, length - max_new

    def _prompt(self, context: str, budget: int) -> list[int]:
        ids = self.tok_encode(context) if context else []
        return ids[-budget:] if ids else [self.prefix_token_id]

    def _generate(self, prompts: list[list[int]], max_new: int, options: _GenerationOptions) -> list[str]:
        rows = list(prompts)
        limits = self._cache_limits()
        if limits is not None:  # the user's caches take exactly their batch size
            rows += [rows[-1]] * (limits[0] - len(rows))
        out = generate(
            self.model,
            rows,
            max_new_tokens=max_new,
            temperature=options.temperature,
            top_k=options.top_k,
            stop_tokens=self._stop_ids,
            pad_id=self.eot_token_id,
            generator=self._generator if options.temperature > 0 else None,
        )
        texts = []
        for r in range(len(prompts)):
            ids = out.generated[r][out.generated_mask[r]].tolist()
            if ids and ids[-1] in self._stop_ids:
                ids = ids[:-1]
            text = self.tok_decode(ids)
            for stop in options.until:
                text = text.split(stop, 1)[0]
            texts.append(text)
        return texts


def _positive_int(name: str, value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if isinstance(value, bool) or number <= 0 or (isinstance(value, float) and value != number):
        hint = " (AttnLM has no 'auto' batch size)" if name == "batch_size" else ""
        raise ValueError(f"{name} must be a positive int, got {value!r}{hint}")
    return number
