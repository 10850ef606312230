"""Input checks of an applied model's forward: shapes that do not fit the tokens are a ``ValueError``.

HF's own forward takes ``position_ids``, ``cache_position`` and ``attention_mask`` on trust: a misfit
either fails deep inside (RoPE's broadcast, "The size of tensor a (8) must match ...") or is silently cut
to size. FPDT cuts tensors into chunks, where a misfit can also pass silently (longer ``position_ids``
were truncated to the tokens' length). ``hf_fpdt.apply`` therefore checks every forward call's shapes
first (a forward pre-hook, no host sync) and names the argument, its shape and the shape that fits.

Shapes that fit the tokens ``input_ids [B, S]`` (or ``inputs_embeds [B, S, E]``):

* ``position_ids``: ``[B | 1, S]`` (a leading axis more for multimodal RoPE, e.g. ``[3, B, S]``);
* ``cache_position``: ``[S]``;
* ``attention_mask``: ``[B, S]``, or with a KV cache ``[B, past + S]`` (at least ``S`` long); a 4D mask
  ``[B | 1, heads | 1, S, keys]``. Where HF's forward makes a cache itself (``use_cache`` on, no cache
  passed), a 2D mask of another length is fitted as HF fits it: padded with 0 (its missing keys masked) or
  cut to ``S``; without a cache it is the error sdpa raises, here a ``ValueError``.

``output_attentions=True`` gets sdpa's notice (fpdt, like sdpa, computes no attention weights: the
``attentions`` of the output are empty), logged once.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.utils import logging

from .cache_names import cache_from
from .mask_spec import fit_padding_mask, hf_holds_cache, mask_length_error

_log = logging.get_logger("hf_fpdt")  # transformers' logger class: warning_once, as sdpa's notice

OUTPUT_ATTENTIONS_NOTICE = (
    "`fpdt` attention does not support `output_attentions=True` (as `sdpa`, it computes no attention "
    "weights). Please set your attention to `eager` if you want any of these features."
)


def output_attentions_notice(kwargs: dict, config=None) -> None:
    """Log sdpa's notice once when the call (or the model's config) asks for attention weights."""
    wanted = kwargs.get("output_attentions")
    if wanted is None and config is not None:
        wanted = getattr(config, "output_attentions", False)
    if wanted:
        _log.warning_once(OUTPUT_ATTENTIONS_NOTICE)


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def check_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
    """Forward pre-hook: raise ``ValueError`` naming the argument whose shape does not fit the tokens; a 2D
    ``attention_mask`` of another length is fitted as HF fits it against the KV cache its forward makes
    (:func:`~hf_fpdt.integrations.mask_spec.fit_padding_mask`), and refused without one, as sdpa fails."""
    tokens = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
        if tokens is None or tokens.dim() < 2:
            return
        batch, length = tokens.shape[0], tokens.shape[1]
        what = f"inputs_embeds {_shape(tokens)}"
    else:
        if tokens.dim() == 1:
            batch, length = 1, tokens.shape[0]
        else:
            batch, length = tokens.shape[0], tokens.shape[-1]
        what = f"input_ids {_shape(tokens)}"
    output_attentions_notice(kwargs, getattr(module, "config", None))
    pos = kwargs.get("position_ids")
    if pos is not None and (pos.dim() < 2 or pos.shape[-1] != length or pos.shape[-2] not in (1, batch)):
        raise ValueError(
            f"position_ids {_shape(pos)} do not fit {what}: pass position_ids of shape [{batch}, {length}] "
            f"(or [1, {length}]), the position of each token"
        )
    cache_position = kwargs.get("cache_position")
    if cache_position is not None and (cache_position.dim() != 1 or cache_position.shape[0] != length):
        raise ValueError(
            f"cache_position {_shape(cache_position)} does not fit {what}: pass cache_position of shape "
            f"[{length}] (the tokens' indices in the KV cache), or none"
        )
    mask = kwargs.get("attention_mask")
    if mask is None or not isinstance(mask, torch.Tensor):
        return None  # HF's dict of masks per attention type (already built by the caller): taken as given
    cached = cache_from(kwargs) is not None
    if mask.dim() == 2:
        if not cached and mask.shape[0] == batch and mask.shape[1] != length:
            if not hf_holds_cache(module, kwargs):
                raise mask_length_error(tuple(mask.shape), length, what)  # sdpa's error, on both paths
            # HF makes a cache first and fits the mask to its length (the keys the mask lacks are masked)
            return args, {**kwargs, "attention_mask": fit_padding_mask(mask, length)}
        fits = mask.shape[0] == batch and (mask.shape[1] >= length if cached else mask.shape[1] == length)
        want = f"[{batch}, past + {length}] (with a KV cache)" if cached else f"[{batch}, {length}]"
    elif mask.dim() == 4:
        fits = mask.shape[0] in (1, batch) and mask.shape[2] == length
        want = f"[{batch}, 1, {length}, keys]"
    else:
        fits, want = False, f"[{batch}, {length}] or a 4D mask [{batch}, 1, {length}, keys]"
    if not fits:
        raise ValueError(f"attention_mask {_shape(mask)} does not fit {what}: pass a mask of shape {want}")
    return None
