"""Text <-> token ids for one model folder: a Hugging Face `tokenizers` model plus its chat template."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from services.errors import CheckpointError
from services.gguf_folder import resolve_folder

CHAT_ROLES = ("system", "user", "assistant", "tool")


class _GenerationTag(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[Any]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own `tojson` HTML-escapes; templates expect plain JSON, as transformers renders it.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# Chat templates come from the Hub, so they are untrusted code: render them sandboxed, as transformers does.
_JINJA = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
)
_JINJA.filters["tojson"] = _tojson
_JINJA.globals["raise_exception"] = _raise_exception
_JINJA.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)


class Tokenizer:
    """Encodes, decodes and renders chat prompts for one model.

    BOS policy: when `add_bos_token` is true, `encode(..., add_special_tokens=True)` starts with exactly
    one BOS whether or not tokenizer.json's post-processor adds it; when false, a post-processor's BOS
    is removed; when None (absent from the config), the post-processor decides.
    """

    def __init__(self, hf_tokenizer: HFTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 add_bos_token: bool | None = None, chat_template: str | None = None) -> None:
        self._hf = hf_tokenizer
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._bos_token_id = self._token_id(bos_token, "bos_token")
        self._eos_token_id = self._token_id(eos_token, "eos_token")
        if add_bos_token and self._bos_token_id is None:
            raise ValueError("add_bos_token is true but there is no bos_token")
        post_adds_bos = self._bos_token_id is not None and hf_tokenizer.encode("").ids[:1] == [self._bos_token_id]
        self._adds_bos = post_adds_bos if add_bos_token is None else add_bos_token
        self._prepend_bos = self._adds_bos and not post_adds_bos
        self._strip_bos = post_adds_bos and not self._adds_bos
        try:
            self._chat_template = None if chat_template is None else _JINJA.from_string(chat_template)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat_template does not parse: {e}") from e
        special = {i for i, t in hf_tokenizer.get_added_tokens_decoder().items() if t.special}
        special.update(i for i in (self._bos_token_id, self._eos_token_id) if i is not None)
        self._all_special_ids = tuple(sorted(special))

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Loads `tokenizer.json`, `tokenizer_config.json` and, if present, `chat_template.jinja` (from a
        `.gguf` file's converted folder for a GGUF path: services/gguf_folder.py)."""
        folder = resolve_folder(path)
        tokenizer_file = folder / "tokenizer.json"
        config_file = folder / "tokenizer_config.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{tokenizer_file}: tokenizer.json is missing")
        try:
            hf_tokenizer = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust binding raises a bare Exception
            raise CheckpointError(f"{tokenizer_file}: tokenizer.json does not parse: {e}") from e
        config = _read_config(config_file)
        # transformers gives a separate chat_template.jinja priority over the config's entry.
        template_file = folder / "chat_template.jinja"
        chat_template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        template_source = template_file if chat_template is not None else config_file
        try:
            add_bos_token = config.get("add_bos_token")
            if add_bos_token is not None and not isinstance(add_bos_token, bool):
                raise ValueError(f"add_bos_token must be true, false or null, got {add_bos_token!r}")
            return cls(
                hf_tokenizer,
                bos_token=_token_content(config.get("bos_token"), "bos_token"),
                eos_token=_token_content(config.get("eos_token"), "eos_token"),
                add_bos_token=add_bos_token,
                chat_template=chat_template or _template_from_config(config.get("chat_template")),
            )
        except ValueError as e:
            bad_file = template_source if isinstance(e.__cause__, jinja2.TemplateError) else config_file
            raise CheckpointError(f"{bad_file}: {e}") from e

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may be below the model's embedding rows)."""
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        return self._all_special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        # encode_batch_fast releases the GIL while it works (encode holds it: 3.7 s for a 3.7 MB
        # prompt), so the router's event loop runs while one of its threads tokenizes
        # (router/cpu_pool.py); and it tracks no offsets, whose freeing held the GIL another 0.3 s.
        ids = self._hf.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._prepend_bos:
            ids.insert(0, self._bos_token_id)
        elif add_special_tokens and self._strip_bos and ids[:1] == [self._bos_token_id]:
            del ids[0]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Ids the vocabulary lacks (e.g. embedding padding rows) decode to nothing, as in `tokenizers`."""
        ids = list(ids)
        if any(i < 0 for i in ids):
            raise ValueError(f"token ids must be >= 0, got {min(ids)}")
        return self._hf.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]  # GIL released, as encode

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (a lone byte of a multi-byte character is
        U+FFFD, so two tokens may share a text: see return_tokens_as_token_ids)."""
        return self._hf.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Renders the model's chat template, or without one the plain format "role: content\\n" per
        message followed by "assistant:" when `add_generation_prompt`. List contents are joined with
        "\\n" before rendering, since most templates expect a string."""
        messages = _normalize_messages(messages)
        if self._chat_template is None:
            lines = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return lines + ("assistant:" if add_generation_prompt else "")
        variables: dict[str, Any] = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        if self._bos_token is not None:
            variables["bos_token"] = self._bos_token
        if self._eos_token is not None:
            variables["eos_token"] = self._eos_token
        try:
            return self._chat_template.render(**variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template rejected the messages: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The rendered prompt's ids, starting with one BOS if this tokenizer adds BOS (the template's own
        BOS counts; no other special tokens are added)."""
        ids = self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
        if self._adds_bos and ids[:1] != [self._bos_token_id]:
            ids.insert(0, self._bos_token_id)
        return ids

    def _token_id(self, token: str | None, name: str) -> int | None:
        if token is None:
            return None
        token_id = self._hf.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{name} {token!r} is not in tokenizer.json's vocabulary")
        return token_id


def _read_config(config_file: Path) -> dict[str, Any]:
    if not config_file.is_file():
        raise CheckpointError(f"{config_file}: tokenizer_config.json is missing")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_file}: tokenizer_config.json does not parse: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: tokenizer_config.json must hold a JSON object")
    return config


def _token_content(token: Any, name: str) -> str | None:
    # HF writes special tokens either as plain strings or as AddedToken dicts {"content": ..., ...}.
    if isinstance(token, dict):
        token = token.get("content")
    if token is not None and not isinstance(token, str):
        raise ValueError(f"{name} must be a string or a dict with a string 'content', got {token!r}")
    return token


def _template_from_config(template: Any) -> str | None:
    # Older configs hold several named templates: [{"name": "default", "template": "..."}, ...].
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"chat_template must be a string or a list with a 'default' entry, got {template!r}")
    return template


def _normalize_messages(messages: list[dict]) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    normalized = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if isinstance(content, list):
            content = "\n".join(_text_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content))
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        normalized.append({**message, "content": content})
    return normalized


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise ValueError(f"{where} must be {{'type': 'text', 'text': <string>}}, got {part!r}")
    return part["text"]
