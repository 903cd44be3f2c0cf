"""The command line (attn/cli.py, attn/__main__.py): demo, info, bench, and usage errors."""

from __future__ import annotations

import io
import json
import os
import runpy
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest

import attn
from attn import cli

ROOT = Path(__file__).resolve().parents[1]


def run_attn(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != attn.policy.ENV_VAR}
    command = [sys.executable, "-m", "attn", *args]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_demo_subprocess_writes_json(tmp_path: Path) -> None:
    path = tmp_path / "demo.json"
    proc = run_attn("demo", "--steps", "20", "--seed", "3", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "training: 100%" in proc.stderr and "20/20" in proc.stderr  # tqdm's bar
    for section in (
        "1. train",
        "2. eval",
        "3. PPO",
        "4. LoRA-PPO",
        "5. GRPO in bf16 parity mode",
        "6. every kind of pass",
        "tokens/s",
    ):
        assert section in proc.stdout, section
    result = json.loads(path.read_text())
    assert result["ok"] is True and result["violations"] == []
    assert result["options"]["steps"] == 20 and result["options"]["seed"] == 3
    assert result["policy"]["policy"] == attn.policy.DEFAULT_POLICY.value
    assert result["environment"]["torch"] == __import__("torch").__version__
    passes = result["passes"]
    assert len(passes) == 20  # the speed comparison times each way 3 times
    for record in passes:
        assert record["ok"] and record["used_cache"] == record["expect_cache"], record
        assert len(record["fill_before"]) == 2  # one per layer
        if not record["expect_cache"]:
            assert record["fill_before"] == record["fill_after"] and not record["buffers_changed"], record
    kinds = {(p["pattern"], p["expect_cache"]) for p in passes}
    assert {("train", False), ("eval", True), ("eval", False), ("ppo", True), ("ppo", False)} <= kinds
    assert {("lora-ppo", True), ("lora-ppo", False), ("speed", True), ("speed", False)} <= kinds
    assert result["train"]["steps"] == 20 and result["train"]["passes"][0]["count"] == 20
    assert result["eval"]["scores_match"] and result["eval"]["scores_bit_identical"]
    assert result["ppo"]["tokens_are_inference"] is False
    assert result["speed"]["cached_tokens_per_s"] > 0 and result["speed"]["uncached_tokens_per_s"] > 0
    assert result["speed"]["same_tokens"] is True
    assert result["seconds"]["total"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["dance"], "invalid choice: 'dance'"),
        (["demo", "--steps", "0"], "--steps: expected a positive integer, got 0"),
        (["demo", "--steps", "many"], "--steps: expected a positive integer, got 'many'"),
        (["demo", "--seed", "x"], "--seed: expected an integer, got 'x'"),
        (["demo", "--policy", "always"], "--policy: invalid choice: 'always'"),
        (["demo", "--backend", "eager"], "--backend only applies with --compile"),
        (["demo", "--json", "/no/such/folder/out.json"], "folder /no/such/folder does not exist"),
        (["demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["info", "--probe", "yes"], "unrecognized arguments: yes"),
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: attn" in err and message in err, err
    assert "Traceback" not in err


def test_python_dash_m_attn_exits_with_the_usage_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``python -m attn`` (attn/__main__.py) exits with main()'s status: 2, no traceback."""
    monkeypatch.setattr(sys, "argv", ["attn", "demo", "--steps", "-5"])
    monkeypatch.delitem(sys.modules, "attn.__main__", raising=False)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("attn", run_name="__main__")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: attn demo" in err and "expected a positive integer, got -5" in err


def test_help_and_version(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "info" in out and "bench" in out and "lm-eval" in out and "generate" in out
    assert cli.main(["generate", "--help"]) == 0
    out = capsys.readouterr().out
    for option in (
        "--chat",
        "--max-new-tokens",
        "--temperature",
        "--top-k",
        "--seed",
        "--dtype",
        "--device",
        "--compile",
    ):
        assert option in out
    assert cli.main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--compile", "--policy", "--seed", "--steps", "--json"):
        assert option in out
    assert cli.main(["--version"]) == 0
    assert attn.__version__ in capsys.readouterr().out


def test_info(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    decision = attn.policy.cache_policy()
    assert f"torch:               {__import__('torch').__version__}" in out
    assert f"cache policy:        {decision.policy.value}" in out
    assert decision.reason in out
    assert "traces is_inference:" in out and "python:" in out and "platform:" in out
    assert "probe" not in out
    assert "parity mode:" in out and "generate's log-probs == the training" in out


def test_info_probe(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["info", "--probe"]) == 0
    out = capsys.readouterr().out
    decides = attn.compat.release_support().decides_in_graph
    assert "probe (fullgraph):" in out and "agrees" in out and "DISAGREES" not in out
    assert ("probe (fullgraph):   yes" in out) == decides


def test_bench_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    fake = types.ModuleType("attn.bench")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "attn.bench", fake)
    assert cli.main(["bench", "--help", "--steps", "3"]) == 7
    assert seen == [["--help", "--steps", "3"]]


def test_bench_without_the_module_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "attn.bench", None)  # as if attn/bench.py did not exist
    assert cli.main(["bench"]) == 1
    err = capsys.readouterr().err
    assert "attn.bench is not part of this installation" in err and "Traceback" not in err


def test_lm_eval_without_the_harness_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-evaluation-harness were not installed
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)
    assert cli.main(["lm-eval", "run", "--model", "attn"]) == 1
    err = capsys.readouterr().err
    assert "lm-evaluation-harness is not installed; pip install 'attn[lm-eval]'" in err


@pytest.mark.slow  # needs the lm-eval extra, as tests/test_lm_eval.py
def test_lm_eval_help_is_the_harness_help_and_restores_argv(capsys: pytest.CaptureFixture) -> None:
    before = list(sys.argv)
    assert cli.main(["lm-eval", "run", "--help"]) == 0
    assert "--model_args" in capsys.readouterr().out
    assert sys.argv == before


# ---------------------------------------------------------------------------- attn generate


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model saved as a Hugging Face directory, with tokenizer.json (320 ids),
    tokenizer_config.json and its chat template."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from attn.checkpoint import save_pretrained

    from .conftest import tiny_model, write_tokenizer_files

    directory = tmp_path_factory.mktemp("checkpoint")
    save_pretrained(tiny_model(3, vocab_size=320, embed_dim=64, hidden_dim=96), directory)
    write_tokenizer_files(directory)
    return directory


def _expected(directory: Path, prompt: str, *, chat: bool = False, max_new_tokens: int, **kwargs: object) -> str:
    """What ``attn generate`` should print: attn.generate's tokens up to a stop, decoded."""
    from attn.tokenizer import TokenizerFile

    tokenizer = TokenizerFile(directory)
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = tokenizer.encode(text)
    else:
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    out = attn.generate(
        attn.load_pretrained(directory),
        [ids],
        max_new_tokens=max_new_tokens,
        stop_tokens=tokenizer.eos_token_ids,
        **kwargs,
    )
    generated = out.generated[0].tolist()
    stops = [i for i, token in enumerate(generated) if token in tokenizer.eos_token_ids]
    return tokenizer.decode(generated[: stops[0]] if stops else generated) + "\n"


class Pieces(io.StringIO):
    """A stdout that remembers each write."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[str] = []

    def write(self, text: str) -> int:
        self.pieces.append(text)
        return super().write(text)


def test_generate_greedy_prints_attn_generate_text(checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["generate", str(checkpoint), "Hello world", "--max-new-tokens", "20"]) == 0
    captured = capsys.readouterr()
    expected = _expected(checkpoint, "Hello world", max_new_tokens=20)
    assert captured.out == expected and len(expected) > 5
    assert "attn generate: 20 tokens in " in captured.err and "tok/s" in captured.err
    assert "prompt 4 tokens" in captured.err  # <s> Hello world: BOS from the post-processor


def test_generate_streams_the_text_in_pieces(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = Pieces()
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main(["generate", str(checkpoint), "The quick", "--max-new-tokens", "24"]) == 0
    assert out.getvalue() == _expected(checkpoint, "The quick", max_new_tokens=24)
    assert len(out.pieces) > 5, out.pieces  # printed as it came, not at the end
    assert not any(piece.endswith("\ufffd") for piece in out.pieces[:-1])


def test_text_stream_holds_back_an_unfinished_character(checkpoint: Path) -> None:
    """Byte-level BPE splits an emoji it never saw into its four bytes: a partial one decodes to U+FFFD,
    which waits for the rest; a part that never gets completed is printed at the end."""
    import torch

    from attn.tokenizer import TokenizerFile

    tokenizer = TokenizerFile(checkpoint)
    ids = tokenizer.encode("Caf\u00e9 \U0001f680 dog")
    halves = [i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd")]
    assert halves, "the test needs a character split over tokens"
    out = Pieces()
    stream = cli._TextStream(tokenizer, tokenizer.eos_token_ids, out)
    for token in [*ids, tokenizer.eos_token_id, tokenizer.eos_token_id, ids[0]]:  # after a stop: pad, not text
        stream(torch.tensor([token]))
    stream.finish()
    assert out.getvalue() == "Caf\u00e9 \U0001f680 dog\n" and stream.count == len(ids) + 1
    assert not any("\ufffd" in piece for piece in out.pieces)
    assert any("\U0001f680" in piece for piece in out.pieces)  # whole, in one piece

    out = Pieces()
    stream = cli._TextStream(tokenizer, tokenizer.eos_token_ids, out)
    for token in ids[: halves[0]]:
        stream(torch.tensor([token]))
    stream.finish()
    assert out.getvalue() == "Caf\u00e9 \ufffd\n" and out.pieces[-2:] == ["\ufffd", "\n"]


def test_generate_chat_applies_the_template(checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["generate", str(checkpoint), "Hi there", "--chat", "--max-new-tokens", "12"]) == 0
    captured = capsys.readouterr()
    assert captured.out == _expected(checkpoint, "Hi there", chat=True, max_new_tokens=12)
    assert captured.out != _expected(checkpoint, "Hi there", max_new_tokens=12)
    from attn.tokenizer import TokenizerFile

    tokenizer = TokenizerFile(checkpoint)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True)
    assert text == "<s><|user|>Hi there<|end|>\n<|assistant|>"
    ids = tokenizer.encode(text)
    assert ids.count(tokenizer.bos_token_id) == 1 and f"prompt {len(ids)} tokens" in captured.err  # BOS once


def test_generate_stops_at_any_eos_id(tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    """generation_config.json lists a second stop id, as Llama 3 and Qwen instruct models do."""
    import shutil

    from attn.tokenizer import TokenizerFile

    shutil.copytree(checkpoint, tmp_path / "ckpt")
    tokenizer = TokenizerFile(checkpoint)
    ids = tokenizer.encode("Hello world", add_special_tokens=True)
    generated = attn.generate(attn.load_pretrained(checkpoint), [ids], max_new_tokens=20).generated[0].tolist()
    stop = generated[5]
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1, stop]}))
    assert cli.main(["generate", str(tmp_path / "ckpt"), "Hello world", "--max-new-tokens", "20"]) == 0
    captured = capsys.readouterr()
    assert captured.out == tokenizer.decode(generated[: generated.index(stop)]) + "\n"
    assert f"attn generate: {generated.index(stop) + 1} tokens in" in captured.err


def test_generate_samples_with_a_seed(checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    import torch

    args = ["generate", str(checkpoint), "Hello", "--temperature", "0.8", "--top-k", "40", "--seed", "5"]
    assert cli.main([*args, "--max-new-tokens", "16"]) == 0
    first = capsys.readouterr().out
    assert cli.main([*args, "--max-new-tokens", "16"]) == 0
    assert capsys.readouterr().out == first
    generator = torch.Generator().manual_seed(5)
    expected = _expected(checkpoint, "Hello", max_new_tokens=16, temperature=0.8, top_k=40, generator=generator)
    assert first == expected


def test_generate_errors_name_the_file_and_the_fix(
    tmp_path: Path, checkpoint: Path, capsys: pytest.CaptureFixture
) -> None:
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    (bare / "tokenizer.json").unlink()
    assert cli.main(["generate", str(bare), "Hi"]) == 1
    err = capsys.readouterr().err
    assert f"{bare / 'tokenizer.json'} not found" in err and "save_pretrained(DIR)" in err
    assert "Traceback" not in err

    plain = tmp_path / "plain"
    shutil.copytree(checkpoint, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    assert cli.main(["generate", str(plain), "Hi", "--chat"]) == 1
    err = capsys.readouterr().err
    assert f"--chat needs a chat template, and {plain / 'tokenizer_config.json'} has none" in err
    assert "run without --chat" in err

    assert cli.main(["generate", str(checkpoint), "Hi", "--max-new-tokens", "100"]) == 1
    err = capsys.readouterr().err
    assert "the prompt's 3 tokens and --max-new-tokens 100 make 103, more than the model's max_seq_len (64): " in err
    assert "ask for at most 61 new tokens" in err


def _set_template(template: str) -> Callable[[Path], None]:
    def change(directory: Path) -> None:
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (directory / "tokenizer_config.json").write_text(json.dumps(config))

    return change


def _truncate(name: str) -> Callable[[Path], None]:
    def change(directory: Path) -> None:
        data = (directory / name).read_bytes()
        (directory / name).write_bytes(data[: len(data) // 2])

    return change


BROKEN = [
    ("template syntax", _set_template("{% for m in messages %}"), True, "tokenizer_config.json", "does not compile"),
    ("unknown filter", _set_template("{{ messages | nosuch }}"), True, "tokenizer_config.json", "does not compile"),
    ("undefined name", _set_template("{{ nosuch.attr }}"), True, "tokenizer_config.json", "failed on these messages"),
    ("corrupt tokenizer", _truncate("tokenizer.json"), False, "tokenizer.json", "not a tokenizer file"),
    ("truncated weights", _truncate("model.safetensors"), False, "model.safetensors", "may be truncated"),
    ("malformed config", _truncate("config.json"), False, "config.json", "is not valid JSON"),
]


@pytest.mark.parametrize(("case", "change", "chat", "file", "message"), BROKEN, ids=[case[0] for case in BROKEN])
def test_a_broken_checkpoint_is_one_line_naming_the_file_and_debug_shows_the_traceback(
    tmp_path: Path,
    checkpoint: Path,
    capsys: pytest.CaptureFixture,
    case: str,
    change: Callable[[Path], None],
    chat: bool,
    file: str,
    message: str,
) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    change(broken)
    argv = ["generate", str(broken), "Hi", *(["--chat"] if chat else []), "--max-new-tokens", "2"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(broken / file) in err and message in err, err
    with pytest.raises(ValueError, match=message):  # the traceback, on request
        cli.main([*argv, "--debug"])


def test_an_unforeseen_failure_is_one_line_too(
    checkpoint: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("something deep\nwith a second line")

    monkeypatch.setattr(attn, "generate", fail)
    assert cli.main(["generate", str(checkpoint), "Hi"]) == 1
    assert capsys.readouterr().err == ("attn generate: RuntimeError: something deep (--debug shows the traceback)\n")
    with pytest.raises(RuntimeError, match="something deep"):
        cli.main(["generate", str(checkpoint), "Hi", "--debug"])


def test_a_bench_failure_is_one_line_too(capsys: pytest.CaptureFixture) -> None:
    argv = ["bench", "--config", '{"vocab_size": 64}', "--no-memory"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("attn bench: TypeError: ") and err.endswith("(--debug shows the traceback)\n"), err
    assert err.count("\n") == 1
    with pytest.raises(TypeError):
        cli.main([*argv, "--debug"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--device", "bogus"], "--device: 'bogus' is not a torch device; use cpu, cuda or cuda:1"),
        (["--device", "meta"], "--device: meta holds shapes, not weights, so it cannot generate"),
        (["--top-k", "5"], "--top-k only applies with --temperature > 0"),
        (["--temperature", "-1"], "--temperature: expected a number >= 0 (0 is greedy), got -1.0"),
        (["--dtype", "int8"], "--dtype: dtype 'int8' is not supported; use one of float32 (fp32)"),
        (["--max-new-tokens", "0"], "--max-new-tokens: expected a positive integer, got 0"),
    ],
)
def test_generate_usage_errors(checkpoint: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["generate", str(checkpoint), "Hi", *extra]) == 2
    err = capsys.readouterr().err
    assert "usage: attn" in err and message in err, err


def test_generate_needs_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["generate", str(tmp_path / "nothing"), "Hi"]) == 2
    assert "is not a directory (config.json, safetensors, tokenizer.json)" in capsys.readouterr().err


@pytest.mark.slow
def test_python_dash_m_attn_generate_compiled(checkpoint: Path) -> None:
    """The command in a process of its own, with the decode step compiled (inductor):
    the same greedy text as eager."""
    proc = run_attn("generate", str(checkpoint), "Hello world", "--max-new-tokens", "20", "--compile", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == _expected(checkpoint, "Hello world", max_new_tokens=20)
    assert "attn generate: 20 tokens in" in proc.stderr
    if attn.native.decode_layers_available():  # its layers run natively (AVX-512 or AVX2): nothing to compile
        native = "; decode steps run their layers as attn::decode_layers calls (attn.native), nothing compiled"
        assert native in proc.stderr
    else:
        assert "; compiled 1 decode graph(s) in" in proc.stderr
