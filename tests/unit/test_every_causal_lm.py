"""Every causal-LM model type of the installed transformers: fpdt's attention equals eager, or is refused by name.

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a tiny config (2 layers, hidden 64, 4 heads / 2
KV heads, vocabulary 256, any ``sliding_window`` / ``attention_chunk_size`` 24, the config's other sizes made
small), 80 tokens, eval mode, fp32; the loss and every parameter's gradient of eager against
``attn_implementation="fpdt"`` (``hf_fpdt.configure``, chunk 16). Each type is

* ``equal``: loss and gradients within 1e-5 relative (also where fpdt's attention is never called: the model's
  attention bypasses HF's interface; the table says so);
* ``refused``: a ``ValueError`` from hf_fpdt naming the feature it cannot compute (the message is the reason);
* ``skipped``: with the reason in the skip message: a tiny config that cannot be built, a model that needs more
  than ``input_ids`` (vision, audio, encoder states), or one whose eager forward itself fails.

Anything else fails: a silently different loss (a dropped window or chunked mask) above all.
``python tests/unit/test_every_causal_lm.py`` prints the table of outcomes (docs/reference/families.md holds it).
"""

from __future__ import annotations

import sys
import time
import warnings

import pytest
import torch
from testkit import max_err, rel_err, tiny_model
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_fpdt
from hf_fpdt.integrations import registration

TOKENS, VOCAB, WINDOW, CHUNK, TOL = 80, 256, 24, 16, 1e-5
TINY = {  # set where the model type's config has the field (its own name or an alias of its attribute_map)
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "intermediate_size": 128,
    "head_dim": 16,
    "sliding_window": WINDOW,
    "attention_chunk_size": WINDOW,
    "max_position_embeddings": 256,
    "attention_dropout": 0.0,
    "pad_token_id": 0,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    # mixtures of experts, small
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "intermediate_size_mlp": 128,
    # multi-head latent attention and friends, small
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    # state-space and linear-attention layers, small
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_d_ssm": 64,  # Falcon-H1: mamba_n_heads * mamba_d_head (its config validates it)
    "mamba_n_groups": 1,
    "ssm_state_size": 16,
}


def model_types() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


MAX_PARAMS = 4_000_000  # a tiny model has fewer (a config whose sizes this sweep cannot shrink is skipped)


def _sub_configs(config) -> list[str]:
    from transformers import PretrainedConfig

    return [k for k, v in vars(config).items() if isinstance(v, PretrainedConfig)]


def tiny_overrides(model_type: str) -> dict:
    """:data:`TINY`'s fields the model type's config has (read from its default config); for a config whose only
    sub-config is ``text_config``, those of the text config, as ``text_config``."""
    default = AutoConfig.for_model(model_type)
    subs = _sub_configs(default)
    if subs == ["text_config"]:
        return {"text_config": {k: v for k, v in _fields(default.text_config).items()}}
    return _fields(default)


