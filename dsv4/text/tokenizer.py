"""Tokenizer loading and streaming detokenization (DSV4_FACTS section 6).

`Tokenizer` wraps a `tokenizers.Tokenizer` loaded from a checkpoint directory. Special tokens
are always looked up by their string (`special_id`), never by a hard-coded id, and special-token
strings inside text (as written by `dsv4.text.chat.encode_messages`) encode to their single ids.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas. Byte-level BPE
splits multi-byte UTF-8 characters (CJK, emoji) across tokens, so a delta is only released
once the trailing character is complete; each step decodes a short trailing window of ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import tokenizers

from ..errors import Dsv4Error
from .encode_cache import EncodeCache

DEFAULT_BOS_TOKEN = "<｜begin▁of▁sentence｜>"
DEFAULT_EOS_TOKEN = "<｜end▁of▁sentence｜>"
REPLACEMENT_CHAR = "\ufffd"  # what decoding puts in place of incomplete/invalid UTF-8 bytes


class TokenizerError(Dsv4Error, ValueError):
    """A tokenizer file is corrupt or lacks its BOS/EOS tokens (the message names the file)."""


class TokenizerNotFoundError(Dsv4Error, FileNotFoundError):
    """A checkpoint directory has no ``tokenizer.json``."""


def _token_string(value: object, field: str, path: Path) -> str:
    """Read a token string from a tokenizer_config field (plain string or AddedToken dict)."""
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str) or not value:
        raise TokenizerError(f"{path}: field {field!r} must be a token string, got {value!r}")
    return value


class Tokenizer:
    """A DSV4 tokenizer: `tokenizers.Tokenizer` plus the BOS/EOS token strings.

    Args:
        tokenizer: the underlying fast tokenizer.
        bos_token: BOS string (must be in the vocabulary).
        eos_token: EOS string (must be in the vocabulary).
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        bos_token: str = DEFAULT_BOS_TOKEN,
        eos_token: str = DEFAULT_EOS_TOKEN,
    ) -> None:
        self.hf = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._bos_id = self.special_id(bos_token)
        self._eos_id = self.special_id(eos_token)
        #: the last long texts encoded, so a text that starts with one (the next turn of a
        #: conversation) tokenizes only what follows (:mod:`dsv4.text.encode_cache`)
        self.cache = EncodeCache(tokenizer)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load `tokenizer.json` (and optional `tokenizer_config.json`) from a directory.

        Raises:
            TokenizerNotFoundError (a FileNotFoundError): `tokenizer.json` is missing (the message
                names the file).
            TokenizerError (a ValueError): either file is corrupt, or the BOS/EOS strings are not
                in the vocabulary.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerNotFoundError(f"tokenizer file not found: {tok_file}")
        try:
            hf = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust loader raises a bare Exception
            raise TokenizerError(f"cannot load tokenizer file {tok_file}: {exc}") from exc

        bos, eos = DEFAULT_BOS_TOKEN, DEFAULT_EOS_TOKEN
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"corrupt tokenizer config {cfg_file}: {exc}") from exc
            if not isinstance(cfg, dict):
                raise TokenizerError(f"corrupt tokenizer config {cfg_file}: expected a JSON object")
            if cfg.get("bos_token") is not None:
                bos = _token_string(cfg["bos_token"], "bos_token", cfg_file)
            if cfg.get("eos_token") is not None:
                eos = _token_string(cfg["eos_token"], "eos_token", cfg_file)
        try:
            return cls(hf, bos, eos)
        except KeyError as exc:
            raise TokenizerError(f"{path}: {exc.args[0]}") from exc

    @property
    def bos_id(self) -> int:
        """Id of the BOS token."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        """Id of the EOS token."""
        return self._eos_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, added/special tokens included."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def special_tokens(self) -> list[str]:
        """The strings of the tokens marked special (what ``skip_special_tokens`` leaves out)."""
        added = self.hf.get_added_tokens_decoder()
        return [t.content for t in added.values() if t.special]

    def special_id(self, token: str) -> int:
        """Id of a special token looked up by its string; KeyError naming the token if absent."""
        token_id = self.hf.token_to_id(token)
        if token_id is None:
            raise KeyError(f"token {token!r} is not in the tokenizer vocabulary")
        return token_id

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Encode text to ids; special-token strings in `text` become their single ids. A long text
        that starts with a recently encoded one (up to a special token) reuses its ids."""
        ids = self.cache.encode(text)
        return [self._bos_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Decode ids to text (special tokens written out unless `skip_special_tokens`)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Streaming ids -> text that never emits half of a UTF-8 character.

    Keeps two offsets into a short window of ids: text up to `read` has been emitted, and
    `prefix..read` is decoded again as context, so each new delta is
    `decode(window[prefix:]) - decode(window[prefix:read])`. While the decoded tail ends with
    U+FFFD (an incomplete character), nothing is emitted and the ids are held. Ids before
    `prefix` are dropped, so each step costs O(window), not O(history).

    Args:
        tokenizer: a `Tokenizer` (or anything with a compatible `decode`).
        prompt_ids: the prompt, used only as decoding context (its last few ids are kept).
        skip_special_tokens: drop special tokens from the emitted text.
    """

    CONTEXT_IDS = 6  # prompt ids kept as context for the first decode
    MAX_HELD_IDS = 16  # give up waiting for a character after this many ids (invalid bytes)

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Iterable[int] | None = None,
        skip_special_tokens: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids or [])[-self.CONTEXT_IDS :]
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the newly completed text (possibly "")."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        held = len(self._ids) - self._read
        if full_text.endswith(REPLACEMENT_CHAR) and held < self.MAX_HELD_IDS:
            return ""  # the last character is still incomplete: wait for its remaining bytes
        return self._advance(full_text[len(prefix_text) :])

    def _advance(self, delta: str) -> str:
        """Mark everything pushed so far as emitted and slide the window forward."""
        self._prefix = self._read
        self._read = len(self._ids)
        if self._prefix > 0:  # drop ids that are no longer needed as context
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta

    def flush(self) -> str:
        """Emit whatever is held (an incomplete character comes out as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        return self._advance(full_text[len(prefix_text) :])
