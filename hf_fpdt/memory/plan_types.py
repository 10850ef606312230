"""The planner's types: :class:`ModelShape` (the numbers of a model the plan needs), :class:`PlanInputs` (the
inputs of one plan, resolved) and :class:`Plan` (bytes per category and tier, the decision, and its text).
:func:`hf_fpdt.memory.planner.plan` makes them; no arithmetic of the step here."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import format_bytes
from ..models.presets import load_model_config

_DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float64": 8, "fp64": 8,
}  # fmt: skip


def dtype_bytes(dtype: object) -> int:
    """Element size of a dtype name (``"bf16"``) or a ``torch.dtype``."""
    if hasattr(dtype, "itemsize"):
        return int(dtype.itemsize)
    name = str(dtype).replace("torch.", "").lower()
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is unknown: use bf16, fp16, fp32 or fp64")
    return _DTYPE_BYTES[name]


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only model the plan needs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int  # all parameters (weights in memory)
    mlp_matrices: int = 3  # 3 for gated (SwiGLU) MLPs, 2 for plain ones

    @classmethod
    def from_config(cls, config: object) -> ModelShape:
        """From an HF ``PretrainedConfig`` (its text config for multimodal ones); parameters counted from it."""
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        e, h = cfg.hidden_size, cfg.num_attention_heads
        hkv = getattr(cfg, "num_key_value_heads", None) or h
        d = getattr(cfg, "head_dim", None) or e // h
        if getattr(cfg, "kv_lora_rank", None):  # multi-head latent attention: kv_b_proj gives every query head its
            # own k and v; what attention stores per head is q/k's width (config.head_dim is RoPE's), v's at most that
            hkv = h
            d = max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, getattr(cfg, "v_head_dim", None) or 0)
        inter = getattr(cfg, "intermediate_size", None) or 4 * e
        act = str(getattr(cfg, "hidden_act", "silu"))
        gated = getattr(cfg, "model_type", "") not in ("gpt_neox", "gpt2", "opt", "phi") and act != "gelu"
        m = 3 if gated else 2
        shape = cls(cfg.num_hidden_layers, e, h, hkv, d, inter, cfg.vocab_size, 0, m)
        tied = bool(getattr(cfg, "tie_word_embeddings", False))
        params = cfg.vocab_size * e * (1 if tied else 2) + cfg.num_hidden_layers * shape.layer_params + e
        return replace(shape, params=params)

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (projections, MLP, two norms)."""
        e, h, hkv, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        return e * h * d + 2 * e * hkv * d + h * d * e + self.mlp_matrices * e * self.intermediate + 2 * e

    def lora_params(self, rank: int) -> int:
        """Trainable parameters of LoRA rank ``rank`` on every linear layer of the decoder layers."""
        e, h, hkv, d, i = self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate
        pairs = [(e, h * d), (e, hkv * d), (e, hkv * d), (h * d, e)] + [(e, i)] * (self.mlp_matrices - 1) + [(i, e)]
        return self.layers * rank * sum(a + b for a, b in pairs)


