"""The contenders: ways to generate the same greedy tokens, each timed token by token.

Shapes: b = batch, P = prompt length, N = new tokens, v = vocab.

Every contender answers ``generate(ctx, new_tokens, want_logits)`` with a ``Generated``: its
tokens, optionally its logits (for the correctness check), and a time stamp taken as each
forward pass returned (the prefill first), from which the benchmark derives time to first
token, decode tokens/s and latency per position. ``attn`` contenders go through
``attn.generate``; ``transformers`` ones through ``AutoModelForCausalLM.generate`` with weights
copied from the ``attn`` model; ``llama.cpp`` through ``llama-cpp-python``'s ``Llama.eval``, one
call per forward pass, on the ``attn`` model exported to GGUF (``attn.bench.gguf_export``).

llama.cpp is optional: ``LLAMA_CPP_INSTALL`` builds ``llama-cpp-python`` from source.
``-DGGML_NATIVE=ON`` makes the build use every instruction set of the machine it is built on;
``-DLLAVA_BUILD=OFF`` leaves out the multimodal library (``libmtmd``), which ``llama_cpp``
loads only for image chat handlers. Built that way it took 5 minutes on a quiet 2-core Intel
Xeon (torch 2.13 era, llama-cpp-python 0.3.36).
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import attn
from attn import policy as cache_rules
from attn.bench import gguf_export
from attn.bench.baseline import greedy_without_cache
from attn.bench.measure import init_weights
from attn.checkpoint import config_to_hf, hf_tensor_names
from attn.decoder import DecoderConfig, TransformerDecoder
from attn.dtypes import short_name
from attn.fast_decode import DecodeCompiled, compile_for_decode
from attn.huge_pages import place_in_huge_pages
from attn.policy import CachePolicy, CompatWarning

__all__ = [
    "CONTENDERS",
    "DEFAULT_CONTENDERS",
    "Cell",
    "CellContext",
    "Contender",
    "Generated",
    "LLAMA_CPP_INSTALL",
    "make_contender",
]

LLAMA_CPP_INSTALL = "CMAKE_ARGS='-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF' pip install 'attn[llama-cpp]'"
"""How to install the llama.cpp contender: a source build for this machine's CPU, without the
multimodal library (the module doc says why)."""


@dataclass(frozen=True)
class Cell:
    """One benchmark setting: model size, dtype, batch, threads and lengths."""

    config_name: str
    config: DecoderConfig
    dtype: torch.dtype
    batch_size: int
    threads: int
    prompt_len: int
    new_tokens: int

    @property
    def dtype_name(self) -> str:
        return short_name(self.dtype)

    @property
    def label(self) -> str:
        return f"{self.config_name} {self.dtype_name} b{self.batch_size} t{self.threads}"


@dataclass
class Generated:
    """One generation: tokens, logits, and when each forward pass returned.

    Attributes:
        tokens: (b, N) the generated tokens.
        logits: (b, N, v) fp32 logits that produced them, when asked for.
        start: ``time.perf_counter()`` when the call started.
        stamps: ``time.perf_counter()`` as each forward pass returned; ``stamps[0]`` is the
            prefill (or, without a cache, the first full pass).
    """

    tokens: torch.Tensor
    logits: torch.Tensor | None
    start: float
    stamps: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        """Seconds to the first token (the prefill's forward pass)."""
        return self.stamps[0] - self.start

    @property
    def step_latencies(self) -> list[float]:
        """Seconds per forward pass after the first: one per decode step."""
        return [b - a for a, b in zip(self.stamps[:-1], self.stamps[1:], strict=True)]

    def decode_tokens_per_s(self, batch_size: int) -> float:
        """Tokens produced by decode steps (all rows) per second of decode."""
        steps = len(self.stamps) - 1
        return batch_size * steps / (self.stamps[-1] - self.stamps[0])


class _Timed:
    """Forwards everything to a model and stamps the time as each call returns."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.stamps: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.model(*args, **kwargs)
        self.stamps.append(time.perf_counter())
        return out

    def native_loop(self, batch_size: int, num_slots: int) -> Any:
        """The model's ``native_loop`` (``attn.native_loop``), its calls stamped: they run many
        forward passes each, so each pass of a call gets an even share of the call's time (its
        stamps are the call's mean step, and the decode speed is exact)."""
        native = getattr(self.model, "native_loop", None)
        loop = None if native is None else native(batch_size, num_slots)
        return None if loop is None else _TimedLoop(loop, self.stamps)


class _TimedLoop:
    """A ``NativeLoop`` whose calls append a stamp for each forward pass they ran (``_Timed``)."""

    def __init__(self, loop: Any, stamps: list[float]) -> None:
        self.loop, self.stamps = loop, stamps

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loop, name)

    def run(self, *args: Any) -> Any:
        start, before = time.perf_counter(), self.loop.model_steps
        following = self.loop.run(*args)
        end, passes = time.perf_counter(), self.loop.model_steps - before
        self.stamps.extend(start + (end - start) * (i + 1) / passes for i in range(passes))
        return following


