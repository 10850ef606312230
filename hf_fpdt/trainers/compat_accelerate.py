"""Accelerate's surface beyond its documented API, the one place hf_fpdt's trainers touch it.

The plugin marks the loaders it prepares as Accelerate does (the private ``_is_accelerate_prepared``) and calls
``prepare_data_loader`` with keywords; the trainers read the gradient state's last-batch ``remainder``; the
whole-batch TRL trainers under SP hold the DP seam's accelerator (:class:`hf_fpdt.trainers.dp_seam.DPAccelerator`),
which answers :data:`DP_SEAM_REPLACES` (Accelerator's collectives and ``prepare``, with Accelerator's signatures)
over the DP group and forwards every other name to the accelerator. :data:`HOOKS` names each;
``tests/unit/test_compat_contract.py`` checks them against the installed Accelerate.
"""

from __future__ import annotations

from typing import Any

from .compat import Hook

PREPARED = "_is_accelerate_prepared"  # Accelerator.prepare_data_loader's mark on a loader it prepared

# what the DP seam's accelerator (hf_fpdt.trainers.dp_seam) answers itself, with Accelerator's leading parameters
DP_SEAM_REPLACES = {
    "gather": ("tensor",),
    "gather_for_metrics": ("input_data", "use_gather_object"),
    "reduce": ("tensor", "reduction", "scale"),
    "pad_across_processes": ("tensor", "dim", "pad_index", "pad_first"),
    "prepare": (),
}
_SEAM = "hf_fpdt.trainers.dp_seam"

_PLUGIN = "hf_fpdt.trainers.accelerate_plugin (FPDTPlugin.prepare_dataloader)"

HOOKS: tuple[Hook, ...] = (
    Hook("accelerate:Accelerator", PREPARED, "attribute", (), f"marks its loaders with it in {_PLUGIN}"),
    Hook(
        "accelerate.data_loader:prepare_data_loader",
        "fields",
        "fields",
        (
            "dataloader",
            "device",
            "num_processes",
            "process_index",
            "split_batches",
            "put_on_device",
            "rng_types",
            "dispatch_batches",
            "even_batches",
            "use_seedable_sampler",
            "data_seed",
            "non_blocking",
            "use_stateful_dataloader",
        ),
        f"calls it with these keywords in {_PLUGIN}",
    ),
    Hook(
        "accelerate:Accelerator",
        "fields",
        "fields",
        (
            "split_batches",
            "device_placement",
            "rng_types",
            "even_batches",
            "use_seedable_sampler",
            "dataloader_config",
            "non_blocking",
            "use_stateful_dataloader",
        ),
        f"reads them in {_PLUGIN}",
    ),
    Hook(
        "accelerate:Accelerator", "prepare_data_loader", "method", ("data_loader",), f"registers loaders in {_PLUGIN}"
    ),
    *(
        Hook("accelerate:Accelerator", name, "method", params, f"answers it over the DP group in {_SEAM}")
        for name, params in DP_SEAM_REPLACES.items()
    ),
    Hook(
        "accelerate:Accelerator",
        "fields",
        "fields",
        ("process_index", "num_processes", "gradient_state"),
        f"answers the first two as the DP rank and size in {_SEAM}",
    ),
    Hook(
        "accelerate.state:GradientState",
        "fields",
        "fields",
        ("remainder", "end_of_dataloader", "active_dataloader"),
        "reads the last batch's remainder in hf_fpdt.trainers.dp_seam and trl_sft",
    ),
    Hook(
        "accelerate.data_loader:DataLoaderShard",
        "fields",
        "fields",
        ("remainder", "end_of_dataloader"),
        "turns the last batch's cut off for one call in hf_fpdt.trainers.trl_sft",
    ),
    Hook(
        "accelerate.utils:recursively_apply",
        "fields",
        "fields",
        ("func", "data", "error_on_other_type"),
        "maps the gathers over nested results in hf_fpdt.trainers.dp_seam",
    ),
)


def is_prepared(obj: Any) -> bool:
    """Whether the Accelerator (or the plugin) already prepared ``obj``."""
    return bool(getattr(obj, PREPARED, False))


def mark_prepared(obj: Any) -> None:
    """Mark ``obj`` as the Accelerator marks what it prepared."""
    setattr(obj, PREPARED, True)
