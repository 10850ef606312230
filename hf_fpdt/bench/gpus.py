"""The GPUs a traced step is timed on (:mod:`hf_fpdt.bench.timeline`): one row per GPU, every rate with its source.

Measured rates come from one H100 80GB (torch 2.11, CUDA 13, bf16) on 2026-11-22 (``gpu/README.md`` of the
project's shared folder): cuDNN's and torch's flash (FA2) attention kernels at chunk-sized blocks, forward and
backward, and the GEMM rate the step's profile implies (0.40 s of GEMMs at 32K tokens on the ``llama-1b`` preset,
about 2.7e14 FLOPs: forward, recomputation and backward). Where nothing was measured the datasheet's figure is
used, scaled by an efficiency the row names; the H200 and A100 take the H100's measured efficiencies.
The dense bf16 peak (the MFU denominator) is :data:`hf_fpdt.bench.common.GPU_BF16_PEAKS`' (the bench's own).
"""

from __future__ import annotations

from dataclasses import dataclass

from .common import GPU_BF16_PEAKS

GB = 1e9
TF = 1e12
MIB = 1 << 20

# the host's cost per operation: the Python and launch time of one eager op (the trace's kernels, copies, syncs);
# an assumption, not a measurement: PyTorch eager launches run at 5-20 us per op from Python.
HOST_OP_S = 10e-6
KERNEL_MIN_S = 2e-6  # the shortest a kernel takes on the device (launch latency of a tiny kernel)
SYNC_S = 10e-6  # a host synchronisation's own round trip
COLLECTIVE_LATENCY_S = 20e-6  # an NCCL all-to-all's fixed cost within a node


def _peak(fragment: str) -> float:
    return dict(GPU_BF16_PEAKS)[fragment]


@dataclass(frozen=True)
class GPU:
    """One GPU's rates (bytes/s, FLOP/s) and where each comes from (``sources``: rate -> source)."""

    name: str
    memory: int  # bytes the device reports (total_memory)
    peak: float  # dense bf16 FLOP/s, the MFU denominator
    gemm: float
    attention: dict  # (backend, head_dim) -> FLOP/s forward+backward, backend "cudnn" or "flash"
    hbm: float  # bytes/s a memory-bound kernel moves
    pcie_pinned: float  # bytes/s one way, pinned host memory
    pcie_pageable: float
    nvlink: float  # bytes/s per GPU one way within a node (all-to-all)
    internode: float  # bytes/s per GPU across nodes
    gpus_per_node: int
    sources: dict

    def attention_rate(self, backend: str, head_dim: int) -> float:
        """FLOP/s of ``backend``'s attention at ``head_dim`` (the nearest measured head dim)."""
        rates = {d: r for (b, d), r in self.attention.items() if b == backend} or {
            d: r for (b, d), r in self.attention.items() if b == "flash"
        }
        nearest = min(rates, key=lambda d: abs(d - head_dim))
        return rates[nearest]


_H100_GEMM = 670 * TF  # measured (see the module docstring)
_GEMM_EFFICIENCY = _H100_GEMM / _peak("H100")
_HBM_EFFICIENCY = 0.8  # assumed: elementwise kernels reach about 80% of the datasheet bandwidth
_PCIE_EFFICIENCY = 0.8  # assumed: pinned cudaMemcpyAsync reaches about 80% of the link's one-way rate

_H100_ATTENTION = {("cudnn", 64): 430 * TF, ("cudnn", 128): 550 * TF, ("flash", 64): 285 * TF, ("flash", 128): 285 * TF}
# F.scaled_dot_product_attention's own choice (HF sdpa): cuDNN's kernel on Hopper, flash on Ampere
_H100_ATTENTION.update({("sdpa", d): rate for (b, d), rate in _H100_ATTENTION.items() if b == "cudnn"})
_MEASURED = "measured on one H100 80GB, 2026-11-22 (gpu/README.md)"

