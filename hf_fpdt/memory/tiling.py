"""Sequence tiling of token-wise pieces: the MLP, and the LM head with its cross-entropy.

Both are token-wise, so any split of the tokens gives the same result; splitting bounds the memory of
their wide intermediates by one tile.

**Tiled MLP** (:func:`tiled_mlp`)::

    x      [B, S, E]        saved (the only activation kept; under activation checkpointing the
                            checkpoint drops it and recomputes the layer as usual)
    x_t    [B, s_t, E]      tile t (a view)
    inter  [B, s_t, I]      e.g. gate/up and act(gate)*up of SwiGLU, or the GELU input: one tile at a time
    out    [B, S, E]

Forward runs tile by tile under ``no_grad``; backward rebuilds each tile's graph and differentiates it,
so neither pass holds more than one tile's intermediates. The MLP is any token-wise callable (the
model's own ``forward``): SwiGLU, GELU, LoRA-wrapped projections all work unchanged.

**Tiled LM head + cross-entropy** (:func:`tiled_lm_loss`)::

    hidden  [N, E]          N = B * S tokens (flattened)
    labels  [N]             already shifted (target of token t), ``ignore_index`` where no target
    logits  [n_t, V]        float32, one tile at a time: the full [N, V] never exists
    dhidden [N, E]          computed in forward (kept until backward), scaled by the loss's grad there

The loss is a sum, so its gradient is linear in the incoming scalar: each tile's gradients are taken
in forward (Liger-Kernel's trick, saving the logits recompute backward would need) and backward only
scales them. Tiles without a valid label are skipped.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence

import torch

from ..config import IGNORE_INDEX
from .host_pool import device_ints
from .replay import DeliveredParams, GradAccumulator, ParamGrads, ReplayState, piece_grads

MIN_LOSS_TILE_TOKENS = 64


def mlp_tiles(runtime, local_len: int, device: torch.device) -> int:
    """MLP tiles of an :class:`~hf_fpdt.attention.runtime.FPDTRuntime`: ``config.mlp_chunks``, else twice the
    attention's chunk count for this length (min 1)."""
    if runtime.config.mlp_chunks is not None:
        return runtime.config.mlp_chunks
    return max(1, 2 * len(runtime.chunk_sizes(local_len, device)))


