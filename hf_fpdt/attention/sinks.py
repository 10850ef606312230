"""Attention sinks: a learned logit per query head that joins every row's softmax denominator and has no value.

HF passes them as the attention keyword ``s_aux`` (gpt-oss, DeepSeek-V4, Granite SWA, MiMo-V2-Flash, ...): eager
appends ``s_h`` as one more column of each row's scores, softmaxes, and drops that column. With a row's running
``(out, lse)`` over all its key blocks (the online softmax of :mod:`hf_fpdt.attention.chunked` or
:mod:`hf_fpdt.attention.cached_attention`), the sink-inclusive result is one more merge, with a block of no value::

    lse' = logaddexp(lse, s_h)                     (a row that sees no key: lse = -inf, so lse' = s_h, out' = 0)
    out' = out * exp(lse - lse') = out * sigmoid(lse - s_h)

The standard block backward fed with the final ``(out', lse')`` instead of ``(out, lse)`` gives the exact
``dq, dk, dv``: ``P' = exp(S - lse')`` are the sink-inclusive probabilities of the keys and
``D' = rowsum(dO * out')`` sums ``P' dP`` over the keys (the sink's column has ``dP = 0``: no value). The sink's own
gradient is its column's ``dS``: ``d s_h = -sum over rows (and batch) of exp(s_h - lse') * D'``. So the forward
folds the sink once, after a row's last merge, and stores ``(out', lse')``; the backward reads each query chunk's
``(out', lse', dO)`` once for the sink's gradient.

Shapes (chunk pipeline, after the all-to-all; ``P`` sequence-parallel ranks, ``h = H / P``, or this rank's share
where ``P`` does not divide ``H``: :mod:`hf_fpdt.data.head_split`)::

    sinks      [H]                 the parameter (any float dtype), one logit per query head
    local      [h]                 this rank's heads: heads r*h .. (r+1)*h - 1 (the head scatter's order; uneven:
                                   HeadSplit.q_range(r))
    out        [B, C, h, D]        float32 (float64 stays float64)
    lse        [B, h, C]           float32
    d sinks    [H]                 this rank's heads filled, zeros elsewhere: a sum over the SP group (the gradient
                                   reduction every replicated parameter gets) completes it
"""

from __future__ import annotations

import torch

from ..data.head_split import query_head_range
from ..distributed.all_to_all import group_rank, group_size


def check_sinks(sinks: torch.Tensor, num_heads: int) -> None:
    """A clear error for sink logits that are not one per query head."""
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,) or not sinks.is_floating_point():
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(
            f"attention sinks (s_aux) must be a float tensor of one logit per query head, [{num_heads}]; got {shape}"
        )


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, S, h, D], lse [B, h, S])`` over all keys -> the sink-inclusive ``(out', lse')`` (module docstring).

    ``sinks [h]``, the logits of these heads; computed in ``lse``'s dtype (float32, float64 stays float64). A row
    with ``lse = -inf`` (no key seen) gets ``out' = 0``, ``lse' = s_h``."""
    s = sinks.detach().to(device=lse.device, dtype=lse.dtype).view(1, -1, 1)
    weight = torch.sigmoid(lse - s).transpose(1, 2).unsqueeze(-1)  # [B, S, h, 1] = exp(lse - lse')
    return out * weight.to(out.dtype), torch.logaddexp(lse, s)


def sink_grad(
    out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, sinks: torch.Tensor, acc: torch.dtype
) -> torch.Tensor:
    """``d s [h]`` from one query chunk's final ``out' [B, C, h, D]``, ``lse' [B, h, C]`` and ``dO [B, C, h, D]``."""
    d = (dout.to(acc) * out.to(acc)).sum(-1)  # D' [B, C, h]
    p = torch.exp(sinks.detach().to(device=lse.device, dtype=acc).view(1, -1, 1) - lse.to(acc))  # [B, h, C]
    return -(p.transpose(1, 2) * d).sum((0, 1))


class AttentionSinks:
    """One chunk-pipeline call's sinks: this rank's slice of the logits, folded into each query chunk's result
    in forward, and their gradient accumulated over the query chunks in backward."""

    def __init__(self, sinks: torch.Tensor, num_heads: int, group) -> None:
        check_sinks(sinks, num_heads)
        start, stop = query_head_range(num_heads, group_size(group), group_rank(group))
        self.heads = slice(start, stop)  # the head scatter's order (hf_fpdt.data.head_split; even or not)
        self.local = sinks.detach()[self.heads]
        self._like = sinks
        self._grad: torch.Tensor | None = None
        self._seen: set[int] = set()

    def fold(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A query chunk's merged ``(out, lse)`` -> the sink-inclusive pair (:func:`fold_sinks`)."""
        return fold_sinks(out, lse, self.local)

    def backward_chunk(self, j: int, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor) -> None:
        """Add query chunk ``j``'s share of the gradient (once per chunk, however many blocks fetch it)."""
        if j in self._seen:
            return
        self._seen.add(j)
        acc = torch.float64 if out.dtype == torch.float64 else torch.float32
        g = sink_grad(out, lse, dout, self.local, acc)
        self._grad = g if self._grad is None else self._grad + g

    def grad(self) -> torch.Tensor:
        """The gradient of the whole ``[H]`` parameter: this rank's heads, zeros elsewhere; then reset."""
        full = torch.zeros(self._like.shape, dtype=self._like.dtype, device=self._like.device)
        if self._grad is not None:
            full[self.heads] = self._grad.to(full.dtype)
        self._grad, self._seen = None, set()
        return full


class SinkSource:
    """A chunk source (:class:`hf_fpdt.attention.chunked.ChunkSource`) whose inputs end with the sink logits:
    the wrapped source sees its own inputs, the sinks get their gradient as the last input's."""

    def __init__(self, inner, sinks: torch.Tensor, group) -> None:
        self.inner = inner
        self.sizes, self.num_heads, self.num_kv_heads, self.spec = (
            inner.sizes,
            inner.num_heads,
            inner.num_kv_heads,
            inner.spec,
        )
        self.sinks = AttentionSinks(sinks, inner.num_heads, group)

    def forward_chunk(self, i: int, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.inner.forward_chunk(i, inputs[:-1])

    def to_save(self, inputs: tuple) -> tuple:
        return self.inner.to_save(inputs[:-1])

    def backward_chunk(self, i: int, saved: tuple, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
        self.inner.backward_chunk(i, saved, dq, dk, dv)

    def input_grads(self) -> tuple:
        return (*self.inner.input_grads(), self.sinks.grad())


def with_sinks(source, inputs: tuple, sinks: torch.Tensor | None, group) -> tuple[object, tuple]:
    """``(source, inputs)`` of a chunk-pipeline call, with the sink logits (HF's ``s_aux``) joined where given."""
    if sinks is None:
        return source, inputs
    return SinkSource(source, sinks, group), (*inputs, sinks)


def sinks_of(source) -> AttentionSinks | None:
    """The sinks of a chunk-pipeline call's source, or None."""
    return source.sinks if isinstance(source, SinkSource) else None
