"""``generate()`` through fpdt attention (:mod:`hf_fpdt.attention.cached_attention`): KV-cache prefill and decode steps.

Greedy tokens and every step's scores must equal HF ``sdpa`` on the same weights (fp32, tiny configs,
a prompt length no chunk divides, batch 2 with left padding), with and without ``hf_fpdt.apply``,
with HF's chunked prefill and a static cache (whose unwritten slots are never read); Mistral with a
window shorter than the prompt and Gemma 2 (softcaps, alternating windows) equal ``eager``; the block
loop itself against a float64 reference with padding, explicit 4D masks, rows that see no key, windows
(the band of blocks) and softcaps; and a prefill's working memory inside attention set by the chunk,
not by the prompt; every registered family generates as sdpa (eager for Gemma 2/3) after ``apply``.
Sequence-parallel generation: ``test_generate_sp.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from families import family_config
from standins import dense_attention, reference_attention
from testkit import rel_err, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig

import hf_fpdt
from hf_fpdt import FPDTConfig
from hf_fpdt.attention import cached_attention as decode
from hf_fpdt.attention.routes import Router
from hf_fpdt.integrations.registration import fpdt_attention_forward, fpdt_mask
from hf_fpdt.models.presets import preset_config
from hf_fpdt.models.registry import FAMILIES as REGISTERED

CHUNK, PROMPT, PAD, NEW = 16, 45, 7, 8  # 45 = 2 * 16 + 13: the last chunk is short


def _config(family: str):
    if family == "qwen2":  # a registry family, run through attn_implementation="fpdt" alone (no apply)
        return AutoConfig.for_model(
            "qwen2",
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        )
    return preset_config(f"tiny-{family}")


def _pair(family: str, applied: bool):
    ref = tiny_model(_config(family), "sdpa", dtype=None, seed=None).float().eval()
    model = copy.deepcopy(ref)
    if applied:
        hf_fpdt.apply(model, FPDTConfig(chunk_size=CHUNK, offload=True))
    else:
        model.set_attn_implementation("fpdt")
        hf_fpdt.configure(model, FPDTConfig(chunk_size=CHUNK, offload=False))
    return ref, model


def _prompts(batch: int = 2):
    ids = torch.randint(5, 500, (batch, PROMPT))
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0  # left padding, as generation batches are padded
    ids[1, :PAD] = 0
    return ids, mask


@pytest.fixture
def spy(monkeypatch):
    """Records the (queries, keys) of every call of the decode block loop."""
    calls = []
    inner = decode.cached_attention

    def wrapped(q, k, *args, **kwargs):
        calls.append((q.shape[1], k.shape[1]))
        return inner(q, k, *args, **kwargs)

    monkeypatch.setattr(decode, "cached_attention", wrapped)
    return calls


def _generate(model, ids, mask, **kwargs):
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences, torch.stack(out.scores)


CASES = [
    ("llama", False, {}),
    ("llama", True, {}),
    ("llama", True, {"prefill_chunk_size": 13}),
    ("llama", False, {"cache_implementation": "static"}),
    ("neox", False, {"prefill_chunk_size": 13}),
    ("neox", True, {}),
    ("qwen2", False, {}),
    ("qwen2", True, {}),
]


@pytest.mark.parametrize(
    "family,applied,kwargs",
    CASES,
    ids=[f"{f}-{'apply' if a else 'attn'}-{'-'.join(k) or 'plain'}" for f, a, k in CASES],
)
def test_greedy_generation_matches_sdpa(spy, family, applied, kwargs):
    ref, model = _pair(family, applied)
    ids, mask = _prompts()
    want, want_scores = _generate(ref, ids, mask, **kwargs)
    assert not spy
    got, scores = _generate(model, ids, mask, **kwargs)
    assert torch.equal(got, want)
    assert rel_err(scores, want_scores) < 1e-5
    layers = model.config.num_hidden_layers
    prefill = kwargs.get("prefill_chunk_size", PROMPT)
    assert len(spy) == layers * (-(-PROMPT // prefill) + NEW - 1)  # every attention call took the cache path
    assert max(q for q, _ in spy) == prefill and min(q for q, _ in spy) == 1  # prefill (chunks), then decode
    assert max(k for _, k in spy) == PROMPT + NEW - 1  # a static cache's unwritten slots are never read


WINDOWED = [
    ("mistral", {"sliding_window": 10}, {}),  # a window shorter than a chunk (16) and than the prompt (45)
    ("mistral", {"sliding_window": 21}, {"prefill_chunk_size": 13}),  # longer than a chunk; a full cache's 4D mask
    ("mistral", {"sliding_window": 21}, {"cache_implementation": "static"}),
    ("gemma2", {"sliding_window": 12, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}, {}),
]


def _windowed_config(model_type: str, overrides: dict):
    from transformers import AutoConfig

    common = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256}
    return AutoConfig.for_model(model_type, **common, **heads, **overrides)


@pytest.mark.parametrize(
    "model_type,overrides,kwargs", WINDOWED, ids=[f"{m}-{'-'.join(k) or 'plain'}" for m, _, k in WINDOWED]
)
def test_windowed_and_softcapped_generation_matches_eager(spy, model_type, overrides, kwargs):
    """Sliding windows (a band of blocks in attention.cached_attention) and Gemma 2's softcaps on the cache path."""
    cfg = _windowed_config(model_type, overrides)
    ref = tiny_model(cfg, "eager", dtype=None).float().eval()
    model = hf_fpdt.apply(copy.deepcopy(ref), FPDTConfig(chunk_size=CHUNK))
    ids, mask = _prompts()
    want, want_scores = _generate(ref, ids, mask, **kwargs)
    got, scores = _generate(model, ids, mask, **kwargs)
    assert torch.equal(got, want)
    assert rel_err(scores, want_scores) < 1e-5
    assert len(spy) == cfg.num_hidden_layers * (-(-PROMPT // kwargs.get("prefill_chunk_size", PROMPT)) + NEW - 1)


def test_cached_attention_with_a_window_and_softcap(backend):
    """The band: blocks before the window are skipped, the cut ones masked; against float64 with padding."""
    b, h, hkv, d, scale, cap = 2, 4, 2, 16, 0.3, 2.0
    for sq, sk, window in ((37, 101, 10), (1, 101, 20), (50, 50, 16), (50, 50, 60)):
        q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, hkv, d), torch.randn(b, sk, hkv, d)
        keys = torch.ones(b, sk, dtype=torch.bool)
        keys[1, :23] = False
        t = torch.arange(sk - sq, sk)[:, None]
        band = torch.arange(sk)[None, :] > t - window
        for mask in (None, keys):
            got = decode.cached_attention(q, k, v, scale, CHUNK, keys=mask, **backend, window=window, softcap=cap)
            want = dense_attention(q, k, v, _causal_keep(b, sq, sk, mask) & band, scale=scale, softcap=cap).out
            assert rel_err(got, want) < 1e-5, (sq, sk, window, mask is None)
    # the band: each query chunk of 16 meets at most 2 key blocks under a window of 10 (7 without one)
    assert [len(blocks) for _, blocks in decode._plan(37, 101, CHUNK, True, 10)] == [2, 2, 2]


def test_applied_model_keeps_the_signature_generate_reads():
    _, model = _pair("llama", applied=True)
    seen = []
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    ids, mask = _prompts()
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert seen == [1, 1, 1]  # logits_to_keep=1: the prefill builds no [prompt, vocab] logits


def test_no_grad_forward_with_left_padding_matches_sdpa():
    ref, model = _pair("llama", applied=True)
    ids, mask = _prompts()
    with torch.no_grad():
        want, got = ref(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
    real = mask.bool()
    assert rel_err(got[real], want[real]) < 1e-5
    assert torch.isfinite(got).all()  # padding rows see no key: 0, never NaN


def test_gradient_forward_with_an_empty_cache_stays_on_the_training_path():
    ref, model = _pair("llama", applied=True)  # eval mode, config.use_cache on: HF fills a cache on the side
    ids = torch.randint(5, 500, (2, PROMPT))
    got, want = model(ids, use_cache=True).logits, ref(ids, use_cache=True).logits
    assert rel_err(got, want) < 1e-5
    got.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- the block loop itself


def _causal_keep(b, sq, sk, keys=None):
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq).expand(b, 1, sq, sk)
    return keep if keys is None else keep & keys[:, None, None, :]


@pytest.fixture(params=[None, "kernel", "math"], ids=["default", "kernel", "math"])
def backend(request):
    """``cached_attention``'s backend arguments: the device's choice at the default slices (CPU's flash kernel, which
    takes the mask), that kernel over slices of 5 rows (its additive mask: 5 rows of [B=2, Sk] fp32 at Sk = CHUNK), or
    the fp32 matmul other devices use over slices of 3 rows (its scores: 3 rows of [B=2, H=4, Sk] at Sk = CHUNK)."""
    if request.param == "kernel":
        return {"backend": None, "scores_bytes": 5 * 2 * CHUNK * 4}
    if request.param == "math":
        return {"backend": "math", "scores_bytes": 3 * 2 * 4 * CHUNK * 4}
    return {"backend": None}


@pytest.mark.parametrize("sq,sk", [(1, 101), (37, 101), (50, 50), (16, 16)])
def test_cached_attention_with_key_padding(sq, sk, backend):
    b, h, hkv, d, scale = 2, 4, 2, 16, 0.3
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, hkv, d), torch.randn(b, sk, hkv, d)
    keys = torch.ones(b, sk, dtype=torch.bool)
    keys[1, :23] = False  # left padding longer than a chunk: whole blocks and part of one are padding
    for mask in (None, keys):
        out = decode.cached_attention(q, k, v, scale, CHUNK, keys=mask, **backend)
        want = reference_attention(q, k, v, scale, causal=False, keep=_causal_keep(b, sq, sk, mask))
        assert rel_err(out, want) < 1e-5, (sq, sk, mask is None)
    if sq == sk:  # the padding queries themselves see no key at all: zeros, not NaN
        out = decode.cached_attention(q, k, v, scale, CHUNK, keys=keys, **backend)
        assert torch.isfinite(out).all() and out[1, :23].abs().max() == 0


