"""The chunking is real: during an fpdt training step of a tiny model at S > chunk, no tensor spans the
sequence twice (no ``[S, S]`` scores or mask) and no attention kernel call sees more than one chunk of
queries. Every aten op's inputs and outputs are recorded with a ``TorchDispatchMode``.
"""

from __future__ import annotations

import pytest
import torch
from testkit import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import hf_fpdt
from hf_fpdt import FPDTConfig

S, CHUNK, BATCH = 300, 64, 2  # 5 chunks, the last one short
ATTN_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
ATTN_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class ShapeRecorder(TorchDispatchMode):
    """Records (op, shapes of every tensor input and output) of each aten call below autograd."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[object, list[torch.Size], tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.calls.append((func, [t.shape for t in tensors], args))
        return out


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-neox"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_no_sequence_squared_tensor_and_chunked_kernel_calls(preset, checkpointing):
    # vocab < S so that the [B, S, vocab] logits (tiled by a later issue) do not look like [S, S]
    model = tiny_model(preset, "fpdt", vocab_size=256, dtype=None, seed=None)
    hf_fpdt.configure(model, FPDTConfig(chunk_size=CHUNK, offload=True))
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    rec = _record_step(model)
    assert len(rec.calls) > 100  # the recorder saw the step
    assert not _square_tensors(rec)

    layers = model.config.num_hidden_layers
    n = -(-S // CHUNK)
    blocks = n * (n + 1) // 2  # causal blocks: chunk i attends to chunks 0..i
    fwd = [args for func, _, args in rec.calls if func == ATTN_FWD]
    bwd = [args for func, _, args in rec.calls if func == ATTN_BWD]
    assert len(fwd) == blocks * layers * (2 if checkpointing else 1)  # recomputed under checkpointing
    assert len(bwd) == blocks * layers
    for q, k, *_ in fwd:  # [B, H, Sq, D]: one chunk of queries against one chunk of keys
        assert q.shape[2] <= CHUNK and k.shape[2] <= CHUNK
    for dout, q, k, *_ in bwd:
        assert dout.shape[2] <= CHUNK and q.shape[2] <= CHUNK and k.shape[2] <= CHUNK
    # no other attention kernel (sdpa's math path, a full-sequence flash call) ran
    names = {str(func) for func, _, _ in rec.calls}
    assert not any("scaled_dot_product" in n and "flash_attention_for_cpu" not in n for n in names)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_recorder_catches_full_sequence_attention(impl):
    """Control: the same checks fail for HF's own attention (so the test above can fail)."""
    model = tiny_model("tiny-llama", impl, vocab_size=256, dtype=None, seed=None)
    model.train()
    rec = _record_step(model)
    kernel_queries = [args[0].shape[2] for func, _, args in rec.calls if func == ATTN_FWD]
    if impl == "eager":
        assert _square_tensors(rec)  # the [B, H, S, S] scores
    else:
        assert max(kernel_queries) == S  # one kernel call over the whole sequence


def _record_step(model) -> ShapeRecorder:
    ids = torch.randint(0, model.config.vocab_size, (BATCH, S))
    rec = ShapeRecorder()
    with rec:
        model(input_ids=ids, labels=ids).loss.backward()
    return rec


def _square_tensors(rec: ShapeRecorder) -> list:
    return [(func, tuple(shape)) for func, shapes, _ in rec.calls for shape in shapes if sum(d >= S for d in shape) > 1]
