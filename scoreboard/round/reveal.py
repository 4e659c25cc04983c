"""The secret parts of the timed prompts: V variants per metric, derived from the round's secret seed.

The round's seed is drawn with ``secrets.randbits`` (unless ``--seed`` is given) and is in no file a worker
can read before the round seals it; the reveals below are a separate derivation of it (a domain-separated
SHA-256, never the ``random`` stream that shuffles the prompt's paragraphs or the block schedule).

* decode at depth d: variant v is the round prompt's first d-K ids plus K tokens drawn uniformly (and
  independently) from the vocabulary's normal tokens, the V variants distinct; begin() sees the d-K ids,
  step() the K drawn tokens. K is the fewest tokens that hold ``reveal_bits`` (40 by default) of secret:
  with ~500 normal tokens (9 bits each) K = 5, so no begin() can decode every possible continuation
  ahead of the clock (one revealed token of ~500 could be enumerated in an untimed begin()).
* prefill at depth d: variant v is the round prompt's first d ids plus n_tokens ids of corpus text in an
  order of its own; begin() sees the d ids, step() the n_tokens.

Every block's worker sees each of the V variants once (warm-up reps included), in an order of its own,
so a process never meets a variant it already answered.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from ..engine import Workload
from ..weights.tokenizer import Tokenizer
from .prompt import draw_prompt

DOMAIN = "scoreboard/reveal/v1"
REVEAL_BITS = 40  # the default secret per decode rep (SpeedPolicy.reveal_bits)


def decode_reveal_len(n_normal: int, bits: int = REVEAL_BITS) -> int:
    """K: the fewest tokens drawn from `n_normal` equally likely ones that hold at least `bits` bits."""
    if n_normal < 2:
        raise ValueError(f"{n_normal} normal token(s) hold no secret: a decode reveal needs at least 2")
    return max(1, math.ceil(bits / math.log2(n_normal)))


def derived(seed: int, *parts: object) -> int:
    text = ":".join([DOMAIN, str(seed), *map(str, parts)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


@dataclass(frozen=True)
class Variants:
    """A metric's variants: the workload begin() sees (shared by all) and each variant's revealed ids."""

    key: str  # "decode@1024"
    workload: Workload
    reveals: tuple[tuple[int, ...], ...]

    def full_prompt(self, v: int) -> tuple[int, ...]:
        return tuple(self.workload.prompt_ids) + self.reveals[v]

    bits: float = 0.0  # the secret one variant's reveal holds (decode: K x log2 of the normal tokens)

    def describe(self) -> dict:
        """What the receipt records: the revealed ids of decode variants, a digest of prefill ones."""
        out: dict = {"metric": self.key, "n_variants": len(self.reveals), "known_len": self.workload.known_len}
        if self.workload.phase == "decode":
            out["revealed"] = [list(r) for r in self.reveals]
            out["reveal_len"] = self.workload.reveal
            out["reveal_bits"] = round(self.bits, 2)
        else:
            out["revealed_sha256"] = [hashlib.sha256(",".join(map(str, r)).encode()).hexdigest() for r in self.reveals]
        return out


def metric_variants(tok: Tokenizer, prompt_ids: tuple[int, ...], phase: str, depth: int, n_tokens: int,
                    n_variants: int, seed: int, reveal_bits: int = REVEAL_BITS) -> Variants:
    key = f"{phase}@{depth}"
    if phase == "decode":
        normal = [i for i, t in enumerate(tok.token_types) if t == 1]
        k = decode_reveal_len(len(normal), reveal_bits)
        if depth < k:
            raise ValueError(f"{key}: a decode metric needs depth >= {k} (its last {k} prompt tokens are revealed "
                             f"when the clock starts, to hold {reveal_bits} bits)")
        if len(normal) ** k < 2 * n_variants:
            raise ValueError(f"{len(normal)} normal tokens cannot give {n_variants} distinct decode variants")
        rng = random.Random(derived(seed, key))
        picks: list[tuple[int, ...]] = []
        while len(picks) < n_variants:  # K independent uniform draws each; the V variants distinct
            cand = tuple(int(rng.choice(normal)) for _ in range(k))
            if cand not in picks:
                picks.append(cand)
        workload = Workload("decode", depth, n_tokens, tuple(prompt_ids[: depth - k]), reveal=k)
        return Variants(key, workload, tuple(picks), k * math.log2(len(normal)))
    workload = Workload("prefill", depth, n_tokens, tuple(prompt_ids[:depth]))
    seen: set[tuple[int, ...]] = set()
    reveals = []
    for v in range(n_variants):
        for attempt in range(100):
            ids = draw_prompt(tok, n_tokens, derived(seed, key, v, attempt) & 0x7FFFFFFF).token_ids
            if ids not in seen:
                break
        else:
            raise ValueError(f"the corpus gives no {n_variants} distinct prompts of {n_tokens} tokens")
        seen.add(ids)
        reveals.append(tuple(int(x) for x in ids))
    return Variants(key, workload, tuple(reveals))


def block_order(seed: int, arm: str, block: int | None, key: str, n_variants: int, n_reps: int) -> list[int]:
    """The variants a launch reveals for a metric, in order: a permutation of all V (the first the warm-up
    reps), or its first n_reps when a launch runs fewer (the warm-up pass)."""
    order = list(range(n_variants))
    random.Random(derived(seed, "order", arm, block, key)).shuffle(order)
    if n_reps > n_variants:
        raise ValueError(f"{n_reps} reps in one launch, only {n_variants} variants")
    return order[:n_reps]
