"""What the chunk loops share: the chunk source protocol, the stored chunks of a call, and the small steps both the
Ulysses loop (:mod:`hf_fpdt.attention.chunked`) and the ring's (:mod:`hf_fpdt.attention.ring`) take (a chunk
projected and exchanged, a block computed, an output chunk placed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..config import check_sp_heads
from ..data.head_split import HeadSplit
from ..distributed.all_to_all import Exchange, start_gather_heads_split, start_scatter_heads_split
from ..memory.host_store import Fetched, HostStore, Slot
from .block_mask import BlockMask, MaskSpec
from .precision import sdpa_inputs
from .routes import Router
from .runtime import FPDTRuntime


class ChunkSource(Protocol):
    """Produces local q/k/v chunks in forward and takes their gradients in backward."""

    sizes: list[int]  # local chunk lengths
    num_heads: int
    num_kv_heads: int
    spec: MaskSpec  # window, softcap, documents, sparse pattern, key mask, 4D mask (global order)

    def forward_chunk(self, i: int, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def to_save(self, inputs: tuple) -> tuple: ...

    def backward_chunk(self, i: int, saved: tuple, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None: ...

    def input_grads(self) -> tuple: ...


@dataclass
class Stored:
    """Host-store slots of one attention call, per global chunk.

    Whatever is still held when this object dies goes back to the store's pool. That matters when a
    graph dies without its backward (a forward whose loss is never differentiated), and under
    non-reentrant checkpointing that ``apply`` did not mark (a custom checkpoint function): there the
    recomputed forward stores its chunks too, but backward runs on the first forward's slots, so the
    recomputation's are dropped unused. Without this they would leave the pool and every step would
    allocate (pinned) host memory again.
    """

    store: HostStore | None = None
    split: HeadSplit | None = None  # the call's heads over the SP group (the output's exchange in a replay)
    blocks: BlockMask | None = None  # the call's block pattern: the forward's evaluation, reused by the backward
    ring: object | None = None  # the call's ring groups (hf_fpdt.distributed.ring_exchange.RingGroups); None: no ring
    q: list[Slot] = field(default_factory=list)
    k: list[Slot] = field(default_factory=list)
    v: list[Slot] = field(default_factory=list)
    o: list[Slot] = field(default_factory=list)
    lse: list[Slot] = field(default_factory=list)

    def holds_output(self, sizes: list[int], sp_size: int) -> bool:
        """Whether the output chunks of a call with local chunk lengths ``sizes`` are all still here (each of
        ``U * l_i`` rows: ``U`` the Ulysses degree, ``sp_size`` without a ring)."""
        width = sp_size if self.ring is None else self.ring.ulysses_size
        return len(self.o) == len(sizes) and all(s.shape[1] == n * width for s, n in zip(self.o, sizes))

    def release(self) -> None:
        """Return every slot to the pool (idempotent)."""
        if self.store is not None:
            for s in self.q + self.k + self.v + self.o + self.lse:
                self.store.release(s)
        self.q, self.k, self.v, self.o, self.lse = [], [], [], [], []

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: the pool is going away anyway
            pass


def fetch_all(store: HostStore, slots) -> list[Fetched]:
    return [store.fetch(s) for s in slots]


def place(out: torch.Tensor | None, o_local: torch.Tensor, span: slice, total: int) -> torch.Tensor:
    """Write a local chunk of the output into ``out`` (allocated from the first chunk)."""
    if out is None:
        b, _, h, d = o_local.shape
        out = o_local.new_empty(b, total, h, d)
    out[:, span] = o_local
    return out


def final_output(o, lse, q: torch.Tensor, dv: int, sinks) -> tuple[torch.Tensor, torch.Tensor]:
    """A query chunk's merged ``(o, lse)`` made final: where no query saw a key (``o is None``) out 0 and lse -inf
    (sdpa's output for such rows), the sinks folded in (``(o', lse')`` with the sink in the denominator: what backward
    reads, :mod:`hf_fpdt.attention.sinks`), ``o`` in q's dtype (``dv``: v's head dim, which may not be q's)."""
    if o is None:
        o = torch.zeros((*q.shape[:-1], dv), dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device)
    if sinks is not None:
        o, lse = sinks.fold(o, lse)
    return o.to(q.dtype), lse


class OutputGather:
    """A forward's local output ``[B, total, H, D]``, one chunk at a time: each final ``o`` back through the
    all-to-all (sequence -> heads) and placed at its span. Overlapped, chunk i's exchange travels while chunk i+1's
    blocks run and is waited just before chunk i+1's is issued (its buffers go before the next ones are made);
    else each is waited where it is issued. :meth:`result` waits the last one."""

    def __init__(self, group, split: HeadSplit, total: int, overlap: bool) -> None:
        self.group, self.split, self.total, self.overlap = group, split, total, overlap
        self.out: torch.Tensor | None = None
        self.behind: tuple[slice, Exchange] | None = None  # the chunk whose output exchange is in flight

    def _land(self) -> None:
        if self.behind is not None:
            span, exchange = self.behind
            self.behind = None
            self.out = place(self.out, exchange.wait()[0], span, self.total)

    def push(self, span: slice, o: torch.Tensor) -> None:
        """Issue chunk ``span``'s output exchange (the previous one landed first)."""
        self._land()
        self.behind = (span, start_gather_heads_split((o,), self.group, self.split))
        if not self.overlap:
            self._land()

    def result(self) -> torch.Tensor:
        self._land()
        return self.out


def block_pattern(source: ChunkSource, sp_size: int, batch: int, lengths: tuple[int, ...] | None = None) -> BlockMask:
    """The blocks a call of ``batch`` rows computes (every causal block, less those outside a window, a document,
    a sparse pattern or a padding mask: the source's :class:`~hf_fpdt.attention.block_mask.MaskSpec`). Built once per
    call, by its forward: the recomputation and the backward reuse it (a ``mask_mod`` is evaluated once)."""
    if lengths is None:  # global chunk i: the P ranks' local chunks i (a ring gives its own, ring_chunk_sizes)
        lengths = tuple(sp_size * n for n in source.sizes)
    return source.spec.blocks(lengths, batch, source.num_heads)


def block_forward(q, k, v, pattern: BlockMask, i: int, j: int, scale: float, softcap, router: Router):
    causal, mask = pattern.block(i, j, q.device)
    return router.forward(q, k, v, causal, scale, mask=mask, softcap=softcap)


def overlaps(runtime: FPDTRuntime) -> bool:
    """Whether the call's exchanges travel while chunks compute: under SP, unless ``config.sync_exchanges``
    asks for the synchronous order (each all-to-all waited where it is issued). One process has no exchange."""
    return runtime.sp_size > 1 and not runtime.config.sync_exchanges


QKV = (False, True, True)  # which of q, k, v (dq, dk, dv) are key/value heads in the exchanges


def head_split(source: ChunkSource, sp_size: int) -> HeadSplit:
    """The call's heads over the SP group (checked: :func:`~hf_fpdt.config.check_sp_heads`)."""
    check_sp_heads(source.num_heads, source.num_kv_heads, sp_size)
    return HeadSplit.of(source.num_heads, source.num_kv_heads, sp_size)


def start_chunk(source: ChunkSource, inputs: tuple, i: int, group, split: HeadSplit) -> Exchange:
    """Chunk i projected (``source.forward_chunk``) and its q, k, v issued in one all-to-all."""
    q_l, k_l, v_l = sdpa_inputs(*source.forward_chunk(i, inputs))  # under autocast: sdpa's dtype
    return start_scatter_heads_split((q_l, k_l, v_l), group, split, QKV)