def test_cached_attention_skips_blocks_no_row_sees(monkeypatch):
    """A decode step over a static cache (every slot in the mask, the unwritten ones False) and a left-padded
    prompt: blocks whose keys no row may see are never run; the result equals the reference."""
    b, h, hkv, d, scale, sk = 2, 4, 2, 16, 0.3, 5 * CHUNK
    runs = []
    real = Router.forward  # a cut or whole block; a key's length in its second argument after self
    monkeypatch.setattr(Router, "forward", lambda r, *a, **kw: runs.append(a[1].shape[1]) or real(r, *a, **kw))
    masked = decode.masked_block
    monkeypatch.setattr(decode, "masked_block", lambda *a, **kw: runs.append(a[1].shape[1]) or masked(*a, **kw))
    q, k, v = torch.randn(b, 1, h, d), torch.randn(b, sk, hkv, d), torch.randn(b, sk, hkv, d)
    keys = torch.arange(sk) < CHUNK + 7  # written: one block and 7 keys of the next; 3 blocks unwritten
    keys = keys.expand(b, sk).clone()
    keys[1, :3] = False
    out = decode.cached_attention(q, k, v, scale, CHUNK, keys=keys)
    assert sum(runs) == 2 * CHUNK  # the two blocks holding written keys, not the 5 of the cache
    keep = keys[:, None, None, :].expand(b, h, 1, sk)
    assert rel_err(out, reference_attention(q, k, v, scale, causal=False, keep=keep)) < 1e-5
    runs.clear()
    q = torch.randn(b, sk, h, d)
    left = torch.ones(b, sk, dtype=torch.bool)
    left[:, : 2 * CHUNK] = False  # every row left-padded over two blocks
    out = decode.cached_attention(q, k, v, scale, CHUNK, keys=left)
    assert rel_err(out, reference_attention(q, k, v, scale, causal=False, keep=_causal_keep(b, sk, sk, left))) < 1e-5
    assert torch.isfinite(out).all() and out[:, : 2 * CHUNK].abs().max() == 0  # queries that see no key: zeros
    assert sum(runs) == (1 + 2 + 3) * CHUNK  # query chunks 2, 3, 4 over key blocks 2..i; blocks 0, 1 never run


