"""Tiled MLP and tiled LM head + cross-entropy equal their untiled selves (fp32, CPU).

Ground truth is plain autograd over the untiled computation: the module on the whole sequence, and
``F.cross_entropy(head(h).float(), reduction="sum")`` on full logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXMLP
from transformers.models.llama.modeling_llama import LlamaMLP

from hf_fpdt.memory.tiling import IGNORE_INDEX, tile_bounds, tiled_lm_loss, tiled_mlp
from hf_fpdt.models.presets import preset_config

RTOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize(("n", "tiles"), [(1, 1), (1, 5), (10, 3), (10, 4), (37, 8), (37, 100), (64, 2)])
def test_tile_bounds_cover_in_order(n, tiles):
    bounds = tile_bounds(n, tiles)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(b0[1] == b1[0] for b0, b1 in zip(bounds, bounds[1:]))
    assert all(b > a for a, b in bounds)
    assert len(bounds) <= min(tiles, n)
    assert tile_bounds(0, 4) == []


def _mlp(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "swiglu":
        return LlamaMLP(preset_config("tiny-llama"))
    return GPTNeoXMLP(preset_config("tiny-neox"))  # GELU, biases


def _params(m: nn.Module) -> list[nn.Parameter]:
    return [p for p in m.parameters() if p.requires_grad]


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
@pytest.mark.parametrize(("seq", "tiles"), [(37, 4), (37, 1), (5, 100), (1, 3)])
def test_tiled_mlp_equals_untiled(kind, seq, tiles):
    mlp = _mlp(kind)
    x = torch.randn(2, seq, 64, requires_grad=True)
    dy = torch.randn(2, seq, 64)

    ref = mlp(x)
    ref_grads = torch.autograd.grad(ref, [x, *_params(mlp)], dy)
    out = tiled_mlp(mlp.forward, x, tiles, _params(mlp))
    grads = torch.autograd.grad(out, [x, *_params(mlp)], dy)

    assert _rel(out, ref) < RTOL
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < RTOL


def test_tiled_mlp_frozen_params_and_param_only_grads():
    mlp = _mlp("swiglu")
    for p in mlp.parameters():
        p.requires_grad_(False)
    x = torch.randn(1, 19, 64, requires_grad=True)
    (gx,) = torch.autograd.grad(tiled_mlp(mlp.forward, x, 3, []).sum(), [x])
    (rx,) = torch.autograd.grad(mlp(x).sum(), [x])
    assert _rel(gx, rx) < RTOL
    # input without grad, parameters trained: only parameter gradients, through autograd's accumulation
    for p in mlp.parameters():
        p.requires_grad_(True)
    x = torch.randn(1, 19, 64)
    tiled_mlp(mlp.forward, x, 3, _params(mlp)).square().sum().backward()
    got = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    mlp(x).square().sum().backward()
    for g, p in zip(got, mlp.parameters()):
        assert _rel(g, p.grad) < RTOL


def test_tiled_mlp_replays_dropout_exactly():
    """Recompute in backward must draw the same dropout masks as the forward did, tile by tile."""
    torch.manual_seed(0)
    fn = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 16)).train()
    x = torch.randn(2, 23, 16, requires_grad=True)
    dy = torch.randn(2, 23, 16)
    bounds = tile_bounds(23, 4)

    torch.manual_seed(123)
    ref = torch.cat([fn(x[:, a:b]) for a, b in bounds], dim=1)  # same draw order as the tiles
    ref_grads = torch.autograd.grad(ref, [x, *fn.parameters()], dy)
    torch.manual_seed(123)
    out = tiled_mlp(fn, x, 4, list(fn.parameters()))
    torch.manual_seed(999)  # backward must not depend on the RNG state it finds
    grads = torch.autograd.grad(out, [x, *fn.parameters()], dy)

    assert torch.equal(out, ref)
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < RTOL
    with torch.no_grad():
        assert not torch.allclose(out, fn.eval()(x))  # dropout really was active


def _loss_case(n: int, vocab: int = 97, hidden: int = 24, bias: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    head = nn.Linear(hidden, vocab, bias=bias)
    h = torch.randn(n, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    labels[: n // 3] = IGNORE_INDEX  # a prompt without targets: whole tiles skip
    labels[-1] = IGNORE_INDEX
    return head, h, labels


def _reference_loss(head, h, labels):
    return F.cross_entropy(head(h).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("trained_head", [True, False])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tiles", [1, 7, 1000])
def test_tiled_lm_loss_equals_full_logits(trained_head, bias, tiles):
    head, h, labels = _loss_case(61, bias=bias)
    head.requires_grad_(trained_head)
    params = [p for p in head.parameters() if p.requires_grad]
    wrt = [h, *params]

    ref = _reference_loss(head, h, labels)
    ref_grads = torch.autograd.grad(ref * 0.37, wrt)  # a non-unit upstream gradient
    loss, count = tiled_lm_loss(h, head, labels, tiles, params)
    grads = torch.autograd.grad(loss * 0.37, wrt)

    assert loss.dtype == torch.float32 and count.item() == int((labels != IGNORE_INDEX).sum())
    assert _rel(loss, ref) < RTOL
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < RTOL


def test_tiled_lm_loss_generic_head_module():
    """A head that is not a plain nn.Linear (e.g. a LoRA wrapper) goes through autograd per tile."""
    head, h, labels = _loss_case(40, bias=True)
    wrapped = nn.Sequential(head)
    params = list(head.parameters())
    ref_grads = torch.autograd.grad(_reference_loss(head, h, labels), [h, *params])
    loss, _ = tiled_lm_loss(h, wrapped, labels, 6, params)
    grads = torch.autograd.grad(loss, [h, *params])
    assert _rel(loss, _reference_loss(head, h, labels)) < RTOL
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < RTOL


def test_tiled_lm_loss_batched_shape_and_low_precision_head():
    """[B, S, E] input; a bf16 head is upcast per tile exactly as HF's loss upcasts the full logits."""
    head, _, _ = _loss_case(1)
    head = head.to(torch.bfloat16)
    h = torch.randn(2, 33, 24, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 97, (2, 33))
    labels[0, :5] = IGNORE_INDEX
    ref = F.cross_entropy(head(h).float().flatten(0, 1), labels.flatten(), reduction="sum")
    (ref_gh,) = torch.autograd.grad(ref, [h])
    loss, count = tiled_lm_loss(h, head, labels, 5, [])
    (gh,) = torch.autograd.grad(loss, [h])
    assert count.item() == 61
    assert _rel(loss, ref) < 1e-5  # the same bf16 logits, the same fp32 reduction up to order
    assert _rel(gh.float(), ref_gh.float()) < 1e-2  # bf16 rounding of the per-tile backward


def test_tiled_lm_loss_no_targets_and_no_grad():
    head, h, labels = _loss_case(20)
    labels[:] = IGNORE_INDEX
    loss, count = tiled_lm_loss(h, head, labels, 4, list(head.parameters()))
    assert loss.item() == 0.0 and count.item() == 0
    loss.backward()
    assert torch.count_nonzero(h.grad) == 0
    with torch.no_grad():  # evaluation: no gradient work, same value
        head2, h2, labels2 = _loss_case(20)
        value, _ = tiled_lm_loss(h2, head2, labels2, 4, list(head2.parameters()))
    assert _rel(value, _reference_loss(head2, h2, labels2).detach()) < RTOL


def test_tiled_lm_loss_rejects_mismatched_labels():
    head, h, labels = _loss_case(20)
    with pytest.raises(ValueError, match="must match"):
        tiled_lm_loss(h, head, labels[:-1], 4)
