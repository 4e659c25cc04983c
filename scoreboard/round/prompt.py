"""The round's prompt: drawn by the round's seed from the corpus the repo ships, tokenized by the harness."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import InputError
from ..weights.tokenizer import Tokenizer


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    corpus_sha256: str
    paragraph_order: tuple[int, ...]
    seed: int

    def describe(self) -> dict:
        ids = ",".join(map(str, self.token_ids)).encode()
        return {"corpus_sha256": self.corpus_sha256, "paragraph_order": list(self.paragraph_order),
                "n_tokens": len(self.token_ids), "token_ids_sha256": hashlib.sha256(ids).hexdigest(),
                "seed": self.seed}


def corpus_text(path: Path | None = None) -> str:
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    return resources.files("scoreboard").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def draw_prompt(tokenizer: Tokenizer, n_tokens: int, seed: int, corpus: str | None = None) -> Prompt:
    """Paragraphs in a seed-shuffled order, tiled until `n_tokens` ids exist; truncated to n_tokens.

    The seed is recorded in the receipt: the same seed reproduces the same ids bit for bit.
    """
    text = corpus if corpus is not None else corpus_text()
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not paragraphs:
        raise InputError("the prompt corpus is empty", "restore scoreboard/data/corpus.txt")
    rng = random.Random(seed)
    order: list[int] = []
    ids: list[int] = []
    while len(ids) < n_tokens:
        perm = list(range(len(paragraphs)))
        rng.shuffle(perm)
        for i in perm:
            order.append(i)
            ids.extend(tokenizer.encode(paragraphs[i] + "\n\n"))
            if len(ids) >= n_tokens:
                break
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return Prompt(tuple(ids[:n_tokens]), digest, tuple(order), seed)
