"""The digests the ranks compare for what a step depends on (:mod:`hf_fpdt.distributed.digests`; the trainer
arguments' fields: :mod:`hf_fpdt.trainers.arguments`; issue 38): every field of the trainer arguments but the
documented exclusions, and the weights' values digested where they live."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from testkit import tiny_model

from hf_fpdt.distributed.digests import values_digest, weights_fingerprint
from hf_fpdt.trainers.arguments import ARGS_EXCLUDED, args_values


def test_values_digest_follows_every_value_and_position() -> None:
    t = torch.randn(1000, 7, generator=torch.Generator().manual_seed(0))
    d = values_digest(t)
    assert len(d) == 16 and d == values_digest(t.clone())
    bumped = t.clone()
    bumped[999, 6] = torch.nextafter(bumped[999, 6], torch.tensor(float("inf")))  # one ulp of one value
    assert values_digest(bumped) != d
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same values elsewhere
    assert values_digest(swapped) != d
    assert values_digest(t.t()) == values_digest(t.t().contiguous())  # the values, not the strides
    assert values_digest(t.to(torch.bfloat16)) != values_digest(t)  # another bit pattern
    odd = torch.arange(7, dtype=torch.uint8)  # 7 bytes: digested byte by byte
    assert values_digest(odd) != values_digest(odd.flip(0))


def test_values_digest_spans_pieces() -> None:
    """A tensor longer than one piece of the digest (2**22 words): a change in the second piece shows."""
    t = torch.zeros((1 << 22) + 5, dtype=torch.int32)
    d = values_digest(t)
    t[-1] = 1
    assert values_digest(t) != d


def test_weights_fingerprint_names_every_parameter() -> None:
    a, b = tiny_model(seed=0), tiny_model(seed=0)
    assert weights_fingerprint(a) == weights_fingerprint(b)
    entries = weights_fingerprint(a)
    assert len(entries) == len(list(a.parameters()))
    assert entries[0].startswith("model.embed_tokens.weight [512, 64] float32 ")
    with torch.no_grad():
        b.lm_head.weight[3, 4] += 1e-3
    differ = [x for x, y in zip(entries, weights_fingerprint(b)) if x != y]
    assert len(differ) == 1 and differ[0].startswith("lm_head.weight")


@pytest.mark.parametrize("config", ["TrainingArguments", "DPOConfig", "GRPOConfig", "KTOConfig", "RLOOConfig"])
def test_every_argument_but_the_exclusions_is_compared(config: str, tmp_path) -> None:
    """The rule covers all fields (new ones included): the compared names are the dataclass's fields minus the
    documented exclusions."""
    if config == "TrainingArguments":
        from transformers import TrainingArguments as cls
    else:
        cls = getattr(pytest.importorskip("trl"), config)
    args = cls(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    values = args_values(args)
    assert set(values) == {f.name for f in dataclasses.fields(cls)} - set(ARGS_EXCLUDED)
    for name in ("learning_rate", "lr_scheduler_type", "gradient_accumulation_steps", "max_grad_norm", "bf16",
                 "fp16", "seed", "weight_decay", "warmup_steps", "optim"):  # fmt: skip
        assert name in values, name
    assert values["lr_scheduler_type"] == "linear"  # an enum by its value
    assert isinstance(values["accelerator_config"], dict)  # a nested dataclass by its fields
    if config != "TrainingArguments":
        assert "beta" in values and ("loss_type" in values or config == "RLOOConfig")


def test_output_dir_and_run_name_may_differ(tmp_path) -> None:
    from transformers import TrainingArguments

    a = TrainingArguments(output_dir=str(tmp_path / "a"), run_name="a", use_cpu=True, report_to="none")
    b = TrainingArguments(output_dir=str(tmp_path / "b"), run_name="b", use_cpu=True, report_to=["tensorboard"])
    assert args_values(a) == args_values(b)
    c = TrainingArguments(output_dir=str(tmp_path / "a"), use_cpu=True, report_to="none", learning_rate=1e-3)
    assert {k for k in args_values(a) if args_values(a)[k] != args_values(c)[k]} == {"learning_rate"}


def test_weights_fingerprint_reads_the_device_once(virtual_cuda) -> None:
    """Digests computed where the weights live, then read in one host sync per device (one per parameter before:
    3,024 at 8B, at the first SP step); the same strings as on the host."""
    host = tiny_model(seed=0)
    want = weights_fingerprint(host)
    model = host.to("cuda")
    before = len(virtual_cuda.syncs)
    assert weights_fingerprint(model) == want
    assert len(virtual_cuda.syncs) - before == 1, virtual_cuda.syncs[before:]