def _has(config, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:  # noqa: BLE001 - transformers' per-layer attributes refuse a global read
        return False


def _fields(default) -> dict:
    out = {k: v for k, v in TINY.items() if _has(default, k)}
    if _has(default, "kv_lora_rank"):  # multi-head latent attention: RoPE's head dim, one KV head per head
        out["head_dim"] = TINY["qk_rope_head_dim"]
        out["num_key_value_heads"] = TINY["num_attention_heads"]
    if _has(default, "rotary_dim"):
        out["rotary_dim"] = 8
    return out


class Skip(Exception):
    """A model type this sweep cannot run, with the reason."""


def _build(model_type: str, attn: str, state: dict | None = None):
    try:
        default = AutoConfig.for_model(model_type)
    except Exception as e:  # noqa: BLE001 - any failure is the reason to report
        raise Skip(f"no default config: {type(e).__name__}: {e}") from e
    subs = [k for k in _sub_configs(default) if k != "text_config"]
    if subs:
        towers = [k for k in subs if any(w in k for w in ("vision", "audio", "speech", "encoder", "vq"))]
        if towers:
            raise Skip(f"needs inputs beyond input_ids ({', '.join(subs)})")
        raise Skip(f"its config has sub-configs this sweep does not make tiny ({', '.join(subs)})")
    overrides = tiny_overrides(model_type)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if state is None:  # its size first, on the meta device (a config this sweep cannot shrink is skipped)
                with torch.device("meta"):
                    size = sum(p.numel() for p in tiny_model(model_type, attn, seed=None, **overrides).parameters())
                if size > MAX_PARAMS:
                    raise Skip(f"the tiny config still has {size / 1e6:.0f}M parameters (sizes this sweep cannot set)")
            model = tiny_model(model_type, attn, state=state, **overrides)
    except Skip:
        raise
    except Exception as e:  # noqa: BLE001
        raise Skip(f"tiny config or model cannot be built ({attn}): {type(e).__name__}: {str(e)[:160]}") from e
    return model.eval()


def _step(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def grad_err(got: torch.Tensor, want: torch.Tensor, every: dict) -> float:
    """``rel_err`` of one gradient, against at least 1e-3 of the model's largest gradient: a gradient that is zero
    but for rounding (a key projection's bias: softmax ignores a shift of every score) is judged so."""
    largest = max(g.abs().max().item() for g in every.values())
    return max_err(got, want) / max(want.abs().max().item(), 1e-3 * largest, 1e-30)


def _float64(model_type: str, eager):
    """``eager``'s weights in a float64 eager model (the reference when fp32 rounding exceeds the tolerance)."""
    state = {k: v.double() if v.is_floating_point() else v for k, v in eager.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(model_type, "eager", dtype=torch.float64, state=state, **tiny_overrides(model_type))
    return model.eval()


def outcome(model_type: str) -> tuple[str, str]:
    """``(kind, detail)`` of one model type: ``equal`` / ``refused`` / ``skipped`` (module docstring); raises
    ``AssertionError`` on a different loss or gradient, and any other error as it is."""
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    eager = _build(model_type, "eager")
    try:
        ref_loss, ref_grads = _step(eager, ids)
    except Exception as e:  # noqa: BLE001
        raise Skip(f"eager forward fails: {type(e).__name__}: {str(e)[:160]}") from e
    if not torch.isfinite(ref_loss):
        raise Skip("eager loss is not finite")
    features = []
    if getattr(eager.config, "sliding_window", None) is not None:
        features.append("window")
    if getattr(eager.config, "attention_chunk_size", None) is not None:
        features.append("chunked")
    model = _build(model_type, "fpdt", state=eager.state_dict())
    hf_fpdt.configure(model, hf_fpdt.FPDTConfig(chunk_size=CHUNK))
    calls = []
    original = registration.pipeline_attention_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    registration.pipeline_attention_forward = counted
    try:
        loss, grads = _step(model, ids)
    except ValueError as e:
        if "fpdt" not in str(e):
            raise
        return "refused", str(e)
    finally:
        registration.pipeline_attention_forward = original
    err = rel_err(loss, ref_loss)
    worst = max(((grad_err(grads[n], g, ref_grads), n) for n, g in ref_grads.items()), default=(0.0, ""))
    assert grads.keys() == ref_grads.keys(), f"{model_type}: gradients of other parameters than eager's"
    rounding = ""
    if max(err, worst[0]) > TOL:  # judged against float64 then: fpdt as close to it as eager's fp32 (x 2)
        f64_loss, f64 = _step(_float64(model_type, eager), ids)
        own = max(rel_err(ref_loss, f64_loss), *(grad_err(g.double(), f64[n], f64) for n, g in ref_grads.items()))
        ours = max(rel_err(loss, f64_loss), *(grad_err(g.double(), f64[n], f64) for n, g in grads.items()))
        assert ours <= 2 * own, (
            f"{model_type}: loss {loss.item():.6f} vs eager {ref_loss.item():.6f} (rel {err:.1e}), gradient of "
            f"{worst[1]} rel {worst[0]:.1e}; against float64 fpdt {ours:.1e}, eager {own:.1e}"
        )
        rounding = f"; fp32 rounding: vs eager {max(err, worst[0]):.1e}, vs float64 fpdt {ours:.1e}, eager {own:.1e}"
    how = f"loss {loss.item():.6f}, grads rel {worst[0]:.1e}" + (f"; {'+'.join(features)}" if features else "")
    how += rounding
    if not calls:
        how += "; fpdt attention not called (no attention layer at 2 layers, or attention outside HF's interface)"
    return "equal", how


@pytest.mark.slow
@pytest.mark.parametrize("model_type", model_types())
def test_model_type_equals_eager_or_is_refused_by_name(model_type):
    try:
        kind, detail = outcome(model_type)
    except Skip as e:
        pytest.skip(f"{model_type}: {e}")
    if kind == "refused":
        assert model_type in detail or any(
            w in detail for w in ("attention", "mask", "window", "chunk", "sink", "dropout", "causal")
        ), detail


def table() -> str:
    """The markdown table of every model type's outcome (what ``python tests/unit/test_every_causal_lm.py``
    prints)."""
    rows = ["| `model_type` | outcome | detail |", "|---|---|---|"]
    for model_type in model_types():
        start = time.perf_counter()
        try:
            kind, detail = outcome(model_type)
        except Skip as e:
            kind, detail = "skipped", str(e)
        except AssertionError as e:
            kind, detail = "DIFFERENT", str(e)
        except Exception as e:  # noqa: BLE001
            kind, detail = "ERROR", f"{type(e).__name__}: {str(e)[:200]}"
        detail = " ".join(detail.split()).replace("|", "\\|")
        rows.append(f"| `{model_type}` | {kind} | {detail} |")
        print(rows[-1], f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
