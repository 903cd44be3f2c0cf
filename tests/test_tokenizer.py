"""attn/tokenizer.py against transformers' own tokenizer on the same files.

The reference is ``PreTrainedTokenizerFast.from_pretrained(DIR)``, which reads the same
tokenizer.json, tokenizer_config.json and chat template files with transformers' code:
ids, special ids and rendered chat templates must agree with it exactly.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("tokenizers")
jinja2 = pytest.importorskip("jinja2")

from attn.tokenizer import TokenizerFile  # noqa: E402
from tests.conftest import SPECIAL_TOKENS, write_tokenizer_files  # noqa: E402

BOS, EOS, USER, ASSISTANT, SYSTEM, END = range(len(SPECIAL_TOKENS))  # ids of the special tokens

# A chat format with what Hub templates use: a system turn taken out of the messages, a
# date from strftime_now, tools as JSON, namespace(), loop controls, raise_exception, a
# {% generation %} block, whitespace control, and eos_token after a final assistant turn.
RICH_TEMPLATE = """{{- bos_token }}
{%- if not year is defined %}{%- set year = strftime_now("%Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "Be terse." %}
{%- endif %}
<|system|>Year {{ year }}. {{ system }}
{%- if tools is defined and tools %} Tools: {{ tools | tojson(indent=2) }}{%- endif %}<|end|>
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message['role'] == 'stop' %}{% break %}{%- endif %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('roles are user and assistant, got ' + message['role']) }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
<|{{ message['role'] }}|>
    {%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{% endgeneration %}
    {%- else %}{{ message['content'] | trim }}{%- endif %}<|end|>
    {%- if loop.last and message['role'] == 'assistant' %}{{ eos_token }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{%- endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello <b> & 'quotes'"}],
    [{"role": "system", "content": " You are a fox. "}, {"role": "user", "content": "Jump?"}],
    [
        {"role": "user", "content": "Caf\u00e9 \U0001f642"},
        {"role": "assistant", "content": "Over the lazy dog. "},
        {"role": "user", "content": "Again\nplease"},
    ],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bye"}],
    [{"role": "user", "content": "kept"}, {"role": "stop", "content": ""}, {"role": "user", "content": "dropped"}],
]


def reference(directory: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json and tokenizer_config.json (BOS, EOS, the small chat template) only."""
    directory = tmp_path_factory.mktemp("plain")
    write_tokenizer_files(directory)
    return directory


@pytest.fixture(scope="module")
def rich(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("rich")
    write_tokenizer_files(directory, chat_template=RICH_TEMPLATE)
    return directory


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content))


# ---------------------------------------------------------------------------- text <-> ids


texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=40).filter(lambda text: "<" not in text)


@given(text=texts)
def test_round_trip_and_ids_equal_transformers(plain: Path, text: str) -> None:
    tokenizer, ref = TokenizerFile(plain), reference(plain)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text  # byte-level BPE: every text round-trips
    assert ids == ref.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text, add_special_tokens=True) == ref.encode(text) == [BOS, *ids]


def test_special_tokens_in_text_are_their_ids_and_decode_skips_them(plain: Path) -> None:
    tokenizer = TokenizerFile(plain)
    ids = tokenizer.encode("<|user|>Hello<|end|></s>")
    assert ids[0] == USER and ids[-2:] == [END, EOS]
    assert tokenizer.decode(ids) == "Hello"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|user|>Hello<|end|></s>"
    assert tokenizer.vocab_size == 320


# ---------------------------------------------------------------------------- special ids


def test_special_ids_equal_transformers(plain: Path) -> None:
    tokenizer, ref = TokenizerFile(plain), reference(plain)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (BOS, EOS)
    assert tokenizer.eos_token_ids == [EOS]
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert tokenizer.add_bos_token  # the post-processor adds it


def test_every_eos_id_of_every_file_stops(tmp_path: Path) -> None:
    """Llama 3 / Qwen instruct: generation_config.json and config.json list several stops."""
    write_tokenizer_files(tmp_path, eos_token={"__type": "AddedToken", "content": "<|end|>", "special": True})
    _write_json(tmp_path / "generation_config.json", {"eos_token_id": [EOS, END], "bos_token_id": BOS})
    _write_json(tmp_path / "config.json", {"eos_token_id": [ASSISTANT, EOS]})
    tokenizer = TokenizerFile(tmp_path)
    assert tokenizer.eos_token_ids == [END, EOS, ASSISTANT]  # the tokenizer's own first, no repeats
    assert tokenizer.eos_token_id == END == reference(tmp_path).eos_token_id
    assert tokenizer.eos_token == "<|end|>"
    assert TokenizerFile(tmp_path, eos_token_id=[ASSISTANT, EOS]).eos_token_ids == [ASSISTANT, EOS]
    assert TokenizerFile(tmp_path, eos_token_id=EOS, bos_token_id=SYSTEM).bos_token_id == SYSTEM


def test_ids_from_config_json_without_tokenizer_config(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    _write_json(tmp_path / "config.json", {"bos_token_id": BOS, "eos_token_id": [EOS, END]})
    tokenizer = TokenizerFile(tmp_path / "tokenizer.json")  # the file itself: the rest from its folder
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids) == (BOS, [EOS, END])
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")  # for chat templates
    assert tokenizer.chat_template is None


def test_a_null_bos_token_means_none(tmp_path: Path) -> None:
    """Qwen: tokenizer_config.json has bos_token null while config.json names an id."""
    write_tokenizer_files(tmp_path, bos_token=None)
    _write_json(tmp_path / "config.json", {"bos_token_id": SYSTEM, "eos_token_id": EOS})
    tokenizer = TokenizerFile(tmp_path)
    assert tokenizer.bos_token_id is None is reference(tmp_path).bos_token_id
    assert not tokenizer.add_bos_token


@pytest.mark.parametrize(
    ("add_bos_token", "post_processor", "starts_with_bos"),
    [
        (None, True, True),  # Llama 3: the post-processor decides
        (None, False, False),  # GPT-2, Qwen
        (False, True, False),  # the config turns the post-processor's BOS off
        (True, False, True),  # Llama 2 style: the config asks, attn adds it
        (True, True, True),  # once, not twice
    ],
)
def test_add_bos_token(tmp_path: Path, add_bos_token: bool | None, post_processor: bool, starts_with_bos: bool) -> None:
    config = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
    tokenizer_json = write_tokenizer_files(tmp_path, **config)
    if not post_processor:
        tokenizer_json.post_processor = None
        tokenizer_json.save(str(tmp_path / "tokenizer.json"))
    tokenizer = TokenizerFile(tmp_path)
    plain = tokenizer.encode("Hello")
    assert tokenizer.add_bos_token == starts_with_bos
    assert tokenizer.encode("Hello", add_special_tokens=True) == ([BOS] if starts_with_bos else []) + plain
    assert plain[0] != BOS


# ---------------------------------------------------------------------------- chat templates


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_chat_template_renders_as_transformers_does(
    rich: Path, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    tokenizer, ref = TokenizerFile(rich), reference(rich)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == expected
    ids = ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert tokenizer.encode(text) == ids  # the template writes BOS: encode adds nothing
    assert ids.count(BOS) == 1


def test_chat_template_variables_and_tools(rich: Path) -> None:
    tokenizer, ref = TokenizerFile(rich), reference(rich)
    tools = [{"name": "search", "parameters": {"query": "<text> & more", "caf\u00e9": 1}}]
    messages = CONVERSATIONS[0]
    text = tokenizer.apply_chat_template(messages, tools=tools, year="1999")
    assert text == ref.apply_chat_template(messages, tools=tools, year="1999", tokenize=False)
    assert "Year 1999" in text and '"query": "<text> & more"' in text and "caf\u00e9" in text  # no HTML escaping


def test_list_of_named_templates(tmp_path: Path) -> None:
    templates = [
        {"name": "default", "template": RICH_TEMPLATE},
        {"name": "tool_use", "template": "{{ bos_token }}{{ tools | tojson }}{{ messages[-1]['content'] }}"},
    ]
    write_tokenizer_files(tmp_path, chat_template=templates)
    tokenizer, ref = TokenizerFile(tmp_path), reference(tmp_path)
    assert tokenizer.chat_template_names == ["default", "tool_use"]
    assert tokenizer.chat_template == RICH_TEMPLATE
    messages = CONVERSATIONS[1]
    assert tokenizer.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False)
    tools = [{"name": "f"}]
    assert tokenizer.apply_chat_template(messages, chat_template="tool_use", tools=tools) == ref.apply_chat_template(
        messages, chat_template="tool_use", tools=tools, tokenize=False
    )
    with pytest.raises(
        ValueError, match=r"no chat template named 'nope' in .*tokenizer_config.json; it has \['default'"
    ):
        tokenizer.apply_chat_template(messages, chat_template="nope")


def test_chat_template_jinja_file_wins(tmp_path: Path) -> None:
    """Newer transformers write the template beside tokenizer_config.json."""
    write_tokenizer_files(tmp_path, chat_template="unused")
    (tmp_path / "chat_template.jinja").write_text(RICH_TEMPLATE)
    messages = CONVERSATIONS[2]
    expected = reference(tmp_path).apply_chat_template(messages, tokenize=False)
    assert TokenizerFile(tmp_path).apply_chat_template(messages) == expected


def test_missing_chat_template_names_the_file(tmp_path: Path) -> None:
    write_tokenizer_files(tmp_path, chat_template=None)
    tokenizer = TokenizerFile(tmp_path)
    assert tokenizer.chat_template is None and tokenizer.chat_template_names == []
    with pytest.raises(ValueError, match=r"tokenizer_config.json has no chat_template .*chat_template.jinja"):
        tokenizer.apply_chat_template(CONVERSATIONS[0])


def test_the_template_refuses_with_raise_exception(rich: Path) -> None:
    messages = [{"role": "tool", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="got tool"):  # transformers says it so
        reference(rich).apply_chat_template(messages, tokenize=False)
    with pytest.raises(
        ValueError, match=r"the chat template refused the messages: roles are user and assistant, got tool"
    ):
        TokenizerFile(rich).apply_chat_template(messages)


@pytest.mark.parametrize(
    "template",
    ["{{ ''.__class__.__mro__[1].__subclasses__() }}", "{% set seen = [] %}{{ seen.append(1) }}"],
    ids=["dunder", "mutation"],
)
def test_templates_run_sandboxed(tmp_path: Path, template: str) -> None:
    write_tokenizer_files(tmp_path, chat_template=template)
    with pytest.raises(ValueError, match=r"failed on these messages \(SecurityError: ") as caught:
        TokenizerFile(tmp_path).apply_chat_template(CONVERSATIONS[0])
    assert caught.value.__cause__ is None and str(tmp_path / "tokenizer_config.json") in str(caught.value)


# ---------------------------------------------------------------------------- errors


def test_errors_name_the_file_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json not found: .*AutoTokenizer.from_pretrained\(DIR\)"):
        TokenizerFile(tmp_path)
    write_tokenizer_files(tmp_path, eos_token=None)
    with pytest.raises(
        ValueError, match=r"no EOS token id for .*tokenizer.json: .*pass TokenizerFile\(\.\.\., eos_token_id=ID\)"
    ):
        TokenizerFile(tmp_path)
    with pytest.raises(ValueError, match=r"eos_token_id must be an id or a non-empty list of ids, got \[\]"):
        TokenizerFile(tmp_path, eos_token_id=[])
    write_tokenizer_files(tmp_path, eos_token="<eos>")
    with pytest.raises(ValueError, match=r"names eos_token '<eos>', which .*tokenizer.json does not have"):
        TokenizerFile(tmp_path)
    write_tokenizer_files(tmp_path, chat_template={"default": "x"})
    with pytest.raises(ValueError, match=r"chat_template in .*tokenizer_config.json must be a string or a list"):
        TokenizerFile(tmp_path)
