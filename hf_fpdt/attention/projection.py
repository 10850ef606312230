"""The chunked q/k/v projection: a chunk source that projects and rotates one hidden chunk at a time.

Feeding :class:`~hf_fpdt.attention.chunked.FPDTAttentionFunction` from the hidden states instead of from
full q/k/v tensors removes the projection's spike (``q, k, v`` together are ``(H + 2 Hkv) * D`` wide,
three times the hidden state for MHA, plus the rotated copies). Shapes (``l_i`` = local chunk i)::

    hidden      [B, S, E]            the attention module's input (saved: backward recomputes from it)
    cos, sin    [B | 1, S, R]        rotary tables for these tokens (R <= D: partial rotary allowed)
    h_i         [B, l_i, E]          a view of hidden
    q_i         [B, l_i, H, D]       k_i, v_i  [B, l_i, Hkv, D]    (rotated; freed after the all-to-all)
    dq_i ...    same as q_i ...      from the attention backward, as soon as chunk i's grads are final
    dhidden     [B, S, E]            filled chunk by chunk

Forward runs each chunk under ``no_grad``; backward rebuilds the chunk's projection with autograd
(:func:`hf_fpdt.memory.replay.piece_grads`) and differentiates it w.r.t. the hidden chunk and the
projection's *trainable* parameters, summing the latter over chunks. Those parameters are inputs of
the autograd Function, so their gradients flow through autograd's ordinary accumulation (and any
DDP/FSDP hooks on it) rather than being written into ``.grad`` behind its back; parameters that are
whole only inside their modules (DeepSpeed ZeRO-3) are delivered instead
(:class:`~hf_fpdt.memory.replay.DeliveredParams`).

The projection itself is a model-specific callable ``project(h_i, cos_i, sin_i) -> (q_i, k_i, v_i)``
(see :func:`hf_fpdt.models.parts.project`); it calls the model's own
submodules, so PEFT LoRA wrappers around them are honoured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..data.chunks import chunk_spans
from ..memory.replay import DeliveredParams, GradAccumulator, ParamGrads, ReplayState, piece_grads
from .block_mask import MaskSpec
from .chunked import FPDTAttentionFunction
from .runtime import FPDTRuntime
from .sinks import with_sinks

Project = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class ProjectedSource:
    """Chunk source over ``inputs = (hidden, cos, sin, *grads.inputs)``; see the module docstring."""

    def __init__(
        self,
        sizes: list[int],
        num_heads: int,
        num_kv_heads: int,
        project: Project,
        spec: MaskSpec | None = None,
        grads: ParamGrads | None = None,
    ) -> None:
        self.sizes, self.num_heads, self.num_kv_heads = sizes, num_heads, num_kv_heads
        self.spec = spec if spec is not None else MaskSpec()
        self.project = project
        self.grads = grads if grads is not None else ParamGrads((), torch.device("cpu"))
        self._spans = chunk_spans(sizes)
        self._states: list[ReplayState | None] = [None] * len(sizes)
        self._needs: tuple[bool, ...] = ()
        self._dhidden: torch.Tensor | None = None
        self._acc: GradAccumulator | None = None

    def forward_chunk(self, i: int, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden, cos, sin = inputs[:3]
        if i == 0:
            params = inputs[3:]
            self._needs = (hidden.requires_grad, *(p.requires_grad for p in params))
        s = self._spans[i]
        if any(self._needs):
            # Dropout inside the projection (e.g. LoRA dropout) must draw the same numbers in backward.
            self._states[i] = ReplayState.capture(hidden.device)
        return self.project(hidden[:, s], cos[:, s], sin[:, s])

    def to_save(self, inputs: tuple) -> tuple:
        # hidden: the only activation backward needs (every chunk's q/k/v is rebuilt from it);
        # cos/sin: tiny and shared by all layers; params: so backward differentiates the live tensors.
        return tuple(inputs)

    def backward_chunk(self, i: int, saved: tuple, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
        hidden, cos, sin = saved[:3]
        params = saved[3:]
        need_x = self._needs[0]
        live = self.grads.live(params, self._needs[1:])
        if self._acc is None:
            self._acc = GradAccumulator(live)
        if need_x and self._dhidden is None:
            self._dhidden = torch.empty_like(hidden)  # every chunk's span is assigned below: no memset
        s = self._spans[i]
        cos_i, sin_i = cos[:, s], sin[:, s]
        dx, dparams = piece_grads(
            lambda h: self.project(h, cos_i, sin_i), hidden[:, s], need_x, live, (dq, dk, dv), self._states[i]
        )
        self._states[i] = None
        if self._dhidden is not None:  # each span written once (zeros if this chunk's q/k/v ignore hidden)
            self._dhidden[:, s] = 0 if dx is None else dx
        self._acc.add(dparams)

    def input_grads(self) -> tuple:
        pgrads = self.grads.finish(self._acc.result() if self._acc is not None else (), self._needs[1:])
        grads = (self._dhidden, None, None, *pgrads)
        self._dhidden, self._acc = None, None
        return grads


def projected_attention(
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    project: Project,
    params: Sequence[torch.Tensor] | DeliveredParams,
    num_heads: int,
    num_kv_heads: int,
    runtime: FPDTRuntime,
    scale: float,
    spec: MaskSpec | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """FPDT attention straight from the hidden states: ``hidden [B, S, E] -> out [B, S, H, D]``.

    ``params`` are the projection's trainable parameters (they receive gradients through this call, as
    inputs or delivered: :class:`~hf_fpdt.memory.replay.DeliveredParams`);
    ``cos, sin [B | 1, S, R]`` the rotary tables of these tokens; ``spec`` the call's window, softcap,
    documents, block-sparse pattern and padding mask (:class:`hf_fpdt.attention.block_mask.MaskSpec`, global token
    order; ``None``: plain causal; :func:`hf_fpdt.attention.chunked.fpdt_attention`); ``sinks [H]`` the module's
    attention sinks (HF's ``s_aux``; :mod:`hf_fpdt.attention.sinks`), which get their gradient through this call.
    """
    hints = {"dtype": hidden.dtype, "width": hidden.shape[-1], "kv_ratio": num_kv_heads / num_heads}  # for "auto"
    sizes = runtime.chunk_sizes(hidden.shape[1], hidden.device, **hints)
    grads = ParamGrads(params, hidden.device)
    source = ProjectedSource(sizes, num_heads, num_kv_heads, project, spec, grads)
    heads = runtime.head_group(num_heads, num_kv_heads) if sinks is not None else runtime.group
    source, inputs = with_sinks(source, (hidden, cos, sin, *grads.inputs), sinks, heads)
    return FPDTAttentionFunction.apply(source, runtime, scale, *inputs)
