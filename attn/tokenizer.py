"""A checkpoint's tokenizer: ``tokenizer.json``, its special ids and its chat template.

Text in, text out for ``python -m attn generate`` and the lm-eval adapter, with the
``tokenizers`` library and ``jinja2`` (``pip install 'attn[tokenizer]'``), not transformers.
The core (``import attn``) never imports this module.

Files read from the checkpoint directory (all but tokenizer.json optional):

- ``tokenizer.json``: vocabulary, pre-tokenizer, post-processor (which may add BOS), decoder;
- ``tokenizer_config.json``: ``bos_token``, ``eos_token``, ``add_bos_token``, ``chat_template``;
- ``generation_config.json`` and ``config.json``: ``bos_token_id`` and ``eos_token_id`` (an
  id or a list: Llama 3 and Qwen instruct models stop on several);
- ``chat_template.jinja`` or ``chat_template.json``: where newer transformers write the
  chat template; either wins over tokenizer_config.json's.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from attn.errors import first_line

__all__ = ["TokenizerFile"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CONFIG_FILE = "config.json"
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class TokenizerFile:
    """A Hugging Face fast tokenizer read from its files, with the ids generation needs.

    Args:
        path: a checkpoint directory holding ``tokenizer.json``, or the file itself (the
            other files are read from the same directory).
        eos_token_id: the stop id, or ids, to use instead of those the files name.
        bos_token_id: the BOS id to use instead of the one the files name.

    Attributes:
        eos_token_ids: every id that ends a generation: tokenizer_config.json's ``eos_token``,
            then generation_config.json's and config.json's ``eos_token_id`` (each an id or a
            list), without repeats.
        eos_token_id: the first of them (the tokenizer's own EOS where it names one).
        bos_token_id: tokenizer_config.json's ``bos_token`` where that file names the key
            (``null`` included: Qwen has no BOS), else config.json's ``bos_token_id``.
        add_bos_token: whether ``encode(text, add_special_tokens=True)`` starts with BOS:
            tokenizer_config.json's ``add_bos_token``, else what tokenizer.json's
            post-processor does (Llama 3's adds BOS; GPT-2's and Qwen's do not).
        chat_template: the default chat template's source, or None.

    Example::

        tokenizer = TokenizerFile("/models/my-llama")
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
        out = attn.generate(model, [tokenizer.encode(text)], max_new_tokens=64, stop_tokens=tokenizer.eos_token_ids)
        print(tokenizer.decode(out.generated[0].tolist()))
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        eos_token_id: int | Sequence[int] | None = None,
        bos_token_id: int | None = None,
    ) -> None:
        file = Path(path)
        if file.is_dir():
            file = file / TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} not found: pass a checkpoint directory holding the Hugging Face fast-tokenizer "
                f"file {TOKENIZER_FILE}, or the file itself. A checkpoint with only a SentencePiece "
                "tokenizer.model gets one with transformers: "
                "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
            )
        self.path = file
        self.directory = file.parent
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as error:  # the tokenizers library raises its own Exception kinds
            raise ValueError(
                f"{file} is not a tokenizer file the tokenizers library can read ({first_line(error)}): "
                "it may be truncated or from a newer library; copy it again from the checkpoint"
            ) from error
        config = self._read_json(TOKENIZER_CONFIG_FILE)
        generation = self._read_json(GENERATION_CONFIG_FILE)
        model = self._read_json(CONFIG_FILE)

        # The token strings are what chat templates print; the ids are what generation uses.
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self.eos_token_ids: list[int] = (
            _ids(eos_token_id) if eos_token_id is not None else self._eos_ids(self.eos_token, generation, model)
        )
        if not self.eos_token_ids:
            raise ValueError(f"eos_token_id must be an id or a non-empty list of ids, got {eos_token_id!r}")
        self.eos_token_id: int = self.eos_token_ids[0]
        self.eos_token = self.eos_token or self._tokenizer.id_to_token(self.eos_token_id)
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        if bos_token_id is not None:
            self.bos_token_id: int | None = int(bos_token_id)
        elif "bos_token" in config:  # null included: the tokenizer has no BOS (Qwen)
            self.bos_token_id = None if self.bos_token is None else self._token_id(self.bos_token, "bos_token")
        else:
            self.bos_token_id = _first(_ids(model.get("bos_token_id")) or _ids(generation.get("bos_token_id")))
        if self.bos_token is None and self.bos_token_id is not None:
            self.bos_token = self._tokenizer.id_to_token(self.bos_token_id)

        self._post_adds_bos = self._post_processor_adds_bos()
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            self.add_bos_token: bool = self._post_adds_bos
        else:
            self.add_bos_token = bool(add_bos) and self.bos_token_id is not None
        self._templates, self._template_source = self._read_chat_templates(config)
        self.chat_template: str | None = self._templates.get("default")

    # -- text <-> ids -------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: the text; special tokens written in it (``<|eot_id|>``) become their ids.
            add_special_tokens: False (the default): the ids of the text alone, as a
                rendered chat template needs. True: what the checkpoint adds around a plain
                prompt: tokenizer.json's post-processor, then BOS added or removed as
                ``add_bos_token`` says.
        """
        ids = list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens and self.add_bos_token != self._post_adds_bos:
            if self.add_bos_token:
                ids = [self.bos_token_id, *ids]  # type: ignore[list-item]  # add_bos_token implies an id
            elif ids[:1] == [self.bos_token_id]:
                ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; special tokens (BOS, EOS, chat markers) dropped by default."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer can produce, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    # -- chat ----------------------------------------------------------------------------

    @property
    def chat_template_names(self) -> list[str]:
        """Names of the chat templates (``"default"`` for a template given as one string)."""
        return list(self._templates)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **variables: Any,
    ) -> str:
        """Renders ``messages`` with the checkpoint's chat template, as transformers does.

        The template runs in jinja2's sandbox with the helpers Hugging Face templates expect
        (``raise_exception``, ``strftime_now``, ``tojson`` without HTML escaping, loop
        controls, a ``{% generation %}`` block) and the variables ``messages``,
        ``add_generation_prompt``, ``bos_token`` and ``eos_token``. Encode the result with
        ``encode(text)``: the template writes the special tokens itself.

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``.
            add_generation_prompt: end with the header of an assistant turn.
            chat_template: a template's name, where tokenizer_config.json lists several;
                None: the one named ``"default"``.
            **variables: more template variables (``tools``, ``date_string``, ...).

        Raises:
            ValueError: the checkpoint has no chat template, has none of that name, or the
                template rejects the messages (its ``raise_exception``).
        """
        name = "default" if chat_template is None else chat_template
        if name not in self._templates:
            if not self._templates:
                raise ValueError(
                    f"{self.directory / TOKENIZER_CONFIG_FILE} has no chat_template (and there is no "
                    f"{' or '.join(CHAT_TEMPLATE_FILES)} in {self.directory}): this tokenizer has no chat "
                    "format; pass the prompt as plain text, or add a chat_template to tokenizer_config.json"
                )
            raise ValueError(
                f"no chat template named {name!r} in {self.directory / TOKENIZER_CONFIG_FILE}; it has "
                f"{self.chat_template_names}: pass one of them as chat_template="
            )
        where = f"the chat template {name!r} in {self._template_source}"
        try:
            template = _environment().from_string(self._templates[name])
        except jinja2.TemplateSyntaxError as error:  # an unknown filter or test too
            raise ValueError(
                f"{where} does not compile, line {error.lineno}: {error.message}; fix the template there, "
                "or pass the prompt as plain text"
            ) from None
        try:
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **variables,
            )
        except jinja2.TemplateError as error:  # an undefined name, a call the sandbox refuses
            raise ValueError(
                f"{where} failed on these messages ({first_line(error)}): it may "
                "need a variable attn does not pass (give it as a keyword), or fix the template there"
            ) from None

    # -- reading the files ----------------------------------------------------------------

    def _read_json(self, name: str) -> dict[str, Any]:
        path = self.directory / name
        if not path.is_file():
            return {}
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON ({error}): fix it, or copy it again") from None
        if not isinstance(content, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(content).__name__}")
        return content

    def _eos_ids(self, eos_token: str | None, generation: Mapping[str, Any], model: Mapping[str, Any]) -> list[int]:
        """tokenizer_config.json's eos_token, then every eos_token_id of the other files, once each."""
        named = [] if eos_token is None else [self._token_id(eos_token, "eos_token")]
        ids = list(dict.fromkeys(named + _ids(generation.get("eos_token_id")) + _ids(model.get("eos_token_id"))))
        if not ids:
            raise ValueError(
                f"no EOS token id for {self.path}: none of {TOKENIZER_CONFIG_FILE} (eos_token), "
                f"{GENERATION_CONFIG_FILE} and {CONFIG_FILE} (eos_token_id) in {self.directory} names "
                "one; pass TokenizerFile(..., eos_token_id=ID)"
            )
        return ids

    def _token_id(self, token: str, key: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"{self.directory / TOKENIZER_CONFIG_FILE} names {key} {token!r}, which {self.path} does "
                f"not have: fix {key} there, or pass TokenizerFile(..., {key}_id=ID)"
            )
        return token_id

    def _post_processor_adds_bos(self) -> bool:
        if self.bos_token_id is None:
            return False
        plain = self._tokenizer.encode("a", add_special_tokens=False).ids
        special = self._tokenizer.encode("a", add_special_tokens=True).ids
        return special[:1] == [self.bos_token_id] and plain[:1] != [self.bos_token_id]

    def _read_chat_templates(self, config: Mapping[str, Any]) -> tuple[dict[str, str], Path]:
        """Every chat template by name (a single template is named ``"default"``), and the file
        they come from."""
        jinja_file, json_file = (self.directory / name for name in CHAT_TEMPLATE_FILES)
        if jinja_file.is_file():
            return {"default": jinja_file.read_text(encoding="utf-8")}, jinja_file
        if json_file.is_file():
            source, value = json_file, self._read_json(json_file.name).get("chat_template")
        else:
            source, value = self.directory / TOKENIZER_CONFIG_FILE, config.get("chat_template")
        if value is None:
            return {}, source
        if isinstance(value, str):
            return {"default": value}, source
        if isinstance(value, list) and all(
            isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str)
            for entry in value
        ):
            return {entry["name"]: entry["template"] for entry in value}, source
        raise ValueError(
            f"chat_template in {source} must be a string or a list of {{'name': ..., 'template': ...}}, "
            f"got {type(value).__name__}"
        )


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    """An id, a list of ids, or nothing, as a list."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _first(ids: list[int]) -> int | None:
    return ids[0] if ids else None


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: marks an assistant reply for training
    masks in transformers; here it renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012  (jinja2 reads it from the class)

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    """JSON as templates expect it: no HTML escaping (jinja2's own ``tojson`` escapes ``<``)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _raise_exception(message: str) -> None:
    raise ValueError(f"the chat template refused the messages: {message}")


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.cache
def _environment() -> jinja2.Environment:
    """The sandboxed environment chat templates run in (Hub templates are untrusted code)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
