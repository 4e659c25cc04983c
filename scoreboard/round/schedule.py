"""Randomized balanced block schedule: every arm takes every slot position equally often (seeded)."""

from __future__ import annotations

import itertools
import random


def balanced_schedule(arms: list[str], blocks: int, seed: int) -> list[list[str]]:
    """`blocks` arm orders. Orders cycle through all permutations (balanced when blocks is a multiple
    of len(arms)!, nearly so otherwise), then the block order is shuffled by the seed.

    Never "reference always first": a cold box biases whichever arm runs first.
    """
    if len(set(arms)) != len(arms) or not arms:
        raise ValueError(f"arms must be distinct and non-empty: {arms}")
    rng = random.Random(seed)
    perms = list(itertools.permutations(arms))
    rng.shuffle(perms)
    out = [list(perms[i % len(perms)]) for i in range(blocks)]
    rng.shuffle(out)
    return out
