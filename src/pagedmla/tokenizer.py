"""Text <-> token ids: the built-in byte tokenizer and a checkpoint's `tokenizer.json`.

Both classes offer the small surface the engine needs (`encode`, `decode`,
`bos_token_id`, `eos_token_id`), described by the `TextTokenizer` protocol.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import tokenizers

from pagedmla.validation import read_json_object


class TextTokenizer(Protocol):
    """What the engine uses of a tokenizer."""

    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens the model expects (e.g. BOS)
        unless add_special_tokens is False (a rendered chat template holds its own)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens left out."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: byte b is id b + 3; ids 0, 1, 2 are pad, BOS and EOS.

    Needs no vocabulary file, so the built-in tiny model runs without any download.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    num_special_tokens = 3
    vocab_size = 256 + num_special_tokens
    special_tokens = ("<pad>", "<bos>", "<eos>")
    """Names of ids 0, 1, 2 in the `tokenizers` version (`to_tokenizers`)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """BOS (unless add_special_tokens is False), then one id per UTF-8 byte of `text`."""
        ids = [b + self.num_special_tokens for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes of the non-special ids as UTF-8; invalid sequences become U+FFFD.

        A generated sequence may stop inside a multi-byte character or hold byte
        sequences that are not UTF-8, so decoding must never fail.
        """
        data = bytes(
            i - self.num_special_tokens
            for i in ids
            if self.num_special_tokens <= i < self.vocab_size
        )
        return data.decode("utf-8", errors="replace")

    def to_tokenizers(self) -> tokenizers.Tokenizer:
        """The same tokenizer as a `tokenizers.Tokenizer`, to save as `tokenizer.json`.

        Byte-level pre-tokenization maps every byte to one printable character and a
        BPE model without merges maps each character to `byte + 3`, so encoding and
        decoding agree with this class (except that the literal text of a special
        token, e.g. "<eos>", becomes that special id, as in any `tokenizer.json`).
        """
        vocab = {name: i for i, name in enumerate(self.special_tokens)}
        for byte, char in _byte_to_char().items():
            vocab[char] = byte + self.num_special_tokens
        tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=False
        )
        tok.decoder = tokenizers.decoders.ByteLevel()
        tok.add_special_tokens(list(self.special_tokens))
        bos = self.special_tokens[self.bos_token_id]
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, self.bos_token_id)]
        )
        return tok


def _byte_to_char() -> dict[int, str]:
    """The usual byte-level alphabet: printable Latin-1 bytes stand for themselves,
    the others are moved to code points from 256 up, so that no byte maps to
    whitespace or a control character that pre-tokenizers would treat specially."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + n) for n, b in enumerate(others)})
    return mapping


class FileTokenizer:
    """A checkpoint's `tokenizer.json`, through the `tokenizers` library."""

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, bos_token_id: int | None, eos_token_id: int | None
    ) -> None:
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`; the file's post-processor adds BOS where the model wants it
        (unless add_special_tokens is False)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` without special tokens."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(directory: str | Path, config: Mapping[str, Any]) -> FileTokenizer | None:
    """The tokenizer of a checkpoint directory, or None when it has no `tokenizer.json`.

    BOS/EOS ids come from the model config (`config`, i.e. config.json) when it names
    them, else from the tokens named in `tokenizer_config.json`. A list of EOS ids in
    the config is reduced to its first entry.
    """
    directory = Path(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # the library raises a bare Exception for a broken file
        raise ValueError(f"{path} is not a tokenizers tokenizer: {err}") from err
    tok_config_path = directory / "tokenizer_config.json"
    tok_config = read_json_object(tok_config_path) if tok_config_path.is_file() else {}

    def special_id(kind: str) -> int | None:
        value = config.get(f"{kind}_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
        token = tok_config.get(f"{kind}_token")
        if isinstance(token, dict):  # AddedToken serialised as {"content": ..., ...}
            token = token.get("content")
        return tok.token_to_id(token) if isinstance(token, str) else None

    return FileTokenizer(tok, special_id("bos"), special_id("eos"))
