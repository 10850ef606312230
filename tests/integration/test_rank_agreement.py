"""The ranks agree on everything that must match, and every collective is guarded (issue 29, items 3, 4, 6).

Two gloo ranks in one launch (:func:`distributed.run_distributed`) hold something different each, as a user
would build it by mistake, and every rank must end with the same :class:`SPAgreementError` naming the field and
both ranks' values (before this, a Llama on one rank and a Qwen2 on the other trained to a loss matching
neither, other layer counts or hidden sizes aborted a rank in gloo, other prompts generated tokens matching no
sdpa run, another ``max_new_tokens`` hung in gloo):

* at ``hf_fpdt.apply``: the model type, the layer count, the hidden size, the dtype, the trainable parameters,
  an attention pattern on one rank only, and a bare ``mask_mod`` closing over another window;
* at a step: an attention mask on one rank only (all ones: the same loss, but other collectives);
* at ``generate``'s prefill: other prompts, another ``max_new_tokens``, sampling from other random states;
  an all-ones mask on one rank only is the same prompt and generates sdpa's tokens.

Dead and late peers (:mod:`fault_script`, each rank its own process): a rank killed before
``FPDTPlugin.prepare``, before ``prepare`` measures ``chunk_size="auto"``, or before SP decode step 3, or late in
that step, ends its peer with :class:`SPPeerFailure` naming the rank, the collective and the timeout, within
the bound. And: ``sp_timeout`` must be positive, ``build_groups`` has a finite default timeout, and an
``sp_size`` from ``FPDT_SP_SIZE`` says so.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from launch import fault_ranks
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.attention.sparse_patterns import local_global
from hf_fpdt.data.layout import shard_batch
from hf_fpdt.distributed.groups import build_groups
from hf_fpdt.distributed.timeouts import DEFAULT_TIMEOUT, group_timeout

TIMEOUT = 4.0  # seconds a collective waits for a missing rank
CHUNK = 16


def _caught(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # returned to the parent, which checks type and message on both ranks
        return type(exc).__name__, str(exc)
    return None


def _config(**kwargs) -> hf_fpdt.FPDTConfig:
    return hf_fpdt.FPDTConfig(chunk_size=CHUNK, offload=False, **kwargs)


def _window(width: int):
    def mask_mod(b, h, q, kv):
        return (kv <= q) & (q - kv < width)

    return mask_mod


def _qwen2():
    """A Qwen2 of tiny-llama's shapes."""
    torch.manual_seed(0)
    shapes = {k: v for k, v in tiny_model().config.to_dict().items() if k.endswith(("_size", "_layers", "_heads"))}
    return tiny_model("qwen2", None, dtype=None, seed=None, **shapes).float()


def _apply_cases(rank: int, group) -> dict:
    def apply(model, config=None):
        return lambda: hf_fpdt.apply(model, config or _config(), group=group)

    frozen = tiny_model()
    if rank == 1:
        frozen.lm_head.weight.requires_grad_(False)
    pattern = local_global(8, 2) if rank == 0 else None
    return {
        "model type": _caught(apply(tiny_model() if rank == 0 else _qwen2())),
        "layers": _caught(apply(tiny_model(num_hidden_layers=2 + rank))),
        "hidden size": _caught(apply(tiny_model(hidden_size=64 * (1 + rank)))),
        "dtype": _caught(apply(tiny_model(dtype=torch.float32 if rank == 0 else torch.bfloat16))),
        "trainable": _caught(apply(frozen)),
        "pattern on one rank": _caught(apply(tiny_model(), _config(attention_pattern=pattern))),
        "mask_mod": _caught(apply(tiny_model(), _config(attention_pattern=_window(8 + 4 * rank)))),
        "same": _caught(apply(tiny_model(), _config(attention_pattern=_window(8)))),
        "configure": _caught(lambda: hf_fpdt.configure(tiny_model(num_hidden_layers=2 + rank), _config(), group)),
    }  # fmt: skip


