"""Blocks on the installed flash-attn builds (FA2 ``flash_attn``, FA3 ``flash_attn_interface``): the dense and
softcapped calls, and which masked blocks a build takes and how.

A block with a mask or a softcap goes to a flash-attn build where the build's kernel has what the block needs
(:func:`masked_route`): a softcap where the build has a ``softcap`` parameter, a mask where it is a
:class:`~hf_fpdt.attention.block_keep.BlockKeep` cut by its window alone and the build takes a window. A
window-cut block runs as its :class:`~hf_fpdt.attention.block_keep.WindowBand`: the rectangle of query rows and keys
that see anything, with its bottom-right aligned ``window_size`` (:func:`band_forward` / :func:`band_backward`);
the rows outside it see no key (``out = 0``, ``lse = -inf``). Every other masked or softcapped block goes to
``math`` (:mod:`hf_fpdt.attention.math_blocks`), or, without a softcap, to ``cpu_flash`` on the CPU. How each
build's entry points are called is :mod:`hf_fpdt.attention.flash_builds`.
"""

from __future__ import annotations

import torch

from .block_keep import BlockKeep, WindowBand
from .flash_builds import FlashCalls, flash_calls

FLASH = ("flash_attn", "flash_attn3")


def flash(name: str) -> FlashCalls:
    """The installed build of backend ``name``'s calls; an error naming why where it has none."""
    calls = flash_calls(name)
    if isinstance(calls, str):
        raise RuntimeError(f"attention backend {name!r}: {calls}")
    return calls


def flash_attn_forward(q, k, v, causal, scale, softcap=None):
    return flash("flash_attn").forward(q, k, v, causal, scale, softcap or 0.0)


def flash_attn_backward(dout, q, k, v, out, lse, causal, scale, softcap=None):
    return flash("flash_attn").backward(dout, q, k, v, out, lse, causal, scale, softcap or 0.0)


def flash_attn3_forward(q, k, v, causal, scale, softcap=None):
    return flash("flash_attn3").forward(q, k, v, causal, scale, softcap or 0.0)


def flash_attn3_backward(dout, q, k, v, out, lse, causal, scale, softcap=None):
    return flash("flash_attn3").backward(dout, q, k, v, out, lse, causal, scale, softcap or 0.0)


def masked_route(
    name: str, mask: torch.Tensor | BlockKeep | None, softcap: float | None
) -> tuple[str, WindowBand | None]:
    """The backend that runs a block with ``mask`` / ``softcap``, and the window band it runs with: ``name`` where
    its kernel takes them (on a flash-attn build: a softcap if the build has a ``softcap`` parameter, a mask if it is
    a :class:`BlockKeep` cut by its window alone (:meth:`BlockKeep.window_only`) and the build takes a window; a mask
    without a softcap on ``cpu_flash``), else ``math`` (query-row slices, any device)."""
    if name in FLASH:
        calls = flash_calls(name)
        if not isinstance(calls, FlashCalls) or (softcap is not None and not calls.softcap):
            return "math", None
        if mask is None:
            return name, None
        band = mask.window_only() if isinstance(mask, BlockKeep) and calls.window else None
        return (name, band) if band is not None else ("math", None)
    if softcap is None and name == "cpu_flash":
        return name, None
    return "math", None


def band_forward(name, q, k, v, scale, band: WindowBand, softcap):
    """A window-cut block on flash-attn: the band's rectangle ``q[r0:r1]`` against ``k, v[c0:c1]`` with its
    ``window_size``; the rows outside it see no key (``out = 0``, ``lse = -inf``)."""
    calls, sq = flash(name), q.shape[1]
    rows, keys = slice(band.r0, band.r1), slice(band.c0, band.c1)
    if band.r0 == 0 and band.r1 == sq and band.c0 == 0 and band.c1 == k.shape[1]:
        return calls.forward(q, k, v, False, scale, softcap or 0.0, window=band.window_size)
    out = q.new_zeros(q.shape)
    lse = torch.full((q.shape[0], q.shape[2], sq), float("-inf"), dtype=torch.float32, device=q.device)
    if band.r1 > band.r0:
        o, l_ = calls.forward(q[:, rows], k[:, keys], v[:, keys], False, scale, softcap or 0.0, window=band.window_size)
        out[:, rows], lse[:, :, rows] = o, l_
    return out, lse


def band_backward(name, dout, q, k, v, out, lse, scale, band: WindowBand, softcap):
    """:func:`band_forward`'s backward: the rectangle's gradients, zero elsewhere."""
    calls = flash(name)
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
