"""What a block kernel is: the :class:`Kernel` record every kernel module fills, and the device facts the registry
(:mod:`hf_fpdt.attention.kernels`) and the router (:mod:`hf_fpdt.attention.routes`) decide from.

A kernel runs one (query chunk, key/value chunk) block in the sequence-major layout of the chunk pipeline::

    q    [B, Sq, Hq, D]      k, v [B, Sk, Hkv, D]      (Hq a multiple of Hkv: MHA, GQA, MQA)
    out  [B, Sq, Hq, D]      lse  [B, Hq, Sq]  (float32; float64 for float64 inputs)

``forward(q, k, v, causal, scale)`` -> ``(out, lse)``; ``backward(dout, q, k, v, out, lse, causal, scale)`` ->
``(dq, dk, dv)`` given the rows' *final* ``out``/``lse`` (the exact-contribution identity: module doc of
:mod:`hf_fpdt.attention.routes`). A kernel that takes masked blocks (a bool ``[Sq, Sk]`` / ``[B, Sq, Sk]`` keep or a
:class:`~hf_fpdt.attention.block_keep.BlockKeep`) has ``masked_forward(q, k, v, causal, scale, mask, softcap,
scores_bytes)`` and its backward; ``math`` takes a softcap too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class DeviceCapability:
    """What backend selection needs to know about a device.

    ``compute_capability``: CUDA (major, minor), ``None`` elsewhere; ``cudnn_version``: e.g. 90100,
    ``None`` without cuDNN; ``torch_cudnn_attention``: torch has the cuDNN attention ops;
    ``flash_attn`` / ``flash_attn3``: the FA2 / FA3 packages import and hf_fpdt can fill their entry points'
    parameters (:func:`hf_fpdt.attention.flash_builds.flash_calls`).
    """

    device_type: str
    compute_capability: tuple[int, int] | None = None
    cudnn_version: int | None = None
    torch_cudnn_attention: bool = False
    flash_attn: bool = False
    flash_attn3: bool = False


Problem = Callable[[DeviceCapability, torch.dtype, "int | None"], "str | None"]


@dataclass(frozen=True)
class Kernel:
    """One block kernel of the registry.

    Attributes:
        name: its backend name (one of :data:`hf_fpdt.config.BACKENDS`).
        takes: in words, the blocks it takes (the kernel table of the docs is made from it).
        problem: ``(capability, dtype, head_dim) -> why it cannot run them | None``.
        forward, backward: the dense (or causal) block, as the module doc says.
        probed: chosen on a real device only after a probe block runs right (the fused CUDA kernels).
        masked_forward, masked_backward: masked blocks (no softcap unless ``softcap``), or ``None``: it takes none.
        softcap: its masked entry points take a softcap too (``math``).
        masked_probed: its masked blocks are taken only after a masked probe passes (``cudnn``'s bias).
    """

    name: str
    takes: str
    problem: Problem
    forward: Callable
    backward: Callable
    probed: bool = False
    masked_forward: Callable | None = None
    masked_backward: Callable | None = None
    softcap: bool = False
    masked_probed: bool = False


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    """The log-sum-exp's (and fp32 accumulators') dtype for blocks of ``q``: float64 for float64, else float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def checked_lse(lse: torch.Tensor, q: torch.Tensor, name: str) -> torch.Tensor:
    """``lse`` as every backend returns it: ``[B, H, Sq]`` in :func:`lse_dtype` (natural log: the probe checks the
    base once); anything else is a kernel build hf_fpdt does not know, refused before it is merged."""
    want, dtype = (q.shape[0], q.shape[2], q.shape[1]), lse_dtype(q)
    if lse.dtype != dtype or tuple(lse.shape) != want:
        raise RuntimeError(f"{name}: log-sum-exp {lse.dtype} {tuple(lse.shape)}, expected {dtype} {want}")
    return lse


def any_device(capability: DeviceCapability, dtype: torch.dtype, head_dim: int | None) -> str | None:
    """The ``problem`` of a kernel that runs anywhere (``math``)."""
    return None


def cuda_half_problem(
    capability: DeviceCapability, dtype: torch.dtype, head_dim: int | None, need_cc: tuple[int, int], max_dim: int
) -> str | None:
    """Why a fused CUDA kernel needing compute capability ``need_cc``, half precision and a head dim that is a
    multiple of 8 up to ``max_dim`` cannot run; ``None`` if it can."""
    if capability.device_type != "cuda":
        return f"needs a CUDA device (found {capability.device_type})"
    cc = capability.compute_capability or (0, 0)
    if cc < need_cc:
        return f"needs CUDA compute capability >= {need_cc[0]}.{need_cc[1]} (found {cc[0]}.{cc[1]})"
    if dtype not in HALF:
        return f"needs float16 or bfloat16 tensors (found {dtype}); the math backend runs float32/float64"
    if head_dim is not None and (head_dim % 8 != 0 or head_dim > max_dim):
        return f"needs a head dim that is a multiple of 8 and at most {max_dim} (found {head_dim})"
    return None


PROBE_TOLERANCE = 0.05  # relative error of a half-precision probe block against the fp32 math path


def probe_mismatch(what: str, got: tuple, ref: tuple) -> str | None:
    """Why a probe block's ``got = (out, lse, dq, dk, dv)`` is not ``ref`` (math in float32), or ``None``: the lse's
    dtype, shape, ``-inf`` rows and values (naming a base-2 lse), then each tensor's relative error (NaN fails)."""
    lse, ref_lse = got[1], ref[1]
    dtype = lse_dtype(got[0])  # what the block's inputs ask for (the reference runs in float32)
    if lse.dtype != dtype or tuple(lse.shape) != tuple(ref_lse.shape):
        want = f"{dtype} {tuple(ref_lse.shape)}"
        return f"its {what}log-sum-exp is {lse.dtype} {tuple(lse.shape)}, expected {want}"
    if not torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)):
        return f"its {what}log-sum-exp is -inf on other rows than math's"
    finite = torch.isfinite(ref_lse)
    lse_err = float((lse - ref_lse)[finite].abs().max()) if finite.any() else 0.0  # NaN fails below
    if not lse_err <= PROBE_TOLERANCE:
        base2 = float((lse - ref_lse * 1.4426950408889634)[finite].abs().max()) < PROBE_TOLERANCE
        return f"its {what}log-sum-exp is off by {lse_err:.3g}" + (" (base 2, not e)" if base2 else "")
    for name, g, r in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), (ref[0], *ref[2:])):
        err = float((g.float() - r.float()).abs().max() / r.float().abs().max().clamp(min=1e-30))
        if not err <= PROBE_TOLERANCE:  # NaN included
            return f"its {what}{name} is off by {err:.3g} (relative)"
    return None
