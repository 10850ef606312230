"""The block kernels' registry: every kernel hf_fpdt runs a (query chunk, key/value chunk) block on, in order of
preference, and the device facts and probes that say which of them can run here.

Each kernel is a :class:`~hf_fpdt.attention.block_kernel.Kernel` in its own module (what it takes, its forward,
backward, masked entry points and problem): ``cudnn`` (:mod:`~hf_fpdt.attention.cudnn_blocks`, with its additive-bias
masked blocks), ``flash_attn3`` and ``flash_attn`` (:mod:`~hf_fpdt.attention.flash_blocks`: window bands and varlen
documents; entry points as :mod:`~hf_fpdt.attention.flash_builds` reads them), ``torch_flash``
(:mod:`~hf_fpdt.attention.torch_flash_blocks`), ``cpu_flash`` (:mod:`~hf_fpdt.attention.cpu_flash_blocks`) and
``math`` (:mod:`~hf_fpdt.attention.math_blocks`, any block on any device, the float64 reference). Which kernel runs a
given block is decided in one place, the router (:mod:`hf_fpdt.attention.routes`), resolved once per device, dtype
and head dim; the docs' kernel table is :func:`kernel_table` of this registry.

Capabilities come from :func:`probe_device` (a :class:`~hf_fpdt.attention.block_kernel.DeviceCapability`); the
selection takes one as an argument, so the choice is testable without the hardware. On the real device a fused CUDA
kernel is chosen only once a tiny probe block (:func:`probe_backend`: forward and backward against ``math``) runs
right. Which one runs is chosen here too, by capability in the order of preference (:func:`select_backend`) or by
name (:func:`resolve_backend`); the router (:mod:`hf_fpdt.attention.routes`) adds the masked blocks' routes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..config import BACKENDS
from ..memory.compat_torch import SDPA_OPS
from .block_kernel import PROBE_TOLERANCE, DeviceCapability, Kernel, probe_mismatch
from .cpu_flash_blocks import CPU_FLASH
from .cudnn_blocks import CUDNN
from .flash_blocks import FLASH_ATTN, FLASH_ATTN3
from .flash_builds import FlashCalls, flash_calls
from .math_blocks import MATH
from .precision import no_autocast
from .torch_flash_blocks import TORCH_FLASH

__all__ = ["KERNELS", "PREFERENCE", "PROBE_TOLERANCE", "DeviceCapability", "Kernel", "backend_problem"]

_log = logging.getLogger("hf_fpdt")

KERNELS: dict[str, Kernel] = {k.name: k for k in (CUDNN, FLASH_ATTN3, FLASH_ATTN, TORCH_FLASH, CPU_FLASH, MATH)}
PREFERENCE = {  # device type -> kernels in order of preference (the first that can run wins)
    "cuda": ("cudnn", "flash_attn3", "flash_attn", "torch_flash", "math"),
    "cpu": ("cpu_flash", "math"),
}


def kernel(name: str) -> Kernel:
    """The registry's kernel ``name``; ``ValueError`` naming the choices for another name."""
    found = KERNELS.get(name)
    if found is None:
        raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
    return found


