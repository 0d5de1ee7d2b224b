"""A converted tokenizer directory read without transformers.

``LightTokenizer.load(path)`` reads what transformers' generic fast tokenizer
(``TokenizersBackend``, formerly ``PreTrainedTokenizerFast``) reads in a directory (tokenizer.json
with the ``tokenizers`` library, tokenizer_config.json, special_tokens_map.json, chat_template.jinja)
and answers the calls yggtree makes with transformers' results: ``tok(text, add_special_tokens=...)
["input_ids"]``, ``encode``, ``decode``, ``apply_chat_template`` (rendered by jinja2 as transformers
renders it), ``chat_template``, the special tokens and their ids, ``all_special_ids``,
``get_vocab``, ``len``, ``convert_tokens_to_ids`` and ``save_pretrained``. Importing transformers
costs seconds of a start; this costs the tokenizer file's parse.

``load`` is None for a directory whose reading by transformers it does not reproduce exactly (no
tokenizer.json, a model-specific tokenizer class, a setting it does not know, padding or truncation
kept in tokenizer.json, special tokens that transformers would add or change in the backend, several
chat templates or one using transformers' ``{% generation %}`` tag): the caller loads it with
transformers then."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # the generic class (transformers 5, 4)
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# every tokenizer_config.json key read here, or without effect on these calls (transformers drops
# add_bos/eos_token when a tokenizer.json exists; the rest is bookkeeping, or padding and truncation
# defaults no call here uses)
_KEYS = {*_NAMED, "tokenizer_class", "chat_template", "added_tokens_decoder", "extra_special_tokens",
         "additional_special_tokens", "split_special_tokens", "clean_up_tokenization_spaces",
         "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", "add_bos_token",
         "add_eos_token", "add_prefix_space", "backend", "is_local", "local_files_only", "model_max_length",
         "padding_side", "truncation_side"}
_ADDED = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_GENERATION = re.compile(r"\{%[-+]?\s*generation\b")
_REASONING = ("reasoning_content", "thinking", "reasoning")


def _text(token, typed: bool) -> str | None:
    """A special token's text: a string, or an AddedToken dict (tagged ``__type`` in
    tokenizer_config.json, untagged in special_tokens_map.json, as transformers reads them). None
    for a value transformers would reject."""
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str) and (token.get("__type") == "AddedToken") == typed:
        return token["content"]
    return None


class LightTokenizer:
    """A directory's tokenizer with transformers' semantics for the calls above (``load``)."""

    def __init__(self, path: Path, backend, named: dict[str, str], extra: list[str], chat_template: str | None,
                 clean_up: bool, bpe: bool) -> None:
        self.path, self._backend, self.chat_template = path, backend, chat_template
        self.special_tokens_map = named  # the named tokens' texts, as the chat template sees them
        self.clean_up_tokenization_spaces = clean_up
        self._no_clean_up = bpe  # transformers ignores the clean-up for a BPE model
        self._compiled = None  # the chat template, compiled at its first use
        for attr in _NAMED:
            token = named.get(attr)
            setattr(self, attr, token)
            setattr(self, f"{attr}_id", None if token is None else backend.token_to_id(token))
        self.all_special_tokens = list(dict.fromkeys([*named.values(), *extra]))
        self.all_special_ids = [backend.token_to_id(t) for t in self.all_special_tokens]

    @classmethod
    def load(cls, path: str | Path) -> LightTokenizer | None:
        path = Path(path)
        try:
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
            smap = path / "special_tokens_map.json"
            smap = json.loads(smap.read_text(encoding="utf-8")) if smap.is_file() else {}
            template = path / "chat_template.jinja"
            template = template.read_text(encoding="utf-8") if template.is_file() else config.get("chat_template")
            from tokenizers import Tokenizer

            backend = Tokenizer.from_file(str(path / "tokenizer.json"))
        except Exception:  # noqa: BLE001 - a missing or unreadable file: transformers decides, and says why
            return None
        if (not isinstance(config, dict) or config.get("tokenizer_class") not in _CLASSES or not set(config) <= _KEYS
                or not isinstance(smap, dict) or not set(smap) <= set(_NAMED) or config.get("split_special_tokens")
                or (path / "added_tokens.json").exists() or (path / "additional_chat_templates").exists()
                or backend.truncation is not None or backend.padding is not None
                or (backend.get_vocab_size() > 100000 and (path / "config.json").exists())  # its Mistral regex fix
                or not isinstance(template, (str, type(None))) or (template and _GENERATION.search(template))):
            return None
        added = {i: {k: getattr(t, k) for k in _ADDED} for i, t in backend.get_added_tokens_decoder().items()}
        raw, typed = {k: config.get(k) for k in _NAMED}, dict.fromkeys(_NAMED, True)
        if "added_tokens_decoder" in config:  # then special_tokens_map.json is not read
            declared = config["added_tokens_decoder"]
            if not isinstance(declared, dict) or added != {int(i): {k: t.get(k) for k in _ADDED}
                                                           for i, t in declared.items() if isinstance(t, dict) and str(i).isdigit()}:
                return None
        else:  # its tokens replace the config's
            raw.update(smap)
            typed.update(dict.fromkeys(smap, False))
        named = {k: _text(v, typed[k]) for k, v in raw.items() if v is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = [_text(t, True) for t in extra] if isinstance(extra, list) else [None]
        special = {t["content"] for t in added.values() if t["special"]}
        present = {t["content"] for t in added.values()}
        # transformers adds the special tokens the backend lacks and marks the named ones special:
        # reproduced only where that changes nothing
        if not set(named.values()) <= special or not set(extra) <= present:  # (None: a value it rejects)
            return None
        if backend.post_processor is None:  # transformers sets its own, which adds nothing
            from tokenizers.processors import TemplateProcessing

            backend.post_processor = TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        backend.encode_special_tokens = False
        bpe = type(backend.model).__name__ == "BPE" and not config.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        return cls(path, backend, named, extra, template, bool(config.get("clean_up_tokenization_spaces", False)), bpe)

    # ---------------------------------------------------------------- encoding

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"LightTokenizer encodes one string, not {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None):
        ids = ids.tolist() if hasattr(ids, "tolist") else ids  # tensors and arrays, as transformers takes them
        if isinstance(ids, int):
            ids = [ids]
        if ids and isinstance(ids[0], (list, tuple)):
            return [self.decode(s, skip_special_tokens, clean_up_tokenization_spaces) for s in ids]
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and not self._no_clean_up:
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    # ---------------------------------------------------------------- vocabulary

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        if isinstance(tokens, str):
            i = self._backend.token_to_id(tokens)
            return self.unk_token_id if i is None else i
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def save_pretrained(self, directory: str | Path) -> tuple[str, ...]:
        """The directory's files copied into ``directory`` (they load back as this tokenizer, with
        transformers too)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        return tuple(shutil.copyfile(self.path / f, out / f) for f in _FILES if (self.path / f).is_file())

    # ---------------------------------------------------------------- chat template

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, return_dict: bool = True):
        """transformers' ``apply_chat_template`` for one conversation of message dicts."""
        if self.chat_template is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if not all(isinstance(m, dict) for m in conversation):
            raise TypeError("LightTokenizer applies the chat template to one conversation of message dicts")
        messages = []
        for m in conversation:  # transformers drops None values, and names the reasoning as templates read it
            m = {k: v for k, v in m.items() if v is not None}
            reasoning = next((m[k] for k in _REASONING if m.get(k) is not None), None)
            messages.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        text = self._compiled.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        if not tokenize:
            return text
        return self(text, add_special_tokens=False) if return_dict else self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return f"LightTokenizer({str(self.path)!r}, {len(self)} tokens)"


def _compile(template: str):
    """``template`` compiled as transformers compiles chat templates (its utils/chat_template_utils.py):
    an immutable sandbox that trims blocks, loop controls, its tojson filter, raise_exception,
    strftime_now, and its restricted dict and namespace."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env.from_string(template)
