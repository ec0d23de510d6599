"""A GGUF file's tokenizer, read without transformers: the ``tokenizers`` library's ``Tokenizer`` and the
special tokens and chat template beside it.

A GGUF vocabulary is converted into a tokenizer once, by transformers' converters, and saved (see
:meth:`~modelrunner.loading.gguf_file.GGUFCheckpoint.tokenizer`); every later load reads the saved
``tokenizer.json`` with ``tokenizers`` alone. Importing transformers would cost half a second of a 2-core load
and wrapping the vocabulary in its ``PreTrainedTokenizerFast`` a fifth more, so :class:`GGUFTokenizer` answers
what the engine asks on every load and request itself, and builds transformers' tokenizer only when something
asks for more (a chat template, a grammar backend, anything it does not define).
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""What transformers' ``save_pretrained`` writes for a tokenizer built from GGUF metadata."""
_NAMED = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
"""The special tokens a tokenizer config may name."""
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
"""transformers' ``clean_up_tokenization``, for configs that ask for it."""


def _content(token: Any) -> str | None:
    """A special token as a config stores it: a string, or an ``AddedToken``'s dict."""
    return token.get("content") if isinstance(token, dict) else token


class GGUFTokenizer:
    """A GGUF file's tokenizer with transformers' tokenizer methods (see the module's docstring).

    ``encode``, ``decode``, the special tokens and ids, ``get_vocab``, ``len()`` and ``save_pretrained`` run on
    the ``tokenizers`` backend and give what transformers' ``PreTrainedTokenizerFast`` gives for the same
    files (a test compares them); ``apply_chat_template``, calling it, and any attribute it does not define are
    answered by that ``PreTrainedTokenizerFast`` (:meth:`to_transformers`), built on first use.
    """

    is_fast = True
    """A Rust (``tokenizers``) backend, as transformers' fast tokenizers."""

    def __init__(self, backend: Any, config: dict[str, Any], chat_template: str | None = None,
                 name_or_path: str = "", files: Path | None = None, transformers_tokenizer: Any = None) -> None:
        self.backend_tokenizer = backend
        """The ``tokenizers.Tokenizer`` that encodes and decodes."""
        self.init_kwargs = dict(config)
        """The tokenizer config (``tokenizer_config.json``)."""
        self.chat_template = chat_template
        """The Jinja chat template the file carries (None if it has none)."""
        self.name_or_path = name_or_path
        """Where it was read from (the GGUF file)."""
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        """Whether ``decode`` removes spaces before punctuation (transformers' option)."""
        self._files = files
        self._transformers = transformers_tokenizer
        self._lock = threading.Lock()
        for name in _NAMED:
            token = _content(config.get(name))
            setattr(self, name, token)
            setattr(self, f"{name}_id", None if token is None else backend.token_to_id(token))
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        named = [getattr(self, name) for name in _NAMED if getattr(self, name) is not None]
        self.all_special_tokens: list[str] = list(dict.fromkeys([*named, *(_content(t) for t in extra)]))
        """The special tokens by name and the extra ones, each once."""
        self.all_special_ids: list[int] = [i for t in self.all_special_tokens
                                           if (i := backend.token_to_id(t)) is not None]
        """Their ids."""

    @classmethod
    def from_directory(cls, directory: str | Path, name_or_path: str = "") -> GGUFTokenizer:
        """Read the files :meth:`save_pretrained` (or transformers') wrote into ``directory``.

        :raises Exception: a missing or unreadable file (the caller builds the tokenizer again).
        """
        from tokenizers import Tokenizer

        directory = Path(directory)
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else config.get("chat_template")
        return cls(Tokenizer.from_file(str(directory / "tokenizer.json")), config, template, name_or_path, directory)

    @classmethod
    def from_transformers(cls, tokenizer: Any, name_or_path: str = "") -> GGUFTokenizer:
        """Wrap a transformers tokenizer built in this process (its backend, special tokens and template)."""
        config = {name: getattr(tokenizer, name, None) for name in _NAMED}
        config["clean_up_tokenization_spaces"] = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        return cls(tokenizer.backend_tokenizer, config, tokenizer.chat_template, name_or_path,
                   transformers_tokenizer=tokenizer)

    # -- what the engine asks ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """Token ids of ``text`` (with the BOS the tokenizer adds, unless ``add_special_tokens=False``);
        other options (truncation, padding…) go to transformers' tokenizer."""
        if kwargs or not isinstance(text, str):
            return self.to_transformers().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        """The text of ``token_ids`` (an id or a sequence of ids)."""
        ids = [int(token_ids)] if isinstance(token_ids, int) or getattr(token_ids, "ndim", 1) == 0 \
            else [int(i) for i in token_ids]
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def batch_decode(self, sequences: Any, **kwargs: Any) -> list[str]:
        """:meth:`decode` of each sequence."""
        return [self.decode(ids, **kwargs) for ids in sequences]

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        """The token string of an id, or of each id in a list (special ones left out if asked)."""
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in special]

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        """The id of a token string, or of each in a list (the unknown token's id where it has none)."""
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        """Token string → id, added tokens included."""
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size (without added tokens), as transformers counts it."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> tuple[str, ...]:
        """Write the tokenizer's files into ``save_directory`` (transformers' ``AutoTokenizer`` reads them)."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        if self._files is None:
            return tuple(self.to_transformers().save_pretrained(str(out), **kwargs))
        written = []
        for name in _FILES:
            if (self._files / name).is_file():
                shutil.copyfile(self._files / name, out / name)
                written.append(str(out / name))
        return tuple(written)

    # -- everything else: transformers' tokenizer --------------------------------------------------

    def to_transformers(self) -> Any:
        """The same tokenizer as transformers' ``PreTrainedTokenizerFast`` (built once; imports transformers)."""
        with self._lock:
            if self._transformers is None:
                from transformers import PreTrainedTokenizerFast

                self._transformers = PreTrainedTokenizerFast.from_pretrained(str(self._files))
            return self._transformers

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``apply_chat_template`` (its Jinja environment and options), on this template."""
        return self.to_transformers().apply_chat_template(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.to_transformers()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.to_transformers(), name)

    def __getstate__(self) -> dict[str, Any]:
        # Pickled (to another process) without the lock and without transformers' copy, rebuilt there on use.
        return {k: v for k, v in vars(self).items() if k not in ("_lock", "_transformers")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock(), _transformers=None)

    def __repr__(self) -> str:
        return f"GGUFTokenizer(name_or_path={self.name_or_path!r}, vocab={len(self)})"