def probe_device(device: torch.device) -> DeviceCapability:
    """The :class:`DeviceCapability` of ``device`` (no kernel runs; a few driver queries on CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceCapability(device.type)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return DeviceCapability(
        "cuda",
        compute_capability=tuple(torch.cuda.get_device_capability(device)),
        cudnn_version=cudnn,
        torch_cudnn_attention=SDPA_OPS.cudnn_backward is not None,
        flash_attn=isinstance(flash_calls("flash_attn"), FlashCalls),  # imports, and its parameters are known
        flash_attn3=isinstance(flash_calls("flash_attn3"), FlashCalls),
    )


def backend_problem(
    name: str, capability: DeviceCapability, dtype: torch.dtype, head_dim: int | None = None
) -> str | None:
    """Why backend ``name`` cannot run blocks of ``dtype`` / ``head_dim`` on that device; ``None`` if it can."""
    if name not in KERNELS:
        return f"unknown attention backend {name!r}; choose from {BACKENDS}"
    return KERNELS[name].problem(capability, dtype, head_dim)


def probe_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> str | None:
    """Why kernel ``name`` fails a tiny block on ``device`` (forward and backward, GQA 2:1, causal, against the
    float32 ``math`` path), or ``None`` where it computes it right: a build that imports but raises (a flash-attn
    wheel built for another torch), or returns another LSE (layout, dtype, base) fails here, not at the first real
    block."""
    device, d = torch.device(device), head_dim or 64
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 48, 2, d, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, 48, 1, d, generator=g).to(device, dtype) for _ in range(2))
    scale, tested, reference = d**-0.5, kernel(name), KERNELS["math"]
    with no_autocast(device.type):
        try:
            out, lse = tested.forward(q, k, v, True, scale)
            grads = tested.backward(dout, q, k, v, out, lse, True, scale)
        except Exception as err:  # any failure of an installed kernel means: not this one
            return f"its probe block raised {type(err).__name__}: {str(err)[:160]}"
        f = [t.float() for t in (dout, q, k, v)]
        ref_out, ref_lse = reference.forward(*f[1:], True, scale)
        ref_grads = reference.backward(*f, ref_out, ref_lse, True, scale)
    return probe_mismatch("probe block's ", (out, lse, *grads), (ref_out, ref_lse, *ref_grads))


Probe = Callable[[str], "str | None"]


def prober(device: torch.device, dtype: torch.dtype, head_dim: int | None) -> Probe:
    """:func:`probe_backend` on ``device`` for blocks of ``dtype`` / ``head_dim``, as a function of the name."""
    return lambda name: probe_backend(name, device, dtype, head_dim)


def _problem(
    name: str, capability: DeviceCapability, dtype: torch.dtype, head_dim: int | None, probe: Probe | None
) -> str | None:
    """Why ``name`` cannot run these blocks: :func:`backend_problem`, then (a fused kernel) its probe's failure."""
    problem = backend_problem(name, capability, dtype, head_dim)
    if problem is None and probe is not None and KERNELS[name].probed:
        failure = probe(name)
        problem = None if failure is None else f"probe failed: {failure}"
    return problem


def select_backend(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    capability: DeviceCapability | None = None,
    probe: Probe | None = None,
) -> str:
    """The fastest exact backend for blocks of ``dtype`` (and ``head_dim``) on ``device``: the first in order of
    preference that can run (:func:`~hf_fpdt.attention.kernels.backend_problem`) and, for the fused CUDA kernels,
    passes ``probe`` (default: :func:`~hf_fpdt.attention.kernels.probe_backend` on ``device`` when ``capability`` is
    probed here; none for a given ``capability``, which may describe another device). One line on the ``hf_fpdt``
    logger names a fused kernel chosen, or any choice after a failed probe, and what was passed over (INFO; WARNING
    after a failed probe)."""
    if capability is None:
        capability = probe_device(device)
        probe = probe or prober(device, dtype, head_dim)
    passed_over = []
    for name in PREFERENCE.get(capability.device_type, ("math",)):
        problem = _problem(name, capability, dtype, head_dim, probe)
        if problem is None:
            failed = any("probe failed" in p for p in passed_over)
            if not KERNELS[name].probed and not failed:
                return name  # CPU's op, or math with nothing probed: no choice worth a line
            _log.log(
                logging.WARNING if failed else logging.INFO,
                "attention backend %r for %s blocks (head dim %s) on %s%s",
                name,
                dtype,
                head_dim,
                torch.device(device),
                f"; passed over: {'; '.join(passed_over)}" if passed_over else "",
            )
            return name
        passed_over.append(f"{name} ({problem})")
    return "math"


def resolve_backend(
    requested: str | None,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    capability: DeviceCapability | None = None,
    probe: Probe | None = None,
) -> str:
    """``requested`` (a name, or ``None`` / ``"auto"`` to select) checked against the device (and, for a fused
    CUDA kernel, its probe block: see :func:`select_backend` for ``capability`` and ``probe``).

    Raises ``ValueError`` naming why a requested backend cannot run and which ones can.
    """
    if capability is None:
        capability = probe_device(device)
        probe = probe or prober(device, dtype, head_dim)
    if requested in (None, "auto"):
        return select_backend(device, dtype, head_dim, capability, probe)
    problem = _problem(requested, capability, dtype, head_dim, probe)
    if problem is not None:
        usable = [n for n in BACKENDS if backend_problem(n, capability, dtype, head_dim) is None]
        raise ValueError(
            f"attention backend {requested!r} cannot run {dtype} blocks (head dim {head_dim}) on "
            f"{torch.device(device)}: {problem}. Set FPDTConfig.backend / FPDT_BACKEND to 'auto' or one of "
            f"{', '.join(usable)}"
        )
    return requested


def kernel_table() -> str:
    """The registry as a markdown table (name, what it takes, probed before use), in order of preference."""
    rows = ["| kernel | takes | probed before use |", "|---|---|---|"]
    for k in KERNELS.values():
        probed = "yes (masked blocks: a masked probe too)" if k.masked_probed else "yes" if k.probed else "no"
        rows.append(f"| `{k.name}` | {k.takes} | {probed} |")
    return "\n".join(rows)
