"""The greedy decode step with static shapes, captured once in a CUDA graph and replayed per token.

Eager decode on CUDA is launch-bound (k3-mini: ~90 tok/s on an H200, a few hundred kernel launches per
token). :class:`StaticDecoder` keeps everything one decode step touches in persistent buffers, so the
step has the same shapes and addresses every token and a CUDA graph can record it once:

* the cache (MLA latent rows [n_ctx, kvr + rope] f16, KDA conv and delta-rule state f32), updated in place;
* the inputs ``tok`` [1] and ``pos`` [1] (long, on the device): the token fed and its position;
* the outputs ``hist`` [n_ctx] long, hist[p] = argmax after consuming position p, and per step of a run (at
  ``slot`` [1], counted from 0 by :meth:`StaticDecoder.run`): ``rows`` [LOGIT_ROWS, V] f32, the step's logits
  row, and ``logprobs`` [LOGIT_ROWS] f32, the log-softmax of that row at its argmax, computed in the step.

One step (``K3Model.forward`` in its static mode) writes the latent row at ``pos`` and attends over the
first ``span`` rows with the rows beyond ``pos`` masked, then feeds itself: ``tok`` <- argmax, ``pos`` += 1.
A run of K revealed tokens and n generated ones is K + n - 1 replays (each revealed token after the first
copied into ``tok`` between replays, over the argmax) and one read of ``hist`` and ``logprobs`` at the end;
``rows`` stay on the device for the gate's checked run (engine.step_logits). Routed experts are gathered with
the fixed [top-k] index shape (model._experts' single-token path), which a graph records as it is.

A graph holds the storage of every buffer it touches: the prefill in begin() writes into the same
buffers in place (:meth:`StaticDecoder.check` verifies it did). The latent span is a power of two
>= the rows a workload needs (one graph per span, captured on first use, in the untimed begin(); the rows
outside 0..pos are masked, so at a shallow position of a large span the MLA kernel's programs past pos
exit at once). The buffers outlive a sequence: the engine's begin() restores a prefix snapshot into them
(prefix.py), so a capture keeps the latent rows its warm-up steps write over (:meth:`StaticDecoder.ready`).
On CPU nothing is captured and the same step runs eagerly (what the equivalence tests exercise).
"""

from __future__ import annotations

import torch

from scoreboard.errors import EngineError

from .model import K3Cache, K3Model

SPAN_MIN = 256  # smallest attention span: small workloads share one graph
WARMUP = 2  # eager steps on a side stream before capture (lazy init: cuBLAS handles, workspaces)
LOGIT_ROWS = 1024  # steps per run whose logits rows are kept (the scored decodes run 64 and 128 tokens)


def span_for(need: int, n_ctx: int) -> int:
    """Latent rows the static step attends over: the next power of two >= need (at least SPAN_MIN),
    capped at n_ctx."""
    span = SPAN_MIN
    while span < need:
        span *= 2
    return min(span, n_ctx)


def _buffers(cache: K3Cache) -> list[torch.Tensor]:
    """Every state tensor of a cache, in a fixed order."""
    out = []
    for i in sorted(cache.layers):
        st = cache.layers[i]
        out += [st.latent] if hasattr(st, "latent") else [st.conv, st.s]
    return out


