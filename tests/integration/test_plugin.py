"""``FPDTPlugin``, ``SPCollator`` and ``FPDTTrainer``'s argument checks.

In-process: configuration (code and ``FPDT_*`` env), the world/sp divisibility error, the collator's
layout (every rank's shard put back together is the shifted batch) and its refusals. Launched
(``accelerate launch``, 4 CPU processes as dp 2 x sp 2): a custom Accelerate loop with the plugin
gives the one-process loss and gradients of the global batch (:mod:`plugin_loop`).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from launch import SCRIPTS, accelerate_launch

from hf_fpdt import FPDTConfig, FPDTPlugin
from hf_fpdt.data.collate import SPCollator
from hf_fpdt.data.demo import passkey_dataset, word_tokenizer
from hf_fpdt.data.layout import IGNORE_INDEX, unshard
from hf_fpdt.trainers.arguments import check_args as _check_args


def test_config_from_code_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert FPDTPlugin(sp_size=2, chunk_size=256, offload=False).config == FPDTConfig(2 * 128, False, 2)
    monkeypatch.setenv("FPDT_SP_SIZE", "4")
    monkeypatch.setenv("FPDT_CHUNK_SIZE", "512")
    monkeypatch.setenv("FPDT_OFFLOAD", "0")
    plugin = FPDTPlugin()
    assert (plugin.config.sp_size, plugin.config.chunk_size, plugin.config.offload) == (4, 512, False)
    assert FPDTPlugin(sp_size=2).config.sp_size == 2  # code wins over env
    with pytest.raises(ValueError, match="either config or its fields"):
        FPDTPlugin(FPDTConfig(), sp_size=2)


@pytest.mark.parametrize("world,sp", [(4, 3), (3, 2), (2, 4)])
def test_sp_size_must_divide_world(world: int, sp: int) -> None:
    state = SimpleNamespace(num_processes=world, process_index=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=f"sp_size={sp} does not divide the world size {world}"):
        FPDTPlugin(sp_size=sp, chunk_size=64).setup(state)


def test_one_process_setup() -> None:
    state = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
    plugin = FPDTPlugin(sp_size=1, chunk_size=64).setup(state)
    assert (plugin.dp_size, plugin.sp_rank, plugin.dp_rank, plugin.loss_scale) == (1, 0, 0, 1)
    assert plugin.sp_group is None and plugin.world_group is None
    batch = {"shift_labels": torch.tensor([[1, 2, IGNORE_INDEX], [IGNORE_INDEX, 5, IGNORE_INDEX]])}
    assert plugin.num_items_in_batch(batch, batch).item() == 6


def test_auto_chunk_size_needs_the_model_first() -> None:
    with pytest.raises(ValueError, match="resolved when the model is applied"):
        FPDTPlugin(sp_size=1, chunk_size="auto").resolved_chunk_size()


@pytest.mark.parametrize("sp,chunk", [(1, 64), (2, 64), (4, 100), (3, 1000)])
def test_collator_shards_put_back_together(sp: int, chunk: int) -> None:
    tokenizer = word_tokenizer()
    rows = [dict(r) for r in passkey_dataset(tokenizer, 3, 203, seed=1, min_fill=0.5, progress=False)]
    full = [SPCollator(sp_rank=r, sp_size=sp, chunk_size=chunk)(rows) for r in range(sp)]
    ids = torch.tensor([r["input_ids"] for r in rows])
    labels = torch.tensor([r["labels"] for r in rows])
    for shard in full:
        assert shard["labels"] is shard["shift_labels"]
        assert shard["input_ids"].shape == (3, -(-203 // sp))
    back = {k: unshard([s[k] for s in full], 203, chunk) for k in ("input_ids", "position_ids", "shift_labels")}
    assert torch.equal(back["input_ids"], ids)
    assert torch.equal(back["position_ids"], torch.arange(203).expand(3, 203))
    want = torch.cat([labels[:, 1:], torch.full((3, 1), IGNORE_INDEX)], dim=1)
    assert torch.equal(back["shift_labels"], want)
    # Valid targets over the SP ranks = one process's count over labels[..., 1:].
    assert sum((s["shift_labels"] != IGNORE_INDEX).sum() for s in full) == (labels[:, 1:] != IGNORE_INDEX).sum()


def test_collator_shards_any_padding_mask() -> None:
    """Left padding and holes are sharded with the tokens (the layout's padding is 0); no padding: no mask."""
    ids = torch.arange(2 * 45).view(2, 45)
    mask = torch.ones(2, 45, dtype=torch.long)
    mask[0, :11] = 0  # left padding
    mask[1, 20:26] = 0  # a hole
    shards = [SPCollator(r, 2, 16, inner=lambda f: f[0])([{"input_ids": ids, "attention_mask": mask}]) for r in (0, 1)]
    assert torch.equal(unshard([s["attention_mask"] for s in shards], 45, 16), mask)
    assert sum(int((s["attention_mask"] == 0).sum()) for s in shards) == 17 + 2  # the layout pads each row to 46
    plain = SPCollator(0, 2, 16, inner=lambda f: f[0])([{"input_ids": ids, "attention_mask": torch.ones_like(mask)}])
    assert "attention_mask" not in plain


def test_collator_refusals() -> None:
    ids = torch.arange(12).view(2, 6)
    four_d = {"input_ids": ids, "attention_mask": torch.ones(2, 1, 6, 6)}
    with pytest.raises(ValueError, match="2D attention_mask"):
        SPCollator(0, 2, 8, inner=lambda f: f[0])([four_d])
    with pytest.raises(ValueError, match="per-token field 'token_type_ids'"):
        SPCollator(0, 2, 8, inner=lambda f: f[0])([{"input_ids": ids, "token_type_ids": ids}])
    with pytest.raises(ValueError, match="unshifted labels"):
        SPCollator(0, 2, 8, inner=lambda f: f[0])([{"input_ids": ids, "shift_labels": ids}])
    ok = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    out = SPCollator(0, 2, 8, inner=lambda f: f[0])([ok])
    assert "attention_mask" not in out and out["input_ids"].shape == (2, 3)


def test_trainer_refuses_settings_that_change_the_loss() -> None:
    args = SimpleNamespace(
        average_tokens_across_devices=True, label_smoothing_factor=0.0, n_gpu=1, train_sampling_strategy="random"
    )
    _check_args(args, 2)
    with pytest.raises(ValueError, match="average_tokens_across_devices=True"):
        _check_args(SimpleNamespace(**{**vars(args), "average_tokens_across_devices": False}), 2)
    with pytest.raises(ValueError, match="label smoothing"):
        _check_args(SimpleNamespace(**{**vars(args), "label_smoothing_factor": 0.1}), 1)
    with pytest.raises(ValueError, match="batch_rebalance"):
        _check_args(SimpleNamespace(**{**vars(args), "train_sampling_strategy": "batch_rebalance"}), 2)


@pytest.mark.multiprocess
def test_custom_accelerate_loop_dp2_sp2_equals_one_process(tmp_path) -> None:
    out = tmp_path / "loop.json"
    accelerate_launch(SCRIPTS / "plugin_loop.py", 4, str(out), "2")
    result = json.loads(out.read_text())
    assert result["dp_rank_of_each_rank"] == [0, 0, 1, 1]  # SP groups share samples, DP replicas differ
    assert abs(result["loss"] - result["ref_loss"]) <= 1e-5 * abs(result["ref_loss"])
    assert result["max_grad_rel"] < 1e-4
    assert max(result["pools_before_release"]) > 0 and max(result["pools_after_release"]) == 0
