"""hf_fpdt's tiled per-token head (:func:`hf_fpdt.memory.tiling.tiled_token_logprobs`): TRL's fused-head fields.

Values and gradients (upstream gradients on both the log-probabilities and the entropies) against a float64
full-logits reference and against TRL's own fused head, at temperature != 1, with ignored rows, a LoRA-wrapped
head and the family logit extras (scale, softcap).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import pytest
import torch
from testkit import tiny_model
from torch import nn

from hf_fpdt.memory.tiling import tiled_token_logprobs
from hf_fpdt.models import parts
from hf_fpdt.models.registry import LLAMA

N, E, V, T = 53, 32, 97, 0.7


def _fields64(head: nn.Module, h: torch.Tensor, y: torch.Tensor, temperature: float) -> tuple:
    z = head(h).double() / temperature
    logp = z.log_softmax(-1)
    valid = y != -100
    safe = torch.where(valid, y, 0)
    p = logp.exp()
    fields = (
        logp.gather(1, safe[:, None])[:, 0],
        -(p * logp).sum(-1),
        (2 * logp).logsumexp(-1),
        z.mean(-1),
        z.argmax(-1) == safe,
    )
    return tuple(torch.where(valid, f, torch.zeros((), dtype=f.dtype)) for f in fields)


def _check(head: nn.Module, params: list, temperature: float, tiles: int = 4, h=None, y=None, tol: float = 1e-6):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(N, E, generator=g) if h is None else h
    y = torch.randint(0, V, (N,), generator=g) if y is None else y
    y[[0, 5, 6, 30]] = -100
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)

    x = h.clone().requires_grad_(True)
    out = tiled_token_logprobs(x, head, y, tiles, params, temperature=temperature)
    wrt = [x, *params]
    grads = torch.autograd.grad((out[0] * g_lp).sum() + (out[1] * g_ent).sum(), wrt)

    ref_head = copy.deepcopy(head).double()
    ref_params = [
        dict(ref_head.named_parameters())[n] for n, p in head.named_parameters() if any(p is q for q in params)
    ]
    x64 = h.double().requires_grad_(True)
    ref = _fields64(ref_head, x64, y, temperature)
    ref_grads = torch.autograd.grad(
        (ref[0] * g_lp.double()).sum() + (ref[1] * g_ent.double()).sum(), [x64, *ref_params]
    )

    for name, a, b in zip(("log_probs", "entropy", "log_sum_sq", "mean_logits"), out[:4], ref[:4]):
        assert a.dtype == torch.float32 and a.shape == (N,)
        assert float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max()) < tol, name
    assert torch.equal(out[4], ref[4]) and out[4].dtype == torch.bool
    assert not out[0][[0, 5, 6, 30]].any() and not out[4][[0, 5, 6, 30]].any()
    for a, b in zip(grads, ref_grads):
        assert float((a.double() - b).abs().max() / b.abs().max()) < tol
    assert not grads[0][[0, 5, 6, 30]].any()  # ignored rows: no gradient
    return out, grads


@pytest.mark.parametrize("temperature", [1.0, T])
@pytest.mark.parametrize("tiles", [1, 4, 100])
def test_linear_head_matches_float64(temperature: float, tiles: int) -> None:
    torch.manual_seed(0)
    head = nn.Linear(E, V, bias=True)
    _check(head, list(head.parameters()), temperature, tiles)


def test_custom_head_with_extras_matches_float64() -> None:
    """A head with the family's logit division and softcap (through autograd, not the Linear fast path)."""
    torch.manual_seed(0)
    model = tiny_model(logits_scaling=2.0, final_logit_softcapping=3.0)
    fam = replace(LLAMA, logit_div="logits_scaling", final_softcap="final_logit_softcapping")
    head = parts.lm_head(fam, model)
    assert isinstance(head, functools.partial)
    lin = model.get_output_embeddings()
    h = torch.randn(N, lin.in_features)
    y = torch.randint(0, lin.out_features, (N,))

    class Extras(nn.Module):  # the same function as a module, for the float64 copy of the reference
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return torch.tanh(self.lin(x) / 2.0 / 3.0) * 3.0

    wrapped = Extras()
    out, grads = _check(wrapped, [lin.weight], T, h=h, y=y)
    x = h.clone().requires_grad_(True)
    again = tiled_token_logprobs(x, head, y, 4, [lin.weight], temperature=T)
    for a, b in zip(out, again):
        assert torch.equal(a, b)