class StaticDecoder:
    """Persistent decode buffers for one model and n_ctx, and one captured step per attention span."""

    def __init__(self, model: K3Model, n_ctx: int, capture: bool):
        dev = model.device
        self.model, self.n_ctx, self.capture = model, n_ctx, capture
        self.cache = model.new_cache(n_ctx)
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)  # [1] the token fed at pos
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # [1] its position
        self.row0 = torch.zeros(1, dtype=torch.long, device=dev)  # [1] the output row (the only one)
        self.hist = torch.zeros(n_ctx, dtype=torch.long, device=dev)  # [n_ctx] argmax after position p
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)  # [1] the step's index within its run
        self.rows = torch.zeros(min(n_ctx, LOGIT_ROWS), model.cfg.n_vocab, device=dev)  # [slots, V] f32
        self.logprobs = torch.zeros(min(n_ctx, LOGIT_ROWS), device=dev)  # [slots] f32, nats
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.span = 0  # the current sequence's span (set by ready)
        self._ptrs = [b.data_ptr() for b in _buffers(self.cache)]

    def step(self, span: int) -> None:
        """One static-shape decode step: consume tok at pos; keep the logits row and the log-probability of its
        argmax at slot; then tok <- argmax, pos += 1, slot += 1."""
        logits: torch.Tensor = self.model.forward(self.tok, self.cache, self.row0, pos=self.pos,  # type: ignore
                                                  span=span)  # [1, V]: rows were asked for, never None
        nxt = logits.argmax(-1)  # [1]
        self.rows.index_copy_(0, self.slot, logits)
        self.logprobs.index_copy_(0, self.slot, torch.log_softmax(logits, -1).gather(-1, nxt[:, None])[:, 0])
        self.hist.index_copy_(0, self.pos, nxt)
        self.tok.copy_(nxt)
        self.pos.add_(1)
        self.slot.add_(1)

    @property
    def logits(self) -> torch.Tensor:
        """The last step's logits row [1, V] (a view of rows; reads slot, so it synchronizes: tests only)."""
        last = int(self.slot) - 1
        return self.rows[last:last + 1]

    def _capture(self, span: int) -> torch.cuda.CUDAGraph:
        """Warm the step up on a side stream, then record it. Both run steps at positions 0..WARMUP: the latent
        rows they write are put back afterwards (a prefix snapshot may need them); the recurrent state they
        change is the caller's to reset or restore."""
        kept = [(st.latent, st.latent[:WARMUP + 1].clone()) for st in self.cache.layers.values()
                if hasattr(st, "latent")]
        self.tok.zero_()
        self.pos.zero_()
        side = torch.cuda.Stream(device=self.model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self.step(span)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step(span)
        for latent, rows in kept:
            latent[:WARMUP + 1].copy_(rows)
        return graph

    def ready(self, need: int) -> K3Cache:
        """Ready for a sequence of at most `need` rows: its span, and that span's graph captured if new (CUDA).
        The state is left as it is (the latent rows too): the caller resets or restores it."""
        if need > self.n_ctx:
            raise EngineError(f"{need} tokens do not fit the decoder's n_ctx {self.n_ctx}",
                              "raise geometry.n_ctx in the target, or ask for less depth")
        self.span = span_for(need, self.n_ctx)
        if self.capture and self.span not in self.graphs:
            try:
                self.graphs[self.span] = self._capture(self.span)
            except RuntimeError as exc:
                raise EngineError(f"capturing the decode step in a CUDA graph (span {self.span}) failed: {exc}",
                                  "set options.cuda_graph = false in the target to decode eagerly") from exc
        return self.cache

    def reset(self, need: int) -> K3Cache:
        """ready(need), then the state zeroed in place: returns the cache to prefill into (n_past 0)."""
        self.ready(need)
        for b in _buffers(self.cache):
            b.zero_()
        self.hist.zero_()
        self.slot.zero_()
        self.cache.n_past = 0
        return self.cache

    def check(self) -> None:
        """The prefill must have updated the state in place: a captured graph still points at it."""
        if [b.data_ptr() for b in _buffers(self.cache)] != self._ptrs:
            raise EngineError("sparkinfer: the prefill replaced a cache buffer instead of updating it in place, "
                              "so the captured decode graph would read stale state",
                              "report this as a sparkinfer bug; set options.cuda_graph = false meanwhile")

    def run(self, seed: torch.Tensor, n_tokens: int) -> tuple[list[int], list[float], torch.Tensor]:
        """Consume the K tokens seed [K] from cache.n_past, then generate n_tokens greedy ids: K + n_tokens - 1
        steps. -> (the n_tokens argmaxes, their log-probabilities, their logits rows [n_tokens, V] on the device,
        a view of `rows` until the next run). One synchronization, at the end."""
        feed = seed.reshape(-1)
        k, start = int(feed.shape[0]), self.cache.n_past
        steps = k + n_tokens - 1
        if start + steps > self.span or steps > self.rows.shape[0]:
            raise EngineError(f"decoding {n_tokens} tokens after {k} revealed from position {start} overruns the "
                              f"span {self.span} or the {self.rows.shape[0]} logits rows kept per run",
                              "call begin() for this workload first; decode at most LOGIT_ROWS tokens per step()")
        self.tok.copy_(feed[:1])
        self.pos.fill_(start)
        self.slot.zero_()
        graph = self.graphs.get(self.span)
        for i in range(steps):
            if graph is None:
                self.step(self.span)
            else:
                graph.replay()
            if i + 1 < k:  # a revealed token is fed next, not the argmax
                self.tok.copy_(feed[i + 1:i + 2])
        self.cache.n_past = start + steps
        first = k - 1  # the step that consumed the last revealed token: its argmax is g1
        ids = [int(x) for x in self.hist[start + first:start + steps].tolist()]
        return ids, [float(x) for x in self.logprobs[first:steps].tolist()], self.rows[first:steps]
