"""The tests' shared helpers, importable from every test module and script (pytest's ``pythonpath`` puts
``tests/`` on ``sys.path``; launched scripts get it from :mod:`launch`): one tiny-model factory, the float64
attention reference and the error measures the tolerance rules use."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import torch
from torch import nn

# Tests write only under temporary folders: the HF datasets cache too (load_dataset/map would otherwise
# fill ~/.cache/huggingface/datasets). Set before any test module imports datasets (conftest imports this
# module first); spawned and launched processes inherit it.
SCRATCH = tempfile.mkdtemp(prefix="hf_fpdt_tests_")
os.environ["HF_DATASETS_CACHE"] = os.path.join(SCRATCH, "datasets")
atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)


def tiny_model(
    preset: str = "tiny-llama",
    attn: str | None = "sdpa",
    *,
    dtype: torch.dtype | None = torch.float32,
    seed: int | None = 0,
    state: dict | None = None,
    **overrides,
) -> nn.Module:
    """A causal LM built from one of :mod:`hf_fpdt.models.presets` (``**overrides`` change its config), with
    ``attn`` as its attention implementation (None: HF's default), seeded weights (``seed=None``: the caller's
    RNG state) or ``state``'s."""
    from transformers import AutoModelForCausalLM

    from hf_fpdt.models.presets import preset_config

    if seed is not None:
        torch.manual_seed(seed)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = AutoModelForCausalLM.from_config(preset_config(preset, **overrides), attn_implementation=attn, **kwargs)
    if state is not None:
        model.load_state_dict(state)
    return model


def reference_attention(q, k, v, scale: float, causal: bool = True) -> torch.Tensor:
    """Causal (top-left aligned) attention in float64 over the whole sequence, differentiable.

    ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]`` -> ``[B, Sq, H, D]``; written independently of
    ``hf_fpdt.core.kernels`` (plain softmax, ``repeat_interleave`` for GQA) so it can judge every backend.
    """
    groups = q.shape[2] // k.shape[2]
    qh = q.double().transpose(1, 2)
    kh = k.double().repeat_interleave(groups, dim=2).transpose(1, 2)
    vh = v.double().repeat_interleave(groups, dim=2).transpose(1, 2)
    s = qh @ kh.transpose(-1, -2) * scale
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return (s.softmax(-1) @ vh).transpose(1, 2)


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max absolute error over the reference's largest magnitude (absolute where the reference is all
    zeros, e.g. dq and dk of a one-token sequence)."""
    scale = ref.double().abs().max().item()
    return max_err(a, ref) / (scale if scale > 0 else 1.0)
