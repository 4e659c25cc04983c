"""A small byte-level BPE (GPT-2 style) learned deterministically from the corpus the package ships.

Tokens: the 256 byte symbols (GPT-2 byte-to-unicode mapping, in byte order), then one token per
learned merge (in merge order), then ``[BOS]`` and ``[EOS]``. Ties between equally frequent pairs break
on the lexicographically smallest pair, so the same corpus always gives the same vocabulary.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from ..errors import InputError

SPECIALS = ("[BOS]", "[EOS]")
CORPUS = "corpus.txt"  # scoreboard/data/corpus.txt

# GPT-2 pre-tokenizer ("gpt-2" pre in llama.cpp), with \p{L}/\p{N} approximated by Python classes.
_PRE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


@lru_cache(maxsize=1)
def byte_symbols() -> tuple[str, ...]:
    """byte value -> printable unicode symbol, the GPT-2 byte-level mapping."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, int] = {b: b for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + extra
            extra += 1
    return tuple(chr(table[b]) for b in range(256))


def pretokenize(text: str) -> list[str]:
    """Split text into pre-tokens, each mapped to byte symbols."""
    sym = byte_symbols()
    return ["".join(sym[b] for b in piece.encode("utf-8")) for piece in _PRE.findall(text)]


def learn_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Learn `n_merges` BPE merges from `text` (incremental pair counts; deterministic tie-breaks)."""
    words = Counter(pretokenize(text))
    seqs = [list(w) for w in sorted(words)]
    freqs = [words[w] for w in sorted(words)]
    pairs: Counter[tuple[str, str]] = Counter()
    where: dict[tuple[str, str], set[int]] = defaultdict(set)
    for i, s in enumerate(seqs):
        for p in zip(s, s[1:]):
            pairs[p] += freqs[i]
            where[p].add(i)
    vocab = set(byte_symbols())
    merges: list[tuple[str, str]] = []
    banned: set[tuple[str, str]] = set()
    while len(merges) < n_merges:
        cands = [(c, p) for p, c in pairs.items() if c > 0 and p not in banned]
        if not cands:
            raise InputError(f"the tokenizer corpus yields only {len(merges)} merges, {n_merges} needed",
                             "lower n_vocab in the spec or ship a larger scoreboard/data/corpus.txt")
        best = min(cands, key=lambda cp: (-cp[0], cp[1]))[1]
        if best[0] + best[1] in vocab:  # the same string reached by another merge: keep tokens unique
            banned.add(best)
            continue
        merges.append(best)
        vocab.add(best[0] + best[1])
        for i in sorted(where.pop(best, ())):
            _merge_word(seqs, freqs, i, best, pairs, where)
        pairs.pop(best, None)
    return merges


def _merge_word(seqs, freqs, i, best, pairs, where) -> None:
    s = seqs[i]
    for p in zip(s, s[1:]):
        pairs[p] -= freqs[i]
    out, j = [], 0
    while j < len(s):
        if j + 1 < len(s) and (s[j], s[j + 1]) == best:
            out.append(s[j] + s[j + 1])
            j += 2
        else:
            out.append(s[j])
            j += 1
    seqs[i] = out
    for p in zip(out, out[1:]):
        pairs[p] += freqs[i]
        where[p].add(i)


@dataclass(frozen=True)
class Tokenizer:
    """The vocabulary written into the GGUF, with an encoder for harness-side prompts."""

    tokens: tuple[str, ...]
    merges: tuple[tuple[str, str], ...]
    corpus_sha256: str

    @property
    def bos_id(self) -> int:
        return len(self.tokens) - 2

    @property
    def eos_id(self) -> int:
        return len(self.tokens) - 1

    @property
    def token_types(self) -> list[int]:
        """gguf TokenType per token: 1 normal, 3 control (the specials)."""
        return [1] * (len(self.tokens) - len(SPECIALS)) + [3] * len(SPECIALS)

    def encode(self, text: str) -> list[int]:
        """Byte-level BPE: greedy lowest-rank merges within each pre-token."""
        ids = {t: i for i, t in enumerate(self.tokens)}
        ranks = {m: r for r, m in enumerate(self.merges)}
        out: list[int] = []
        for word in pretokenize(text):
            parts = list(word)
            while len(parts) > 1:
                rank, j = min((ranks.get((a, b), len(ranks)), k) for k, (a, b) in enumerate(zip(parts, parts[1:])))
                if rank == len(ranks):
                    break
                parts[j:j + 2] = [parts[j] + parts[j + 1]]
            out.extend(ids[p] for p in parts)
        return out

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        """The vocabulary a GGUF carries (`tokenizer.ggml.tokens` / `.merges`): the harness encodes
        prompts with it, so both engines receive the same ids and neither chooses them."""
        from gguf import GGUFReader

        fields = GGUFReader(str(path)).fields

        def strings(key: str) -> list[str]:
            f = fields.get(key)
            if f is None:
                raise InputError(f"{path}: GGUF has no {key}", "the harness needs a byte-level BPE vocabulary")
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

        tokens = tuple(strings("tokenizer.ggml.tokens"))
        merges = tuple(tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges"))
        missing = [c for c in byte_symbols() if c not in set(tokens)]
        if missing:
            raise InputError(f"{path}: not a byte-level BPE vocabulary ({len(missing)} byte symbols missing)")
        return cls(tokens=tokens, merges=merges, corpus_sha256="")  # type: ignore[arg-type]

    def decode(self, ids: list[int]) -> str:
        back = {s: b for b, s in enumerate(byte_symbols())}
        data = bytearray()
        for i in ids:
            tok = self.tokens[i]
            if tok in SPECIALS:
                continue
            data.extend(back[c] for c in tok)
        return data.decode("utf-8", "replace")


def corpus_text() -> tuple[str, str]:
    """(text, sha256) of the shipped tokenizer corpus."""
    try:
        raw = resources.files("scoreboard").joinpath("data").joinpath(CORPUS).read_bytes()
    except FileNotFoundError as exc:
        raise InputError(f"scoreboard/data/{CORPUS} is missing", "reinstall scoreboard (`pip install -e .`)") from exc
    return raw.decode("utf-8"), hashlib.sha256(raw).hexdigest()


@lru_cache(maxsize=4)
def build_tokenizer(n_vocab: int) -> Tokenizer:
    """The deterministic vocabulary of `n_vocab` tokens: 256 bytes + merges + [BOS] + [EOS]."""
    text, digest = corpus_text()
    merges = learn_merges(text, n_vocab - 256 - len(SPECIALS))
    tokens = (*byte_symbols(), *(a + b for a, b in merges), *SPECIALS)
    return Tokenizer(tokens=tokens, merges=tuple(merges), corpus_sha256=digest)
