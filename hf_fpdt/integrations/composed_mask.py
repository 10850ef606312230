"""What HF composes for a layer's mask, read as structure: the guarantee that no mask feature is lost.

Transformers builds each layer type's mask from one *mask function* ``(batch_idx, head_idx, q_idx, kv_idx) ->
bool`` (``masking_utils``: ``create_causal_mask``, ``create_sliding_window_causal_mask``,
``create_chunked_causal_mask``), composed with ``and_masks`` / ``or_masks`` from ``causal_mask_function``,
``sliding_window_overlay``, ``chunked_overlay``, the packed-sequence pieces and whatever a model adds
(``or_mask_function`` / ``and_mask_function``), and hands it to the registered mask function
(:func:`hf_fpdt.integrations.registration.fpdt_mask`). That function reads it here, whole, before it returns:

* the structured pieces are recognised by their code (HF's own closures, their variables read with
  :func:`closure_vars`): ``causal_mask_function`` (the chunk loop's causality), ``sliding_window_overlay``
  (a window: a band of blocks), ``chunked_overlay`` (attention chunks, Llama 4: per row ids
  ``(t - left_padding) // chunk_size``, blocks outside a token's chunk are neither fetched nor computed),
  ``packed_sequence_mask_function`` and ``remap_positions_for_packed_sequence`` (packed documents, the chunk
  ids then from the positions HF remaps to);
* every other term of the AND (an ``or_masks``, a model's own overlay, anything a newer transformers adds,
  or one of the above whose closure no longer reads as expected) is kept as a function and evaluated at
  block level on the whole input, once per call, as a block-sparse pattern's ``mask_mod`` is
  (:class:`hf_fpdt.attention.block_mask.BlockMask`: later keys, rows that differ and the like are refused
  there, by name); where causality is not among the AND's terms the whole function is evaluated so;
* what cannot be evaluated is refused by name (:class:`ComposedMask.refusal`): bidirectional attention.

So a mask feature is either computed exactly or refused with the model type and the feature named; it is never
dropped. The result travels to the attention call on the tensor HF passes it as ``attention_mask``
(:func:`carry`, :func:`composed_of`): fpdt's mask function returns its usual 2D key mask, or an empty ``[B, 0]``
marker, as a new view holding the :class:`ComposedMask` (nothing of the caller's is written to).

This module is the one place that reads ``masking_utils``' closures (private to transformers); a closure it
cannot read is evaluated as a function instead (exact, O(S^2) per call), and ``tests/unit/test_mask_spec.py``
checks each recognised piece against the installed transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..attention.sparse_patterns import SparsePattern

ATTRIBUTE = "fpdt_composed_mask"  # the attribute of the carrier tensor (a view fpdt's mask function made)


def closure_vars(fn: Callable) -> dict:
    """The closure variables of ``fn`` by name (empty for a function without a closure)."""
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}


def _codes() -> dict:
    """The code object of each mask-function piece of the installed transformers, by name (built each call: a
    handful of closures, no cache held between calls)."""
    from transformers import masking_utils as mu

    def f(b, h, q, kv):
        return q >= kv

    pieces = {
        "and": lambda: mu.and_masks(f),
        "or": lambda: mu.or_masks(f),
        "window": lambda: mu.sliding_window_overlay(1),
        "chunk": lambda: mu.chunked_overlay(1, None),
        "packed": lambda: mu.packed_sequence_mask_function(None),
        "remap": lambda: mu.remap_positions_for_packed_sequence(f, None),
        "bidirectional_window": lambda: mu.sliding_window_bidirectional_overlay(1),
    }
    codes = {}
    for name, make in pieces.items():
        try:
            codes[name] = make().__code__
        except (AttributeError, TypeError):  # a piece this transformers lacks: evaluated as a function if met
            pass
    codes["causal"] = mu.causal_mask_function.__code__
    if hasattr(mu, "bidirectional_mask_function"):
        codes["bidirectional"] = mu.bidirectional_mask_function.__code__
    return codes


def describe(fn: Callable) -> str:
    """A short name of a mask function for messages: ``and_masks(causal_mask_function, my_overlay)``."""
    parts = closure_vars(fn).get("mask_functions")
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    if isinstance(parts, tuple) and name.endswith(("and_mask", "or_mask")):
        kind = "and_masks" if name.endswith("and_mask") else "or_masks"
        return f"{kind}({', '.join(describe(p) for p in parts)})"
    inner = closure_vars(fn).get("mask_function")
    if callable(inner) and "<locals>" in name:
        return f"{name.split('.<locals>')[0]}({describe(inner)})"
    return name.split(".<locals>")[0] if "<locals>" in name else name


@dataclass(frozen=True, eq=False)
class ComposedMask:
    """One layer type's mask as HF composed it, read as structure (module docstring).

    Args:
        model_type: the model's ``config.model_type`` (named in refusals).
        mask_function: HF's composed mask function, as given.
        given: whether the call passed a 2D ``attention_mask`` (HF's rule: then no packed documents).
        window: the sliding window (``kv > q - window``), or None.
        chunk: the attention chunk size (``chunked_overlay``), or None.
        left_padding: ``[B]`` tokens of left padding each row's chunks start after (HF's), with ``chunk``.
        positions: ``[B, S]`` positions HF remaps the chunk overlay to (packed rows), or None.
        documents: HF's packed-sequence ids ``[B, S]``, or None.
        rest: the AND's other terms (already remapped to packed positions), evaluated at block level.
        causal: whether causality is among the AND's terms (then ``rest`` is evaluated ANDed with it; else
            ``rest`` is the whole function, whose later keys the evaluation refuses).
        refusal: why this mask cannot be computed (the feature named), or None.
    """

    model_type: str
    mask_function: Callable | None = None
    given: bool = False
    window: int | None = None
    chunk: int | None = None
    left_padding: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    documents: torch.Tensor | None = None
    rest: tuple = field(default=())
    refusal: str | None = None
    causal: bool = True

    @property
    def plain(self) -> bool:
        """Whether the mask is causal attention alone (padding and packed documents aside)."""
        return self.window is None and self.chunk is None and not self.rest and self.refusal is None

    @property
    def window_only(self) -> bool:
        """Whether a sliding window is all the mask holds beyond causality (every path of fpdt takes a window)."""
        return self.window is not None and self.chunk is None and not self.rest and self.refusal is None

    @property
    def features(self) -> str:
        """The mask's features beyond causality, for messages."""
        out = [f"sliding window {self.window}"] if self.window is not None else []
        out += [f"chunked attention (attention_chunk_size {self.chunk})"] if self.chunk is not None else []
        out += [f"mask function {describe(f)}" for f in self.rest]
        out += [self.refusal] if self.refusal is not None else []
        return ", ".join(out) or "causal"

    def check(self) -> None:
        """Raise the refusal, if any: a ``ValueError`` naming the model type and the feature."""
        if self.refusal is not None:
            raise ValueError(
                f"fpdt attention cannot compute the attention mask transformers composes for model type "
                f"{self.model_type!r}: {self.refusal}; use attn_implementation='sdpa' for this model"
            )

    def refuse(self, what: str) -> None:
        """A ``ValueError`` naming the model type, the mask's features and ``what`` cannot take them."""
        raise ValueError(
            f"fpdt attention: model type {self.model_type!r} masks attention with {self.features}, which "
            f"{what} cannot compute; use attn_implementation='sdpa' for it"
        )

    def pattern(self) -> SparsePattern | None:
        """The AND's other terms as one block-sparse pattern (evaluated over every block, once per call)."""
        if not self.rest:
            return None
        fns, causal = self.rest, self.causal

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            out = (kv <= q) if causal else torch.ones((), dtype=torch.bool, device=q.device)
            for fn in fns:
                out = out & fn(b, h, q, kv).to(out.device)
            return out

        name = f"{self.model_type} mask function {' & '.join(describe(f) for f in fns)}"
        return SparsePattern(mask_mod, name=name)

    def chunk_ids(self, batch: int, length: int, device: torch.device, key_mask: torch.Tensor | None = None):
        """``[B, S]`` attention-chunk id of every token (non-decreasing along a row), or None without chunks (or
        one chunk for every token). ``key_mask``: the global padding mask under sequence parallelism, whose left
        padding then stands in for HF's (computed from the rank's shard)."""
        if self.chunk is None:
            return None
        if self.positions is not None:
            idx = self.positions.to(device).expand(batch, -1)
        else:
            idx = torch.arange(length, device=device).expand(batch, -1)
        if key_mask is not None:
            pad = (key_mask.to(device).long().cumsum(-1) == 0).sum(-1)
        elif self.left_padding is not None:
            pad = self.left_padding.to(device).reshape(-1).expand(batch)
        else:
            pad = torch.zeros(batch, dtype=torch.long, device=device)
        ids = torch.div(idx - pad[:, None], self.chunk, rounding_mode="floor")
        if bool((ids == ids[:, :1]).all()):  # one chunk per row: causal attention (one host sync)
            return None
        return ids