def model_shape(model: object) -> ModelShape:
    """A :class:`ModelShape` from a shape, an HF config, a preset name or an HF config path/folder."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, str):
        return ModelShape.from_config(load_model_config(model))
    return ModelShape.from_config(model)


@dataclass
class Plan:
    """Bytes per rank of one training step, by category, and the placement decision.

    ``device`` and ``host`` map category -> bytes on that tier (on CPU everything is ``host``).
    ``replay_layers`` layers keep their replay chunks (``replay_per_layer`` bytes each); the others
    recompute attention in backward. Of what is kept across layers, ``resident`` bytes stay on the device
    (the device tier, ``resident_budget``: the last ``resident_inputs`` kept inputs and the replay chunks of
    the last ``resident_replay`` keeping layers), the rest goes to the host. ``host_kept`` is what the host
    budget bounds; ``peak`` the predicted peak of the step's growth (what is allocated after weights,
    optimizer state and inputs exist).
    """

    seq_len: int
    local_len: int
    batch: int
    sp_size: int
    dp_size: int
    device_type: str
    host_budget: int | None  # None: unlimited
    device_budget: int | None
    replay_layers: int
    replay_per_layer: int
    layer_input: int
    layers: int
    device: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    peak: int = 0
    host_kept: int = 0
    problems: list = field(default_factory=list)
    longest: int | None = None  # longest sequence that fits (multiple of sp_size), None if not searched
    segments: int = 1  # k layers per checkpoint segment this plan assumes (1: per-layer checkpointing)
    segments_needed: int | None = None  # smallest k that would fit when per-layer checkpointing does not
    resident_budget: int | None = 0  # the device tier: bytes layer inputs and chunks may keep there (None: no limit)
    resident: int = 0  # bytes of it used at the end of the forward (the last layers' inputs and chunks)
    resident_inputs: int = 0  # kept layer inputs wholly on the device (the last ones)
    resident_replay: int = 0  # layers whose replay chunks are wholly on the device (the last keepers)
    host_need: int = 0  # the host's peak for this step (CPU: weights, optimizer state and the step's peak)
    host_capacity: int | None = None  # what this process may allocate on the host (None: not checked)
    host_limit: str = ""  # what sets host_capacity (RAM, RLIMIT_AS, the cgroup limit)
    host_margin: int = 0  # what the step takes on the host beyond host_need (planner.host_margin), checked with it
    # Host buffers as the allocator takes them (pinned: power-of-two blocks; hf_fpdt.memory.host_pool.host_block_nbytes)
    layer_input_host: int = 0  # one layer input
    replay_host_per_layer: int = 0  # one layer's replay chunks (the host tier counts these; replay_budget exact bytes)
    backward_bytes: int = 0  # the attention backward's dO + fp32 dq chunks, exact
    backward_host: int = 0  # the same as host buffers take them
    heads: str = ""  # how the heads split over the SP group (planner.heads_line; "" at one rank)
    ring: int = 1  # R, the ring of Ulysses groups (sp_size = U x R; hf_fpdt.config.sp_degrees)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def host_fits(self) -> bool:
        """Whether what is kept on the host fits ``host_memory`` (0, the floor, is never over) and the host's
        peak with its margin fits what the process may allocate (``host_capacity``, where checked)."""
        within_budget = not self.host_budget or self.host_kept <= self.host_budget
        return within_budget and (self.host_capacity is None or self.host_need + self.host_margin <= self.host_capacity)

    @property
    def replay_budget(self) -> int | None:
        """Bytes of replay chunks the runtime may keep this step (``None``: no limit), in the attention's own count
        (exact bytes, :func:`hf_fpdt.attention.chunked.replay_nbytes`): ``replay_layers`` layers exactly; the host
        tier's figure counts them as its buffers take them (``replay_host_per_layer``)."""
        return None if self.host_budget is None else self.replay_layers * self.replay_per_layer

    def rounding_line(self) -> str | None:
        """One line when host buffers take more than their bytes (pinned blocks rounded up), else ``None``."""
        pairs = [
            ("layer input", self.layer_input, self.layer_input_host),
            ("replay chunks per layer", self.replay_per_layer, self.replay_host_per_layer),
            ("dO + dq chunks", self.backward_bytes, self.backward_host),
        ]
        if self.device_type == "cpu" or all(host == exact for _, exact, host in pairs):
            return None
        said = ", ".join(f"{name} {format_bytes(exact)} -> {format_bytes(host)}" for name, exact, host in pairs)
        return f"host buffers as the pinned allocator takes them (power-of-two blocks): {said}"

    def describe(self) -> str:
        """A human-readable table of the plan (per rank)."""
        lines = [
            f"plan per rank: seq {self.seq_len} (local {self.local_len}) x batch {self.batch}, sp {self.sp_size}"
            + (f" (U {self.sp_size // self.ring} x R {self.ring})" if self.ring > 1 else "")
            + ", "
            f"dp {self.dp_size}, device {self.device_type}",
            f"host budget: {format_bytes(self.host_budget)}" + (f", device budget: {format_bytes(self.device_budget)}"),
        ]
        if self.heads:
            lines.append(f"heads: {self.heads}")
        tiers = [("device", self.device), ("host", self.host)] if self.device_type != "cpu" else [("host", self.host)]
        width = max([34] + [len(name) for _, items in tiers for name in items])
        for tier, items in tiers:
            lines.append(f"  {tier}:")
            for name, nbytes in items.items():
                lines.append(f"    {name:<{width}} {format_bytes(nbytes):>12}")
            lines.append(f"    {'total':<{width}} {format_bytes(sum(items.values())):>12}")
        rounding = self.rounding_line()
        if rounding:
            lines.append(rounding)
        lines.append(f"placement: {self.placement()}")
        tier = "host" if self.device_type == "cpu" else "device"
        lines.append(f"predicted step peak growth ({tier}): {format_bytes(self.peak)}")
        if self.host_capacity is not None:
            lines.append(
                f"host peak {format_bytes(self.host_need)} + margin {format_bytes(self.host_margin)} of "
                f"{format_bytes(self.host_capacity)} this process may allocate ({self.host_limit})"
            )
        if self.segments > 1:
            lines.append(
                f"checkpoint segments of k={self.segments} layers (FPDTConfig(checkpoint_segments=k) / "
                f"FPDT_CHECKPOINT_SEGMENTS; attention is computed again inside a segment, no replay); cost: "
                f"attention's forward again in every layer's recomputation, and k layers' activations held while "
                f"a segment's backward runs"
            )
        if self.segments_needed is not None:
            lines.append(
                f"segments: checkpoint segments of k={self.segments_needed} layers would fit (one input kept per "
                f"segment; cost: attention's forward again in every layer's recomputation): "
                f"FPDTConfig(checkpoint_segments={self.segments_needed}) or FPDT_CHECKPOINT_SEGMENTS"
            )
        if self.longest is not None:
            lines.append(f"longest sequence that fits: {self.longest} tokens")
        lines += [f"DOES NOT FIT: {p}" for p in self.problems] or ["fits"]
        return "\n".join(lines)

    def placement(self) -> str:
        """One line: segments, layers keeping replay chunks, what stays on the device and what goes to the host."""
        inputs = -(-self.layers // self.segments)
        text = (
            f"checkpoint segments of k={self.segments}; {self.replay_layers}/{self.layers} layers keep their "
            f"attention replay chunks ({format_bytes(self.replay_per_layer)} each), {self.layers - self.replay_layers} "
            "recompute attention in backward"
        )
        if self.device_type != "cpu":
            text += (
                f"; on the device (budget {format_bytes(self.resident_budget)}): "
                f"{format_bytes(self.resident)}, the last "
                f"{self.resident_inputs}/{inputs} layer inputs and the replay chunks of the last "
                f"{self.resident_replay} keeping layers"
            )
        return text + f"; kept on the host across layers: {format_bytes(self.host_kept)}"

    def error(self) -> str:
        """The message of the fail-fast error: the numbers and the ways out."""
        return (
            "hf_fpdt: the plan for this step does not fit: "
            + "; ".join(self.problems)
            + ". Ways out: a shorter sequence"
            + (f" (the longest that fits is {self.longest} tokens)" if self.longest else "")
            + (
                f", checkpoint segments of {self.segments_needed} layers (FPDTConfig(checkpoint_segments="
                f"{self.segments_needed}) or FPDT_CHECKPOINT_SEGMENTS={self.segments_needed})"
                if self.segments_needed
                else ""
            )
            + ", a larger sp_size (more ranks share the sequence), a larger host_memory (FPDTConfig(host_memory=...) "
            "or FPDT_HOST_MEMORY; 0 keeps only the layer inputs), "
            + (
                "more host memory for the process (fewer processes per node, a higher ulimit -v or container limit), "
                if self.host_capacity is not None and self.host_need + self.host_margin > self.host_capacity
                else ""
            )
            + "or activation checkpointing if it is off. "
            "See python -m hf_fpdt.bench plan."
        )


@dataclass(frozen=True)
class PlanInputs:
    """The inputs of one plan, resolved once by :func:`hf_fpdt.memory.planner.plan`: the model as its shape, the
    budgets in bytes, the host capacity with its source. The planner's searches vary one field with
    :func:`dataclasses.replace` (the segment search ``segments``, the longest-length search ``seq_len``)."""

    shape: ModelShape
    seq_len: int
    batch: int
    sp_size: int
    dp_size: int
    trainable_params: int
    es: int  # element size of the dtype
    device: str
    device_budget: int | None  # the device's memory (None: not checked)
    host_budget: int | None  # host_memory (None: unlimited)
    chunk_size: int
    mlp_chunks: int | None
    loss_chunks: int | None
    checkpointing: bool
    offload: bool
    offload_layer_inputs: bool
    optimizer: bool
    segments: int | str  # k layers per checkpoint segment, or "auto" (the runtime's rule)
    resident_memory: int | str | None  # the device tier, as given (resolved with the step's working set)
    host_capacity: tuple[int, str] | None  # (bytes, what sets them); None: not checked
    ring: int = 1  # R, the ring of Ulysses groups: sp_size = U x R (hf_fpdt.config.sp_degrees)

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"


__all__ = ["ModelShape", "Plan", "PlanInputs", "dtype_bytes", "model_shape"]
