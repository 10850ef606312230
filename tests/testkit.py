"""The tests' shared helpers, importable from every test module and script (pytest's ``pythonpath`` puts
``tests/`` on ``sys.path``; launched scripts get it from :mod:`launch`): one tiny-model factory and the error measures
the tolerance rules use (the float64 attention reference and the stand-in kernels: :mod:`standins`)."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Tests write only under temporary folders: the HF datasets cache too (load_dataset/map would otherwise
# fill ~/.cache/huggingface/datasets). Set before any test module imports datasets (conftest imports this
# module first); spawned and launched processes inherit it.
SCRATCH = tempfile.mkdtemp(prefix="hf_fpdt_tests_")
os.environ["HF_DATASETS_CACHE"] = os.path.join(SCRATCH, "datasets")
atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)


def tiny_model(
    preset: str | PretrainedConfig = "tiny-llama",
    attn: str | None = "sdpa",
    *,
    dtype: torch.dtype | None = torch.float32,
    seed: int | None = 0,
    state: dict | None = None,
    auto: str | None = None,
    **overrides,
) -> nn.Module:
    """The tests' one way to build a causal LM: from ``preset``, with ``attn`` as its attention implementation
    (None: HF's default), in ``dtype`` (None: torch's default, no ``dtype`` argument), with seeded weights
    (``seed=None``: the caller's RNG state) or ``state``'s.

    ``preset``: a name of :mod:`hf_fpdt.models.presets` (``**overrides`` set on its config); another HF
    ``model_type`` (``**overrides`` are its config class's arguments, so derived fields such as ``head_dim``
    follow them: ``tiny_model("qwen2", hidden_size=32, ...)``); or a config object, used as given (for a test
    that reads the same config elsewhere, e.g. the planner's shapes). ``auto``: the transformers auto class that
    builds it (default: ``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for a model type that has no
    causal LM: a vision-language model, for text-only tests)."""
    import transformers
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hf_fpdt.models.presets import PRESETS, preset_config

    if isinstance(preset, PretrainedConfig):
        if overrides:
            raise TypeError(f"tiny_model: a config object is used as given; got overrides {sorted(overrides)}")
        config = preset
    elif preset in PRESETS:
        config = preset_config(preset, **overrides)
    else:
        config = AutoConfig.for_model(preset, **overrides)
    if seed is not None:
        torch.manual_seed(seed)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if auto is None:
        causal = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        auto = "AutoModelForCausalLM" if causal else "AutoModelForImageTextToText"
    model = getattr(transformers, auto).from_config(config, attn_implementation=attn, **kwargs)
    if state is not None:
        model.load_state_dict(state)
    return model


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item()


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max absolute error over the reference's largest magnitude (absolute where the reference is all
    zeros, e.g. dq and dk of a one-token sequence)."""
    scale = ref.double().abs().max().item()
    return max_err(a, ref) / (scale if scale > 0 else 1.0)


# Frames a library call passes through between its caller and the library's own code: torch's module call
# (``model(...)`` runs ``forward`` from here), the standard library's wrappers.
_CALL_MACHINERY = ("torch.nn.modules.module", "functools", "contextlib", "torch.utils._contextlib")
# Frames of the warning itself: ``warnings`` (C ``warn`` has none; 3.13's ``@warnings.deprecated``) and
# ``typing_extensions.deprecated``'s wrapper (torch's ``dist.all_gather_into_tensor`` in 2.13).
_WARNING_MACHINERY = ("warnings", "typing_extensions")


def _package(frame) -> str:
    return frame.f_globals.get("__name__", "").partition(".")[0]


def deprecation_caller(frame) -> str:
    """The module whose call caused a warning being shown, given a frame of the code that warned (or of the
    warning machinery above it).

    The warning's own module attribution (what ``filterwarnings``' module field matches) depends on the
    warner's ``stacklevel``, and a call through ``nn.Module.__call__`` lands in torch: walking out from the
    warning code past its own package's frames and the call machinery finds the caller instead. A warning
    issued in hf_fpdt's frame (its own ``warnings.warn``, or one torch raises in C++ from hf_fpdt's call) is
    hf_fpdt's."""
    while frame is not None and frame.f_globals.get("__name__") in _WARNING_MACHINERY:
        frame = frame.f_back
    if frame is None:
        return ""
    issuer = _package(frame)
    while frame is not None and issuer != "hf_fpdt":
        name = frame.f_globals.get("__name__", "")
        if _package(frame) != issuer and name not in _CALL_MACHINERY:
            return name
        frame = frame.f_back
    return "hf_fpdt" if frame is not None else ""


@contextlib.contextmanager
def no_deprecation_from_hf_fpdt() -> Iterator[list[str]]:
    """Inside: a ``DeprecationWarning`` or ``FutureWarning`` caused by hf_fpdt's own call (see
    :func:`deprecation_caller`: hf_fpdt's code calling a deprecated API of transformers, accelerate, peft,
    trl or torch, or warning itself) raises at once, as the error it is; those a library causes inside
    itself are listed in the yielded list (``"Category (module): message"``) and shown nowhere."""
    internal: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not issubclass(category, DeprecationWarning | FutureWarning):
            return shown(message, category, filename, lineno, file, line)
        caller = deprecation_caller(sys._getframe(1))  # called in the warning's stack (warnings._showwarnmsg)
        if caller.partition(".")[0] == "hf_fpdt":
            raise category(f"{message} (from hf_fpdt's call, in {filename}:{lineno})")
        internal.append(f"{category.__name__} ({caller}): {message}")

    with warnings.catch_warnings():
        shown = warnings.showwarning  # the other categories go where they went (pytest's record, or stderr)
        warnings.simplefilter("always", DeprecationWarning)
        warnings.simplefilter("always", FutureWarning)
        warnings.showwarning = show  # called in the warning code's stack, so the callers can be walked
        yield internal


def record_kernel(monkeypatch, name: str, runs_as: str | None = None) -> list:
    """Record the blocks registry kernel ``name`` runs, forward and backward: ``("fwd" | "bwd", the mask's ``ks`` or
    None)`` per call; ``runs_as``: compute them with that kernel instead (a stand-in: ``cudnn``'s blocks on ``math``
    on the CPU). The registry's entry is replaced for the test (``hf_fpdt.attention.kernels.KERNELS``, which the
    router reads at each block)."""
    from dataclasses import replace

    from hf_fpdt.attention.kernels import KERNELS

    calls: list = []
    real = KERNELS[runs_as or name]

    def wrap(fn, tag: str, at: int):
        if fn is None:
            return None

        def run(*a, **kw):
            mask = a[at] if len(a) > at else kw.get("mask")
            calls.append((tag, getattr(mask, "ks", None)))
            return fn(*a, **kw)

        return run

    entry = replace(
        KERNELS[name],
        forward=wrap(real.forward, "fwd", 5),
        backward=wrap(real.backward, "bwd", 8),
        masked_forward=wrap(real.masked_forward, "fwd", 5) if KERNELS[name].masked_forward else None,
        masked_backward=wrap(real.masked_backward, "bwd", 8) if KERNELS[name].masked_backward else None,
    )
    monkeypatch.setitem(KERNELS, name, entry)
    return calls


def count_math(monkeypatch) -> list:
    """:func:`record_kernel` of ``math``: every block the ``math`` kernel runs."""
    return record_kernel(monkeypatch, "math")


def trainer_step(model, ids: torch.Tensor, batch: int, output_dir: str, fpdt=None) -> dict:
    """One SGD step (lr 0.1, no clipping, gradient checkpointing) of HF ``Trainer`` (``fpdt=None``) or
    ``hf_fpdt.FPDTTrainer`` on rows ``ids`` (labels = ids): ``{"loss": [logged losses], "grads": {name: gradient of
    each trainable parameter before the optimizer step}}``."""
    import datasets
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import hf_fpdt

    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    grads = {}

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            for n, p in model.named_parameters():
                if p.requires_grad:
                    grads[n] = p.grad.detach().clone()

    args = TrainingArguments(
        output_dir=output_dir, max_steps=1, per_device_train_batch_size=batch, learning_rate=0.1, optim="sgd",
        logging_steps=1, save_strategy="no", report_to="none", seed=0, data_seed=0, use_cpu=True,
        max_grad_norm=0.0, disable_tqdm=True, gradient_checkpointing=True,
    )  # fmt: skip
    common = dict(model=model, args=args, train_dataset=data, callbacks=[Grads()])
    trainer = Trainer(**common) if fpdt is None else hf_fpdt.FPDTTrainer(**common, fpdt=fpdt)
    trainer.train()
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"loss": loss, "grads": grads}
