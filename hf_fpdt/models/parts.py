"""The generic chunked parts a :class:`~hf_fpdt.models.registry.Family` drives.

* :func:`project`: one hidden chunk -> rotated ``q``, ``k`` and ``v`` in the sequence-major layout the
  chunk pipeline uses, for every q/k/v layout and q/k norm of the registry::

      h        [B, l, E]
      q        [B, l, H, D]     k, v  [B, l, Hkv, D]
      cos/sin  [B | 1, l, R]    R <= D (partial rotary: the family's own ``apply_rotary_pos_emb``)

  It calls the module's own submodules (so PEFT LoRA wrappers run) and the RoPE function of the
  module's own modeling file, so the arithmetic is HF's, op for op.
* :func:`proj_modules`: the submodules whose parameters :func:`project` uses (they get gradients).
* :func:`lm_head`: the LM head with the family's logit extras, as the tiled loss calls it per tile.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch import nn

from .registry import Family


def head_dim(module: nn.Module) -> int:
    return getattr(module, "head_dim", None) or module.head_size


def heads(module: nn.Module, family: Family | None = None) -> tuple[int, int]:
    """``(query heads, key/value heads)`` of an attention module, from its config (multi-head latent attention:
    ``kv_b_proj`` expands the latent into one key and value per query head)."""
    cfg = module.config
    if family is not None and family.qkv == "mla":
        return cfg.num_attention_heads, cfg.num_attention_heads
    return cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def rope_problem(family: Family, module: nn.Module) -> str | None:
    """Why :func:`project` cannot rotate ``module``'s q/k with its modeling file's RoPE function, or None: the
    function it calls is missing (an older transformers that rotates differently, e.g. Qwen2.5-VL's multimodal
    RoPE inside the attention in 5.10)."""
    if family.qkv == "mla":
        needed = {"complex": "apply_rotary_emb", "none": None}.get(family.rotary, "apply_rotary_pos_emb")
    else:
        needed = "apply_rotary_pos_emb"
    source = sys.modules[type(module).__module__]
    if needed is None or hasattr(source, needed):
        return None
    return (
        f"{type(module).__name__}'s modeling file ({source.__name__}) has no {needed}, the RoPE function hf_fpdt's "
        "chunked projection calls (this transformers rotates q/k another way, e.g. multimodal RoPE inside the "
        "attention); use a newer transformers, or attn_implementation='fpdt' without apply"
    )


def _rope(module: nn.Module) -> Callable:
    return sys.modules[type(module).__module__].apply_rotary_pos_emb


def project(
    family: Family, module: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One hidden chunk -> rotated q and k, and v (sequence-major heads); see the module docstring."""
    if family.qkv == "mla":
        return _project_mla(family, module, h, cos, sin)
    d = head_dim(module)
    shape = (*h.shape[:-1], -1, d)
    if family.qkv == "separate":
        q, k, v = (getattr(module, name)(h) for name in family.qkv_names)
        if family.q_gate:  # [q_h | gate_h] per head (Qwen3-Next): the gate is applied after attention
            q = q.view(*h.shape[:-1], -1, 2 * d)[..., :d]
    elif family.qkv == "fused":  # [q | k | v] along the features (Phi-3)
        n_q, n_kv = heads(module)
        q, k, v = getattr(module, family.qkv_names[0])(h).split([n_q * d, n_kv * d, n_kv * d], dim=-1)
    elif family.qkv == "interleaved":  # [q_h, k_h, v_h] per head (GPT-NeoX)
        q, k, v = getattr(module, family.qkv_names[0])(h).view(*h.shape[:-1], -1, 3 * d).chunk(3, dim=-1)
    else:
        raise ValueError(f"unknown q/k/v layout {family.qkv!r}")
    norm = _qk_norm(family, module)
    if norm == "full":
        q, k = module.q_norm(q), module.k_norm(k)
    q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
    if norm == "head":
        q, k = module.q_norm(q), module.k_norm(k)
    if family.key_mul is not None:  # Falcon-H1: keys scaled before RoPE, as HF does
        k = k * getattr(module, family.key_mul)
    if family.rope_flag is None or getattr(module, family.rope_flag):
        q, k = _rope(module)(q, k, cos, sin, unsqueeze_dim=2)
    return q, k, v


