"""Restored prefills: a begin() continues from the state an earlier prefill of the same prompt prefix left.

llama-bench -d prefills a depth once per process and restores the saved context state for every later rep at
that depth (llama_state_seq_set_data). sparkinfer's begin() does the same through :class:`PrefixStore`, which
lives beside one persistent cache (the static decoder's buffers, or the eager path's one cache):

* a snapshot is taken where a prefill passes the last multiple of the call size (``chunk``) below its end: the
  KDA layers' conv and recurrent state, copied (fixed-size: the cost of a snapshot does not grow with depth),
  the ids of that prefix, and a fingerprint of the latent rows below it, which stay in the shared cache;
* begin(ids) restores the longest snapshot whose ids are a prefix of ``ids`` (the ids compared, not a hash) and
  prefills the rest from there in calls of ``chunk`` tokens at absolute positions k x chunk: the same calls a
  prefill from zero makes after that point, so the state is the one a prefill from zero leaves, bit for bit on
  the same device (tests/test_sparkinfer_engine.py compares them);
* the invariant: rows below a snapshot's length are never overwritten. Every write into the cache announces its
  first row (:meth:`writes_from`: a prefill from its restored length, a decode from n_past) and drops the
  snapshots longer than that; a restore re-reads the rows below the snapshot's length and refuses when their
  fingerprint changed (a write that bypassed the store: a bug).

At most ``keep`` snapshots are kept, the longest first (a later workload's prompt extends an earlier one's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from scoreboard.errors import EngineError

from .model import K3Cache

Tensor = torch.Tensor
SNAPSHOTS_MAX = 4  # the harness nests a launch's decode prompts (1024, 16384, 65536, 131072): three aligned points
Prefill = Callable[[K3Cache, Tensor], Any]  # feeds ids [T] from cache.n_past in calls of the store's chunk


@dataclass
class Snapshot:
    ids: tuple[int, ...]  # the prefix, len(ids) = n_past
    kda: dict[int, tuple[Tensor, Tensor]]  # layer -> copies of (conv [3di, K-1], s [H, dk, dv]) f32
    rows: dict[int, tuple[int, int]]  # MLA layer -> fingerprint of latent rows 0..n_past-1 (latent_fingerprint)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.kda.values() for t in pair)


def latent_fingerprint(latent: Tensor, n: int) -> tuple[int, int]:
    """An exact, order-free fingerprint of latent rows 0..n-1 (f16 [n_ctx, width]): the sum of their bit patterns
    as integers, and the same sum weighted by row index (a changed value or two swapped rows change it)."""
    per_row = latent[:n].view(torch.int16).sum(1, dtype=torch.int64)  # [n]
    idx = torch.arange(n, device=latent.device, dtype=torch.int64)
    return int(per_row.sum()), int((per_row * idx).sum())


class PrefixStore:
    """Snapshots of one persistent cache's state at aligned prefix lengths, and the restore that uses them."""

    def __init__(self, chunk: int, keep: int = SNAPSHOTS_MAX):
        if chunk < 1 or keep < 0:
            raise ValueError(f"PrefixStore: chunk {chunk} and keep {keep}")
        self.chunk, self.keep = chunk, keep
        self.snapshots: list[Snapshot] = []  # longest first
        self.restored = 0  # tokens the last begin() restored rather than prefilled

    def begin(self, cache: K3Cache, ids: tuple[int, ...], prefill: Prefill, device: Any) -> int:
        """Leave `cache` as a prefill of `ids` from zero would: restore the longest snapshot that is a prefix of
        ids (else zero the state), prefill the rest in aligned calls, snapshot the last aligned point. Returns
        the length restored."""
        snap = self._longest(ids)
        start = len(snap.ids) if snap else 0
        if snap:
            self._check_rows(cache, snap)
            for il, (conv, s) in snap.kda.items():
                cache.layers[il].conv.copy_(conv)
                cache.layers[il].s.copy_(s)
        else:
            for st in cache.layers.values():
                if not hasattr(st, "latent"):
                    st.conv.zero_()
                    st.s.zero_()
        cache.n_past = start
        self.writes_from(start)
        aligned = len(ids) // self.chunk * self.chunk  # the last multiple of the call size within ids
        if aligned > start:
            prefill(cache, torch.tensor(ids[start:aligned], dtype=torch.long, device=device))
            self._take(cache, ids[:aligned])
        if len(ids) > cache.n_past:
            prefill(cache, torch.tensor(ids[cache.n_past:], dtype=torch.long, device=device))
        self.restored = start
        return start

    def writes_from(self, row: int) -> None:
        """Rows >= `row` of the cache are about to be written: the snapshots that need any of them go."""
        self.snapshots = [s for s in self.snapshots if len(s.ids) <= row]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.snapshots)

    def _longest(self, ids: tuple[int, ...]) -> Snapshot | None:
        for s in self.snapshots:  # longest first
            if len(s.ids) <= len(ids) and ids[:len(s.ids)] == s.ids:
                return s
        return None

    def _take(self, cache: K3Cache, ids: tuple[int, ...]) -> None:
        n = len(ids)
        if self.keep == 0 or cache.n_past != n or any(len(s.ids) == n and s.ids == ids for s in self.snapshots):
            return
        kda = {il: (st.conv.clone(), st.s.clone()) for il, st in cache.layers.items() if not hasattr(st, "latent")}
        rows = {il: latent_fingerprint(st.latent, n) for il, st in cache.layers.items() if hasattr(st, "latent")}
        self.snapshots.append(Snapshot(ids, kda, rows))
        self.snapshots.sort(key=lambda s: -len(s.ids))
        del self.snapshots[self.keep:]

    def _check_rows(self, cache: K3Cache, snap: Snapshot) -> None:
        n = len(snap.ids)
        changed = [il for il, fp in snap.rows.items() if latent_fingerprint(cache.layers[il].latent, n) != fp]
        if changed:
            self.snapshots.clear()
            raise EngineError(f"sparkinfer: latent rows below a prefix snapshot's length ({n}) changed in layer(s) "
                              f"{changed} since it was taken: something wrote the cache without announcing it",
                              "report this as a sparkinfer bug; the next begin() prefills from zero")
