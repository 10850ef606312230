"""The contract with TRL, HF Trainer and Accelerate (issue 35, item 2): every private name hf_fpdt's trainers rely
on is listed in one compat module per library (``hf_fpdt/trainers/compat_*.py``) and exists in the installed
release with the parameters hf_fpdt relies on. Fast (no model, no process); CI runs it in both environments
(the newest releases and ``.ci/minimums``).

* each library's hooks are present and unchanged (a failure names the library, its version, the hook and where
  hf_fpdt uses it);
* every method hf_fpdt's trainer classes override on a library class is listed (so none is missed);
* a renamed or re-signed hook fails the check with that message (TRL's ``_precompute_ref_logps`` renamed, then
  given another signature, in this process);
* the DP view of the accelerator forwards only the names it knows; any other is an error naming it;
* TRL has no upper pin (issue 43, item 6): importing an FPDT TRL trainer on a TRL whose hooks changed is an
  ``ImportError`` naming that TRL's version and the hook; on a new TRL with the same hooks it imports (a fake
  release: the version and a hook monkeypatched in this process).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")

import trl  # noqa: E402

from hf_fpdt.trainers import compat, compat_accelerate, compat_transformers, compat_trl  # noqa: E402
from hf_fpdt.trainers.dp_seam import DPAccelerator  # noqa: E402
from hf_fpdt.trainers.trainer import FPDTTrainer  # noqa: E402
from hf_fpdt.trainers.trl_dpo import FPDTDPOTrainer, FPDTKTOTrainer  # noqa: E402
from hf_fpdt.trainers.trl_grpo import FPDTGRPOTrainer, FPDTRLOOTrainer  # noqa: E402
from hf_fpdt.trainers.trl_sft import FPDTSFTTrainer  # noqa: E402

MODULES = {"trl": compat_trl, "transformers": compat_transformers, "accelerate": compat_accelerate}
TRAINERS = (FPDTTrainer, FPDTSFTTrainer, FPDTDPOTrainer, FPDTKTOTrainer, FPDTGRPOTrainer, FPDTRLOOTrainer)


@pytest.mark.parametrize("library", sorted(MODULES))
def test_the_installed_release_has_every_hook(library):
    module = MODULES[library]
    assert module.HOOKS, f"{module.__name__} lists no hook"
    assert all(h.library == library for h in module.HOOKS), f"{module.__name__} lists another library's hook"
    problems = compat.problems(module.HOOKS)
    assert not problems, "\n".join(problems)


def _library_owners(cls: type, name: str) -> list[type]:
    return [c for c in cls.__mro__ if name in c.__dict__ and c.__module__.split(".")[0] in ("trl", "transformers")]


def test_every_overridden_library_method_is_listed():
    """A method an hf_fpdt trainer class defines that a TRL / Trainer base also defines is an override: a hook
    of the base (or of a library base further up, for Trainer's public hooks) must list it."""
    listed = {(h.where, h.name) for m in MODULES.values() for h in m.HOOKS if h.kind == "method"}
    missing = []
    for trainer in TRAINERS:
        ours = [c for c in trainer.__mro__ if c.__module__.startswith("hf_fpdt.")]
        names = {n for c in ours for n, v in vars(c).items() if callable(v) and not n.startswith("__")}
        for name in sorted(names):
            owners = _library_owners(trainer, name)
            if owners and not any((f"{o.__module__.split('.')[0]}:{o.__name__}", name) in listed for o in owners):
                missing.append(f"{trainer.__name__}.{name} (defined by {', '.join(o.__name__ for o in owners)})")
    assert not missing, "overrides no compat module lists: " + "; ".join(missing)


def test_a_renamed_trl_hook_fails_naming_the_version_and_the_hook(monkeypatch):
    """TRL renames ``DPOTrainer._precompute_ref_logps``: the check names trl's version, the hook and hf_fpdt's use."""
    hook = next(h for h in compat_trl.HOOKS if h.where == "trl:DPOTrainer" and h.name == "_precompute_ref_logps")
    assert compat.problem(hook) is None
    original = trl.DPOTrainer.__dict__["_precompute_ref_logps"]
    monkeypatch.delattr(trl.DPOTrainer, "_precompute_ref_logps")
    monkeypatch.setattr(trl.DPOTrainer, "_precompute_reference_logps", original, raising=False)
    message = compat.problem(hook)
    assert message is not None and message.startswith(
        f"trl {trl.__version__}: DPOTrainer._precompute_ref_logps is gone or changed (not found)"
    ), message
    assert "hf_fpdt.trainers.trl_dpo" in message and "compat_trl.py" in message, message


def test_a_changed_signature_fails(monkeypatch):
    """TRL reorders ``_calculate_rewards``' parameters: the positional call hf_fpdt relies on would break."""
    hook = next(h for h in compat_trl.HOOKS if h.where == "trl:GRPOTrainer" and h.name == "_calculate_rewards")

    def reordered(self, prompts, inputs, completions, completion_ids_list):
        raise AssertionError("never called")

    monkeypatch.setattr(trl.GRPOTrainer, "_calculate_rewards", reordered)
    message = compat.problem(hook)
    assert message is not None and "parameters (prompts, inputs, completions, completion_ids_list)" in message


def test_a_changed_logs_schema_and_return_order_fail(monkeypatch):
    """The checks read TRL's source: another ``_logs`` schema or ``_generate`` tuple is reported."""
    logs = compat.Hook("trl:GRPOTrainer", "_logs", "keys", ("prompt", "completion", "new_column"), "a test")
    assert "new_column" in compat.problem(logs)
    returns = next(h for h in compat_trl.HOOKS if h.where == "trl:RLOOTrainer" and h.kind == "returns")
    assert compat.problem(returns) is None
    swapped = compat.Hook(returns.where, returns.name, "returns", ("completion_ids", "prompt_ids"), returns.used_by)
    assert "by position" in compat.problem(swapped)


def test_generated_names_the_fields_of_each_rollout_trainer():
    for trainer, fields in ((FPDTGRPOTrainer, "tool_mask"), (FPDTRLOOTrainer, "completions")):
        out = compat_trl.generated(object.__new__(trainer), ("p", "c", "x", "rest"))
        assert list(out) == ["prompt_ids", "completion_ids", fields] and out[fields] == "x"


def test_the_dp_seam_answers_the_collectives_and_forwards_the_rest():
    """The seam's accelerator: Accelerator's collectives (with its signatures) over the DP group, the DP rank and size,
    loaders prepared by the plugin; any other name read or written on the accelerator itself."""
    from torch.utils.data import DataLoader

    gradient_state = SimpleNamespace(end_of_dataloader=False, remainder=0)
    one_or_all = lambda *objs: objs if len(objs) > 1 else objs[0]  # noqa: E731 (Accelerator.prepare's return)
    accelerator = SimpleNamespace(device="cpu", gradient_state=gradient_state, prepare=one_or_all)
    groups = SimpleNamespace(dp=None, dp_size=1, dp_rank=0)
    seam = DPAccelerator(accelerator, groups, prepare_loader=lambda loader: ("sharded", loader))
    assert seam.device == "cpu" and seam.num_processes == 1 and seam.process_index == 0
    seam.step_marker = 3  # written on the accelerator, not on the seam
    assert accelerator.step_marker == 3
    with pytest.raises(AttributeError, match="is FPDT's; set it on the accelerator itself"):
        seam.num_processes = 4
    loader = DataLoader([1, 2])
    model = torch.nn.Linear(1, 1)
    assert seam.prepare(loader) == ("sharded", loader)
    assert seam.prepare(model, loader) == (model, ("sharded", loader))
    assert seam.gather(torch.tensor(2.0)).shape == (1,)  # a rank's scalar is one row, as Accelerate gathers it
    for name, params in compat_accelerate.DP_SEAM_REPLACES.items():  # the seam's own methods keep the signatures
        mine = tuple(p for p in inspect.signature(getattr(DPAccelerator, name)).parameters if p != "self")
        assert mine[: len(params)] == params, (name, mine)


def test_trl_module_collectives_are_redirected_for_the_loop_only():
    """TRL's module-level gathers (the rewards, the completion logs) are the DP group's inside the loop, TRL's again
    after it: the one place a module-level function is redirected."""
    import trl.trainer.grpo_trainer as grpo

    before = grpo.gather, grpo.gather_object
    trainer = object.__new__(FPDTGRPOTrainer)
    mine = {"gather": lambda t: ("dp", t), "gather_object": lambda o: ["dp", o]}
    with compat_trl.module_collectives(trainer, mine):
        assert grpo.gather(1) == ("dp", 1) and grpo.gather_object(2) == ["dp", 2]
        with compat_trl.module_collectives(trainer, mine):
            pass
        assert grpo.gather is mine["gather"]  # a nested loop (evaluation inside training) restores in order
    assert (grpo.gather, grpo.gather_object) == before


def test_both_ci_environments_run_the_contract_and_the_sp_trl_runs():
    """``.ci/run`` runs the whole suite on the newest releases within setup.cfg's range; ``.ci/minimums`` runs this
    test and the SP DPO/KTO and GRPO/RLOO runs on the lowest ones, so the TRL range is the one CI proves."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert "python -m pytest -q tests" in (root / ".ci" / "run").read_text()
    minimums = (root / ".ci" / "minimums").read_text()
    for test in ("test_compat_contract.py", "test_trl_dpo.py", "test_trl_grpo.py", "test_trl_fused_head_sp.py"):
        assert test in minimums, f".ci/minimums does not run {test}"
    assert '-k "sp2_equals_one_process or 2-2 or bad_batches"' in minimums


def _fresh_import(monkeypatch, name: str):
    """Import ``hf_fpdt.trainers.<name>`` again, its TRL check included; this test's end gives the process its
    modules back (sys.modules and the package's attributes), so later tests see the classes they imported."""
    import hf_fpdt.trainers as package

    for mod in ("compat_trl", name):
        monkeypatch.delattr(package, mod)  # else ``from . import compat_trl`` takes the package's attribute
        monkeypatch.delitem(sys.modules, f"hf_fpdt.trainers.{mod}")
    return importlib.import_module(f"hf_fpdt.trainers.{name}")


def test_a_trl_whose_hook_changed_fails_at_import_naming_the_version_and_the_hook(monkeypatch):
    import hf_fpdt

    monkeypatch.setattr(compat, "version", lambda library: "1.17.0" if library == "trl" else "?")
    monkeypatch.delattr(trl.DPOTrainer, "_precompute_ref_logps")  # TRL 1.17 renamed it (say)
    with pytest.raises(ImportError) as info:
        _fresh_import(monkeypatch, "trl_dpo")
    message = str(info.value)
    assert message.startswith("hf_fpdt's TRL trainers cannot run on the installed trl 1.17.0: 1 of"), message
    assert "trl 1.17.0: DPOTrainer._precompute_ref_logps is gone or changed (not found)" in message, message
    assert "KTOTrainer" not in message and "pip install 'trl==" in message, message
    with pytest.raises(ImportError, match=r"trl 1\.17\.0: DPOTrainer\._precompute_ref_logps"):
        hf_fpdt.FPDTKTOTrainer  # noqa: B018  (the public name: the same check, the same message)
    assert "hf_fpdt.trainers.trl_dpo" not in sys.modules  # nothing half-imported stays behind


def test_a_new_trl_with_the_same_hooks_imports(monkeypatch):
    """A release with a new optional parameter on an overridden hook and new methods of its own is compatible."""
    monkeypatch.setattr(compat, "version", lambda library: "1.17.0" if library == "trl" else "?")
    original = trl.GRPOTrainer._calculate_rewards

    def calculate_rewards(self, inputs, prompts, completions, completion_ids_list, new_option=None):
        return original(self, inputs, prompts, completions, completion_ids_list)

    monkeypatch.setattr(trl.GRPOTrainer, "_calculate_rewards", calculate_rewards)
    monkeypatch.setattr(trl.GRPOTrainer, "_a_new_method", lambda self: None, raising=False)
    module = _fresh_import(monkeypatch, "trl_grpo")
    assert issubclass(module.FPDTGRPOTrainer, trl.GRPOTrainer) and compat_trl.check_contract() is None