def _step_cases(rank: int, group) -> dict:
    model = hf_fpdt.apply(tiny_model(), _config(), group=group)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    shard = shard_batch(ids, ids, rank=rank, sp_size=2, chunk_size=CHUNK)
    kwargs = shard.model_kwargs()
    ones = {"attention_mask": torch.ones_like(shard.input_ids)} if rank == 0 else {}
    short = {"attention_mask": torch.ones(1, 7, dtype=torch.long)} if rank == 0 else {}  # 7 for 32 tokens
    out = {"mask on one rank": _caught(lambda: model(**kwargs, **ones))}
    out["short mask on one rank"] = _caught(lambda: model(**kwargs, **short))
    out["after"] = model(**kwargs).loss.detach()  # the group works on: both ranks without a mask
    out["pickled"] = _caught(lambda: torch.save(model, io.BytesIO()))
    # weights built with seed = rank, the same architecture: refused at the first forward (issue 38)
    other = hf_fpdt.apply(tiny_model(seed=rank), _config(), group=group)
    out["weights"] = _caught(lambda: other(**kwargs))
    return out


def _generate(model, ids, mask=None, new: int = 4, **kwargs):
    extra = {} if mask is None else {"attention_mask": mask}
    return model.generate(ids, max_new_tokens=new, pad_token_id=0, **extra, **kwargs)


def _generate_cases(rank: int, group) -> dict:
    ref = tiny_model().eval()
    model = hf_fpdt.apply(copy.deepcopy(ref), _config(), group=group)
    ids = torch.randint(5, 500, (1, 37), generator=torch.Generator().manual_seed(1))
    other = ids.clone()
    other[0, 5] += rank  # rank 1's prompt differs in one token
    torch.manual_seed(rank)  # the ranks' random generators differ
    out = {
        "prompts": _caught(lambda: _generate(model, other)),
        "max_new_tokens": _caught(lambda: _generate(model, ids, new=3 + rank)),
        "sampling": _caught(lambda: _generate(model, ids, do_sample=True, top_k=50)),
    }
    mask = torch.ones_like(ids) if rank == 0 else None  # the same prompt: agreed, sdpa's tokens
    out["ones on one rank"] = (_generate(model, ids, mask), _generate(ref, ids))
    hf_fpdt.unapply(model)
    out["unapplied generate"] = "generate" in vars(model)
    return out


def _worker(rank: int, world_size: int) -> dict:
    refused = _caught(lambda: build_groups(2, timeout=0))
    groups = build_groups(2)  # the default timeout
    out = {"timeout 0": refused, "default timeout": group_timeout(groups.sp).total_seconds()}
    groups = build_groups(2, timeout=TIMEOUT)
    out.update(_apply_cases(rank, groups.sp))
    out.update(_step_cases(rank, groups.sp))
    out.update(_generate_cases(rank, groups.sp))
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(_worker, 2, timeout=240)


def _refused_alike(ranks: list[dict], case: str) -> str:
    first, second = (r[case] for r in ranks)
    assert first == second, (first, second)  # the same error on every rank
    assert first is not None and first[0] == "SPAgreementError", first
    return first[1]


@pytest.mark.multiprocess
def test_apply_refuses_different_models_on_every_rank(ranks) -> None:
    msg = _refused_alike(ranks, "model type")
    assert "disagree on the model given to hf_fpdt.apply" in msg
    assert "model type: rank 0 has 'llama', rank 1 has 'qwen2'" in msg, msg
    assert "layers: rank 0 has 2, rank 1 has 3" in _refused_alike(ranks, "layers")
    msg = _refused_alike(ranks, "hidden size")
    assert "hidden size: rank 0 has 64, rank 1 has 128" in msg, msg
    msg = _refused_alike(ranks, "dtype")
    assert "parameter dtypes: rank 0 has ['torch.float32'], rank 1 has ['torch.bfloat16']" in msg, msg
    assert "'model.embed_tokens.weight [512, 64] torch.bfloat16'" in msg  # the trainable parameters' dtypes too
    msg = _refused_alike(ranks, "trainable")
    assert "trainable parameters: rank 0 has 21 entries, #20: 'lm_head.weight [512, 64] torch.float32', " in msg, msg
    assert "rank 1 has 20 entries" in msg and "same PEFT adapters" in msg
    msg = _refused_alike(ranks, "configure")  # the attention-only path's settings too
    assert "disagree on the model given to hf_fpdt.configure" in msg and "layers: rank 0 has 2, rank 1 has 3" in msg