@contextmanager
def cache_policy(policy: CachePolicy | None) -> Iterator[None]:
    """Runs the body under ``policy`` (``None``: leave it), then restores the previous one."""
    if policy is None:
        yield
        return
    before = cache_rules.cache_policy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompatWarning)
        cache_rules.set_cache_policy(policy)
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompatWarning)
            cache_rules.set_cache_policy(before.policy if before.source == "override" else None)


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def llama_cpp_available() -> bool:
    """Are ``llama-cpp-python`` and ``gguf`` (the file writer) both installed?"""
    return all(importlib.util.find_spec(name) is not None for name in ("llama_cpp", "gguf"))


def hf_config(config: DecoderConfig) -> Any:
    """The transformers config of the same architecture as ``config`` (``config_to_hf``), without EOS."""
    import transformers

    fields = {k: v for k, v in config_to_hf(config).items() if k not in ("architectures", "dtype")}
    return transformers.AutoConfig.for_model(
        fields.pop("model_type"), **fields, bos_token_id=None, eos_token_id=None, pad_token_id=0
    )


def hf_state_dict(model: TransformerDecoder) -> dict[str, torch.Tensor]:
    """``model``'s weights under transformers' names (the layouts match: no permutation)."""
    state = model.state_dict()
    return {theirs: state[ours] for ours, theirs in hf_tensor_names(model.config).items()}


