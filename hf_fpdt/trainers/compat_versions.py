"""What hf_fpdt's trainers need from the installed TRL and Trainer, found by feature detection (never a version
compare).

The TRL adapters (``FPDTSFTTrainer``, ``FPDTDPOTrainer``, ``FPDTKTOTrainer``, ``FPDTGRPOTrainer``,
``FPDTRLOOTrainer``) are built on TRL's fused LM head: TRL's trainers score sequences with
``model(..., fused_lm_head=True)`` and hf_fpdt answers that call (:mod:`.trl_fused_head`). A TRL without it
cannot be served, and the trainers' module would fail deep inside an ``import``; :func:`trl_missing` names what is
missing instead, and ``hf_fpdt.FPDT*Trainer`` raises an ``ImportError`` that says so and how to install a TRL
that has it (setup.cfg's ``trl`` extra; CHANGELOG.md, issue 39, has what fails on each older release).
"""

from __future__ import annotations

import importlib.util
from importlib import metadata


def trl_missing() -> str | None:
    """What the installed TRL lacks for hf_fpdt's TRL trainers, or None where it has all of it (or no TRL is
    installed: the trainers' own ``from trl import ...`` then says so). Checked, by what TRL defines:

    * ``trl.trainer.utils.add_fused_lm_head``: TRL's fused LM head (TRL 1.15 on; 1.14 and older compute the
      logits in each trainer, and SFT's ``chunked_nll`` reads ``model.forward.__func__``, which hf_fpdt's installed
      forward does not have);
    * its kernel: ``trl.trainer.utils._ChunkedLogProbFunction`` is None where TRL made it a Triton-only kernel
      and Triton is not installed (TRL 1.15 on a CPU machine: every fused-head call fails with ``'NoneType' object
      has no attribute 'apply'``); TRL 1.16 on has a torch path.
    """
    if importlib.util.find_spec("trl") is None:
        return None
    from trl.trainer import utils

    if not hasattr(utils, "add_fused_lm_head"):
        return "TRL's fused LM head (trl.trainer.utils.add_fused_lm_head)"
    if getattr(utils, "_ChunkedLogProbFunction", True) is None:
        return "a kernel for TRL's fused LM head here (trl.trainer.utils._ChunkedLogProbFunction is None: Triton-only)"
    return None


def trl_requirement() -> str:
    """The ``trl`` extra's requirement as the installed hf_fpdt declares it (``trl>=...``), for messages."""
    try:
        requires = metadata.requires("hf_fpdt") or []
    except metadata.PackageNotFoundError:
        requires = []
    found = [r.split(";")[0].strip() for r in requires if r.startswith("trl") and 'extra == "trl"' in r]
    return found[0] if found else "trl (the hf_fpdt[trl] extra)"


def check_trl(name: str) -> None:
    """Raise an ``ImportError`` naming what the installed TRL lacks for ``hf_fpdt.<name>`` (a TRL trainer)."""
    missing = trl_missing()
    if missing is not None:
        raise ImportError(
            f"hf_fpdt.{name} needs {missing}, which the installed trl {metadata.version('trl')} lacks: "
            f"install {trl_requirement()!r} (pip install 'hf_fpdt[trl]')"
        )
