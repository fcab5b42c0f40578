"""Tokenizers: the built-in character tokenizer for tiny models and an adapter for local HF tokenizers.

Both expose the same small interface the engine, trainer and tasks rely on:
`encode(text, add_bos=False) -> list[int]`, `decode(ids, skip_special=True) -> str`,
`vocab_size`, `pad_id`, `bos_id`, `eos_id`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

# Fixed layout: ids 0..2 are specials, then '\n', then printable ASCII 32..126 in order.
# Never reorder: checkpoints of tiny models store embeddings indexed by these ids.
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
_SPECIALS = (PAD, BOS, EOS)
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of tracerl needs from a tokenizer."""

    pad_id: int
    bos_id: int
    eos_id: int

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str: ...


class CharTokenizer:
    """Character tokenizer: <pad>=0, <bos>=1, <eos>=2, '\\n'=3, then ASCII 32..126 (vocab 99)."""

    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self) -> None:
        self._offset = len(_SPECIALS)
        self._to_id = {ch: i + self._offset for i, ch in enumerate(_CHARS)}
        self._to_str = list(_SPECIALS) + list(_CHARS)

    @property
    def vocab_size(self) -> int:
        """Number of ids (99); models may pad their embedding beyond it."""
        return len(self._to_str)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Map each character to its id; raise ValueError on a character outside the vocabulary."""
        ids = [self.bos_id] if add_bos else []
        to_id = self._to_id
        for pos, ch in enumerate(text):
            i = to_id.get(ch)
            if i is None:
                raise ValueError(f"CharTokenizer: character {ch!r} (U+{ord(ch):04X}) at position {pos} is not in the vocabulary")
            ids.append(i)
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Map ids back to text; specials are dropped (skip_special) or rendered as <pad>/<bos>/<eos>."""
        out = []
        n = len(self._to_str)
        for i in ids:
            i = int(i)
            if not 0 <= i < n:
                # Models pad the embedding to 128 rows; an id in the padding is a model bug, not text.
                raise ValueError(f"CharTokenizer: id {i} is outside the vocabulary (size {n})")
            if i < self._offset and skip_special:
                continue
            out.append(self._to_str[i])
        return "".join(out)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
    """Adapter giving a local Hugging Face tokenizer folder the CharTokenizer interface."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from transformers import AutoTokenizer

        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"HFTokenizer: {path!r} is not a directory holding a tokenizer")
        self.path = path
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        tok = self._tok
        self.eos_id = tok.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"HFTokenizer: tokenizer at {path!r} defines no eos token")
        # Many causal-LM tokenizers have no pad or bos token; reuse eos so ids are always valid.
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
        self.bos_id = tok.bos_token_id if tok.bos_token_id is not None else self.eos_id
        self._has_bos = tok.bos_token_id is not None

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens."""
        return len(self._tok)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Tokenize without the tokenizer's own special tokens; prepend bos if asked."""
        ids = list(self._tok.encode(text, add_special_tokens=False))
        return ([self.bos_id] + ids) if add_bos and self._has_bos else ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Detokenize; specials are dropped when skip_special."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def load_tokenizer(spec: str) -> CharTokenizer | HFTokenizer:
    """Return the tokenizer named by spec: "char" or a local HF tokenizer folder."""
    if spec == "char":
        return CharTokenizer()
    if os.path.isdir(spec):
        return HFTokenizer(spec)
    raise ValueError(f"unknown tokenizer {spec!r}: use 'char' or the path of a local Hugging Face tokenizer folder")