@pytest.mark.multiprocess
def test_apply_refuses_different_attention_patterns(ranks) -> None:
    msg = _refused_alike(ranks, "pattern on one rank")
    assert "attention pattern: rank 0 has 2 entries, #0: 'layer 0: local_global(window=8, global=2)" in msg, msg
    assert "rank 1 has 2 entries, #0: 'layer 0: dense'" in msg
    msg = _refused_alike(ranks, "mask_mod")  # the same code closing over another width
    assert "attention pattern: rank 0 has 2 entries, #0: 'layer 0: mask_mod _window.<locals>.mask_mod" in msg, msg
    assert ranks[0]["same"] is None and ranks[1]["same"] is None  # the same mask_mod built on each rank agrees


@pytest.mark.multiprocess
def test_a_mask_on_one_rank_only_is_refused_on_every_rank(ranks) -> None:
    msg = _refused_alike(ranks, "mask on one rank")
    assert "attention mask: rank 0 has 2D, rank 1 has none" in msg, msg
    total = ranks[0]["after"] + ranks[1]["after"]
    assert torch.isfinite(total) and total.item() > 1.0  # the next step runs (about ln 512)


@pytest.mark.multiprocess
def test_a_mask_of_another_shape_on_one_rank_names_kinds_and_shapes(ranks) -> None:
    """Issue 38 item 2d: the kinds and the shapes ((1, 7) on rank 0 for its 32 tokens), before the mask's gather."""
    msg = _refused_alike(ranks, "short mask on one rank")
    assert "attention mask: rank 0 has 2D, rank 1 has none" in msg, msg
    assert "attention mask shape: rank 0 has [1, 7], rank 1 has None" in msg, msg
    assert "attention mask shape: rank 0 has [1, 32], rank 1 has None" in _refused_alike(ranks, "mask on one rank")


@pytest.mark.multiprocess
def test_weights_differing_per_rank_are_refused_at_the_first_forward(ranks) -> None:
    """Issue 38 item 1: the policy's weights where each rank builds its own copy (no DDP broadcast)."""
    msg = _refused_alike(ranks, "weights")
    assert "disagree at step 1 on the model's weights (load one checkpoint on every rank" in msg, msg
    assert "rank 0 has 21 entries, #0: 'model.embed_tokens.weight [512, 64] float32 " in msg


@pytest.mark.multiprocess
def test_a_model_applied_under_sp_names_what_to_do_when_pickled(ranks) -> None:
    """Issue 38 item 2a: its process group cannot be pickled; the error names hf_fpdt and the way out."""
    for rank in ranks:
        kind, msg = rank["pickled"]
        assert kind == "TypeError" and msg.startswith("hf_fpdt: this model was applied over a sequence-parallel"), msg
        assert "model.state_dict()" in msg and "hf_fpdt.unapply(model)" in msg


@pytest.mark.multiprocess
def test_generate_refuses_other_prompts_and_arguments(ranks) -> None:
    msg = _refused_alike(ranks, "prompts")
    assert "prompt input_ids: rank 0 has '[1, 37] int64 sha256:" in msg, msg
    assert "local sequence length" not in msg  # only what differs
    msg = _refused_alike(ranks, "max_new_tokens")
    assert "generation arguments max_new_tokens: rank 0 has 3, rank 1 has 4" in msg, msg
    msg = _refused_alike(ranks, "sampling")
    assert "sampling random state: rank 0 has '[5056] uint8 sha256:" in msg, msg


@pytest.mark.multiprocess
def test_generate_with_an_all_ones_mask_on_one_rank_is_the_same_prompt(ranks) -> None:
    for r in ranks:
        got, want = r["ones on one rank"]
        assert torch.equal(got, want), (got, want)  # sdpa's greedy tokens
        assert not r["unapplied generate"]  # unapply took the generate wrapper off


