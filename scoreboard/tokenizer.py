"""Byte-level BPE encoder (GPT-2 style) read from a GGUF's tokenizer metadata — the harness's own.

The harness tokenizes gate and timing prompts itself, so both engines receive the same ids and no
engine can choose an easier prompt. Reads `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from .errors import InputError

# GPT-2 pre-tokenizer: contractions, letters, digits, other symbols, whitespace.
_PRETOKEN = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+|_+""", re.UNICODE)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char mapping."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


class BPETokenizer:
    def __init__(self, tokens: list[str], merges: list[str]):
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.byte_map = bytes_to_unicode()
        missing = [c for c in self.byte_map.values() if c not in self.vocab]
        if missing:
            raise InputError(f"tokenizer is not byte-level: {len(missing)} byte symbols missing from the vocabulary")

    @classmethod
    def from_gguf(cls, path: Path) -> "BPETokenizer":
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        fields = reader.fields

        def strings(key: str) -> list[str]:
            f = fields.get(key)
            if f is None:
                raise InputError(f"{path}: GGUF has no {key}", "the harness tokenizer needs a byte-level BPE vocabulary")
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

        return cls(strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges"))

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), None), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            pairs = [(r, i) for r, i in pairs if r is not None]
            if not pairs:
                break
            _, i = min(pairs)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _PRETOKEN.findall(text):
            mapped = "".join(self.byte_map[b] for b in piece.encode("utf-8"))
            for tok in self._bpe(mapped):
                ids.append(self.vocab[tok])
        return ids
