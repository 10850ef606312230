"""FPDTRuntime: what the chunk pipeline of one model needs beside its tensors.

One runtime is shared by every attention layer of a model (``hf_fpdt.apply`` installs it), so the
host store's pool is reused across layers and steps. It holds the process group explicitly; nothing
here is global.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import FPDTConfig
from .offload import HostStore
from .sequence_parallel import group_size


@dataclass
class FPDTRuntime:
    """Settings, sequence-parallel group and host stores of one model.

    Args:
        config: the :class:`FPDTConfig`.
        group: the sequence-parallel process group (``None`` = one process).
        backend: force a kernel backend (see :mod:`hf_fpdt.kernels`); ``None`` chooses by device.
    """

    config: FPDTConfig = field(default_factory=FPDTConfig)
    group: dist.ProcessGroup | None = None
    backend: str | None = None
    _stores: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        sp = group_size(self.group)
        if sp != self.config.sp_size:
            if self.group is None:
                raise ValueError(
                    f"sp_size={self.config.sp_size} needs a sequence-parallel process group: pass group= to "
                    "hf_fpdt.apply (or use hf_fpdt.FPDTPlugin, which builds it)"
                )
            self.config.sp_size = sp

    @property
    def sp_size(self) -> int:
        return group_size(self.group)

    def chunk_size(self, device: torch.device) -> int:
        """Tokens of the global sequence per chunk (``"auto"`` is resolved by measurement once)."""
        cs = self.config.chunk_size
        if cs == "auto":
            from .autotune import resolve_chunk_size

            cs = self.config.chunk_size = resolve_chunk_size(device, sp_size=self.sp_size)
        return int(cs)

    def store(self, device: torch.device) -> HostStore:
        """The host store of ``device`` (created on first use, then reused)."""
        key = str(device)
        if key not in self._stores:
            offload = self.config.offload
            if offload == "auto":
                from .autotune import resolve_offload

                offload = resolve_offload(device)
            self._stores[key] = HostStore(device, enabled=bool(offload))
        return self._stores[key]