def loss_tiles(runtime, vocab: int, hidden: int, tokens: int) -> int:
    """LM-head tiles: ``config.loss_chunks``, else ``2 * vocab // hidden`` (a logits tile of about half the
    hidden state), but no tile under ``MIN_LOSS_TILE_TOKENS`` tokens: below that the head's weight is
    re-read for too little work, and the tile's logits are small in absolute terms anyway."""
    if runtime.config.loss_chunks is not None:
        return runtime.config.loss_chunks
    return max(1, min(2 * vocab // hidden, math.ceil(tokens / MIN_LOSS_TILE_TOKENS)))


def tile_bounds(n: int, tiles: int) -> list[tuple[int, int]]:
    """``min(tiles, n)`` contiguous near-equal ranges covering ``[0, n)`` (none when ``n == 0``)."""
    if n <= 0:
        return []
    tiles = max(1, min(int(tiles), n))
    step = math.ceil(n / tiles)
    return [(a, min(a + step, n)) for a in range(0, n, step)]


class _TiledTokenwise(torch.autograd.Function):
    """``apply(fn, tiles, grads, x [B, S, E], *grads.inputs) -> fn(x) [B, S, E']``, tiled over dim 1 (see
    module doc); ``grads``: a :class:`~hf_fpdt.memory.replay.ParamGrads`."""

    @staticmethod
    def forward(ctx, fn: Callable, tiles: int, grads: ParamGrads, x: torch.Tensor, *params: torch.Tensor):
        bounds = tile_bounds(x.shape[1], tiles)
        needs = any(ctx.needs_input_grad[3:])
        states, out = [], None
        for a, b in bounds:
            if needs:  # dropout in fn must replay identically in backward
                states.append(ReplayState.capture(x.device))
            y = fn(x[:, a:b])
            if out is None:
                out = y.new_empty(x.shape[0], x.shape[1], *y.shape[2:])
            out[:, a:b] = y
            del y
        if needs:
            ctx.fn, ctx.bounds, ctx.states, ctx.grads = fn, bounds, states, grads
            ctx.save_for_backward(x, *params)  # x: the tiles are rebuilt from it
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[3]
        live = ctx.grads.live(params, ctx.needs_input_grad[4:])
        dx = torch.empty_like(x) if need_x else None
        acc = GradAccumulator(live)
        for (a, b), state in zip(ctx.bounds, ctx.states):
            dx_t, dp = piece_grads(lambda t: (ctx.fn(t),), x[:, a:b], need_x, live, (dout[:, a:b],), state)
            if need_x:
                dx[:, a:b] = dx_t if dx_t is not None else 0
            acc.add(dp)
        ctx.states = None
        return (None, None, None, dx, *ctx.grads.finish(acc.result(), ctx.needs_input_grad[4:]))


@torch.compiler.disable  # tiles loop over data-dependent bounds: eager under torch.compile
def tiled_mlp(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    tiles: int,
    params: Sequence[torch.Tensor] | DeliveredParams,
) -> torch.Tensor:
    """``fn(x)`` for a token-wise ``fn``, computed and recomputed ``tiles`` tiles at a time over dim 1.

    Args:
        fn: the MLP (or any token-wise callable) ``[B, s, E] -> [B, s, E']``.
        x: ``[B, S, E]``.
        tiles: number of tiles over S (capped at S).
        params: the trainable parameters ``fn`` uses; they get their gradients through this call (as
            inputs, or delivered: :class:`~hf_fpdt.memory.replay.DeliveredParams`).
    """
    grads = ParamGrads(params, x.device)
    return _TiledTokenwise.apply(fn, tiles, grads, x, *grads.inputs)


def check_label_dtype(labels: torch.Tensor) -> None:
    """Labels are token ids: a ``ValueError`` naming the dtype otherwise (no host sync)."""
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(
            f"labels must be integer token ids (torch.long), got dtype {labels.dtype}: pass the token ids "
            "themselves (e.g. labels = input_ids.clone(), or labels.long()), with -100 where a token has no target"
        )


def label_range_error(value: int, vocab: int, ignore_index: int) -> ValueError:
    """The error of a label outside ``[0, vocab)`` that is not ``ignore_index`` (HF: ``Target 133 is out of
    bounds``)."""
    return ValueError(
        f"labels hold {value}, outside the vocabulary of {vocab} tokens (ids 0 to {vocab - 1}): every label must "
        f"be a token id in [0, {vocab}) or ignore_index ({ignore_index}) for a token without a target; check the "
        "tokenizer's ids against the model's vocab_size (resize_token_embeddings after adding tokens)"
    )


class _TiledLMLoss(torch.autograd.Function):
    """``apply(head, tiles, ignore_index, vocab, pgrads, hidden [N, E], labels [N], *pgrads.inputs) -> loss_sum``
    (fp32, 0-d); ``vocab``: the logits' width, or None (read from the first tile's logits); ``pgrads``: a
    :class:`~hf_fpdt.memory.replay.ParamGrads`."""

    @staticmethod
    def forward(ctx, head, tiles, ignore_index, vocab, pgrads, hidden, labels, *params):
        need_x = ctx.needs_input_grad[5]
        live = pgrads.live(params, ctx.needs_input_grad[7:])
        needs = need_x or bool(live)
        # A plain nn.Linear head gets its backward written out: dW accumulates in place (addmm_) instead of
        # one fresh [V, E] gradient per tile, which would dominate at short tiles. Anything else (a LoRA-
        # wrapped head, a custom module, a head whose weight is whole only inside its forward: delivered
        # parameters) goes through autograd, and so does any head under torch.autocast (its matmuls then run
        # in the autocast dtype, HF's backward with them).
        autocast = torch.is_autocast_enabled(hidden.device.type)
        linear = type(head) is torch.nn.Linear and pgrads.delivered is None and not autocast
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        dx = torch.zeros_like(hidden) if need_x else None
        acc = GradAccumulator(live)
        bounds = tile_bounds(hidden.shape[0], tiles)
        # One host sync for all tiles (not one per tile): which tiles hold any target at all, and the
        # smallest and largest target (a label outside the vocabulary is an error before any tile runs).
        kept = labels != ignore_index
        valid = kept.to(torch.int64).cumsum(0)
        targets = torch.where(kept, labels, 0)
        # the tiles' ends in one non-blocking copy from pinned memory (torch.tensor(list, device=cuda) would be a
        # pageable copy: a second host sync)
        at = device_ints([[b - 1 for _, b in bounds]], valid.device)[0]
        stats = torch.cat([valid[at], targets.min().view(1), targets.max().view(1)]).tolist() if bounds else [0, 0]
        ends, (low, high) = stats[:-2], stats[-2:]
        counts = [e - s for e, s in zip(ends, [0, *ends[:-1]])]
        if vocab is not None and (low < 0 or high >= vocab):
            raise label_range_error(low if low < 0 else high, vocab, ignore_index)
        # Delivered parameters (ZeRO-3): every head call gathers them collectively, so every rank calls the
        # head once per tile, targets or not.
        skip_empty = pgrads.delivered is None
        for (a, b), count in zip(bounds, counts):
            if count == 0 and skip_empty:
                continue  # no target in this tile: contributes 0 to the loss and its gradients
            h = hidden[a:b].detach().requires_grad_(need_x and not linear)
            with torch.enable_grad() if needs and not linear else torch.no_grad():
                z = head(h)  # [n_t, V] in the head's dtype
            # fp32 per tile, like HF's ForCausalLMLoss upcast. The softmax gradient is formed in place in
            # this buffer, so it must be our own: z itself for a plain fp32 Linear, else a copy.
            if vocab is None and (low < 0 or high >= z.shape[-1]):  # the logits' width, from the first tile
                raise label_range_error(low if low < 0 else high, z.shape[-1], ignore_index)
            zf = z.detach().to(torch.float32, copy=not linear or z.dtype != torch.float32)
            loss, dz = _cross_entropy_sum(zf, labels[a:b], ignore_index, needs)
            del zf
            if needs:
                dz = dz.to(z.dtype)  # the backward of .float()
                if linear:
                    _linear_backward(head, h, dz, dx[a:b] if need_x else None, live, acc)
                else:
                    grads = torch.autograd.grad(z, ([h] if need_x else []) + live, dz, allow_unused=True)
                    if need_x:
                        dx[a:b] = grads[0]
                    acc.add(grads[1:] if need_x else grads)
                    del grads
                del dz
            total += loss
            del loss, z, h
        # No target at all (every label ignored): the sum is 0 whatever the inputs, and its gradients are 0, also
        # where the loss divides it by 0 valid targets (NaN, as HF's); zeros for the head too, as HF gives it.
        ctx.empty = not any(counts)
        if needs:
            if ctx.empty and skip_empty:
                acc.add([torch.zeros_like(p) for p in live])
            # Gradients of the tile sums w.r.t. hidden and params, final up to the scalar grad of the loss.
            ctx.dx, ctx.acc, ctx.pgrads = dx, acc, pgrads
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # In place: the forward's buffers are this Function's alone, and backward runs once per forward.
        scale = None if ctx.empty else grad  # zero gradients stay 0 under a loss divided by 0 targets (inf)
        dx = ctx.dx
        if dx is not None and scale is not None:
            dx.mul_(scale.to(dx.dtype))
        pgrads = ctx.pgrads.finish(ctx.acc.result(scale=scale), ctx.needs_input_grad[7:])
        ctx.dx = ctx.acc = ctx.pgrads = None
        return (None, None, None, None, None, dx, None, *pgrads)


def log_softmax_(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In place: ``z [n, V] <- log_softmax(z)`` over the last dim; returns ``(z, top [n], log_sum [n])`` with
    ``log_softmax(z) = (z - top) - log_sum``, each log-probability rounded at its own magnitude.

    Why the order (issue 36): a trained model's logits reach tens (-29 to +45 for a 135M Llama on code), where an
    fp32 ulp is ~4e-6. ``z_y - logsumexp(z)`` rounds at that magnitude: an error of ~eps * 45 in a log-probability
    of a near-certain token that is itself ~1e-6, which ``exp(z - lse) - onehot`` then carries into the gradient.
    Here ``z - top`` is exact near the top (Sterbenz), ``log_sum = log1p(sum of the other terms)`` lies in ``[0,
    log V]`` and keeps ``1 - p(top)`` however small, and the last subtraction rounds at ``|log p|``: per token
    ``|error| <= ~eps (1 + |log p|)``. (torch's CPU ``log_softmax``, HF's path, is measurably further at these
    scales, e.g. a bias of 8e-7 per token under AVX-512 and 1.5e-6 under AVX2; ``tests/scripts/
    real_scale_numerics.py`` prints both.)
    """
    top, first = z.max(-1, keepdim=True)
    z.sub_(top)
    # sum_v exp(z_v - top) = 1 + rest, the 1 being the top's own term: log1p(rest) keeps a near-certain row's
    # 1 - p(top) even where 1 + rest rounds to 1 (rest below 6e-8: a top 17 nats above the runner-up)
    rest = z.exp().scatter_(-1, first, 0.0).sum(-1, keepdim=True)
    log_sum = rest.log1p_()
    z.sub_(log_sum)
    return z, top.squeeze(-1), log_sum.squeeze(-1)


def _cross_entropy_sum(
    z: torch.Tensor, y: torch.Tensor, ignore_index: int, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed cross-entropy of fp32 logits ``z [n, V]`` against ``y [n]``, and ``d loss / d z`` if asked.

    ``loss_t = -log_softmax(z_t)[y_t]`` over valid rows; ``dz = softmax(z) - onehot(y)`` with ``softmax =
    exp(log_softmax)``, zero on ignored rows: the arithmetic of HF's ``F.cross_entropy`` (:func:`log_softmax_`
    says why the order matters). The gradient is built in ``z``'s own memory (``z`` is consumed): one [n, V]
    buffer per tile (and the exponentials' temporary) instead of autograd's log-softmax, its gradient and the
    upcast copy.
    """
    valid = y != ignore_index
    safe = torch.where(valid, y, 0).unsqueeze(1)
    logp = log_softmax_(z)[0]
    target = torch.where(valid.unsqueeze(1), logp.gather(1, safe), 0.0)  # [n, 1]
    loss = -target.sum()
    if not need_grad:
        return loss, None
    dz = logp.exp_().mul_(valid.unsqueeze(1))
    # p_y - 1 as expm1(log p_y): exp(log p_y) - 1 cancels for a near-certain target (1 - p_y below an fp32 ulp of 1)
    dz.scatter_(1, safe, torch.expm1(target))
    return loss, dz


def _linear_backward(
    head: torch.nn.Linear,
    h: torch.Tensor,
    dz: torch.Tensor,
    dx: torch.Tensor | None,
    live: list[torch.Tensor],
    acc: GradAccumulator,
) -> None:
    """``z = h W^T + b`` backward for one tile: ``dx = dz W``, ``dW += dz^T h``, ``db += sum(dz)``."""
    if dx is not None:
        torch.mm(dz, head.weight, out=dx)
    for n, p in enumerate(live):
        if p is head.weight:
            acc.add_matmul(n, dz.t(), h)
        elif p is head.bias:
            acc.add([None] * n + [dz.sum(0)])


@torch.compiler.disable  # tiles loop over data-dependent bounds: eager under torch.compile
def tiled_lm_loss(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    labels: torch.Tensor,
    tiles: int,
    params: Sequence[torch.Tensor] | DeliveredParams = (),
    ignore_index: int = IGNORE_INDEX,
    vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies of ``head(hidden)`` against ``labels``, never forming all logits.

    Args:
        hidden: ``[..., E]`` final hidden states (any leading shape, e.g. ``[B, S, E]``).
        head: the LM head (``[n, E] -> [n, V]``), e.g. the model's ``lm_head`` (frozen or trained).
        labels: ``[...]`` matching ``hidden``'s leading shape, *already shifted* (the target of each
            token), ``ignore_index`` where a token has no target.
        tiles: number of token tiles (capped at the token count).
        params: the head's trainable parameters (they get their gradients through this call, as inputs or
            delivered: :class:`~hf_fpdt.memory.replay.DeliveredParams`).
        vocab: the logits' width (``None``: read from the first tile's logits). Labels must be integer ids in
            ``[0, vocab)`` or ``ignore_index``: else a ``ValueError`` naming the dtype, or the bad value and the
            vocabulary size (checked on the whole tensor with the tiles' one host sync, before any tile runs
            where ``vocab`` is given).

    Returns:
        ``(loss_sum, num_valid)``: float32 0-d sum of token losses (differentiable) and int64 0-d count
        of valid targets. HF's mean is ``loss_sum / num_valid``; with ``num_items_in_batch`` it is
        ``loss_sum / num_items_in_batch``; under sequence parallelism see :func:`hf_fpdt.distributed.sp_loss.sp_loss`.
    """
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels {tuple(labels.shape)} must match the hidden states' leading shape {tuple(hidden.shape[:-1])}"
        )
    check_label_dtype(labels)
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = labels.reshape(-1).to(hidden.device)
    num_valid = (flat_y != ignore_index).sum()
    grads = ParamGrads(params, hidden.device)
    loss_sum = _TiledLMLoss.apply(head, tiles, ignore_index, vocab, grads, flat_h, flat_y, *grads.inputs)
    return loss_sum, num_valid


@torch.no_grad()
@torch.compiler.disable  # tiles loop over data-dependent bounds: eager under torch.compile
def tiled_head_map(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    fn: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
    tiles: int,
    labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fn`` applied to the logits of each token tile, concatenated in token order; all logits never exist.

    For evaluation (e.g. Trainer's ``preprocess_logits_for_metrics``): ``fn(logits [1, n, V], labels
    [1, n] | None) -> [1, n, ...]`` must be token-wise (argmax, top-k, the log-probability of the target)
    and gets fp32 logits. No gradients.

    Args:
        hidden: ``[B, S, E]`` final hidden states.
        head: the LM head ``[n, E] -> [n, V]``.
        fn: the per-token reduction of the logits.
        tiles: number of token tiles over the ``B * S`` tokens (capped at the token count).
        labels: ``[B, S]`` targets passed to ``fn`` tile by tile (already shifted: the target of each token).

    Returns:
        ``[B, S, ...]``: ``fn``'s per-token results.
    """
    batch, seq = hidden.shape[:2]
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = None if labels is None else labels.reshape(-1).to(hidden.device)
    pieces = []
    for a, b in tile_bounds(flat_h.shape[0], tiles):
        z = head(flat_h[a:b]).float().unsqueeze(0)  # [1, n_t, V]: one tile of logits
        out = fn(z, None if flat_y is None else flat_y[a:b].unsqueeze(0))
        if not torch.is_tensor(out) or tuple(out.shape[:2]) != (1, b - a):
            shape = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
            raise ValueError(
                f"the logits function must map logits [1, n, vocab] to a per-token tensor [1, n, ...] (it runs tile "
                f"by tile, so full-sequence logits never exist); for {b - a} tokens it returned {shape}"
            )
        pieces.append(out[0])
        del z, out
    if not pieces:
        return hidden.new_empty(batch, seq)
    return torch.cat(pieces).reshape(batch, seq, *pieces[0].shape[1:])


class _TiledExperts(torch.autograd.Function):
    """``apply(experts, tiles, grads, h [N, E], index [N, k], weights [N, k], *grads.inputs) -> out [N, E]``
    tiled over N (``grads``: a :class:`~hf_fpdt.memory.replay.ParamGrads`).

    The mixture-of-experts step after routing: each token's output depends on its own hidden state,
    expert indices and routing weights only, so tiles of tokens are exact. Forward under ``no_grad``;
    backward rebuilds each tile and differentiates it w.r.t. ``h``, the routing ``weights`` (they carry
    the router's gradient) and the experts' trainable parameters.
    """

    @staticmethod
    def forward(ctx, experts, tiles, grads, h, index, weights, *params):
        bounds = tile_bounds(h.shape[0], tiles)
        out = None
        states = []
        for a, b in bounds:
            states.append(ReplayState.capture(h.device))
            y = experts(h[a:b], index[a:b], weights[a:b])
            if out is None:
                out = y.new_empty(h.shape[0], *y.shape[1:])
            out[a:b] = y
            del y
        ctx.experts, ctx.bounds, ctx.states, ctx.grads = experts, bounds, states, grads
        ctx.save_for_backward(h, index, weights, *params)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        h, index, weights, *params = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[3], ctx.needs_input_grad[5]
        live = ctx.grads.live(params, ctx.needs_input_grad[6:])
        dh = torch.zeros_like(h) if need_h else None
        dw = torch.zeros_like(weights) if need_w else None
        acc = GradAccumulator(live)
        for (a, b), state in zip(ctx.bounds, ctx.states):
            w = weights[a:b].detach().requires_grad_(need_w)
            wrt = ([w] if need_w else []) + live
            fn = functools.partial(_experts_tile, ctx.experts, index[a:b], w)
            dh_t, grads = piece_grads(fn, h[a:b], need_h, wrt, (dout[a:b],), state)
            if need_h and dh_t is not None:
                dh[a:b] = dh_t
            if need_w:
                if grads[0] is not None:
                    dw[a:b] = grads[0]
                grads = grads[1:]
            acc.add(grads)
        ctx.states = ctx.experts = None
        return (None, None, None, dh, None, dw, *ctx.grads.finish(acc.result(), ctx.needs_input_grad[6:]))


def _experts_tile(experts: Callable, index: torch.Tensor, weights: torch.Tensor, h: torch.Tensor) -> tuple:
    return (experts(h, index, weights),)


@torch.compiler.disable  # tiles loop over data-dependent bounds: eager under torch.compile
def tiled_experts(
    experts: Callable,
    h: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    tiles: int,
    params: Sequence[torch.Tensor] | DeliveredParams,
) -> torch.Tensor:
    """``experts(h, index, weights)`` (HF's ``*Experts`` call after the router) over ``tiles`` token tiles.

    Args:
        experts: ``(h [n, E], index [n, k], weights [n, k]) -> [n, E]``.
        h: ``[N, E]`` the tokens' hidden states; ``index``, ``weights``: the router's top-k choice.
        tiles: number of token tiles (capped at N).
        params: the experts' trainable parameters (they get their gradients through this call).
    """
    grads = ParamGrads(params, h.device)
    return _TiledExperts.apply(experts, tiles, grads, h, index, weights, *grads.inputs)


class _TiledTokenLogProbs(torch.autograd.Function):
    """``apply(head, tiles, ignore_index, temperature, pgrads, hidden [N, E], targets [N], *pgrads.inputs)`` ->
    the five per-token fields of :func:`tiled_token_logprobs` (``pgrads``: a
    :class:`~hf_fpdt.memory.replay.ParamGrads`).

    Forward runs tile by tile under ``no_grad`` and keeps ``hidden`` and three floats per token (the log-partition
    in :func:`log_softmax_`'s two parts, and the entropy); backward recomputes each tile's logits, forms ``d/dz`` of
    ``sum_t g_t log p_t(y_t) + e_t H_t`` from the per-token upstream gradients ``g`` and ``e``, and differentiates
    the head with it.
    """

    @staticmethod
    def forward(ctx, head, tiles, ignore_index, temperature, pgrads, hidden, targets, *params):
        ctx.set_materialize_grads(False)  # the entropy is often logged only: no zeros formed for its gradient
        n = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        log_probs, entropy = torch.zeros(n, **f32), torch.zeros(n, **f32)
        log_sum_sq, mean_logits = torch.zeros(n, **f32), torch.zeros(n, **f32)
        is_top1 = torch.zeros(n, dtype=torch.bool, device=hidden.device)
        top, log_sum = torch.zeros(n, **f32), torch.zeros(n, **f32)  # log softmax(z) = (z - top) - log_sum
        bounds = tile_bounds(n, tiles)
        kept = targets != ignore_index
        counts, low, high = _tile_counts(kept, torch.where(kept, targets, 0), bounds)
        skip_empty = pgrads.delivered is None  # delivered (ZeRO-3) heads gather collectively: every tile runs
        inv_t = 1.0 / temperature
        for (a, b), count in zip(bounds, counts):
            if count == 0 and skip_empty:
                continue
            with torch.no_grad():
                z = head(hidden[a:b].detach()).to(torch.float32).mul_(inv_t)  # [n_t, V], our own fp32 buffer
            if low < 0 or high >= z.shape[-1]:  # the logits' width, from the first tile that runs
                raise label_range_error(low if low < 0 else high, z.shape[-1], ignore_index)
            valid = kept[a:b]
            safe = torch.where(valid, targets[a:b], 0)
            mean = z.mean(-1)
            first = z.argmax(-1) == safe  # torch's argmax is the first maximum, as TRL's kernel counts a tie
            zero = torch.zeros((), **f32)
            logp, top[a:b], log_sum[a:b] = log_softmax_(z)  # in place; the order keeps fp32 bits at large logits
            del z
            log_probs[a:b] = torch.where(valid, logp.gather(1, safe.unsqueeze(1)).squeeze(1), zero)
            mean_logits[a:b] = torch.where(valid, mean, zero)
            is_top1[a:b] = first & valid
            # log(sum p^2) = logsumexp(2 log p); H = -sum p log p
            log_sum_sq[a:b] = torch.where(valid, torch.logsumexp(2 * logp, dim=-1), zero)
            entropy[a:b] = torch.where(valid, -(logp.exp() * logp).sum(-1), zero)
            del logp
        ctx.head, ctx.bounds, ctx.counts, ctx.pgrads = head, bounds, counts, pgrads
        ctx.ignore_index, ctx.inv_t = ignore_index, inv_t
        ctx.autocast = _autocast_state(hidden.device.type)
        ctx.save_for_backward(hidden, targets, top, log_sum, entropy, *params)
        ctx.mark_non_differentiable(log_sum_sq, mean_logits, is_top1)
        return log_probs, entropy, log_sum_sq, mean_logits, is_top1

    @staticmethod
    def backward(ctx, g_logp, g_ent, *_):
        hidden, targets, top, log_sum, entropy, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[5]
        live = ctx.pgrads.live(params, ctx.needs_input_grad[7:])
        dx = torch.zeros_like(hidden) if need_x else None
        acc = GradAccumulator(live)
        head, kept = ctx.head, targets != ctx.ignore_index
        skip_empty = ctx.pgrads.delivered is None
        nothing = g_logp is None and g_ent is None
        linear = type(head) is torch.nn.Linear and ctx.pgrads.delivered is None and ctx.autocast is None
        for (a, b), count in zip(ctx.bounds, ctx.counts):
            if (count == 0 or nothing) and skip_empty:
                continue
            h = hidden[a:b].detach().requires_grad_(need_x and not linear)
            with torch.enable_grad() if not linear else torch.no_grad(), _autocast(hidden.device.type, ctx.autocast):
                z = head(h)
            # our own fp32 copy: z stays as the head made it (its graph may have saved it); forward's operations in
            # forward's order, so logp is forward's log-softmax bit for bit
            logp = z.detach().to(torch.float32, copy=True).mul_(ctx.inv_t)
            logp = logp.sub_(top[a:b].unsqueeze(1)).sub_(log_sum[a:b].unsqueeze(1))
            valid = kept[a:b].to(torch.float32)
            p = logp.exp()
            dz = torch.zeros_like(logp)
            if g_ent is not None:  # dH/dz = -p (log p + H)
                dz -= (g_ent[a:b].to(torch.float32) * valid).unsqueeze(1) * p * (logp + entropy[a:b].unsqueeze(1))
            if g_logp is not None:  # d log p_y / dz = onehot_y - p
                g = g_logp[a:b].to(torch.float32) * valid
                safe = torch.where(kept[a:b], targets[a:b], 0).unsqueeze(1)
                # p_y - 1 as expm1(log p_y) (no cancellation for a near-certain target), then dz -= g (p - onehot)
                p.scatter_(1, safe, torch.expm1(logp.gather(1, safe)))
                dz -= g.unsqueeze(1) * p
            del logp, p
            dz = dz.mul_(ctx.inv_t).to(z.dtype)
            if linear:
                _linear_backward(head, h, dz, dx[a:b] if need_x else None, live, acc)
            else:
                grads = torch.autograd.grad(z, ([h] if need_x else []) + live, dz, allow_unused=True)
                if need_x and grads[0] is not None:
                    dx[a:b] = grads[0]
                acc.add(grads[1:] if need_x else grads)
                del grads
            del dz, z, h
        if skip_empty and live and (nothing or not any(ctx.counts)):  # no tile ran: zero gradients, as TRL gives
            acc.add([torch.zeros_like(p) for p in live])
        pgrads = ctx.pgrads.finish(acc.result(), ctx.needs_input_grad[7:])
        ctx.head = ctx.pgrads = None
        return (None, None, None, None, None, dx, None, *pgrads)


def _tile_counts(
    kept: torch.Tensor, targets: torch.Tensor, bounds: list[tuple[int, int]]
) -> tuple[list[int], int, int]:
    """Valid targets per tile, and the smallest and largest target (one host sync)."""
    if not bounds:
        return [], 0, 0
    at = torch.tensor([b - 1 for _, b in bounds], dtype=torch.long, device=kept.device)
    valid = kept.to(torch.int64).cumsum(0)
    *ends, low, high = torch.cat([valid[at], targets.min().view(1), targets.max().view(1)]).tolist()
    return [e - s for e, s in zip(ends, [0, *ends[:-1]])], low, high


def _autocast_state(device_type: str) -> torch.dtype | None:
    """The autocast dtype in effect (None: autocast off): backward recomputes the head under the same."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _autocast(device_type: str, dtype: torch.dtype | None):
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


@torch.compiler.disable  # tiles loop over data-dependent bounds: eager under torch.compile
def tiled_token_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    tiles: int,
    params: Sequence[torch.Tensor] | DeliveredParams = (),
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token statistics of ``softmax(head(hidden) / temperature)`` at ``targets``, never forming all logits.

    TRL's fused LM head fields (``trl.trainer.utils.FusedCausalLMOutput``), with its semantics: logits ``z =
    head(hidden) / temperature`` in fp32 per tile; ``log_probs = log softmax(z)[y]``; ``entropy = -sum p log p``;
    ``log_sum_sq_probs = log sum p^2``; ``mean_logits = mean_v z``; ``is_top1``: ``y`` is the first argmax. Every
    field is 0 (False) where the target is ``ignore_index``. ``log_probs`` and ``entropy`` are differentiable in
    ``hidden`` and the head's parameters (backward recomputes each tile's logits with the per-token upstream
    gradients); the other three are not.

    Args:
        hidden: ``[N, E]`` final hidden states (already shifted against ``targets``).
        head: the LM head ``[n, E] -> [n, V]`` with its logit extras (:func:`hf_fpdt.models.parts.lm_head`).
        targets: ``[N]`` integer token ids in ``[0, V)``, or ``ignore_index``.
        tiles: number of token tiles (capped at N), e.g. :func:`loss_tiles`.
        params: the head's trainable parameters (as inputs, or delivered:
            :class:`~hf_fpdt.memory.replay.DeliveredParams`).
        temperature: the logits are divided by it (TRL's sampling temperature).

    Returns:
        ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each ``[N]`` (fp32; ``is_top1`` bool).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden [N, E] and targets [N] expected, got {tuple(hidden.shape)} and {tuple(targets.shape)}"
        )
    check_label_dtype(targets)
    targets = targets.to(hidden.device)
    grads = ParamGrads(params, hidden.device)
    return _TiledTokenLogProbs.apply(
        head, tiles, ignore_index, float(temperature), grads, hidden, targets, *grads.inputs
    )