class CellContext:
    """What the contenders of one cell share: models, caches, prompts (built on first use).

    Args:
        cell: the setting.
        seed: seed for weights and prompts.
        init_std: standard deviation of the random weights (0.05: at 0.02 greedy decoding
            collapses into one repeated token and an equality check proves little).
        checkpoint: a Hugging Face checkpoint directory to load instead of random weights.
        max_rows: ``compile_for_decode``'s ``max_rows``.
        nocache_max_batch: largest batch the no-cache contender runs at (it costs a prefill
            per token).
        standalone: build each model on its own (memory probes: no second model in memory).
    """

    def __init__(
        self,
        cell: Cell,
        *,
        seed: int = 0,
        init_std: float = 0.05,
        checkpoint: str | None = None,
        max_rows: int = 8,
        nocache_max_batch: int = 1,
        standalone: bool = False,
    ) -> None:
        self.cell = cell
        self.nocache_max_batch = nocache_max_batch
        self.seed = seed
        self.init_std = init_std
        self.checkpoint = checkpoint
        self.max_rows = max_rows
        self.standalone = standalone
        generator = torch.Generator().manual_seed(seed + 1)
        self.prompts = torch.randint(
            1, cell.config.vocab_size, (cell.batch_size, cell.prompt_len), generator=generator
        )  # (b, P)
        self._fp32: TransformerDecoder | None = None
        self._model: TransformerDecoder | None = None
        self._hf: Any = None

    def _build(self, dtype: torch.dtype) -> TransformerDecoder:
        """A fresh model in ``dtype``, created in that dtype (no transient fp32 copy)."""
        if self.checkpoint is not None:
            from attn.checkpoint import load_pretrained

            return load_pretrained(self.checkpoint, dtype=dtype).eval()
        with _default_dtype(dtype):
            model = TransformerDecoder(self.cell.config).eval()
        init_weights(model, self.init_std, self.seed)
        place_in_huge_pages(model)  # as load_pretrained places a checkpoint's weights
        return model

    @property
    def reference_model(self) -> TransformerDecoder:
        """The fp32 model (for checks; the timed model too in fp32 cells)."""
        if self._fp32 is None:
            self._fp32 = self._build(torch.float32)
        return self._fp32

    @property
    def model(self) -> TransformerDecoder:
        """The timed ``attn`` model, in the cell's dtype, with caches for ``P + N`` tokens."""
        if self._model is None:
            if self.cell.dtype == torch.float32:
                model = self.reference_model
            elif self.standalone:
                model = self._build(self.cell.dtype)
            else:
                model = TransformerDecoder(self.cell.config).eval().to(self.cell.dtype)
                model.load_state_dict(self.reference_model.state_dict())
                place_in_huge_pages(model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", CompatWarning)
                model.setup_caches(self.cell.batch_size, self.cell.prompt_len + self.cell.new_tokens)
            self._model = model
        return self._model

    def hf_model(self) -> Any:
        """A ``LlamaForCausalLM`` with the same weights, in the cell's dtype (shared by HF contenders)."""
        if self._hf is None:
            import transformers

            standalone = self.standalone and self.checkpoint is None
            with warnings.catch_warnings(), _default_dtype(self.cell.dtype if standalone else torch.float32):
                warnings.simplefilter("ignore")
                hf = transformers.AutoModelForCausalLM.from_config(hf_config(self.cell.config)).eval()
            if standalone:
                init_weights(hf, self.init_std, self.seed)
            else:
                hf.load_state_dict(hf_state_dict(self.reference_model), strict=False)
                if hf.config.tie_word_embeddings:
                    hf.tie_weights()
            self._hf = hf.to(self.cell.dtype)
        return self._hf

    def release_models(self) -> None:
        """Drops the models built so far (a memory probe of a contender that copied what it needs)."""
        self._fp32 = self._model = self._hf = None


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class Contender:
    """A way to generate greedily; subclasses fill in ``generate``.

    Attributes:
        name: short name used on the command line and in the table.
        description: one line for the table's legend.
        warmup_tokens: tokens of the warm-up generation (``None``: a full one, which is
            then also the checked one).
        max_repeats: cap on timed generations (``None``: as many as asked).
        memory_probe: measure this contender's peak memory in a fresh process.
    """

    name = ""
    description = ""
    warmup_tokens: int | None = None
    max_repeats: int | None = None
    memory_probe = True

    def skip_reason(self, ctx: CellContext) -> str | None:
        """Why this contender cannot run in this cell, or ``None``."""
        return None

    def setup(self, ctx: CellContext) -> None:
        """Builds what the contender needs (models, compiled wrappers); not timed."""

    def generate(self, ctx: CellContext, new_tokens: int, want_logits: bool) -> Generated:
        raise NotImplementedError

    def graphs(self) -> int | None:
        """Graphs compiled so far, for contenders that compile; ``None`` otherwise."""
        return None

    def note(self) -> str | None:
        """Anything about how it ran worth a line in the report."""
        return None


class AttnEager(Contender):
    """``attn.generate`` on the eager model, under a given cache policy."""

    def __init__(self, name: str, policy: CachePolicy | None, description: str, *, memory_probe: bool = True) -> None:
        self.name = name
        self.policy = policy
        self.description = description
        self.memory_probe = memory_probe

    def runner(self, ctx: CellContext) -> Any:
        return ctx.model

    def generate(self, ctx: CellContext, new_tokens: int, want_logits: bool) -> Generated:
        timed = _Timed(self.runner(ctx))
        with cache_policy(self.policy):
            start = time.perf_counter()
            out = attn.generate(timed, ctx.prompts, max_new_tokens=new_tokens, return_logits=want_logits)
        return Generated(out.generated, out.logits, start, timed.stamps)


class PackedDecode:
    """Mixin: generations run with packed decode on (``attn.set_packed_decode``): the weights
    are packed in the warm-up run, and the shared model is left as it was after each one."""

    def skip_reason(self, ctx: CellContext) -> str | None:
        return None if attn.packed.packed_decode_available() else "this torch build has no oneDNN packed linear"

    def generate(self, ctx: CellContext, new_tokens: int, want_logits: bool) -> Generated:
        ctx.model.packed_decode = True  # the packed copies stay between generations: the weights do not change
        try:
            return super().generate(ctx, new_tokens, want_logits)  # type: ignore[misc]
        finally:
            ctx.model.packed_decode = False


class AttnPacked(PackedDecode, AttnEager):
    """``attn.generate`` on the eager model with packed decode."""


class AttnCompiled(AttnEager):
    """``attn.generate`` through ``attn.compile_for_decode``: eager prefill, compiled decode step."""

    def __init__(
        self,
        name: str,
        policy: CachePolicy | None,
        description: str,
        *,
        rewrite: bool = True,
        native_layers: bool = True,
    ) -> None:
        super().__init__(name, policy, description)
        self.rewrite = rewrite
        self.native_layers = native_layers
        self.fast: DecodeCompiled | None = None

    def setup(self, ctx: CellContext) -> None:
        self.fast = compile_for_decode(
            ctx.model, max_rows=ctx.max_rows, rewrite_linears=self.rewrite, native_layers=self.native_layers
        )

    def runner(self, ctx: CellContext) -> Any:
        if self.fast is None:
            raise RuntimeError(f"{self.name}: setup() was not called")
        return self.fast

    def graphs(self) -> int | None:
        return None if self.fast is None else self.fast.stats.graphs

    def note(self) -> str | None:
        if self.fast is None:
            return None
        stats = self.fast.stats
        if stats.native_steps and not stats.graphs:
            return f"{stats.native_steps} decode steps run eager, layers as attn::decode_layers calls; nothing compiled"
        width = "inductor's default" if stats.vector_bits is None else f"{stats.vector_bits} bits"
        layers = "one decoder layer compiled for every layer" if stats.regions else "every layer compiled"
        native = f" ({stats.linears_native} of them through a native kernel)" if stats.linears_native else ""
        attention = f" ({stats.attention_native} through attn::decode_attention)" if stats.attention_native else ""
        return (
            f"{stats.linears_rewritten} linear layer(s){native} and {stats.attention_rewritten} attention call(s)"
            f"{attention} rewritten for few rows, {stats.linears_packed} reading packed weights ({layers}); SIMD width "
            f"{width}; {stats.compile_seconds:.1f} s in inductor"
        )


class AttnCompiledPacked(PackedDecode, AttnCompiled):
    """``attn.compile_for_decode`` with packed decode: its step's matrix products (more rows
    than ``max_rows``) read packed weights."""


class AttnTorchCompile(AttnEager):
    """``attn.generate`` on ``torch.compile(model)``: what a user who compiles the obvious way
    gets (inductor, default options; prefill and decode graphs compile in the warm-up run)."""

    def __init__(self) -> None:
        super().__init__("attn-torch-compile", None, "attn.generate on torch.compile(model), inductor defaults")
        self.compiled: nn.Module | None = None

    def setup(self, ctx: CellContext) -> None:
        self.compiled = torch.compile(ctx.model)

    def runner(self, ctx: CellContext) -> Any:
        if self.compiled is None:
            raise RuntimeError(f"{self.name}: setup() was not called")
        return self.compiled


class AttnNoCache(Contender):
    """Greedy decoding with no cache: every step runs the whole sequence again."""

    name = "attn-nocache"
    description = "attn eager, no KV-cache: a full forward pass over the whole sequence per token"
    warmup_tokens = 2
    max_repeats = 1
    memory_probe = False

    def skip_reason(self, ctx: CellContext) -> str | None:
        if ctx.cell.batch_size > ctx.nocache_max_batch:
            return (
                f"batch {ctx.cell.batch_size} > --nocache-max-batch {ctx.nocache_max_batch} "
                "(a full forward pass per token takes minutes here)"
            )
        return None

    def generate(self, ctx: CellContext, new_tokens: int, want_logits: bool) -> Generated:
        stamps: list[float] = []
        kept: list[torch.Tensor] = []

        def step(logits: torch.Tensor) -> None:
            stamps.append(time.perf_counter())
            if want_logits:
                kept.append(logits.float())

        start = time.perf_counter()
        tokens = greedy_without_cache(ctx.model, ctx.prompts, max_new_tokens=new_tokens, on_step=step)
        generated = tokens[:, ctx.prompts.shape[1] :]  # (b, N)
        logits_out = torch.stack(kept, dim=1).clone() if want_logits else None  # (b, N, v)
        return Generated(generated, logits_out, start, stamps)


class HFGenerate(Contender):
    """``transformers``' ``generate`` with a static or a dynamic cache, same weights."""

    def __init__(self, cache: str) -> None:
        self.cache = cache
        self.name = f"hf-{cache}"
        self.description = f"transformers generate, {cache} cache, eager, inference mode"

    def skip_reason(self, ctx: CellContext) -> str | None:
        if not transformers_available():
            return "transformers is not installed (pip install transformers to compare with it)"
        return None

    def setup(self, ctx: CellContext) -> None:
        ctx.hf_model()

    def generate(self, ctx: CellContext, new_tokens: int, want_logits: bool) -> Generated:
        import transformers

        hf = ctx.hf_model()
        config = transformers.GenerationConfig(
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
            cache_implementation="static" if self.cache == "static" else None,
            return_dict_in_generate=True,
            output_logits=want_logits,
        )
        stamps: list[float] = []
        hook = hf.register_forward_hook(lambda *_: stamps.append(time.perf_counter()))
        prompts = ctx.prompts
        try:
            with warnings.catch_warnings(), torch.inference_mode():
                warnings.simplefilter("ignore")
                start = time.perf_counter()
                out = hf.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=config)
        finally:
            hook.remove()
        tokens = out.sequences[:, prompts.shape[1] :].clone()  # (b, N)
        logits = torch.stack(out.logits, dim=1).float().clone() if want_logits else None  # (b, N, v)
        return Generated(tokens, logits, start, stamps)