def test_cached_attention_with_4d_masks(backend):
    b, sq, sk, h, hkv, d, scale = 2, 21, 70, 4, 1, 8, 0.25
    q, k, v = torch.randn(b, sq, h, d), torch.randn(b, sk, hkv, d), torch.randn(b, sk, hkv, d)
    keep = torch.rand(b, h, sq, sk) > 0.6
    keep[0, 0, 3] = False  # a row that keeps nothing
    keep[1, :, :, :CHUNK] = False  # rows whose first blocks keep nothing, later blocks something
    want = reference_attention(q, k, v, scale, causal=False, keep=keep)
    out = decode.cached_attention(q, k, v, scale, CHUNK, mask=keep, **backend)
    assert rel_err(out, want) < 1e-5 and out[0, 3, 0].abs().max() == 0
    bias = torch.zeros(b, 1, sq, sk).masked_fill(~keep[:, :1], torch.finfo(torch.float32).min)  # HF eager style
    out = decode.cached_attention(q, k, v, scale, CHUNK, mask=bias, **backend)
    assert rel_err(out, reference_attention(q, k, v, scale, causal=False, keep=keep[:, :1].expand_as(keep))) < 1e-5


class WidestRows(TorchDispatchMode):
    """The most ``rows x columns`` (the last two dims' product) of any tensor an op allocates (views of its inputs,
    such as a block's view of the caller's 4D mask, are no allocation), and that op: a cut block's whole mask or
    scores ``[.., c, c]`` shows as ``c * c``."""

    def __init__(self):
        super().__init__()
        self.widest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves
        inputs = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if torch.is_tensor(t)}
        for t in leaves(out):
            if not torch.is_tensor(t) or t.dim() < 2 or t.untyped_storage().data_ptr() in inputs:
                continue
            if t.shape[-2] * t.shape[-1] > self.widest:
                self.widest, self.op = t.shape[-2] * t.shape[-1], str(func)
        return out