def read(mask_function: Callable, model_type: str, given: bool) -> ComposedMask:
    """``mask_function`` (HF's composed mask function) read as structure (module docstring)."""
    codes = _codes()
    found: dict = {"rest": [], "causal": False, "refusal": None}

    def remapped(fn: Callable, positions: torch.Tensor | None) -> Callable:
        if positions is None:
            return fn
        return lambda b, h, q, kv: fn(b, h, positions[b, q], positions[b, kv])

    def walk(fn: Callable, positions: torch.Tensor | None) -> None:
        code, cells = getattr(fn, "__code__", None), closure_vars(fn)
        if code is codes.get("and") and isinstance(cells.get("mask_functions"), tuple):
            for part in cells["mask_functions"]:
                walk(part, positions)
        elif code is codes.get("remap") and callable(cells.get("mask_function")) and "position_ids" in cells:
            walk(cells["mask_function"], cells["position_ids"])
        elif code is codes["causal"]:
            found["causal"] = True
        elif code is codes.get("window") and isinstance(cells.get("sliding_window"), int):
            w = cells["sliding_window"]
            found["window"] = min(w, found.get("window", w))
        elif code is codes.get("chunk") and isinstance(cells.get("chunk_size"), int) and "chunk" not in found:
            found.update(chunk=cells["chunk_size"], left_padding=cells.get("left_padding"), positions=positions)
        elif code is codes.get("packed") and isinstance(cells.get("packed_sequence_mask"), torch.Tensor):
            found["documents"] = cells["packed_sequence_mask"]
        elif code is not None and code in (codes.get("bidirectional"), codes.get("bidirectional_window")):
            found["refusal"] = f"bidirectional attention ({describe(fn)}; config.is_causal=False?)"
        else:
            found["rest"].append(remapped(fn, positions))

    walk(mask_function, None)
    if found["refusal"] is None and not found["causal"]:  # no causal term: the whole function is evaluated
        found = {"rest": [mask_function], "refusal": None, "causal": False}
    return ComposedMask(
        model_type,
        mask_function,
        given,
        found.get("window"),
        found.get("chunk"),
        found.get("left_padding"),
        found.get("positions"),
        found.get("documents"),
        tuple(found["rest"]),
        found["refusal"],
        found["causal"],
    )


