"""``attn_implementation="fpdt"``: the attention and mask functions registered with transformers.

The attention function receives HF's full local ``q [B, H, S, D]``, ``k, v [B, Hkv, S, D]`` and runs
them through the chunk pipeline of :mod:`hf_fpdt.attention`. Its settings come from the runtime that
``hf_fpdt.apply`` installs on the attention module; without ``apply`` a module gets the defaults plus
the ``FPDT_*`` environment on first use.

Only causal decoder attention is supported. For training the mask function never builds a mask: it
accepts no mask or a right-padded 2D mask (padding after the real tokens, which causal attention keeps
away from every real token). Calls with a KV cache or another mask (``generate()``, left padding) go
to :mod:`hf_fpdt.decode` (inference only): the mask function then returns a 2D key padding mask, or
HF's 4D mask for a static cache.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import fpdt_attention
from ..config import FPDTConfig
from ..decode import cached_attention_forward, generation_mask, serves
from ..layout import is_right_padded
from ..runtime import FPDTRuntime

NAME = "fpdt"


def runtime_of(module: nn.Module) -> FPDTRuntime:
    """The module's runtime (installed by ``apply``), created from config defaults + env on first use."""
    rt = getattr(module, "fpdt_runtime", None)
    if rt is None:
        rt = FPDTRuntime(FPDTConfig())
        module.fpdt_runtime = rt
    return rt


def _check_positions(position_ids: torch.Tensor | None) -> None:
    if position_ids is None or position_ids.shape[-1] < 2:
        return
    if not bool((position_ids[..., 1:] > position_ids[..., :-1]).all()):
        raise ValueError(
            "fpdt attention computes one causal sequence per batch row, but position_ids are not increasing "
            "(packed sequences or left padding); pass one sample per row, right-padded, with labels -100 on padding"
        )


def check_call(module: nn.Module, attention_mask, dropout: float, position_ids: torch.Tensor | None) -> None:
    """The checks every fpdt attention call makes (registered function and ``apply``'s patched module)."""
    if attention_mask is not None:
        raise ValueError(
            "fpdt attention got an explicit attention mask; it supports causal attention with no mask or "
            "right padding only (use padding_side='right' and labels -100 on padding)"
        )
    if dropout:
        raise ValueError(
            f"fpdt attention does not implement attention dropout (got {dropout}); set attention_dropout=0"
        )
    if getattr(module, "layer_idx", 0) in (0, None):  # every layer sees the same positions: one host sync
        _check_positions(position_ids)


def fpdt_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention interface: ``q [B, H, S, D]`` -> ``(out [B, S, H, D], None)``."""
    runtime = runtime_of(module)
    cached = bool(kwargs.pop("fpdt_cached", False))  # set by apply's attention patch when it holds a cache
    if serves(query, key, value, attention_mask, runtime, cached):  # a KV cache, a mask, or no gradient needed
        if attention_mask is None and query.shape[2] == key.shape[2] and not cached:
            check_call(module, None, dropout, kwargs.get("position_ids"))
        else:  # generate's position ids under left padding repeat 0 over the padding: not a packing
            check_call(module, None, dropout, None)
        _check_module(module, kwargs)
        return cached_attention_forward(query, key, value, attention_mask, runtime, scaling), None
    check_call(module, attention_mask, dropout, kwargs.get("position_ids"))
    _check_module(module, kwargs)
    out = fpdt_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), runtime, scaling)
    return out, None


def _check_module(module: nn.Module, kwargs: dict) -> None:
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError("fpdt attention supports causal (decoder) self-attention only; this module is not causal")
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"fpdt attention does not support {unsupported}; use sdpa for this model")


def fpdt_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """HF mask interface. Training (no cache, no padding or right padding): no mask is needed (causal
    structure is built into the chunk loop). A cache or left padding: :func:`hf_fpdt.decode.generation_mask`."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("fpdt attention accepts a 2D padding mask (batch, length) only")
    cached = kv_offset != 0 or kv_length != q_length or int(q_offset) != 0
    if not cached and (attention_mask is None or is_right_padded(attention_mask.bool())):
        return None  # right padding includes no padding at all
    if mask_function is not None:
        kwargs["mask_function"] = mask_function
    return generation_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, **kwargs)


def register() -> None:
    """Register ``"fpdt"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, fpdt_attention_forward)
    AttentionMaskInterface.register(NAME, fpdt_mask)
