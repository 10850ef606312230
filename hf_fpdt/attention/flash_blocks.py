"""Blocks on the installed flash-attn builds (FA2 ``flash_attn``, FA3 ``flash_attn_interface``): the dense and
softcapped calls, and which masked blocks a build takes and how.

A block with a mask or a softcap goes to a flash-attn build where the build's kernel has what the block needs
(:func:`flash_plan`, which the router of :mod:`hf_fpdt.attention.routes` asks): a softcap where the build has a
``softcap`` parameter, and a mask where it is a :class:`~hf_fpdt.attention.block_keep.BlockKeep`

- cut by its window alone and the build takes a window: the block runs as its
  :class:`~hf_fpdt.attention.block_keep.WindowBand`, the rectangle of query rows and keys that see anything with its
  bottom-right aligned ``window_size`` (:func:`band_forward` / :func:`band_backward`);
- cut by document boundaries (packed sequences, with or without a window) and the build has varlen entry points
  (FA2 ``flash_attn_varlen_func`` / ``_flash_attn_varlen_backward``, FA3's ``_flash_attn_forward`` /
  ``_flash_attn_backward`` with ``cu_seqlens_*``) that take what the block needs: the block runs as its
  :class:`~hf_fpdt.attention.block_keep.DocSegments`, one varlen sequence per (batch row, document) present on both
  sides, packed into one call per distinct ``window_size`` (:func:`documents_forward` / :func:`documents_backward`;
  the diagonal block is one causal call, an off-diagonal block one non-causal call, with a window at most one call
  per batch row more). The packing is a view where the sequences cover the block's rows (the diagonal block without a
  window), an ``index_select`` of their rows (O(chunk)) otherwise; the log-sum-exp comes back ``[H, total_q]``
  (:meth:`~hf_fpdt.attention.flash_builds.FlashCalls.varlen_forward`) and is scattered into ``[B, H, Sq]``.

Rows outside every rectangle / sequence see no key in the block (``out = 0``, ``lse = -inf``, zero gradients).
Every other masked or softcapped block goes to ``math`` (:mod:`hf_fpdt.attention.math_blocks`), or, without a
softcap, to ``cpu_flash`` on the CPU, and to ``cudnn`` with an additive bias where the runtime found its op takes one
(:mod:`hf_fpdt.attention.cudnn_blocks`).

The build a call's masked blocks run on: the call's backend where that is a flash-attn build; where it is ``cudnn``
or ``torch_flash`` (no masks, no softcap), a flash-attn build the router chose for masked blocks (``flash``:
:attr:`hf_fpdt.attention.routes.Router.flash`, probed once), so window-cut, document-cut and
softcapped blocks do not fall to ``math``. How each build's entry points are called is
:mod:`hf_fpdt.attention.flash_builds`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..memory.host_pool import device_ints
from .block_keep import BlockKeep, DocSegment, DocSegments, WindowBand
from .block_kernel import DeviceCapability, Kernel, cuda_half_problem, lse_dtype
from .flash_builds import FlashCalls, VarlenBatch, flash_calls

FLASH = ("flash_attn", "flash_attn3")
SECOND = ("cudnn", "torch_flash")  # backends without masks or softcap: their masked blocks may go to a flash build


def flash(name: str, calls: FlashCalls | None = None) -> FlashCalls:
    """``calls`` where it is backend ``name``'s build (the runtime's, resolved once), else the installed build of
    ``name`` read now; an error naming why where it has none."""
    if calls is not None and calls.backend == name:
        return calls
    found = flash_calls(name)
    if isinstance(found, str):
        raise RuntimeError(f"attention backend {name!r}: {found}")
    return found


def flash_problem(name: str) -> Callable[[DeviceCapability, torch.dtype, int | None], str | None]:
    """The ``problem`` of flash-attn build ``name``: FA2 on compute capability >= 8.0, FA3 on 9.x (Hopper), fp16/bf16,
    head dim a multiple of 8 up to 256, and the package installed with entry points hf_fpdt can fill."""

    def problem(capability: DeviceCapability, dtype: torch.dtype, head_dim: int | None) -> str | None:
        cc = capability.compute_capability or (0, 0)
        if name == "flash_attn3" and capability.device_type == "cuda" and cc[0] != 9:
            return f"needs CUDA compute capability 9.x (Hopper) (found {cc[0]}.{cc[1]})"
        found = cuda_half_problem(capability, dtype, head_dim, (9, 0) if name == "flash_attn3" else (8, 0), 256)
        if found is not None:
            return found
        if name == "flash_attn" and not capability.flash_attn:
            return "the flash-attn package is not installed or does not import (pip install 'hf_fpdt[flash]')"
        if name == "flash_attn3" and not capability.flash_attn3:
            return (
                "FlashAttention-3 (flash_attn_interface, flash-attention's hopper/ build) is not installed or does "
                "not import"
            )
        return None

    return problem


def _flash_kernel(name: str, takes: str) -> Kernel:
    """The registry's record of build ``name``: its dense blocks through the installed build, read at the call (the
    router passes the build it resolved once: :class:`~hf_fpdt.attention.routes.Router`)."""

    def forward(q, k, v, causal, scale):
        return flash(name).forward(q, k, v, causal, scale)

    def backward(dout, q, k, v, out, lse, causal, scale):
        return flash(name).backward(dout, q, k, v, out, lse, causal, scale)

    return Kernel(name=name, takes=takes, problem=flash_problem(name), forward=forward, backward=backward, probed=True)


FLASH_ATTN3 = _flash_kernel(
    "flash_attn3",
    "CUDA 9.x, fp16/bf16, head dim a multiple of 8 up to 256; dense, causal and softcapped blocks, window-cut blocks "
    "as a band, document-cut blocks through its varlen calls",
)
FLASH_ATTN = _flash_kernel(
    "flash_attn",
    "CUDA >= 8.0, fp16/bf16, head dim a multiple of 8 up to 256; dense and causal blocks, softcaps (>= 2.6), "
    "window-cut blocks as a band (>= 2.3), document-cut blocks through its varlen calls",
)


def flash_plan(calls: FlashCalls, mask, softcap) -> WindowBand | DocSegments | None | bool:
    """How build ``calls`` runs a block with ``mask`` / ``softcap`` (module doc): ``None`` (a plain call: no mask), a
    band, the documents' segments, or ``False`` (it cannot)."""
    if softcap is not None and not calls.softcap:
        return False
    if mask is None:
        return None
    if not isinstance(mask, BlockKeep):
        return False
    band = mask.window_only() if calls.window else None
    if band is not None:
        return band
    varlen = calls.varlen
    if varlen is None or (softcap is not None and not varlen.softcap):
        return False
    if mask.window is not None and not varlen.window:
        return False
    segments = mask.documents()
    return False if segments is None else segments