def carry(mask: torch.Tensor | None, composed: ComposedMask, batch: int, device) -> torch.Tensor:
    """What fpdt's mask function returns for a mask that is more than causal: ``mask`` (its usual 2D key mask or
    empty marker), or an empty ``[B, 0]`` marker where that is None, as a new view holding ``composed``."""
    base = mask if mask is not None else torch.ones(batch, 0, dtype=torch.bool, device=device)
    out = base.view(base.shape)  # a new tensor object: the caller's mask is not written to
    setattr(out, ATTRIBUTE, composed)
    return out


def composed_of(attention_mask: torch.Tensor | None) -> ComposedMask | None:
    """The :class:`ComposedMask` an attention call's mask carries (see :func:`carry`), or None."""
    return getattr(attention_mask, ATTRIBUTE, None) if attention_mask is not None else None


def generation_mask_4d(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset,
    kv_offset: int,
    attention_mask: torch.Tensor | None,
    kwargs: dict,
) -> torch.Tensor:
    """fpdt's mask against a cache that holds tokens where HF composed more than causal attention (a window of a
    family the registry does not list, attention chunks, other terms): HF's own 4D bool mask of the call,
    ``[B, 1, Sq, Sk]``, built from the composed ``mask_function`` in ``kwargs`` as sdpa's mask is (O(Sq * Sk)
    bools, as for sdpa: one row per decode step), which the cached attention applies block by block."""
    from transformers.masking_utils import sdpa_mask

    rest = {k: v for k, v in kwargs.items() if k not in ("allow_is_causal_skip", "local_size")}
    return sdpa_mask(
        batch_size,
        q_length,
        kv_length,
        q_offset=int(q_offset),
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        **rest,
    )


def outside_interface(config: object) -> str | None:
    """The base model class of ``config``'s model type where its modeling code never calls transformers' attention
    interface (``ALL_ATTENTION_FUNCTIONS``: Bloom, GPT-Neo, MPT, ...), else None. Such a model computes attention
    itself with the mask fpdt's mask function returns (none for causal attention: fpdt's chunk loop is causal),
    so it would attend unmasked: fpdt's mask function refuses it by name."""
    import sys

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    for mapping in (MODEL_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING):  # the base model, else the causal LM (TrOCR)
        try:
            cls = mapping[type(config)]
        except (KeyError, ValueError, ImportError, AttributeError):
            continue
        module = sys.modules.get(getattr(cls, "__module__", ""))
        if module is None or "ALL_ATTENTION_FUNCTIONS" in vars(module):
            return None
        return cls.__name__
    return None