def _project_mla(
    family: Family, module: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-4 MoE lite) of one hidden chunk, HF's ops in the
    sequence-major layout::

        q        [B, l, H, nope + rope]    from q_proj, or the q LoRA q_b_proj(q_a_layernorm(q_a_proj(h)))
        latent   [B, l, kv_lora_rank]      kv_a_layernorm of kv_a_proj_with_mqa(h)'s first part
        k_rot    [B, l, 1, rope]           its second part, rotated, shared by every head
        k        [B, l, H, nope + rope]    [kv_b_proj(latent)'s key part | k_rot]
        v        [B, l, H, v_head_dim]     kv_b_proj(latent)'s value part
    """
    b, n = h.shape[:2]
    nope, rope, dv = module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim
    if module.q_lora_rank is None:
        q = module.q_proj(h)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(h)))
    q_pass, q_rot = q.view(b, n, -1, nope + rope).split([nope, rope], dim=-1)
    latent, k_rot = module.kv_a_proj_with_mqa(h).split([module.kv_lora_rank, rope], dim=-1)
    latent = module.kv_a_layernorm(latent)
    k_rot = k_rot.view(b, n, 1, rope)
    rotary = sys.modules[type(module).__module__]
    if family.rotary == "complex":  # DeepSeek-V2: cos holds view_as_real(freqs_cis), heads-major as HF calls it
        q_rot, k_rot = rotary.apply_rotary_emb(
            q_rot.transpose(1, 2), k_rot.transpose(1, 2), torch.view_as_complex(cos.contiguous())
        )
        q_rot, k_rot = q_rot.transpose(1, 2), k_rot.transpose(1, 2)
    elif family.rotary == "none":  # NoPE (Kimi Linear): the shared key part is not rotated
        pass
    elif getattr(module.config, "rope_interleave", False):
        q_rot, k_rot = rotary.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    else:
        q_rot, k_rot = rotary.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    k_nope, v = module.kv_b_proj(latent).view(b, n, -1, nope + dv).split([nope, dv], dim=-1)
    k = torch.cat((k_nope, k_rot.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
    return torch.cat((q_pass, q_rot), dim=-1), k, v


MLA_MODULES = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")


def _qk_norm(family: Family, module: nn.Module) -> str | None:
    # the family's q/k norm where this module has one (Cohere's are optional: use_qk_norm)
    return family.qk_norm if getattr(module, "q_norm", None) is not None else None


def proj_modules(family: Family, module: nn.Module) -> tuple[nn.Module, ...]:
    """The submodules :func:`project` calls: q/k/v projections and q/k norms."""
    if family.qkv == "mla":  # q_proj or the q LoRA (the others are None), the compressed KV projection
        return tuple(m for m in (getattr(module, name, None) for name in MLA_MODULES) if m is not None)
    mods = [getattr(module, name) for name in family.qkv_names]
    if _qk_norm(family, module) is not None:
        mods += [module.q_norm, module.k_norm]
    return tuple(mods)


def sliding_window(module: nn.Module) -> int | None:
    """The attention module's window (HF's ``sliding_window``: key j is seen by query i iff ``i - j < W``).

    HF sets it per layer on the module where a family has per-layer windows (``layer_types``, Qwen2's
    ``max_window_layers``); other families read the config.
    """
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(getattr(module, "config", None), "sliding_window", None)


def attn_sinks(family: Family, module: nn.Module) -> torch.Tensor | None:
    """The attention module's per-head sink logits (what HF passes as ``s_aux``), or None where it has none
    (MiMo's full-attention layers hold ``sinks = None``)."""
    sinks = getattr(module, family.sinks, None)
    return sinks if isinstance(sinks, torch.Tensor) else None


def attn_softcap(family: Family, module: nn.Module) -> float | None:
    """The attention's logit softcap (``cap * tanh(s / cap)`` on the scaled scores), or None."""
    if family.attn_softcap is None:
        return None
    cap = getattr(module, family.attn_softcap, None)
    if cap is None:
        cap = getattr(module.config, family.attn_softcap, None)
    return cap or None


def _with_extras(head: nn.Module, div: float | None, mul: float | None, cap: float | None, h: torch.Tensor):
    z = head(h)
    if div is not None:
        z = z / div
    if mul is not None:
        z = z * mul
    if cap is not None:
        z = torch.tanh(z / cap) * cap
    return z


def lm_head(family: Family | None, model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The causal LM's output layer with the family's logit extras, in HF's order and dtype.

    A bare ``nn.Linear`` is returned as is (the tiled loss writes its backward out for it).
    """
    head = model.get_output_embeddings()
    if family is None:
        return head
    cfg = model.config.get_text_config()
    names = (family.logit_div, family.logit_mul, family.final_softcap)
    extras = [getattr(cfg, name, None) if name else None for name in names]
    if all(e is None for e in extras):
        return head
    return functools.partial(_with_extras, head, *extras)