class LlamaCpp(Contender):
    """llama.cpp through ``llama-cpp-python``, on the ``attn`` model written to a GGUF file.

    Batch 1 only: ``Llama`` holds one sequence. Greedy decoding is an argmax of the logits
    of each ``Llama.eval`` here, not llama.cpp's sampler (which would also stop at the dummy
    vocabulary's end-of-sequence id). The KV-cache is kept in the cell's dtype (llama.cpp's
    default is F16) and flash attention is off, so an fp32 cell computes in fp32 throughout.
    """

    name = "llama.cpp"
    description = "llama-cpp-python, the same weights as GGUF (llama arch), one Llama.eval per forward pass"

    def __init__(self) -> None:
        self.llm: Any = None
        self.folder: tempfile.TemporaryDirectory[str] | None = None
        self.threads = 0

    def skip_reason(self, ctx: CellContext) -> str | None:
        if not llama_cpp_available():
            return (
                f"llama-cpp-python is not installed ({LLAMA_CPP_INSTALL} builds it from source, about 5 "
                "minutes on 2 cores)"
            )
        if ctx.cell.batch_size != 1:
            return f"batch {ctx.cell.batch_size}: llama-cpp-python's Llama holds one sequence, so only batch 1 runs"
        problem = gguf_export.unsupported(ctx.cell.config, ctx.cell.dtype)
        return None if problem is None else f"cannot export to GGUF: {problem}"

    def setup(self, ctx: CellContext) -> None:
        import gguf
        import llama_cpp

        cell = ctx.cell
        self.folder = tempfile.TemporaryDirectory(prefix="attn-bench-gguf-")
        path = gguf_export.export_gguf(ctx.model, Path(self.folder.name) / "model.gguf")
        if ctx.standalone:
            ctx.release_models()  # a memory probe: llama.cpp holds its own copy now
        cache_type = int(gguf.GGMLQuantizationType[gguf_export.GGML_TYPES[cell.dtype]])  # the cell's dtype
        self.threads = cell.threads
        self.llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=cell.prompt_len + cell.new_tokens,
            n_batch=cell.prompt_len,  # the prompt in one pass, as the others prefill it
            n_ubatch=cell.prompt_len,
            n_threads=cell.threads,
            n_threads_batch=cell.threads,
            type_k=cache_type,
            type_v=cache_type,
            flash_attn=False,
            n_gpu_layers=0,
            seed=0,
            verbose=False,
        )

    def generate(self, ctx: CellContext, new_tokens: int, want_logits: bool) -> Generated:
        import llama_cpp
        import numpy as np

        llm = self.llm
        if llm is None:
            raise RuntimeError(f"{self.name}: setup() was not called")
        vocab_size = ctx.cell.config.vocab_size
        tokens: list[int] = []
        kept: list[torch.Tensor] = []
        stamps: list[float] = []
        llm.reset()
        start = time.perf_counter()
        llm.eval(ctx.prompts[0].tolist())  # the prefill
        while True:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab_size,))  # (v,)
            stamps.append(time.perf_counter())
            tokens.append(int(logits.argmax()))
            if want_logits:
                kept.append(torch.from_numpy(logits.copy()))
            if len(tokens) == new_tokens:
                break
            llm.eval(tokens[-1:])  # one decode step
        generated = torch.tensor([tokens])  # (1, N)
        logits_out = torch.stack(kept)[None] if want_logits else None  # (1, N, v)
        return Generated(generated, logits_out, start, stamps)

    def note(self) -> str | None:
        import llama_cpp

        return (
            f"llama-cpp-python {llama_cpp.__version__}, {self.threads} thread(s), KV-cache in the cell's dtype, "
            "flash attention off"
        )