@pytest.mark.parametrize("kind", ["window", "padding", "mask4d", "float4d"])
@pytest.mark.parametrize("backend", [None, "math"], ids=["kernel", "math"])
def test_cut_blocks_build_no_whole_mask(kind, backend):
    """A prefill of two chunks of 256 whose blocks a window, key padding or a 4D mask cut: with the kernels' bound set
    to 16 rows a slice, no op makes a tensor of a block's ``[c, c]`` (mask, additive mask or scores; before, each cut
    block got its whole ``[1|B, 1, c, c]`` keep and additive masks, and CPU's kernel the whole additive mask), and the
    result is the float64 reference's."""
    c, b, h, hkv, d, scale = 256, 2, 4, 2, 8, 0.3
    sk = 2 * c
    gen = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(b, sk, h, d, generator=gen),
        torch.randn(b, sk, hkv, d, generator=gen),
        torch.randn(b, sk, hkv, d, generator=gen),
    )
    keys = torch.ones(b, sk, dtype=torch.bool)
    keys[1, : c + 40] = False  # block 0 padding in row 1, block 1 cut
    keep = _causal_keep(b, sk, sk)
    kwargs = {}
    if kind == "window":
        kwargs["window"] = 100
        keep = keep & (torch.arange(sk)[None, :] > torch.arange(sk)[:, None] - 100)
    elif kind == "padding":
        kwargs["keys"] = keys
        keep = _causal_keep(b, sk, sk, keys)
    else:
        keep = _causal_keep(b, sk, sk, keys) & (torch.rand(b, 1, sk, sk, generator=gen) > 0.2)
        kwargs["mask"] = (
            keep if kind == "mask4d" else torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        )
    bound = 16 * b * h * c * 4 if backend == "math" else 16 * b * c * 4  # 16 rows of scores / of additive mask
    with WidestRows() as rec:
        out = decode.cached_attention(q, k, v, scale, c, backend=backend, scores_bytes=bound, **kwargs)
    assert rec.widest <= 16 * (h // hkv) * c < c * c // 4, (rec.widest, rec.op)  # 16 rows of 2 heads (GQA folded)
    assert rel_err(out, reference_attention(q, k, v, scale, causal=False, keep=keep)) < 1e-5


def test_mask_function_for_generation():
    left = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    assert fpdt_mask(2, 5, 5) is None  # training: causal, no mask
    assert fpdt_mask(2, 1, 6, q_offset=5) is None  # decoding without padding
    got = fpdt_mask(2, 5, 5, attention_mask=left)
    assert got.dtype == torch.bool and torch.equal(got, left.bool())  # left padding: the key mask, O(keys)
    got = fpdt_mask(2, 1, 6, q_offset=5, attention_mask=torch.cat([left, torch.ones(2, 1, dtype=torch.long)], 1))
    assert got.shape == (2, 6)
    static = fpdt_mask(2, 5, 12, q_offset=0, attention_mask=left)  # static cache: the written slots' key mask
    assert static.dtype == torch.bool and torch.equal(static, left.bool())
    static = fpdt_mask(2, 1, 12, q_offset=5, attention_mask=torch.ones(2, 6, dtype=torch.long))
    written = torch.arange(12) < 6  # a decode step: every slot (one shape at every position), 6 of 12 written
    assert torch.equal(static, written.expand(2, 12))
    prefill = fpdt_mask(2, 3, 12, q_offset=3, attention_mask=torch.ones(2, 6, dtype=torch.long))
    assert torch.equal(prefill, torch.ones(2, 6, dtype=torch.bool))  # a prefill chunk: up to the last written slot
    dropped = fpdt_mask(2, 1, 4, q_offset=9, kv_offset=6, attention_mask=torch.ones(2, 10, dtype=torch.long))
    assert dropped.shape == (2, 1, 1, 4)  # a sliding cache that has dropped keys: HF's 4D mask


def test_calls_that_need_gradients_and_a_cache_raise():
    q = torch.randn(1, 4, 1, 16, requires_grad=True)
    k, v = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)

    class Module(torch.nn.Module):
        is_causal = True

    with pytest.raises(ValueError, match="already holds earlier tokens"):
        fpdt_attention_forward(Module(), q, k, v, None)
    with torch.no_grad():
        out, _ = fpdt_attention_forward(Module(), q, k, v, None, scaling=0.25)
    want = reference_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.25, causal=False, keep=_causal_keep(1, 1, 9)
    )
    assert out.shape == (1, 1, 4, 16) and rel_err(out, want) < 1e-5