def test_lora_head_matches_float64() -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = tiny_model()
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False))
    head = model.get_output_embeddings()
    assert type(head) is not nn.Linear
    params = [p for p in head.parameters() if p.requires_grad]
    assert len(params) == 2
    g = torch.Generator().manual_seed(2)
    h = torch.randn(N, model.config.hidden_size, generator=g)
    y = torch.randint(0, model.config.vocab_size, (N,), generator=g)
    _check(head, params, T, h=h, y=y, tol=2e-6)  # fp32 rounding of the LoRA chain's three matmuls: 1.04e-6


def test_matches_trl_fused_head() -> None:
    """TRL's ``add_fused_lm_head`` (its ChunkedLogProbFunction) on a tiny model with logit scale and softcap."""
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_model(logits_scaling=2.0, final_logit_softcapping=3.0)
    fam = replace(LLAMA, logit_div="logits_scaling", final_softcap="final_logit_softcapping")
    fields = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    add_fused_lm_head(model, temperature=T, outputs=fields)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=g)
    labels = ids.clone()
    labels[:, :9] = -100
    labels[1, -7:] = -100
    g_lp, g_ent = torch.randn(2, 39, generator=g), torch.randn(2, 39, generator=g)

    trl_out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    trl_loss = (trl_out.log_probs * g_lp).sum() + (trl_out.entropy * g_ent).sum()
    trl_grads = torch.autograd.grad(trl_loss, list(model.parameters()))

    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    lin = model.get_output_embeddings()
    out = tiled_token_logprobs(
        hidden.reshape(-1, hidden.shape[-1]), parts.lm_head(fam, model), labels[:, 1:].reshape(-1), 3, [lin.weight],
        temperature=T,
    )  # fmt: skip
    out = [f.view(2, 39) for f in out]
    ours = (out[0] * g_lp).sum() + (out[1] * g_ent).sum()
    grads = torch.autograd.grad(ours, list(model.parameters()))
    for name, a in zip(fields, out):
        b = getattr(trl_out, name)
        if name == "is_top1":
            assert torch.equal(a, b)
        else:
            assert float(((a - b).abs().max() / b.abs().max()).detach()) < 1e-5, name
    for (name, _), a, b in zip(model.named_parameters(), grads, trl_grads):
        assert float(((a - b).abs().max() / b.abs().max()).detach()) < 1e-5, name


def test_labels_outside_the_vocabulary_raise() -> None:
    head = nn.Linear(E, V)
    y = torch.full((N,), -100)
    y[3] = V
    with pytest.raises(ValueError, match=f"labels hold {V}, outside the vocabulary of {V} tokens"):
        tiled_token_logprobs(torch.randn(N, E), head, y, 2)
    with pytest.raises(ValueError, match="must be integer token ids"):
        tiled_token_logprobs(torch.randn(N, E), head, y.float(), 2)


def test_all_ignored_gives_zero_fields_and_gradients() -> None:
    head = nn.Linear(E, V)
    x = torch.randn(N, E, requires_grad=True)
    out = tiled_token_logprobs(x, head, torch.full((N,), -100), 3, list(head.parameters()))
    assert all(not f.any() for f in out)
    grads = torch.autograd.grad(out[0].sum() + out[1].sum(), [x, head.weight, head.bias])
    assert all(g is not None and not g.any() for g in grads)