GPUS: dict[str, GPU] = {
    "h100": GPU(
        name="H100 SXM 80GB",
        memory=81559 * MIB,
        peak=_peak("H100"),
        gemm=_H100_GEMM,
        attention=_H100_ATTENTION,
        hbm=3.35e12 * _HBM_EFFICIENCY,
        pcie_pinned=64 * GB * _PCIE_EFFICIENCY,
        pcie_pageable=20 * GB,
        nvlink=450 * GB * 0.8,
        internode=50 * GB,
        gpus_per_node=8,
        sources={
            "peak": "datasheet 989 TFLOP/s dense bf16 (hf_fpdt.bench.common.GPU_BF16_PEAKS)",
            "gemm": f"{_MEASURED}: the 32K profile's GEMM time",
            "attention": f"{_MEASURED}: cuDNN 390-475 (head dim 64), 526-576 (128); flash (FA2) 250-320, mid-range; "
            "HF sdpa at cuDNN's (torch's default on Hopper: the measured sdpa + checkpointing step times of llama-1b "
            "match cuDNN's rates, not FA2's)",
            "hbm": "datasheet 3.35 TB/s x 0.8 (assumed)",
            "pcie_pinned": "PCIe 5.0 x16, 64 GB/s one way x 0.8 (assumed)",
            "pcie_pageable": "assumed 20 GB/s (a pageable copy is staged through a pinned buffer)",
            "nvlink": "datasheet NVLink 4 900 GB/s both ways: 450 one way x 0.8 (assumed all-to-all efficiency)",
            "internode": "one 400 Gb/s NDR link per GPU (assumed)",
        },
    ),  # fmt: skip
    "h200": GPU(
        name="H200 SXM 141GB",
        memory=143771 * MIB,
        peak=_peak("H200"),
        gemm=_H100_GEMM,
        attention=_H100_ATTENTION,
        hbm=4.8e12 * _HBM_EFFICIENCY,
        pcie_pinned=64 * GB * _PCIE_EFFICIENCY,
        pcie_pageable=20 * GB,
        nvlink=450 * GB * 0.8,
        internode=50 * GB,
        gpus_per_node=8,
        sources={
            "peak": "datasheet 989 TFLOP/s dense bf16 (the H100's SMs and clocks)",
            "gemm": "the H100's measured rate (same SMs and clocks)",
            "attention": "the H100's measured rates (same SMs and clocks)",
            "hbm": "datasheet 4.8 TB/s x 0.8 (assumed)",
            "pcie_pinned": "PCIe 5.0 x16, 64 GB/s one way x 0.8 (assumed)",
            "pcie_pageable": "assumed 20 GB/s",
            "nvlink": "datasheet NVLink 4, as the H100",
            "internode": "one 400 Gb/s NDR link per GPU (assumed)",
        },
    ),  # fmt: skip
    "a100": GPU(
        name="A100 SXM 80GB",
        memory=81920 * MIB,
        peak=_peak("A100"),
        gemm=_peak("A100") * _GEMM_EFFICIENCY,
        attention={
            ("cudnn", 64): 170 * TF,
            ("cudnn", 128): 190 * TF,
            ("flash", 64): 170 * TF,
            ("flash", 128): 190 * TF,
        },
        hbm=2.039e12 * _HBM_EFFICIENCY,
        pcie_pinned=32 * GB * _PCIE_EFFICIENCY,
        pcie_pageable=12 * GB,
        nvlink=300 * GB * 0.8,
        internode=25 * GB,
        gpus_per_node=8,
        sources={
            "peak": "datasheet 312 TFLOP/s dense bf16 (hf_fpdt.bench.common.GPU_BF16_PEAKS)",
            "gemm": "datasheet x the H100's measured GEMM efficiency (0.68)",
            "attention": "FlashAttention-2 paper (Dao, 2023), A100 forward+backward causal: up to about 190 (head dim "
            "128) and 170 (64) TFLOP/s; cuDNN and HF sdpa's default taken as the same on Ampere",
            "hbm": "datasheet 2.04 TB/s x 0.8 (assumed)",
            "pcie_pinned": "PCIe 4.0 x16, 32 GB/s one way x 0.8 (assumed)",
            "pcie_pageable": "assumed 12 GB/s",
            "nvlink": "datasheet NVLink 3 600 GB/s both ways: 300 one way x 0.8",
            "internode": "one 200 Gb/s HDR link per GPU (assumed)",
        },
    ),  # fmt: skip
}


def gpu(name: str) -> GPU:
    """The table's row for ``name`` (``h100``, ``h200``, ``a100``; case and spaces ignored)."""
    key = name.strip().lower().replace(" ", "").replace("-", "")
    for k, row in GPUS.items():
        if key.startswith(k):
            return row
    raise ValueError(f"unknown GPU {name!r}; choose from {', '.join(GPUS)}")
