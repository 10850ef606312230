"""Which pieces each HF decoder family has, keyed by ``config.model_type``.

``hf_fpdt.apply`` looks a model's family up here and drives one generic set of chunked parts
(:mod:`hf_fpdt.models.parts`) with it; adding a family is an entry here plus a test, not a new patch
file. What a :class:`Family` describes, per decoder layer and for the causal-LM head:

* ``attention`` / ``mlp``: the attribute names of the attention module and the MLP on the decoder layer;
* ``qkv``: ``"separate"`` (three linears named ``qkv_names``), ``"fused"`` (one linear, output
  ``[q | k | v]`` contiguous: Phi-3) or ``"interleaved"`` (one linear, ``[q_h, k_h, v_h]`` per head:
  GPT-NeoX); ``out_proj`` the output projection;
* ``qk_norm``: ``None``, ``"head"`` (a norm over each head's ``D`` after the head split: Qwen3, Gemma 3,
  Cohere) or ``"full"`` (a norm over the whole projection before the split: OLMo 2), modules
  ``q_norm``/``k_norm`` (used where the module has them);
* ``rope_flag``: the attention attribute that switches RoPE off per layer (SmolLM3's NoPE layers);
* ``out_dropout``: the attention attribute holding a dropout applied after ``out_proj`` (StarCoder2);
* ``mlp_kind``: ``"gated"`` or ``"plain"`` (token-wise: tiled over the sequence with the module's own
  forward, fused ``gate_up`` included) or ``"moe"`` (token-wise too, but its router logits feed HF's
  auxiliary loss);
* ``logit_div`` / ``logit_mul`` / ``final_softcap``: config attributes of LM-head extras (Granite's
  ``logits_scaling`` divides the logits, Cohere's ``logit_scale`` multiplies them, Gemma 2's
  ``final_logit_softcapping`` applies ``cap * tanh(z / cap)``);
* ``moe_router`` / ``moe_scores``: a MoE block's router attribute (``gate``: Mixtral, Qwen3-MoE; ``router``:
  gpt-oss) and whether the block returns ``(hidden, router_scores)`` (gpt-oss) rather than the hidden states;
* ``attn_softcap``: the attention attribute with a logit softcap (Gemma 2); ``sinks``: the attention attribute
  with per-head attention sinks (HF's ``s_aux``: gpt-oss), used where the module has it;
  ``refuse``: a reason this family cannot run exactly (checked at apply);
* multi-head latent attention (``qkv="mla"``: DeepSeek-V2/V3, GLM-4 MoE lite): q from ``q_proj`` or the q LoRA
  (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``), k and v from the compressed KV projection
  (``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``) with one shared rotated key part, all per chunk;
  q/k have ``qk_nope_head_dim + qk_rope_head_dim`` per head, v ``v_head_dim``; ``rotary="complex"``: the
  rotary table is DeepSeek-V2's complex ``freqs_cis`` instead of ``(cos, sin)``, ``"none"``: no RoPE (Kimi
  Linear's MLA layers);
* ``q_gate``: ``q_proj`` yields ``[q_h | gate_h]`` per head and the attention output is multiplied by
  ``sigmoid(gate)`` before ``out_proj`` (Qwen3-Next; the gate and ``out_proj`` tiled over the sequence);
  ``key_mul``: the attention attribute multiplying the keys before RoPE (Falcon-H1's ``key_multiplier``);
* ``shared_expert`` / ``shared_expert_gate``: a MoE block's shared expert (added to the routed experts, tiled
  too) and its sigmoid gate (Qwen3-Next);
* ``whole``: decoder-layer attributes of token mixers hf_fpdt does not chunk (linear attention, state-space
  layers of hybrids): they run over the whole local sequence as in HF, ``apply`` names them
  (``model.fpdt.whole``), and they are refused under sequence parallelism (a recurrence over the sequence
  cannot run on one rank's slice of it).

Embedding and residual multipliers (Granite, Gemma's ``sqrt(hidden)``), pre/post norms and the
per-layer rotary tables (Gemma 3) live in HF code hf_fpdt does not replace (the embedding, the decoder
layer), so they apply unchanged. A per-layer sliding window is read from the attention module
(``sliding_window``, set by HF from ``layer_types`` / ``max_window_layers``) or else the config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Family:
    """The pieces of one decoder family (see the module docstring)."""

    attention: str = "self_attn"
    mlp: str = "mlp"
    qkv: str = "separate"
    qkv_names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    out_proj: str = "o_proj"
    qk_norm: str | None = None
    rope_flag: str | None = None
    out_dropout: str | None = None
    mlp_kind: str = "gated"
    logit_div: str | None = None
    logit_mul: str | None = None
    final_softcap: str | None = None
    attn_softcap: str | None = None
    moe_router: str = "gate"
    moe_scores: bool = False
    sinks: str = "sinks"
    refuse: str | None = None
    rotary: str = "tables"
    q_gate: bool = False
    key_mul: str | None = None
    shared_expert: str | None = None
    shared_expert_gate: str | None = None
    whole: tuple[str, ...] = ()


LLAMA = Family()
# multi-head latent attention; DeepSeek's MoE (router, experts, shared expert; no auxiliary loss in HF's model) tiled
# with its own forward, token-wise (its router's API changed across transformers 5.x)
MLA = Family(qkv="mla", qkv_names=(), mlp_kind="plain")

FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": replace(LLAMA, qk_norm="head"),
    "gemma": LLAMA,
    "gemma2": replace(LLAMA, final_softcap="final_logit_softcapping", attn_softcap="attn_logit_softcapping"),
    "gemma3_text": replace(
        LLAMA, qk_norm="head", final_softcap="final_logit_softcapping", attn_softcap="attn_logit_softcapping"
    ),
    "phi3": replace(LLAMA, qkv="fused", qkv_names=("qkv_proj",)),
    "olmo2": replace(LLAMA, qk_norm="full"),
    "granite": replace(LLAMA, logit_div="logits_scaling"),
    "smollm3": replace(LLAMA, rope_flag="use_rope"),
    "starcoder2": replace(LLAMA, mlp_kind="plain", out_dropout="residual_dropout"),
    "gpt_neox": Family(
        attention="attention", qkv="interleaved", qkv_names=("query_key_value",), out_proj="dense", mlp_kind="plain"
    ),
    "cohere": replace(LLAMA, qk_norm="head", logit_mul="logit_scale"),  # q/k norms if use_qk_norm
    "mixtral": replace(LLAMA, mlp_kind="moe"),
    "qwen3_moe": replace(LLAMA, qk_norm="head", mlp_kind="moe"),
    # attention sinks, alternating sliding / full layers, YaRN (HF's rotary tables), biased q/k/v; MoE with a
    # biased router and clamped SwiGLU experts (token-wise: tiled)
    "gpt_oss": replace(LLAMA, mlp_kind="moe", moe_router="router", moe_scores=True),
    "deepseek_v2": replace(MLA, rotary="complex"),
    "deepseek_v3": MLA,  # rope_interleave read from the config
    "glm4_moe_lite": MLA,
    # Kimi Linear: NoPE MLA layers chunked, its Kimi delta attention layers (also ``self_attn``) whole
    "kimi_linear": replace(MLA, rotary="none", whole=("self_attn",)),
    # vision-language models' text decoders (text-only batches; 3D rotary positions [3 | 4, B, S] become HF's
    # cos / sin tables before the attention, so the chunked projection rotates with them unchanged)
    "qwen2_5_vl_text": LLAMA,
    "qwen3_vl_text": replace(LLAMA, qk_norm="head"),
    # hybrids: the full-attention layers, MLP / MoE and loss chunked; the linear / state-space mixers whole
    "qwen3_next": replace(
        LLAMA,
        qk_norm="head",
        q_gate=True,
        mlp_kind="moe",
        shared_expert="shared_expert",
        shared_expert_gate="shared_expert_gate",
        whole=("linear_attn",),
    ),
    "falcon_h1": replace(
        LLAMA, mlp="feed_forward", key_mul="key_multiplier", logit_mul="lm_head_multiplier", whole=("mamba",)
    ),
}


def family(model_type: str) -> Family | None:
    """The registered family of ``model_type``, or None (an unknown family: fpdt attention only)."""
    return FAMILIES.get(model_type)
