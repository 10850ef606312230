"""Attention over a KV cache for ``generate()``: chunked prefill and decode steps (inference only).

HF's attention modules call the attention function with the cache *after* its update, so the new
tokens' keys are its last ones::

    q        [B, Sq, H, D]       the new tokens' queries (a prompt, a prefill chunk, one decode token)
    k, v     [B, Sk, Hkv, D]     every key/value of the cache (Sk >= Sq), views of HF's tensors
    keys     [B, Sk] bool        which keys are real tokens (False: padding), or None for all
    mask     [B, 1|H, Sq, Sk]    an explicit 4D mask instead (bool keep, or an additive float bias)
    out      [B, Sq, H, D]

With ``keys`` (or no mask) query t is token ``Sk - Sq + t`` of the cache: causal attention aligned at
the bottom right. Queries run ``c`` at a time (``c``: the runtime's chunk size). Query chunk
``[a, b)`` first meets its own keys ``[Sk - Sq + a, Sk - Sq + b)`` (the diagonal block, causal), then
the earlier keys ``c`` at a time; each block's ``(out, lse)`` from :meth:`hf_fpdt.attention.routes.Router.forward`
is folded in with :func:`hf_fpdt.attention.merge.merge_rows`. A decode step is the case ``Sq = 1``: one
query against the cache in chunks. So whatever the prompt's length, the working memory beyond the
cache and the output is one query chunk's fp32 merge state and one block: O(c).

Padding is masked per block: the blocks whose keys hold padding (found for the whole call with one
host sync) and the blocks a sliding window cuts go to the router (:mod:`hf_fpdt.attention.routes`) with their
keep pattern as a :class:`~hf_fpdt.attention.block_keep.BlockKeep` over cache indices (the causal bound, the window,
the block's ``[B, c]`` slice of the key mask), as the chunk pipeline hands its cut blocks to the kernels: the kernels
build the mask of a slice of query rows at a time, under their byte bound
(:func:`~hf_fpdt.attention.math_blocks.math_scores_bytes`), and a block cut by its window alone runs on a flash-attn
build with a window where that is the backend. Under an explicit 4D mask every block runs :func:`masked_block`, which
reads the block's view of the caller's mask a slice of query rows at a time. So no cut block forms a ``[c, c]`` mask
or ``[c, c]`` fp32 scores (a prefill at chunk 16K: 1 GiB of fp32 per block otherwise). The rest run the block
kernel. A query row may see no key in a block, or in any block (a padding token under left padding): its block lse
is ``-inf`` and its output 0, never NaN (a NaN in a padding position's key or value would reach every real token
through ``0 * NaN``).

A sliding window (HF's ``sliding_window``, in cache indices) is a band of blocks, as in training
(:mod:`hf_fpdt.attention.block_mask`): key blocks wholly before the window of a query chunk's first query are
skipped, the blocks the window cuts are masked (above). A softcap (Gemma 2) is part of
the block math (the blocks then run the fp32 math kernel, as in training). A static cache passes a
2D key mask of its slots (:func:`generation_mask`): for a prefill up to the last written one, for a decode
step all of them, the unwritten ones False. Blocks whose keys no row may see (unwritten slots, a
left-padded prompt's first blocks) are skipped, found in the same host sync.

Inference only: nothing here is differentiable. Calls that need gradients run the chunk pipeline
(:func:`hf_fpdt.attention.chunked.fpdt_attention`, with the same masks).
Under sequence parallelism (:mod:`hf_fpdt.integrations.sp_generation`) the
prompt's prefill runs through the training pipeline, sequence-parallel, and leaves each rank its share
of the keys in its cache; a decode step attends over each rank's share here and
:func:`merge_over_group` folds the ranks' ``(out, lse)`` together (one all-gather per layer).
"""

from __future__ import annotations

import torch

