"""At one rank the attention backward reads dO as views of ``dout``: no copy, no trip through the host store.

``dout`` stays on the device until the backward returns (autograd holds it), so its chunks need not be parked;
under SP the all-to-all's result is new and goes to the store (tests/integration/test_sp_models.py). The gradients
stay the float64 reference's, for a plain ``dout`` and for an expanded one (``out.sum()``'s, stride 0).
"""

from __future__ import annotations

import pytest
import torch
from standins import reference_attention
from testkit import rel_err

from hf_fpdt import FPDTConfig, FPDTRuntime, fpdt_attention
from hf_fpdt.attention.routes import Router
from hf_fpdt.memory.host_store import HostStore


@pytest.mark.parametrize("expanded", [False, True], ids=["dout", "expanded-dout"])
def test_one_rank_backward_reads_dout_views(monkeypatch, expanded):
    b, s, h, hkv, d, chunk = 2, 300, 4, 2, 16, 64
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, s, n, d, generator=g) for n in (h, hkv, hkv))
    dout = torch.ones(b, s, h, d) if expanded else torch.randn(b, s, h, d, generator=g)
    runtime = FPDTRuntime(FPDTConfig(chunk_size=chunk, offload=True))  # a store that copies what it is given

    seen, put = {"dout": None, "views": 0, "blocks": 0}, []
    real_backward, real_put = Router.backward, HostStore.put

    def spy_backward(router, doj, *args, **kwargs):
        seen["blocks"] += 1
        seen["views"] += doj.untyped_storage().data_ptr() == seen["dout"]
        return real_backward(router, doj, *args, **kwargs)

    def spy_put(self, t, *args, **kwargs):
        put.append(t.untyped_storage().data_ptr())
        return real_put(self, t, *args, **kwargs)

    class Capture(torch.autograd.Function):  # the dout the attention's backward gets, as it gets it
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            seen["dout"] = grad.untyped_storage().data_ptr() if grad.is_contiguous() else None
            return grad

    monkeypatch.setattr(Router, "backward", spy_backward)
    monkeypatch.setattr(HostStore, "put", spy_put)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = Capture.apply(fpdt_attention(qs, ks, vs, runtime))
    if expanded:
        out.sum().backward()  # dout = ones expanded (stride 0): made contiguous once
    else:
        out.backward(dout)
    n = -(-s // chunk)
    assert seen["blocks"] == n * (n + 1) // 2
    if not expanded:  # every block's dO is a view of dout, and dout never went into the store
        assert seen["views"] == seen["blocks"]
        assert seen["dout"] not in put
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    reference_attention(q64, k64, v64, d**-0.5).backward(dout.double())
    for ours, ref in zip((qs.grad, ks.grad, vs.grad), (q64.grad, k64.grad, v64.grad)):
        assert rel_err(ours, ref) < 1e-5