def test_fused_head_call_at_one_process_uses_the_tiled_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """``install_sp_fused_head(model, None, ...)``: TRL's fused-head call answered by the tiled head (TRL's kernel
    never runs), TRL's output and gradients within 1e-5, at a temperature, pre-shifted labels too."""
    pytest.importorskip("trl")
    import trl.trainer.utils as trl_utils

    import hf_fpdt
    from hf_fpdt.trainers.trl_fused_head import install_sp_fused_head

    state = tiny_model().state_dict()
    ref = tiny_model(state=state)
    fields = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    trl_utils.add_fused_lm_head(ref, temperature=T, outputs=fields)
    model = hf_fpdt.apply(tiny_model(state=state), hf_fpdt.FPDTConfig(chunk_size=16))
    trl_utils.add_fused_lm_head(model, temperature=T, outputs=("log_probs",))
    install_sp_fused_head(model, None, 16, temperature=T)

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 512, (2, 50), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :12] = -100
    g_lp, g_ent = torch.randn(2, 49, generator=g), torch.randn(2, 49, generator=g)
    for shifted in (False, True):
        batch = {"input_ids": ids, "attention_mask": mask}
        if shifted:
            batch["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        else:
            batch["labels"] = labels
        expected = ref(**batch, fused_lm_head=True)
        total = (expected.log_probs[:, :49] * g_lp).sum() + (expected.entropy[:, :49] * g_ent).sum() + expected.loss
        want = torch.autograd.grad(total, list(ref.parameters()))

        def refused(*args, **kwargs):
            raise AssertionError("TRL's kernel ran")

        with monkeypatch.context() as patch:
            patch.setattr(trl_utils._ChunkedLogProbFunction, "apply", refused)
            out = model(**batch, fused_lm_head=True)
        assert type(out) is trl_utils.FusedCausalLMOutput
        assert torch.equal(out.label_mask, expected.label_mask)
        for name in fields:
            a, b = getattr(out, name), getattr(expected, name)
            if name == "is_top1":
                assert torch.equal(a, b)
            else:
                assert float(((a - b).abs().max() / b.abs().max()).detach()) < 1e-5, name
        assert float(((out.loss - expected.loss).abs() / expected.loss.abs()).detach()) < 1e-5
        total = (out.log_probs[:, :49] * g_lp).sum() + (out.entropy[:, :49] * g_ent).sum() + out.loss
        got = torch.autograd.grad(total, list(model.parameters()))
        for (name, _), a, b in zip(ref.named_parameters(), got, want):
            assert float(((a - b).abs().max() / b.abs().max()).detach()) < 1e-5, name


def test_head_in_float32_under_autocast_as_trl_casts_it() -> None:
    """``head_fp32=True`` (GRPO's ``cast_lm_head_to_fp32``): under bf16 autocast the tiled head projects in float32,
    as TRL's kernel does with that option (within 1e-5 on the same backbone); without it the head runs in bf16."""
    pytest.importorskip("trl")
    import trl.trainer.utils as trl_utils

    import hf_fpdt
    from hf_fpdt.trainers.trl_fused_head import install_sp_fused_head

    state = tiny_model().state_dict()

    def model(install: bool | None):
        m = hf_fpdt.apply(tiny_model(state=state), hf_fpdt.FPDTConfig(chunk_size=16))
        trl_utils.add_fused_lm_head(m, cast_lm_head_to_fp32=install is None)
        if install is not None:
            install_sp_fused_head(m, None, 16, head_fp32=install)
        return m

    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        want = model(None)(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.float()
        fp32 = model(True)(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.float()
        bf16 = model(False)(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.float()
    err = float((fp32 - want).abs().max() / want.abs().max())
    assert err < 1e-5, err
    assert float((bf16 - want).abs().max() / want.abs().max()) > 10 * max(err, 1e-7)  # the option matters