from ..distributed.all_to_all import group_rank
from ..memory.compat_torch import SDPA_OPS
from .block_keep import BlockKeep
from .math_blocks import math_scores_bytes
from .merge import merge_rows
from .routes import Router, block_router, value_width
from .runtime import FPDTRuntime
from .sinks import check_sinks, fold_sinks


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record a call on ``tensors`` (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def serves(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    runtime: FPDTRuntime,
    cached: bool = False,
) -> bool:
    """Whether an attention call (HF layout ``q [B, H, Sq, D]``) belongs here rather than to the chunk pipeline.

    Any call that needs no gradient does, on one process (a prefill with an empty cache looks like a
    full-sequence forward, and the pipeline would copy its keys and values into the host store: a second
    cache); under sequence parallelism only one with a cache (``Sq != Sk``, or ``cached``: the caller
    knows it holds one), else it is an SP evaluation's shard, which the pipeline runs with the group's
    padding mask. Calls that need gradients go to the pipeline (masks of every kind, an empty cache that
    HF fills on the side); a cache that already holds earlier keys is refused (:data:`CACHE_GRAD_REFUSAL`).
    """
    earlier = query.shape[2] != key.shape[2]
    if needs_grad(query, key, value):
        if earlier:
            raise ValueError(CACHE_GRAD_REFUSAL.format(cached=key.shape[2] - query.shape[2], new=query.shape[2]))
        return False
    return runtime.sp_size == 1 or cached or earlier


CACHE_GRAD_REFUSAL = (
    "fpdt attention cannot differentiate through a KV cache that already holds earlier tokens ({cached} cached "
    "keys before these {new} queries): its training pipeline attends a sequence to itself. Run the whole "
    "sequence in one call (an empty cache, or use_cache=False), run this call under torch.no_grad() (as "
    "generate() does), or use attn_implementation='sdpa' for it"
)


def _plan(
    sq: int, sk: int, chunk: int, aligned: bool, window: int | None = None
) -> list[tuple[slice, list[tuple[slice, bool]]]]:
    """Per query chunk: its span and its key blocks ``(span, causal)`` in merge order.

    ``aligned`` (causal, bottom-right): the diagonal block first, then the earlier keys, on a grid of
    ``chunk`` keys from key 0 (so the query chunks share their earlier-key blocks); with a ``window``
    only the blocks whose last key is inside the window of the chunk's first query (the band).
    Otherwise (an explicit mask decides what is seen) every key block, none causal.
    """
    off, plan = sk - sq, []
    for a in range(0, sq, chunk):
        b = min(a + chunk, sq)
        if aligned:
            first = 0 if window is None else off + a - window + 1  # the first key query a sees
            blocks = [(slice(off + a, off + b), True)]
            blocks += [
                (slice(s, min(s + chunk, off + a)), False)
                for s in range(0, off + a, chunk)
                if min(s + chunk, off + a) > first
            ]
        else:
            blocks = [(slice(s, min(s + chunk, sk)), False) for s in range(0, sk, chunk)]
        plan.append((slice(a, b), blocks))
    return plan


WHOLE, CUT, EMPTY = 0, 1, 2  # a block's keys: all real, some padding, padding in every row (skipped)


def _padded_blocks(keys: torch.Tensor | None, plan: list) -> list[list[int]]:
    """For every block of ``plan``: ``WHOLE``, ``CUT`` (some key is padding in some row) or ``EMPTY`` (every
    key is padding in every row: a left-padded prompt's first blocks, a static cache's unwritten slots).

    One host sync for the whole call; each test reads one block of the mask (O(chunk), never O(keys)),
    once per distinct key span (the earlier-key blocks of all query chunks share one grid).
    """
    if keys is None:
        return [[WHOLE] * len(blocks) for _, blocks in plan]
    spans = list(dict.fromkeys((ks.start, ks.stop) for _, blocks in plan for ks, _ in blocks))
    kinds = [torch.where(keys[:, a:b].all(), WHOLE, torch.where(keys[:, a:b].any(), CUT, EMPTY)) for a, b in spans]
    flags = dict(zip(spans, torch.stack(kinds).tolist()))
    return [[flags[ks.start, ks.stop] for ks, _ in blocks] for _, blocks in plan]


def masked_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor,
    router: Router,
    softcap: float | None = None,
    scores_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block under its rows of an explicit 4D mask: ``(out [B, sq, H, D], lse [B, H, sq])``, like
    :meth:`~hf_fpdt.attention.routes.Router.forward`.

    ``mask`` ``[B, 1|H, sq, sk]``: the block's view of the caller's mask, bool keep or additive float (HF's masked
    value, the dtype's minimum, read as ``-inf``; any other value added to the scores). It is read a slice of query
    rows at a time and made additive for those rows alone, so no ``[sq, sk]`` mask or scores of the whole block exist:
    each slice holds at most ``scores_bytes`` (default :func:`~hf_fpdt.attention.math_blocks.math_scores_bytes`, the
    kernels' bound) of additive mask (CPU's flash kernel, which takes the mask and forms no scores of its own beyond
    its tiles: :meth:`~hf_fpdt.attention.routes.Router.takes_additive_on_cpu`) or of fp32 scores (elsewhere, and for
    ``backend="math"`` or a ``softcap``: ``cap * tanh(s / cap)`` on
    the scaled scores, which no fused kernel has), GQA folded into the rows (keys are never repeated). Rows that see
    no key get ``lse = -inf`` and output 0.
    """
    padded = value_width(q, k, v)
    if padded is not None:  # v's head dim not q's (multi-head latent attention): one width, v's columns kept
        _, pad = padded
        out, lse = masked_block(pad(q), pad(k), pad(v), scale, mask, router, softcap, scores_bytes)
        return out[..., : v.shape[-1]], lse
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    bound = math_scores_bytes(q) if scores_bytes is None else scores_bytes
    if router.takes_additive_on_cpu(q, softcap):
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)
        out, lse = q.new_empty(q.shape), None
        rows = max(1, bound // (b * mask.shape[1] * max(sk, 1) * q.element_size()))
        for r in range(0, sq, rows):
            n = min(rows, sq - r)
            bias = _bias_rows(mask[:, :, r : r + n], q.dtype)  # [B, 1|H, n, sk]
            res = _CPU_FLASH(q[:, r : r + n].transpose(1, 2), kt, vt, 0.0, False, attn_mask=bias, scale=scale)
            o, rows_lse = res[0], res[1]
            if lse is None:
                lse = torch.empty(b, h, sq, dtype=rows_lse.dtype, device=q.device)
            out[:, r : r + n] = o.transpose(1, 2)
            lse[:, :, r : r + n] = rows_lse.masked_fill(torch.isneginf(bias).all(-1), float("-inf"))
            del bias, res, o, rows_lse
        return out, lse
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    kt, vh = k.transpose(1, 2).to(acc).transpose(-1, -2), v.transpose(1, 2).to(acc)
    out, lse = q.new_empty(q.shape), torch.empty(b, h, sq, dtype=acc, device=q.device)
    rows = max(1, bound // (b * h * max(sk, 1) * torch.finfo(acc).bits // 8))
    for r in range(0, sq, rows):
        n = min(rows, sq - r)
        qg = q[:, r : r + n].transpose(1, 2).to(acc).reshape(b, hkv, (h // hkv) * n, d)  # head h: kv head h // groups
        s = torch.matmul(qg, kt).view(b, h, n, sk).mul_(scale)
        if softcap is not None:
            s.div_(softcap).tanh_().mul_(softcap)
        s.add_(_bias_rows(mask[:, :, r : r + n], acc))
        rows_lse = torch.logsumexp(s, dim=-1)
        p = s.sub_(rows_lse.masked_fill(torch.isneginf(rows_lse), 0.0).unsqueeze(-1)).exp_()
        out[:, r : r + n] = torch.matmul(p.view(b, hkv, -1, sk), vh).view(b, h, n, d).transpose(1, 2)
        lse[:, :, r : r + n] = rows_lse
        del s, p, qg
    return out, lse


_CPU_FLASH = SDPA_OPS.cpu_flash


def _bias_rows(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a 4D mask (bool keep, or additive float whose masked value is the dtype's minimum) as the additive
    mask the kernels take, in ``dtype``: 0 (or the float mask's own value) where a key is seen, ``-inf`` where not."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return mask.masked_fill(mask == torch.finfo(mask.dtype).min, float("-inf")).to(dtype)


def _cut(
    qs: slice, ks: slice, off: int, causal: bool, window: int | None, keys: torch.Tensor | None
) -> BlockKeep | None:
    """The keep pattern of one aligned block (query t at cache index ``off + t``) as a
    :class:`~hf_fpdt.attention.block_keep.BlockKeep` over cache indices, as the chunk pipeline hands its cut blocks to
    the kernels (built a slice of query rows at a time, never ``[sq, kb]`` at once); None where the block is whole
    (or exactly the causal triangle, which the kernel's causal flag covers)."""
    cut = window is not None and ks.start < off + qs.stop - window  # its first key leaves the last query's window
    if keys is None and not cut:
        return None
    return BlockKeep(
        off + qs.start,
        ks.start,
        qs.stop - qs.start,
        ks.stop - ks.start,
        causal=causal,
        window=window if cut else None,
        keys=None if keys is None else keys[:, ks],
    )


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    chunk_size: int,
    keys: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    backend: str | None = None,
    window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    static: bool = False,
    sinks: torch.Tensor | None = None,
    scores_bytes: int | None = None,
    router: Router | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [B, Sq, H, D]`` over a cache ``k, v [B, Sk, Hkv, D]`` (see the module docstring).

    Args:
        q, k, v: sequence-major queries, keys, values (``Sq <= Sk``; views are fine).
        scale: softmax scale.
        chunk_size: queries per query chunk and keys per key block.
        keys: ``[B, Sk]`` bool, True for real keys (bottom-right causal alignment), or None.
        mask: an explicit ``[B, 1|H, Sq, Sk]`` mask (bool keep or additive float); the queries see exactly
            what it allows (no causal structure or window is added). Exclusive with ``keys``.
        backend: the block kernel backend (:mod:`hf_fpdt.attention.kernels`); None chooses by device. Ignored
            with a ``router``.
        window: HF's ``sliding_window`` in cache indices (query at index i sees key j iff ``i - W < j <= i``);
            blocks outside the band are skipped. Ignored under an explicit ``mask`` (it holds the window).
        softcap: ``cap * tanh(s / cap)`` on the scaled scores (Gemma 2), or None.
        return_lse: also return the rows' log-sum-exp ``[B, H, Sq]`` (float32), with the output in float32,
            for a merge with other keys' attention (:func:`merge_over_group`).
        static: no host sync (under ``torch.compile``): with ``keys`` every block takes the masked path
            instead of finding the padded ones first.
        sinks: ``[H]`` attention sinks (HF's ``s_aux``), folded into each query chunk's merged result
            (:mod:`hf_fpdt.attention.sinks`); the lse returned then includes them.
        scores_bytes: the bound on one query-row slice of a masked block (its fp32 scores, or the additive mask CPU's
            flash kernel takes), as the kernels take it (default
            :func:`~hf_fpdt.attention.math_blocks.math_scores_bytes` of the query chunk).
        router: where each block runs (:class:`~hf_fpdt.attention.routes.Router`, the runtime's:
            :meth:`~hf_fpdt.attention.runtime.FPDTRuntime.router`); ``None``: ``backend``'s, with no flash-attn build
            beside ``cudnn`` / ``torch_flash`` and no cuDNN bias (:func:`~hf_fpdt.attention.routes.block_router`).
    """
    sq, sk = q.shape[1], k.shape[1]
    if sq > sk:
        raise ValueError(f"more queries ({sq}) than keys ({sk}): a cache holds the new tokens' keys too")
    if keys is not None and mask is not None:
        raise ValueError("pass either a key padding mask or an explicit 4D mask, not both")
    if keys is not None and tuple(keys.shape) != (q.shape[0], sk):
        raise ValueError(f"key padding mask {tuple(keys.shape)} must be [batch, keys] = {(q.shape[0], sk)}")
    if mask is not None and (mask.dim() != 4 or mask.shape[-2:] != (sq, sk)):
        raise ValueError(f"a 4D attention mask must be [batch, 1 or heads, {sq}, {sk}]; got {tuple(mask.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"sliding_window must be at least 1 token, got {window}")
    if sinks is not None:
        check_sinks(sinks, q.shape[2])
    router = router or block_router(q, backend)
    aligned = mask is None
    plan = _plan(sq, sk, chunk_size, aligned, window if aligned else None)
    cut = CUT if keys is not None else WHOLE
    padded = [[cut] * len(b) for _, b in plan] if static else _padded_blocks(keys, plan)
    off = sk - sq
    shape = (*q.shape[:-1], v.shape[-1])  # v's head dim (multi-head latent attention: not q's)
    out = q.new_empty(shape) if not return_lse else q.new_empty(shape, dtype=torch.float32)
    lse_all = q.new_empty((q.shape[0], q.shape[2], sq), dtype=torch.float32) if return_lse else None
    for (qs, blocks), flags in zip(plan, padded):
        q_c = q[:, qs]
        o = lse = None
        for (ks, causal), kind in zip(blocks, flags):
            if kind == EMPTY:
                continue  # no row sees a key here
            k_b, v_b = k[:, ks], v[:, ks]
            if mask is not None:  # the block's view of the caller's 4D mask, read a row slice at a time
                block = masked_block(q_c, k_b, v_b, scale, mask[:, :, qs, ks], router, softcap, scores_bytes)
            else:
                cut = _cut(qs, ks, off, causal, window, keys if kind else None)
                block = router.forward(
                    q_c, k_b, v_b, causal, scale, mask=cut, softcap=softcap, scores_bytes=scores_bytes
                )
            o, lse = merge_rows(o, lse, *block, take=True)  # a fresh block: the accumulator, merged in place
            del block, k_b, v_b
        if o is None:  # every key of these queries is padding: output 0, lse -inf (as masked_block's empty rows)
            o = q_c.new_zeros((*q_c.shape[:-1], v.shape[-1]))
            lse = q_c.new_full((q.shape[0], q.shape[2], q_c.shape[1]), float("-inf"), dtype=torch.float32)
        if sinks is not None:
            o, lse = fold_sinks(o.to(lse.dtype), lse, sinks)
        out[:, qs] = o.to(out.dtype)
        if return_lse:
            lse_all[:, :, qs] = lse
        del o, lse
    return (out, lse_all) if return_lse else out


def merge_over_group(out: torch.Tensor, lse: torch.Tensor, group) -> torch.Tensor:
    """Fold every rank's ``(out [B, Sq, H, D], lse [B, H, Sq])`` over disjoint keys into the attention over
    all of them: one all-gather of both (packed into one buffer), merged in rank order, so every rank holds
    the same result. Under sequence-parallel decoding each rank attends over its share of the cache."""
    import torch.distributed as dist

    flat = torch.cat([out.reshape(-1), lse.reshape(-1).to(out.dtype)])
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, flat, group=group)
    o = m = None
    for part in parts:
        o, m = merge_rows(o, m, part[: out.numel()].view_as(out), part[out.numel() :].view_as(lse), take=True)
    return o


def cached_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    runtime: FPDTRuntime,
    scaling: float | None,
    window: int | None = None,
    softcap: float | None = None,
    group=None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """HF's layout in (``q [B, H, Sq, D]``, ``k, v [B, Hkv, Sk, D]``, the mask :func:`generation_mask` made)
    -> ``out [B, Sq, H, D]``, chunked with the runtime's chunk size.

    A 2D key mask shorter than the cache (``[B, n]``, ``n < Sk``: a static cache with ``n`` slots written,
    the queries its last ones) restricts the call to the first ``n`` keys. With ``group`` (sequence-parallel
    decoding) the cache is this rank's share of the keys and the result is merged over the group
    (:func:`merge_over_group`). ``sinks [H]``: attention sinks (HF's ``s_aux``); under SP folded into the first
    rank's share only (a sink is one more block of no value: merged once, :mod:`hf_fpdt.attention.sinks`).
    """
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    keys = mask = None
    if attention_mask is not None:
        if attention_mask.dim() == 2:
            keys = attention_mask.to(device=query.device, dtype=torch.bool)
            if keys.shape[1] < key.shape[2]:  # a static cache: only the first n slots are written
                key, value = key[:, :, : keys.shape[1]], value[:, :, : keys.shape[1]]
        elif attention_mask.dim() == 4:
            mask = attention_mask.to(query.device)
        else:
            raise ValueError(
                f"fpdt attention takes a 2D key padding mask or a 4D mask; got {attention_mask.dim()} dimensions"
            )
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    hints = {"dtype": q.dtype, "width": q.shape[2] * q.shape[3], "kv_ratio": k.shape[2] / q.shape[2]}
    chunk = runtime.global_chunk_size(q.device, **hints)
    router = runtime.router(q.device, q.dtype, q.shape[-1])  # each block's kernel, as in training
    if window is not None and window >= k.shape[1]:
        window = None  # every key is inside the window
    with torch.no_grad():
        if group is None:
            return cached_attention(
                q, k, v, scale, chunk, keys, mask, None, window, softcap, sinks=sinks, router=router
            )
        first = group_rank(group) == 0
        sinks = sinks if first else None
        out, lse = cached_attention(
            q, k, v, scale, chunk, keys, mask, None, window, softcap, return_lse=True, sinks=sinks, router=router
        )
        return merge_over_group(out, lse, group).to(q.dtype)


def generation_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset,
    kv_offset: int,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> torch.Tensor | None:
    """What fpdt's mask function returns when HF builds a mask for a cache or a left-padded batch.

    With the queries the last ``q_length`` of ``kv_length`` keys (a dynamic cache, or none), a 2D bool
    key padding mask ``[B, kv_length]`` (or None when nothing is padded): O(keys), never ``[Sq, Sk]``.
    A static cache (``kv_length`` preallocated slots from 0, the queries at ``q_offset``): the key padding
    mask of the written slots only, ``[B, q_offset + q_length]``, even when nothing is padded (its length
    tells the attention which slots hold keys); for a decode step (``q_length == 1``) every slot,
    ``[B, kv_length]``, the unwritten ones False, so each position's mask has one shape (a compiled decode
    step is one graph) and the attention skips the unwritten blocks. Otherwise (a cache whose slots do not
    start at key 0: a sliding window cache that has dropped keys, a ring buffer) HF's 4D bool mask, which the attention
    applies block by block (O(Sq * Sk) bools, as for ``sdpa``).
    """
    from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

    q_offset = int(q_offset)
    if kv_offset == 0 and q_offset + q_length <= kv_length:
        written = q_offset + q_length
        if attention_mask is None:
            mask = None
        else:
            mask = prepare_padding_mask(attention_mask.bool(), written, 0)[:, :written]
        if written == kv_length:
            return None if mask is None or bool(mask.all()) else mask
        if mask is None:
            device = kwargs.get("device") or "cpu"
            mask = torch.ones(batch_size, written, dtype=torch.bool, device=device)
        if q_length == 1:  # a decode step: every slot, the unwritten ones False (one shape for every position)
            mask = torch.nn.functional.pad(mask, (0, kv_length - written), value=False)
        return mask
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.setdefault("mask_function", causal_mask_function)
    return sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        **kwargs,
    )