@pytest.mark.multiprocess
def test_build_groups_timeout(ranks) -> None:
    kind, msg = ranks[0]["timeout 0"]
    assert kind == "ValueError" and "timeout=0: use a positive, finite number of seconds" in msg
    assert ranks[0]["default timeout"] == ranks[1]["default timeout"] == DEFAULT_TIMEOUT == 600.0


def test_sp_timeout_must_be_positive() -> None:
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"sp_timeout=.*: use a positive, finite number of seconds"):
            hf_fpdt.FPDTPlugin(sp_size=1, sp_timeout=bad)
    assert hf_fpdt.FPDTPlugin(sp_size=1).sp_timeout == DEFAULT_TIMEOUT


def test_sp_size_from_the_environment_is_named(monkeypatch) -> None:
    monkeypatch.setenv("FPDT_SP_SIZE", "2")
    model = tiny_model(attn="fpdt")  # the attention-only path: its runtime comes from FPDT_* at the first call
    ids = torch.arange(8).view(1, 8)
    with pytest.raises(ValueError, match=r"sp_size=2 \(from the environment variable FPDT_SP_SIZE='2'") as err:
        model(ids)
    assert "needs a sequence-parallel process group" in str(err.value) and "unset it" in str(err.value)
    with pytest.raises(ValueError, match="FPDT_SP_SIZE"):
        hf_fpdt.apply(tiny_model(), hf_fpdt.FPDTConfig(chunk_size=CHUNK))
    monkeypatch.delenv("FPDT_SP_SIZE")
    with pytest.raises(ValueError) as err:  # given in code: no word of the environment
        hf_fpdt.apply(tiny_model(), hf_fpdt.FPDTConfig(chunk_size=CHUNK, sp_size=2))
    assert "FPDT_SP_SIZE" not in str(err.value)


# --- dead and late peers: each rank its own process ---------------------------------------------------------

DELAY, MARGIN = 15.0, 6.0


def _run(tmp_path: Path, shape: str, fault: str, where: str) -> list[dict]:
    return fault_ranks(tmp_path / f"{shape}_{fault}_{where}", shape, fault, where, TIMEOUT, DELAY)


def _survivor(rank: dict, collective: str, within: float) -> str:
    assert rank["rc"] == 1, rank["out"][-3000:]
    assert rank["type"] == "SPPeerFailure", rank.get("error")
    error = rank["error"]
    assert "world rank 1" in error and collective in error and f"timeout {TIMEOUT:g} s" in error, error
    assert rank["done"] - rank["entered"] < within, (rank["done"] - rank["entered"], error)
    assert rank["end"] - rank["entered"] < within + MARGIN, rank["end"] - rank["entered"]  # the process ended too
    return error


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "shape,where,collective",
    [
        ("loop", "prepare", "FPDTPlugin.setup (every rank's arrival"),
        ("loop", "apply", "FPDTPlugin.apply: chunk_size='auto'"),
        ("generate", "decode", "SP generation's decode step 3"),
    ],
)
def test_killed_rank_in_set_up_or_decode_ends_its_peer(tmp_path: Path, shape: str, where: str, collective: str) -> None:
    survivor, killed = _run(tmp_path, shape, "kill", where)
    assert killed["rc"] == -9
    error = _survivor(survivor, collective, TIMEOUT + MARGIN)
    assert "world rank 0" in error  # who reports


@pytest.mark.multiprocess
def test_late_rank_in_decode_ends_every_rank(tmp_path: Path) -> None:
    survivor, late = _run(tmp_path, "generate", "late", "decode")
    _survivor(survivor, "SP generation's decode step 3", TIMEOUT + MARGIN)  # not DELAY
    assert survivor["done"] - survivor["entered"] >= TIMEOUT - 0.5  # it did wait for the peer
    assert late["rc"] == 1 and late["type"] == "SPPeerFailure", late["out"][-3000:]  # arrives to find it gone
    assert "decode step 3" in late["error"] and "world rank 0" in late["error"], late["error"]
    assert late["done"] - late["entered"] < DELAY + MARGIN
