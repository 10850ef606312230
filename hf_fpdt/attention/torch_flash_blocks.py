"""The ``torch_flash`` block kernel: torch's own CUDA flash ops (``aten._scaled_dot_product_flash_attention`` and its
``_backward``); compute capability >= 8.0, fp16/bf16, K/V heads expanded per block for GQA. No masks, no softcap:
its masked blocks go to the flash-attn build the router found beside it, or to ``math``.
"""

from __future__ import annotations

import torch

from ..distributed.all_to_all import repeat_heads, sum_repeated_heads
from ..memory.compat_torch import SDPA_OPS
from .block_kernel import DeviceCapability, Kernel, checked_lse, cuda_half_problem


def torch_flash_forward(q, k, v, causal, scale):
    groups = q.shape[2] // k.shape[2]
    res = SDPA_OPS.flash(
        q.transpose(1, 2),
        repeat_heads(k, groups).transpose(1, 2),
        repeat_heads(v, groups).transpose(1, 2),
        0.0,
        causal,
        False,
        scale=scale,
    )
    return res[0].transpose(1, 2), checked_lse(res[1], q, "torch_flash")


def torch_flash_backward(dout, q, k, v, out, lse, causal, scale):
    groups = q.shape[2] // k.shape[2]
    ke, ve = repeat_heads(k, groups), repeat_heads(v, groups)
    empty = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv = SDPA_OPS.flash_backward(
        dout.transpose(1, 2),
        q.transpose(1, 2),
        ke.transpose(1, 2),
        ve.transpose(1, 2),
        out.transpose(1, 2),
        lse.contiguous(),
        None,
        None,
        q.shape[1],
        k.shape[1],
        0.0,
        causal,
        empty,
        empty,
        scale=scale,
    )
    dk, dv = (sum_repeated_heads(g.transpose(1, 2), groups) for g in (dk, dv))
    return dq.transpose(1, 2), dk, dv


def torch_flash_problem(capability: DeviceCapability, dtype: torch.dtype, head_dim: int | None) -> str | None:
    return cuda_half_problem(capability, dtype, head_dim, (8, 0), 256)


TORCH_FLASH = Kernel(
    name="torch_flash",
    takes="CUDA >= 8.0, fp16/bf16, head dim a multiple of 8 up to 256; dense and causal blocks only",
    problem=torch_flash_problem,
    forward=torch_flash_forward,
    backward=torch_flash_backward,
    probed=True,
)