# ----------------------------------------------------------------------------- memory


class LargestAllocation(TorchDispatchMode):
    """The largest tensor any op allocates (outputs sharing no storage with an input; ``empty`` excluded:
    that is the attention's output buffer)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.startswith(("empty", "new_empty")):
            return out
        leaves = torch.utils._pytree.tree_leaves
        inputs = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if torch.is_tensor(t)}
        for t in leaves(out):
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _prefill_largest(monkeypatch, prompt: int, chunk: int) -> tuple[int, int]:
    """Largest allocation inside the attention of a left-padded prefill (generate, one new token), and the
    bytes of one layer's key cache."""
    _, model = _pair("llama", applied=True)
    model.fpdt.runtime.config.chunk_size = chunk
    mode = LargestAllocation()
    inner = decode.cached_attention

    def tracked(*args, **kwargs):
        with mode:
            return inner(*args, **kwargs)

    monkeypatch.setattr(decode, "cached_attention", tracked)
    ids = torch.randint(5, 500, (2, prompt))
    mask = torch.ones_like(ids)
    mask[1, : prompt // 3] = 0  # left padding over several chunks: the masked path runs too
    out = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)  # fmt: skip
    monkeypatch.setattr(decode, "cached_attention", inner)
    return mode.largest, out.past_key_values.layers[0].keys.untyped_storage().nbytes()


def test_prefill_memory_grows_with_the_chunk_not_the_prompt(monkeypatch):
    short, cache_short = _prefill_largest(monkeypatch, 150, CHUNK)
    long, cache_long = _prefill_largest(monkeypatch, 600, CHUNK)
    assert cache_long > 3.9 * cache_short  # the cache grows with the prompt ...
    assert long == short  # ... the attention's working set does not
    wider, _ = _prefill_largest(monkeypatch, 150, 4 * CHUNK)
    assert wider > 3 * short  # it is set by the chunk (score blocks [B, H, c, c] grow with c^2)
    assert short < cache_short  # and even a short prompt's cache is larger


@pytest.mark.parametrize("model_type", sorted(REGISTERED))
def test_every_family_generates_as_sdpa(model_type):
    """Greedy tokens and scores of ``generate()`` on every family ``apply`` supports (the README's list) equal
    sdpa's (eager's for Gemma 2 and 3, whose softcaps and windows HF computes there, and for gpt-oss, whose sinks
    sdpa does not have), left-padded batch, on the installed transformers (the cache under either keyword)."""
    cfg = family_config(model_type, output_router_logits=False)
    eager = model_type.startswith("gemma") and model_type != "gemma" or model_type == "gpt_oss"
    attn = "eager" if eager else "sdpa"
    ref = tiny_model(cfg, attn).eval()
    model = hf_fpdt.apply(copy.deepcopy(ref), FPDTConfig(chunk_size=CHUNK))
    ids, mask = _prompts()
    ids = ids % cfg.get_text_config().vocab_size
    want, want_scores = _generate(ref, ids, mask)
    got, scores = _generate(model, ids, mask)
    assert torch.equal(got, want)
    assert rel_err(scores, want_scores) < 1e-5