def band_forward(calls: FlashCalls, q, k, v, scale, band: WindowBand, softcap):
    """A window-cut block on flash-attn: the band's rectangle ``q[r0:r1]`` against ``k, v[c0:c1]`` with its
    ``window_size``; the rows outside it see no key (``out = 0``, ``lse = -inf``)."""
    sq = q.shape[1]
    rows, keys = slice(band.r0, band.r1), slice(band.c0, band.c1)
    if band.r0 == 0 and band.r1 == sq and band.c0 == 0 and band.c1 == k.shape[1]:
        return calls.forward(q, k, v, False, scale, softcap or 0.0, window=band.window_size)
    out = q.new_zeros(q.shape)
    lse = torch.full((q.shape[0], q.shape[2], sq), float("-inf"), dtype=lse_dtype(q), device=q.device)
    if band.r1 > band.r0:
        o, l_ = calls.forward(q[:, rows], k[:, keys], v[:, keys], False, scale, softcap or 0.0, window=band.window_size)
        out[:, rows], lse[:, :, rows] = o, l_
    return out, lse


def band_backward(calls: FlashCalls, dout, q, k, v, out, lse, scale, band: WindowBand, softcap):
    """:func:`band_forward`'s backward: the rectangle's gradients, zero elsewhere."""
    rows, keys = slice(band.r0, band.r1), slice(band.c0, band.c1)
    if band.r0 == 0 and band.r1 == q.shape[1] and band.c0 == 0 and band.c1 == k.shape[1]:
        return calls.backward(dout, q, k, v, out, lse, False, scale, softcap or 0.0, window=band.window_size)
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    if band.r1 > band.r0:
        dq[:, rows], dk[:, keys], dv[:, keys] = calls.backward(
            dout[:, rows],
            q[:, rows],
            k[:, keys],
            v[:, keys],
            out[:, rows],
            lse[:, :, rows],
            False,
            scale,
            softcap or 0.0,
            window=band.window_size,
        )
    return dq, dk, dv


def _groups(segments: DocSegments) -> dict[tuple[int, int], list[DocSegment]]:
    """The segments by their ``window_size``: one varlen call each (flash-attn takes one window per call)."""
    groups: dict[tuple[int, int], list[DocSegment]] = {}
    for seg in segments.segments:
        groups.setdefault(seg.window, []).append(seg)
    return groups


