"""The checkpoint's tokenizer, torch-free so the gRPC server process can tokenize prompts without loading the engine."""

from __future__ import annotations

import functools
import json
import os

from hybridkv.sidecar.core.config import ConfigError


class Tokenizer:
    """The checkpoint's `tokenizer.json`, with the end-of-sequence ids its configs declare."""

    def __init__(self, folder: str):
        from tokenizers import Tokenizer as HFTokenizer

        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(f"model folder {folder!r} has no tokenizer.json")
        try:
            self._tokenizer = HFTokenizer.from_file(path)
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises bare Exceptions for a bad file
            raise ConfigError(f"{path} is not a tokenizer the tokenizers library can read ({str(exc)[:200]}); "
                              "rebuild or download the checkpoint again") from None
        self.eos_token_ids = tuple(sorted(self._eos_ids(folder)))

    def _eos_ids(self, folder: str) -> set[int]:
        ids: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            config = _read_json(os.path.join(folder, name))
            for scope in (config, config.get("text_config") or {}):
                value = scope.get("eos_token_id")
                values = [] if value is None else [value] if not isinstance(value, list) else value
                if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
                    raise ConfigError(f"{os.path.join(folder, name)}: eos_token_id must be a token id or a list of "
                                      f"token ids, got {str(value)[:80]!r}")
                ids.update(values)
        eos_token = _read_json(os.path.join(folder, "tokenizer_config.json")).get("eos_token")
        if isinstance(eos_token, dict):
            eos_token = eos_token.get("content")
        if isinstance(eos_token, str) and self._tokenizer.token_to_id(eos_token) is not None:
            ids.add(self._tokenizer.token_to_id(eos_token))
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (a byte-level token's string has a character per byte,
        and a character is at least a byte): a text longer than `n * max_token_chars` has more than n tokens."""
        return max(len(token) for token in self._tokenizer.get_vocab(with_added_tokens=True))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def decode_batch(self, sequences: list[list[int]]) -> list[str]:
        return self._tokenizer.decode_batch(sequences, skip_special_tokens=True)

    @property
    def backend(self):
        """The tokenizers library's tokenizer (what its `DecodeStream` steps take)."""
        return self._tokenizer


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    return data if isinstance(data, dict) else {}
