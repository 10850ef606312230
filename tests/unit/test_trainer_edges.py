"""The trainers' edges as a user meets them (issue 43, item 7): each refusal of the arguments names the trainer in
use, ``parallelism_config``'s ``sp_size`` either sets the SP size of an FPDT trainer or is refused (and
docs/guides/trainer.md says which), and the compat modules' docs name the modules that really use each name."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from testkit import tiny_model

import hf_fpdt
from hf_fpdt.trainers import compat_accelerate, compat_transformers, dp_seam
from hf_fpdt.trainers.arguments import plugin_for

ROOT = Path(__file__).resolve().parents[2]
# every FPDT trainer -> the config class its ``args`` are (what a user builds)
TRAINERS = {
    "FPDTTrainer": ("transformers", "TrainingArguments"),
    "FPDTSFTTrainer": ("trl", "SFTConfig"),
    "FPDTDPOTrainer": ("trl", "DPOConfig"),
    "FPDTKTOTrainer": ("trl", "KTOConfig"),
    "FPDTGRPOTrainer": ("trl", "GRPOConfig"),
    "FPDTRLOOTrainer": ("trl", "RLOOConfig"),
}
CPU = dict(use_cpu=True, bf16=False, report_to="none")


def _config_class(trainer: str) -> type:
    module, name = TRAINERS[trainer]
    return getattr(__import__(module), name)


def _build(trainer: str, args) -> None:
    """Construct ``trainer`` on a tiny model with ``args`` (a refusal of the arguments comes before anything runs)."""
    cls = getattr(hf_fpdt, trainer)
    model = tiny_model("tiny-llama", None)
    if trainer in ("FPDTDPOTrainer", "FPDTKTOTrainer"):
        cls(model, ref_model=tiny_model("tiny-llama", None), args=args)
    elif trainer in ("FPDTGRPOTrainer", "FPDTRLOOTrainer"):
        cls(model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args)
    else:
        cls(model, args=args)


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_an_argument_refusal_names_the_trainer_in_use(trainer: str, tmp_path) -> None:
    args = _config_class(trainer)(output_dir=str(tmp_path), average_tokens_across_devices=False, **CPU)
    with pytest.raises(ValueError, match=rf"^{trainer} needs average_tokens_across_devices=True"):
        _build(trainer, args)


def _sp_config(trainer: str, tmp_path) -> object:
    from accelerate.parallelism_config import ParallelismConfig

    return _config_class(trainer)(output_dir=str(tmp_path), parallelism_config=ParallelismConfig(sp_size=2), **CPU)


def _routes(tmp_path) -> dict[str, str]:
    """Each trainer -> "works" (its config takes parallelism_config's sp_size and the plugin gets it) or "refused"."""
    routes = {}
    for trainer in TRAINERS:
        try:
            args = _sp_config(trainer, tmp_path)
        except ValueError as err:
            assert "sp_size" in str(err), err  # the config's own refusal, naming the setting
            routes[trainer] = "refused"
            continue
        run_args, plugin = plugin_for(args, None, trainer)
        assert plugin.sp_size == 2 and run_args.parallelism_config is None, trainer
        assert args.parallelism_config.sp_size == 2  # the caller's arguments are not written
        routes[trainer] = "works"
    return routes


def test_parallelism_config_sets_the_sp_size_of_every_trainer_whose_config_takes_it(tmp_path) -> None:
    routes = _routes(tmp_path)
    # TRL's GRPOConfig / RLOOConfig refuse sp_size > 1 in __post_init__ (TRL 1.16): their trainers take fpdt= only
    assert routes == {t: "refused" if t in ("FPDTGRPOTrainer", "FPDTRLOOTrainer") else "works" for t in TRAINERS}


def test_the_trainer_guide_says_which_trainers_take_parallelism_config(tmp_path) -> None:
    """docs/guides/trainer.md's paragraph on ``parallelism_config``: the sentence that says where it works names
    exactly the trainers it works for, the one that says where it is refused exactly the others, with what to pass."""
    routes = _routes(tmp_path)
    text = (ROOT / "docs" / "guides" / "trainer.md").read_text()
    paragraph = next(p for p in text.split("\n\n") if "parallelism_config=ParallelismConfig" in p)
    sentences = re.split(r"(?<=\.)\s+", " ".join(paragraph.split()))

    def named(word: str) -> set[str]:
        sentence = next((s for s in sentences if word in s), "")
        return set(re.findall(r"`(FPDT\w*Trainer)`", sentence))

    assert named("works for") == {t for t, r in routes.items() if r == "works"}, paragraph
    assert named("refuse") == {t for t, r in routes.items() if r == "refused"}, paragraph
    assert "fpdt=FPDTPlugin(sp_size=N)" in paragraph


def test_the_dp_seam_hooks_name_the_module_that_holds_the_seam() -> None:
    replaced = set(compat_accelerate.DP_SEAM_REPLACES)
    hooks = [h for h in compat_accelerate.HOOKS if h.where == "accelerate:Accelerator" and h.name in replaced]
    assert {h.name for h in hooks} == replaced
    source = inspect.getsource(dp_seam)
    for hook in hooks:
        assert "hf_fpdt.trainers.dp_seam" in hook.used_by, hook
    for name in replaced:
        assert f"def {name}(" in source, name


def test_compat_transformers_reads_no_private_attribute_of_trainer() -> None:
    """The whole-batch trainers keep the library's own loaders (the DP seam prepares them): no accessor of Trainer's
    private attributes is left, and the docstring says so."""
    trainer = ("transformers:Trainer", "transformers.trainer:Trainer")
    privates = [
        h for h in compat_transformers.HOOKS if h.where in trainer and h.kind == "attribute" and h.name[0] == "_"
    ]
    assert not privates, privates
    assert "none of Trainer's private attributes is read" in " ".join(compat_transformers.__doc__.split())


def test_the_training_arguments_hook_names_where_each_field_is_read() -> None:
    """``TrainingArguments``' fields hf_fpdt relies on: each is read in one of the modules the hook names (the
    refusals' fields in arguments.py since check_args moved there, not in adapter.py)."""
    hook = next(h for h in compat_transformers.HOOKS if h.where == "transformers:TrainingArguments")
    modules = set(re.findall(r"hf_fpdt\.trainers\.(\w+)", hook.used_by))
    sources = "\n".join((ROOT / "hf_fpdt" / "trainers" / f"{m}.py").read_text() for m in modules)
    assert [field for field in hook.params if field not in sources] == [], hook.used_by
