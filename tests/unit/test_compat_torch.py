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


def test_the_traced_device_names_exist():
    """hf_fpdt.bench.trace's private torch names: a wrapper over a meta tensor that C++ sees on the CPU, a dispatch
    mode that sees its ops, aliasing corrected for an in-place op, the storage identity, a fake process group."""
    import torch.distributed as dist

    from hf_fpdt.memory import compat_torch

    class Wrapper(torch.Tensor):
        __torch_function__ = compat_torch.disabled_torch_function()

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    elem = torch.empty(3, 4, device="meta")
    w = compat_torch.make_wrapper_subclass(Wrapper, elem, torch.device("cpu"))
    assert w.shape == (3, 4) and w.device.type == "cpu" and isinstance(w, Wrapper)
    seen = []

    class Mode(compat_torch.dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            out = func(*args, **(kwargs or {}))
            return compat_torch.correct_aliasing(func, args, kwargs or {}, out)

    x = torch.zeros(2)
    with Mode():
        y = x.add_(1)
    assert y is x and torch.ops.aten.add_.Tensor in seen
    assert compat_torch.storage_key(x) == compat_torch.storage_key(x[1:]) != compat_torch.storage_key(x.clone())
    dist.init_process_group("fake", store=compat_torch.fake_store(), rank=0, world_size=3)
    try:
        assert dist.get_world_size() == 3 and dist.get_backend() == "fake"
    finally:
        dist.destroy_process_group()