def _pack(segs: list[DocSegment], sq: int, sk: int, rows: int, device: torch.device):
    """``(query rows, key rows, VarlenBatch)``: the flat ``[B * S]`` row indices of the sequences' tokens in order
    (``None`` where they are every row in order: the packing is a view), and their lengths as ``cu_seqlens``. Every
    integer the device needs goes in one non-blocking copy (:func:`~hf_fpdt.memory.host_pool.device_ints`): no
    host synchronisation per block."""
    lq = [s.r1 - s.r0 for s in segs]
    lk = [s.c1 - s.c0 for s in segs]
    cu_q, cu_k = [0], [0]
    for a, b in zip(lq, lk):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    starts_q = [s.row * sq + s.r0 for s in segs]
    starts_k = [s.row * sk + s.c0 for s in segs]
    gather_q = not (cu_q[-1] == rows * sq and starts_q == cu_q[:-1])  # else the packing is a view
    gather_k = not (cu_k[-1] == rows * sk and starts_k == cu_k[:-1])
    shift_q = [s - c for s, c in zip(starts_q, cu_q[:-1])] if gather_q else []
    shift_k = [s - c for s, c in zip(starts_k, cu_k[:-1])] if gather_k else []
    cu_qd, cu_kd, shift_qd, n_qd, shift_kd, n_kd = device_ints(
        [cu_q, cu_k, shift_q, lq if gather_q else [], shift_k, lk if gather_k else []], device
    )
    seqs = VarlenBatch(cu_qd.to(torch.int32), cu_kd.to(torch.int32), max(lq), max(lk), tuple(lq))
    qi = _rows(shift_qd, n_qd, cu_q[-1], device) if gather_q else None
    ki = _rows(shift_kd, n_kd, cu_k[-1], device) if gather_k else None
    return qi, ki, seqs


def _rows(shift: torch.Tensor, lengths: torch.Tensor, total: int, device) -> torch.Tensor:
    """Flat row indices of the runs ``[start, start + length)`` in order (vectorised, on the device): run ``i``'s
    tokens sit at ``cu[i] + t`` in the packing and at ``start_i + t = cu[i] + t + shift_i`` in the block."""
    return torch.arange(total, device=device) + torch.repeat_interleave(shift, lengths, output_size=total)


def _take(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """``x [B, S, H, D]``'s rows ``idx`` of its flat ``[B * S, H, D]`` (a view where ``idx`` is None)."""
    flat = x.reshape(-1, *x.shape[2:])
    return flat if idx is None else flat.index_select(0, idx)


def documents_forward(calls: FlashCalls, q, k, v, scale, segments: DocSegments, softcap):
    """A document-cut block on a build's varlen calls: ``(out [B, Sq, H, D], lse [B, H, Sq])``; rows in no segment
    ``out = 0``, ``lse = -inf``."""
    b, sq, h, d = q.shape
    out = q.new_zeros(b * sq, h, d)
    lse = torch.full((h, b * sq), float("-inf"), dtype=lse_dtype(q), device=q.device)
    for window, segs in _groups(segments).items():
        qi, ki, seqs = _pack(segs, sq, k.shape[1], b, q.device)
        o, l_ = calls.varlen.varlen_forward(
            _take(q, qi), _take(k, ki), _take(v, ki), seqs, segments.causal, scale, softcap or 0.0, window
        )
        if qi is None:
            out, lse = o, l_
        else:
            out.index_copy_(0, qi, o)
            lse.index_copy_(1, qi, l_)
    return out.reshape(b, sq, h, d), lse.reshape(h, b, sq).transpose(0, 1).contiguous()


def documents_backward(calls: FlashCalls, dout, q, k, v, out, lse, scale, segments: DocSegments, softcap):
    """:func:`documents_forward`'s backward from the final ``out, lse``: each segment's gradients, zero elsewhere."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    dq, dk, dv = q.new_zeros(b * sq, h, d), k.new_zeros(b * sk, *k.shape[2:]), v.new_zeros(b * sk, *v.shape[2:])
    lse_flat = lse.transpose(0, 1).reshape(h, b * sq)  # [H, B * Sq]: the varlen layout's rows
    for window, segs in _groups(segments).items():
        qi, ki, seqs = _pack(segs, sq, sk, b, q.device)
        g = calls.varlen.varlen_backward(
            _take(dout, qi), _take(q, qi), _take(k, ki), _take(v, ki), _take(out, qi),
            lse_flat if qi is None else lse_flat.index_select(1, qi), seqs, segments.causal, scale, softcap or 0.0,
            window,
        )  # fmt: skip
        if qi is None:
            dq = g[0]
        else:
            dq.index_copy_(0, qi, g[0])
        if ki is None:
            dk, dv = g[1], g[2]
        else:
            dk.index_copy_(0, ki, g[1])
            dv.index_copy_(0, ki, g[2])
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
