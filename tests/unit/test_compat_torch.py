"""Contract test of torch's private attention ops (hf_fpdt/memory/compat_torch.py): the block kernels call them by
position, so each op's positional parameters in the installed torch must be the ones the calls fill, in that order.
Checked the same on torch 2.9.0 (the declared minimum, .ci/minimums), 2.13.0 (CI) and 2.14.1 (.ci/newest); a torch
that renames or reorders one fails here, not in a kernel with an argument in the wrong place."""

from __future__ import annotations

import pytest
import torch

from hf_fpdt.memory.compat_torch import SDPA_NAMES, SDPA_OPS

# what hf_fpdt/attention/kernels.py, cudnn_blocks.py and cached_attention.py pass, positionally, then by keyword
FILLED = {
    "cpu_flash": (("query", "key", "value", "dropout_p", "is_causal"), {"attn_mask", "scale"}),
    "cpu_flash_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal"),
        {"attn_mask", "scale"},
    ),
    "flash": (("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"), {"scale"}),
    "flash_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k", "max_q", "max_k")
        + ("dropout_p", "is_causal", "philox_seed", "philox_offset"),
        {"scale"},
    ),
    "cudnn": (
        ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "return_debug_mask"),
        {"scale"},
    ),
    "cudnn_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed", "philox_offset", "attn_bias")
        + ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal"),
        {"scale"},
    ),
}


def test_every_op_is_named_once():
    assert set(FILLED) == set(SDPA_NAMES) == set(SDPA_OPS.__dataclass_fields__)


@pytest.mark.parametrize("field", sorted(FILLED))
def test_the_installed_ops_take_the_arguments_where_the_kernels_pass_them(field):
    op = getattr(SDPA_OPS, field)
    if op is None:
        pytest.skip(f"torch {torch.__version__} has no aten.{SDPA_NAMES[field]}: that backend is not chosen")
    schema = op.default._schema
    positional = tuple(a.name for a in schema.arguments if not a.kwarg_only)
    keywords = {a.name for a in schema.arguments if a.kwarg_only}
    want_positional, want_keywords = FILLED[field]
    assert positional == want_positional, (torch.__version__, SDPA_NAMES[field], positional)
    assert want_keywords <= keywords, (torch.__version__, SDPA_NAMES[field], keywords)


def test_the_cpu_flash_op_is_there():
    """The CPU backend every CPU run takes: a torch without it cannot run hf_fpdt's kernels on the CPU."""
    assert SDPA_OPS.cpu_flash is not None and SDPA_OPS.cpu_flash_backward is not None