CONTENDERS: dict[str, Any] = {
    "attn-eager": lambda: AttnEager("attn-eager", None, "attn.generate, eager, the default cache policy"),
    "attn-packed": lambda: AttnPacked(
        "attn-packed", None, "attn.generate, eager, with packed decode (attn.set_packed_decode)"
    ),
    "attn-compiled": lambda: AttnCompiled(
        "attn-compiled",
        None,
        "attn.compile_for_decode: eager prefill; decode steps as attn::decode_layers calls where the model's layers "
        "and the CPU take them, else an inductor step with row-wise linears",
    ),
    "attn-compiled-graph": lambda: AttnCompiled(
        "attn-compiled-graph",
        None,
        "attn.compile_for_decode(native_layers=False): eager prefill, inductor decode step with row-wise linears",
        native_layers=False,
    ),
    "attn-compiled-packed": lambda: AttnCompiledPacked(
        "attn-compiled-packed",
        None,
        "attn.compile_for_decode with packed decode: matrix products over more rows than max_rows read packed weights",
    ),
    "attn-compiled-plain": lambda: AttnCompiled(
        "attn-compiled-plain",
        None,
        "decode step compiled with stock inductor (no linear rewrite)",
        rewrite=False,
    ),
    "attn-torch-compile": AttnTorchCompile,
    "attn-nocache": AttnNoCache,
    "hf-static": lambda: HFGenerate("static"),
    "hf-dynamic": lambda: HFGenerate("dynamic"),
    "llama.cpp": LlamaCpp,
}
"""Every contender by name: a factory for a fresh instance."""

DEFAULT_CONTENDERS = (
    "attn-eager",
    "attn-packed",
    "attn-compiled",
    "attn-nocache",
    "hf-static",
    "hf-dynamic",
    "llama.cpp",
)


def make_contender(name: str) -> Contender:
    """A fresh contender by name.

    Raises:
        ValueError: ``name`` is not one of ``CONTENDERS``.
    """
    if name not in CONTENDERS:
        raise ValueError(f"unknown contender {name!r}; choose from {', '.join(CONTENDERS)}")
    return CONTENDERS[name]()
