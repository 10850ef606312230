"""Ulysses sequence parallelism: the chunked all-to-all between sequence and head layouts.

Every function takes the sequence-parallel (SP) process group explicitly; ``group=None`` means one
process (the identity). Shapes, with P the SP size::

    local chunk   [B, l, H, D]        (this rank's l tokens, all heads)
    global chunk  [B, P * l, H / P, D] (all ranks' tokens of the chunk, this rank's heads)

Key/value heads: when P exceeds the number of key/value heads (GQA/MQA), each KV head is replicated
``P / Hkv`` times before the scatter, so every rank receives the KV head its query heads use; in
backward the replicas' gradients are summed. The same code runs on gloo (CPU) and NCCL (GPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .peers import peer_failure


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def kv_replicas(num_kv_heads: int, sp_size: int) -> int:
    """How many times each KV head is replicated before the head scatter (1 = none)."""
    return sp_size // num_kv_heads if sp_size > num_kv_heads else 1


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    # x [P, ...] contiguous: slice r goes to rank r; the result's slice r came from rank r.
    out = torch.empty_like(x)
    try:
        dist.all_to_all_single(out, x, group=group)
    except RuntimeError as exc:  # a peer raised, died or stalled: say which, when it left a note
        raise peer_failure(group, exc, "all_to_all of an attention chunk") from exc
    return out


def scatter_heads(x: torch.Tensor, group: dist.ProcessGroup | None, replicas: int = 1) -> torch.Tensor:
    """Local chunk ``[B, l, H, D]`` -> global chunk ``[B, P*l, H*replicas/P, D]``."""
    p = group_size(group)
    if replicas > 1:
        b, n, h, d = x.shape
        x = x.unsqueeze(3).expand(b, n, h, replicas, d).reshape(b, n, h * replicas, d)
    if p == 1:
        return x
    b, n, h, d = x.shape
    send = x.reshape(b, n, p, h // p, d).permute(2, 0, 1, 3, 4).contiguous()  # [P, B, n, H/P, D]
    recv = _all_to_all(send, group)  # [P (source rank = sequence piece), B, l, H/P, D]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, p * n, h // p, d)


def gather_heads(x: torch.Tensor, group: dist.ProcessGroup | None, replicas: int = 1) -> torch.Tensor:
    """Global chunk ``[B, P*l, h, D]`` -> local chunk ``[B, l, P*h/replicas, D]`` (inverse of scatter).

    With ``replicas > 1`` the replicated heads are summed, which is the adjoint of the replication
    and so the right thing for gradients.
    """
    p = group_size(group)
    if p > 1:
        b, pl, h, d = x.shape
        send = x.reshape(b, p, pl // p, h, d).permute(1, 0, 2, 3, 4).contiguous()  # [P, B, l, h, D]
        recv = _all_to_all(send, group)  # [P (source rank = head group), B, l, h, D]
        x = recv.permute(1, 2, 0, 3, 4).reshape(b, pl // p, p * h, d)
    if replicas > 1:
        b, n, h, d = x.shape
        x = x.reshape(b, n, h // replicas, replicas, d).sum(3)
    return x
