"""fpdt inside ``torch.compile``: which calls Dynamo traces, and how.

Under ``torch.compile`` two kinds of fpdt calls meet Dynamo:

* **Training** (gradients recorded): the chunk pipeline (host store, prefetch, nested backward, the
  layer wrappers) runs eagerly: its entry points are ``torch.compiler.disable``-d, a graph break each,
  and the mask function keeps its eager rule (a 2D key mask, O(keys)).
* **Inference** (no gradients, one process: evaluation, a prefill, a decode step): traced. The mask
  function returns what sdpa gets under compile (HF's ``sdpa_mask``: ``None`` where the causal structure
  says everything, else a 4D bool mask, with padding, packed documents, a static cache's unwritten slots
  and a sliding window in it) and the attention runs
  :func:`hf_fpdt.attention.cached_attention.cached_attention` over the keys it is given, with no host sync
  (every block under a mask takes the masked path). Shapes are those of the call, so a static cache
  decodes every position with one graph (the cache's full length, its unwritten slots masked) and
  ``fullgraph=True`` compiles where sdpa's does.

``hf_fpdt.apply``'s chunked projection, tiled MLP / experts / LM head and loss, layer wrappers and hooks
give way to HF's own forwards in a traced inference call, so an applied model compiles like the plain one
there (the values are sdpa's; the tiles' memory bound is not kept inside a compiled inference call).

What stays eager (a graph break, so not under ``fullgraph=True``): any call recording gradients,
sequence-parallel calls, block-sparse ``attention_pattern`` layers, and an evaluation with a per-tile
``logits_fn`` (FPDTTrainer's ``preprocess_logits_for_metrics``) (README: torch.compile). A pattern layer's
break says so (:func:`break_for_pattern`: ``fullgraph=True`` fails with a message naming the pattern and the
fix), and so does the chunk pipeline's (:data:`EAGER_REASON`). A layer's pattern is read from the settings
here, never evaluated inside a trace (its checks read tensor values).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..attention.cached_attention import cached_attention, needs_grad
from ..attention.runtime import FPDTRuntime


def traced_without_grad() -> bool:
    """Whether Dynamo is tracing a call that records no gradients (the mask function, the layer wrappers and
    the packed-document hook step aside for it; under SP too, where the attention itself stays eager)."""
    return torch.compiler.is_compiling() and not torch.is_grad_enabled()


def traced_inference(runtime: FPDTRuntime) -> bool:
    """Whether Dynamo is tracing a call that records no gradients (evaluation, a prefill, a decode step) on
    one process.

    Then ``hf_fpdt.apply``'s pieces (chunked projection, tiled MLP / experts / LM head and loss, layer
    wrappers, the step plan and packed-document hooks) give way to HF's own module forwards, whose attention
    call is traced (:func:`traced_call`): the values are sdpa's, the tiling's memory bound is not kept."""
    return runtime.sp_size == 1 and traced_without_grad()


TRACED_CHUNK = 65536  # keys per block traced before an eager call made the runtime or resolved chunk_size="auto"


def traced_call(
    runtime: FPDTRuntime | None, module: nn.Module, query, key, value, dropout: float, kwargs: dict
) -> bool:
    """Whether an attention call under ``torch.compile`` is traced (:func:`traced_attention`) rather than
    run eagerly: an inference call (no gradients) on one process, dense, causal, without dropout.

    ``runtime``: the module's, or None where no eager call has made one yet (a runtime cannot be built
    inside a trace: the default settings then hold, blocks of :data:`TRACED_CHUNK` keys)."""
    return (
        torch.compiler.is_compiling()
        and not needs_grad(query, key, value)
        and (runtime is None or runtime.sp_size == 1)
        and not dropout
        and (runtime is None or pattern_setting(runtime, module) is None)
        and getattr(module, "is_causal", True)
        and kwargs.get("is_causal") is not False
        and getattr(module, "compressor", None) is None  # DeepSeek-V4's compressed keys: refused eagerly
    )


EAGER_REASON = (
    "hf_fpdt's chunk pipeline runs eagerly under torch.compile (calls recording gradients, sequence-parallel "
    "calls, attention_pattern layers): compile without fullgraph=True, so each such call is a graph break"
)


def pattern_setting(runtime: FPDTRuntime, module: nn.Module) -> object | None:
    """The ``attention_pattern`` setting of ``module``'s layer (a pattern or a bare ``mask_mod``; ``None``: dense),
    as given: not checked or evaluated, so it can be read inside a trace."""
    setting = runtime.config.attention_pattern
    if isinstance(setting, Mapping):
        setting = setting.get(getattr(module, "layer_idx", None))
    return setting


def break_for_pattern(runtime: FPDTRuntime | None, module: nn.Module) -> None:
    """Under ``torch.compile``, a layer with an ``attention_pattern`` runs eagerly: a graph break whose message
    (what ``fullgraph=True`` fails with) names the pattern and the fix. Nothing for a dense layer."""
    setting = None if runtime is None else pattern_setting(runtime, module)
    if setting is None:
        return
    name = getattr(setting, "name", None) or getattr(setting, "__name__", None) or type(setting).__name__
    torch._dynamo.graph_break(
        msg=f"hf_fpdt: layer {getattr(module, 'layer_idx', None)} has the block-sparse attention_pattern "
        f"{name!r}, which runs in fpdt's eager chunk pipeline and cannot be traced, so torch.compile(fullgraph=True) "
        "cannot compile this model: compile it without fullgraph=True (each pattern layer is then a graph break), "
        "or apply it without attention_pattern"
    )


def traced_attention(
    runtime: FPDTRuntime | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    kwargs: dict,
) -> torch.Tensor:
    """HF layout in (``q [B, H, Sq, D]``, ``k, v [B, Hkv, Sk, D]``, the mask :func:`traced_mask` made) ->
    ``out [B, Sq, H, D]``: the cached attention's blocks, traceable (no host sync, static shapes)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    chunk, router = TRACED_CHUNK, None  # None: the device's kernel (hf_fpdt.attention.routes.block_router)
    if runtime is not None:
        chunk = runtime.resolved_chunk_size() or TRACED_CHUNK  # "auto" is measured eagerly, never in a trace
        router = runtime.router(q.device, q.dtype, q.shape[-1])  # the routes of training and generation
    keys = mask = None
    if attention_mask is not None:
        if attention_mask.dim() == 4:
            mask = attention_mask
        else:
            keys = attention_mask.to(torch.bool)
    window = kwargs.get("sliding_window") if mask is None else None  # a 4D mask holds the window
    if window is not None and window >= k.shape[1]:
        window = None
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")  # sinks: folded per query chunk (attention.sinks)
    return cached_attention(
        q, k, v, scale, chunk, keys, mask, None, window, softcap, static=True, sinks=sinks, router=router
    )


def traced_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset,
    kv_offset: int,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """The mask of an inference call under ``torch.compile``: sdpa's (HF's ``sdpa_mask``, which reads no
    tensor value while tracing)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    return sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function or causal_mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )
