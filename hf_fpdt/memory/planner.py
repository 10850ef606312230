"""Where the bytes of one training step go, per rank, before anything is allocated.

:func:`plan` takes a model shape (an HF config, a preset name, a config path, or :class:`ModelShape`),
the sequence length and the parallel sizes, and returns a :class:`Plan`: bytes per category and tier,
how many layers keep their attention replay chunks within the budgets, what stays on the device,
whether it fits, and the longest sequence that would. The runtime calls it at the first step of each
step shape (:func:`hf_fpdt.integrations.step_plan.plan_step`) and follows it; a plan that does not
fit the host is a ``ValueError`` naming the numbers and the ways out, on every rank, before the first
forward (or, with ``checkpoint_segments="auto"``, checkpoint segments of the smallest k that fits).

Per rank, with ``S`` the local length (``ceil(seq / sp)`` padded), ``E`` the hidden size, ``es`` the
element size, ``H, Hkv'`` the query and (replicated, ``max(Hkv, sp)`` when sp > Hkv) key/value heads::

    layer input        B * S * E * es                                   one per layer (checkpointing)
    replay chunks  R = B * S * ((H + Hkv') * D * 2 * es + H * 4)          q, k, v, o + fp32 lse, per layer
    backward extra     B * S * H * D * (es + 4)                         dO + fp32 dq accumulators, one layer

What hf_fpdt keeps across layers is ``inputs + n_keep * R`` (+ one layer's chunks and backward extra,
the pool's working set, while a layer recomputes). Two tiers hold it: the device tier (``resident_memory``
= ``FPDTConfig.device_memory``, bytes ``Dr``) takes the newest of it, i.e. the last layers' replay chunks
and inputs (walking the forward backwards, :func:`_device_share`; the runtime's
:class:`hf_fpdt.memory.host_store.DeviceBudget` spills the oldest first, which lands there), and the host takes the
rest, bounded by ``host_memory``: ``n_keep`` is the most layers with
``inputs + n_keep * R + working <= host_memory + Dr``. With ``host_memory=0`` (the floor) the host keeps
only inputs and ``n_keep`` is what the device tier holds beyond them (0 on CPU, where the device is the
host and ``Dr = 0``). Segments of ``k`` layers keep ``ceil(L / k)`` inputs and no replay chunks; while a
segment's backward runs, its recomputation holds ``SEGMENT_SAVED * k`` buffers of ``B * S * E`` on the
device (the k layers run without inner checkpoints; ``SEGMENT_SAVED`` is measured on CPU with
``bench memory --segments 1,2``). The pool's working set (a segment's chunks and the attention backward's
dO/dq accumulators) is counted at the peak: the pool keeps it from the first segment's backward on, so
every later segment's recomputation peaks on top of it (a model of one segment peaks a little lower, its
only recomputation running before its first attention backward; compare 4 and 8 layers, not 2 and 6,
for the growth per layer).

The step's peak on CPU (where the device *is* the host) comes in the backward of the last layer: all
layer inputs and kept replay chunks are still alive, with the gradients made so far (LM head and one
layer), the pool's working set, and the transient activations of one layer's recomputation and
backward: ``ACT_TRANSIENT`` buffers of ``B * S * E`` (the layer's saved activations and the gradients
in flight) and ``MLP_TRANSIENT`` of one MLP tile ``B * S / mlp_tiles * I``. Those two constants are the
measured count of such buffers alive at the peak on this code (tests/test_planner.py and
``python -m hf_fpdt.bench memory --layers 2,6`` compare the prediction with the measured peak); the
rest is exact from the shapes. No allocation happens here: only arithmetic on the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config import format_bytes, parse_bytes
from ..models.presets import load_model_config
from .probes import auto_host_memory, host_limits, local_processes

ACT_TRANSIENT = 10  # [B, S, E] buffers alive at the peak of one layer's recomputation + backward (measured)
MLP_TRANSIENT = 4  # [B, S / tiles, I] buffers of one MLP tile (gate, up, act, grad)
SEGMENT_SAVED = 3  # [B, S, E] buffers a layer inside a checkpoint segment saves in its recomputation (measured)
AUTO_DEVICE_SHARE = 0.9  # share of the device's memory the step may plan for (the rest: allocator slack)

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
        raise ValueError(f"unknown dtype {dtype!r}; use bf16, fp16, fp32 or fp64")
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

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def host_fits(self) -> bool:
        """Whether what is kept on the host fits ``host_memory`` (0, the floor, is never over) and the host's
        peak fits what the process may allocate (``host_capacity``, where checked)."""
        within_budget = not self.host_budget or self.host_kept <= self.host_budget
        return within_budget and (self.host_capacity is None or self.host_need <= self.host_capacity)

    @property
    def replay_budget(self) -> int | None:
        """Bytes of replay chunks the runtime may keep this step (``None``: no limit)."""
        return None if self.host_budget is None else self.replay_layers * self.replay_per_layer

    def describe(self) -> str:
        """A human-readable table of the plan (per rank)."""
        lines = [
            f"plan per rank: seq {self.seq_len} (local {self.local_len}) x batch {self.batch}, sp {self.sp_size}, "
            f"dp {self.dp_size}, device {self.device_type}",
            f"host budget: {format_bytes(self.host_budget)}" + (f", device budget: {format_bytes(self.device_budget)}"),
        ]
        tiers = [("device", self.device), ("host", self.host)] if self.device_type != "cpu" else [("host", self.host)]
        width = max([34] + [len(name) for _, items in tiers for name in items])
        for tier, items in tiers:
            lines.append(f"  {tier}:")
            for name, nbytes in items.items():
                lines.append(f"    {name:<{width}} {format_bytes(nbytes):>12}")
            lines.append(f"    {'total':<{width}} {format_bytes(sum(items.values())):>12}")
        lines.append(f"placement: {self.placement()}")
        tier = "host" if self.device_type == "cpu" else "device"
        lines.append(f"predicted step peak growth ({tier}): {format_bytes(self.peak)}")
        if self.host_capacity is not None:
            lines.append(
                f"host peak {format_bytes(self.host_need)} of {format_bytes(self.host_capacity)} this process may "
                f"allocate ({self.host_limit})"
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
                if self.host_capacity is not None and self.host_need > self.host_capacity
                else ""
            )
            + "or activation checkpointing if it is off. "
            "See python -m hf_fpdt.bench plan."
        )


def replay_bytes_per_layer(shape: ModelShape, batch: int, local_len: int, sp_size: int, es: int) -> int:
    """What one layer's attention stores for backward (q, k, v, o and the fp32 lse), per rank."""
    kv = max(shape.kv_heads, sp_size) if sp_size > shape.kv_heads else shape.kv_heads
    return batch * local_len * ((shape.heads + kv) * shape.head_dim * 2 * es + shape.heads * 4)


def plan(
    model: object,
    seq_len: int,
    *,
    batch: int = 1,
    sp_size: int = 1,
    dp_size: int = 1,
    lora_rank: int | None = None,
    trainable_params: int | None = None,
    dtype: object = "bfloat16",
    device: str = "cuda",
    device_memory: int | str | None = None,
    host_memory: int | str | None = "auto",
    chunk_size: int = 65536,
    mlp_chunks: int | None = None,
    loss_chunks: int | None = None,
    checkpointing: bool = True,
    offload: bool = True,
    offload_layer_inputs: bool = True,
    optimizer: bool = True,
    search_longest: bool = True,
    segments: int | str = 1,
    resident_memory: int | str | None = "auto",
    host_capacity: int | str | tuple | None = None,
) -> Plan:
    """The :class:`Plan` of one training step (see the module docstring). Allocates nothing.

    Args:
        model: :class:`ModelShape`, an HF config, a preset name, or an HF config file/folder.
        seq_len: tokens per sample (the whole sequence, over all SP ranks).
        lora_rank: LoRA rank on every linear layer; ``None`` = full finetune (unless ``trainable_params``).
        trainable_params: parameters that get gradients (overrides ``lora_rank``).
        device: ``"cpu"`` (the device is the host: one tier) or an accelerator type.
        device_memory: the device's memory (bytes, ``"80GiB"``; ``None``: not checked, and the device tier is
            empty under ``resident_memory="auto"``): the plan must fit in it.
        host_memory: the host budget (``FPDTConfig.host_memory``: bytes, ``"64GiB"``, ``"auto"``, ``0``,
            ``"unlimited"``/``None``).
        resident_memory: the device tier (``FPDTConfig.device_memory``): device bytes that layer inputs and
            replay chunks may keep on the device, the last layers' first, before the rest goes to the host
            (same forms; ``"auto"``: ``AUTO_DEVICE_SHARE`` of ``device_memory`` less the weights and the
            planned working set). Replay chunks are kept for as many layers as device + host hold.
        optimizer: count Adam's two fp32 states per trainable parameter.
        segments: k consecutive layers per checkpoint segment (``FPDTConfig.checkpoint_segments``: one input
            kept per segment plus, while a segment's backward runs, the k layers' saved activations and
            attention chunks its recomputation rebuilds; no replay chunks are kept inside segments). When the default
            (1) does not fit the host, ``Plan.segments_needed`` is the smallest k that would. ``"auto"``: the
            runtime's rule (``checkpoint_segments="auto"``), k=1 when it fits the host, else that smallest k.
        host_capacity: what one process may really allocate on the host, compared with the step's host peak
            (on CPU: weights, optimizer state and the step's peak; else what the host tier holds): bytes,
            ``"auto"`` (this machine now: the smallest of RAM available, ``RLIMIT_AS`` and the cgroup limit,
            RAM and cgroup shared by ``LOCAL_WORLD_SIZE`` processes, :mod:`hf_fpdt.memory.probes`) or ``None``
            (not checked: planning for another machine).
    """
    if host_capacity == "auto":
        host_capacity = host_limits().per_process(local_processes())
    elif isinstance(host_capacity, (int, str)):
        host_capacity = (_budget(host_capacity), "host_capacity") if host_capacity != "unlimited" else None
    if host_capacity is not None and host_capacity[0] is None:
        host_capacity = None
    if segments == "auto":  # the runtime's rule: per-layer checkpointing, else the smallest k that fits the host
        settings = {name: value for name, value in locals().items() if name not in ("model", "seq_len", "segments")}
        first = plan(model, seq_len, **{**settings, "segments": 1, "search_longest": False})
        if first.host_fits or first.segments_needed is None:
            return plan(model, seq_len, segments=1, **settings) if search_longest else first
        return plan(model, seq_len, segments=first.segments_needed, **settings)
    if not isinstance(segments, int) or isinstance(segments, bool) or segments < 1:
        raise ValueError(f"segments must be an int >= 1 or 'auto' (layers per checkpoint segment), got {segments!r}")
    shape = model_shape(model)
    es = dtype_bytes(dtype)
    host_budget = _budget(host_memory)
    device_budget = _budget(device_memory) if device_memory is not None else None
    padded = -(-seq_len // sp_size) * sp_size
    local = padded // sp_size
    cpu = device == "cpu"
    e, i_, v = shape.hidden, shape.intermediate, shape.vocab
    bse = batch * local * e * es
    layer_input = bse
    k = min(segments, shape.layers) if checkpointing else 1
    inputs = -(-shape.layers // k) * layer_input  # one input per segment (per layer when k = 1)
    # a segment's recomputation runs its k layers without inner checkpoints: their saved activations live
    # on the device while the segment's backward runs (autograd's, not the offloader's)
    segment_held = SEGMENT_SAVED * k * bse if k > 1 else 0
    replay = replay_bytes_per_layer(shape, batch, local, sp_size, es)
    bwd_extra = batch * local * shape.heads * shape.head_dim * (es + 4)
    if trainable_params is None:
        trainable_params = shape.params if lora_rank is None else shape.lora_params(lora_rank)
    grads = trainable_params * es
    full_ft = trainable_params >= shape.params
    grads_at_peak = (v * e + shape.layer_params) * es if full_ft else grads  # LM head + last layer so far
    opt = trainable_params * 8 if optimizer else 0
    n_chunks = max(1, -(-padded // chunk_size))
    mlp_tiles = mlp_chunks or 2 * n_chunks
    loss_tiles = loss_chunks or max(1, 2 * v // e)
    loss_tile = 2 * batch * -(-local // loss_tiles) * v * 4  # fp32 logits of one tile and their gradient
    mlp_tile = MLP_TRANSIENT * batch * -(-local // mlp_tiles) * i_ * es
    act = ACT_TRANSIENT * bse + mlp_tile

    # Placement: every layer keeps its chunks while the two tiers hold them, else as many as fit beside one
    # layer's working set (the recomputing layer's chunks), else none (the floor). The device tier (``room``,
    # the resident budget) holds the last layers' inputs and chunks, the host the rest (see _device_share).
    host_inputs = inputs if (cpu or offload_layer_inputs) else 0  # the inputs the two tiers place
    chunks_on_host = cpu or offload
    saved_no_ckpt = 0 if checkpointing else shape.layers * 2 * bse  # projection input + MLP tile inputs
    dev: dict = {}
    host: dict = {}
    if cpu:
        dev = host
    dev["weights"] = shape.params * es
    dev["gradients"] = grads
    if opt:
        dev["optimizer state (Adam, fp32)"] = opt
    dev["layer recompute transients"] = act
    dev["loss tile (fp32 logits + grad)"] = loss_tile
    if saved_no_ckpt:
        dev["saved activations (no checkpointing)"] = saved_no_ckpt
    if segment_held:
        dev[f"a segment's recomputed activations ({k} layers)"] = segment_held
    if not cpu:
        # q_i, k_i, v_i, o_i of the chunk, the fetched k_j, v_j and the prefetched next pair
        dev["attention working set (chunks)"] = 8 * batch * min(chunk_size, padded) * shape.heads * shape.head_dim * es
    room = _resident_room(resident_memory, cpu, device_budget, sum(dev.values()) - dev["weights"], dev["weights"])
    cap = None if host_budget is None or room is None else host_budget + room
    if host_capacity is not None and room is not None:  # what the host really has bounds the kept bytes too
        limit = host_capacity[0]
        if cpu:  # less the rest of the host's peak (with a recomputing layer's chunks in the pool)
            limit -= dev["weights"] + opt + grads_at_peak + saved_no_ckpt + segment_held - bwd_extra
            limit -= max(replay * k + bwd_extra + act, loss_tile + bse)
        cap = limit + room if cap is None else min(cap, limit + room)
    if not checkpointing:
        keep = shape.layers  # nothing is recomputed: every layer's chunks survive until its backward
    elif k > 1:
        keep = 0  # inside a checkpoint segment attention is computed again in the recomputation (no replay)
    elif cap is None or not chunks_on_host:
        keep = shape.layers
    elif host_inputs + shape.layers * replay + bwd_extra <= cap:
        keep = shape.layers
    else:
        keep = max(0, min(shape.layers - 1, (cap - host_inputs - bwd_extra - replay) // max(1, replay)))
    # a segment's recomputation stores the chunks of its k layers before their backward runs
    working = (replay * k if keep < shape.layers else 0) + bwd_extra  # pooled while one layer's backward runs
    share = _device_share(shape.layers, k, keep, layer_input if host_inputs else 0, replay if chunks_on_host else 0,
                          room)  # fmt: skip
    lasting = host_inputs + (keep * replay if chunks_on_host else 0)
    transient = working if chunks_on_host else 0
    resident = lasting + transient if room is None else min(room, lasting + transient)
    host_kept = lasting + transient - resident
    n_inputs = -(-shape.layers // k)
    if not cpu and host_inputs:
        dev[f"layer inputs (last {share.input_layers} of {n_inputs})"] = share.input_bytes
    if not cpu and chunks_on_host:
        dev[f"replay chunks (last {share.replay_layers} of {keep} layers)"] = share.replay_bytes
        dev["chunk working set (in the budget)"] = resident - share.input_bytes - share.replay_bytes
    tier_chunks = host if chunks_on_host else dev
    tier_inputs = host if host_inputs else dev
    tier_inputs["layer inputs"] = inputs - (share.input_bytes if host_inputs else 0)
    tier_chunks[f"replay chunks ({keep} layers)"] = keep * replay - (share.replay_bytes if chunks_on_host else 0)
    pool = f"chunks of a segment ({k} layers) + dO/dq (pool)" if k > 1 else "one layer's chunks + dO/dq (pool)"
    tier_chunks[pool] = working - (resident - share.input_bytes - share.replay_bytes if chunks_on_host else 0)

    if cpu:  # one tier: the kept bytes, then the larger of a layer's backward and the loss tile
        peak = grads_at_peak + inputs + keep * replay + saved_no_ckpt + segment_held
        peak += max(working + act, loss_tile + bse)
        host_need = dev["weights"] + opt + peak
    else:  # the device's growth: what the step allocates there (weights and optimizer state exist before)
        peak = sum(nbytes for name, nbytes in dev.items() if name != "weights" and not name.startswith("optimizer"))
        host_need = sum(host.values())
    p = Plan(
        seq_len, local, batch, sp_size, dp_size, device, host_budget, device_budget, keep, replay, layer_input,
        shape.layers, dev if not cpu else {}, host, peak, host_kept, segments=k, resident_budget=room,
        resident=0 if cpu else resident, resident_inputs=share.input_layers, resident_replay=share.replay_layers,
        host_need=host_need, host_capacity=None if host_capacity is None else host_capacity[0],
        host_limit="" if host_capacity is None else host_capacity[1],
    )  # fmt: skip
    if host_budget is not None and host_budget > 0 and host_kept > host_budget:
        p.problems.append(
            f"hf_fpdt would keep {format_bytes(host_kept)} on the host across layers "
            f"(layer inputs {format_bytes(host_inputs)}"
            + (f", {pool.replace(' (pool)', '')} {format_bytes(working)}" if chunks_on_host else "")
            + (f", less {format_bytes(resident)} on the device" if resident and not cpu else "")
            + f") but host_memory is {format_bytes(host_budget)}"
        )
    if p.host_capacity is not None and host_need > p.host_capacity:
        p.problems.append(
            f"the step's host peak is about {format_bytes(host_need)} but this process may allocate "
            f"{format_bytes(p.host_capacity)} ({p.host_limit})"
        )
    if device_budget is not None and not cpu:
        need = sum(dev.values())
        if need > device_budget:
            p.problems.append(f"the device needs about {format_bytes(need)} but has {format_bytes(device_budget)}")
    if p.problems and k == 1 and checkpointing and not p.host_fits:
        for kk in range(2, shape.layers + 1):
            what_if = plan(
                shape, seq_len, batch=batch, sp_size=sp_size, dp_size=dp_size, trainable_params=trainable_params,
                dtype=dtype, device=device, device_memory=device_budget, host_memory=host_budget,
                chunk_size=chunk_size, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks, offload=offload,
                offload_layer_inputs=offload_layer_inputs, optimizer=optimizer, search_longest=False, segments=kk,
                resident_memory=resident_memory, host_capacity=host_capacity,
            )  # fmt: skip
            if what_if.fits:
                p.segments_needed = kk
                break
    if search_longest and (host_budget or device_budget or host_capacity):
        settings = dict(
            batch=batch, sp_size=sp_size, dp_size=dp_size, trainable_params=trainable_params, dtype=dtype,
            device=device, device_memory=device_budget, host_memory="unlimited" if host_budget is None else host_budget,
            chunk_size=chunk_size, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks, checkpointing=checkpointing,
            offload=offload, offload_layer_inputs=offload_layer_inputs, optimizer=optimizer, search_longest=False,
            segments=k, resident_memory=resident_memory, host_capacity=host_capacity,
        )  # fmt: skip
        p.longest = _longest(lambda n: plan(shape, n, **settings).fits, sp_size)
    return p


@dataclass(frozen=True)
class _Share:
    input_bytes: int = 0
    replay_bytes: int = 0
    input_layers: int = 0  # kept inputs wholly on the device (one per segment)
    replay_layers: int = 0  # layers whose replay chunks are wholly on the device


def _device_share(layers: int, k: int, keep: int, input_b: int, replay_b: int, room: int | None) -> _Share:
    """What of the lasting tensors the device budget ``room`` holds at the end of the forward.

    The budget spills the oldest lasting tensors first (:class:`hf_fpdt.memory.host_store.DeviceBudget`), so the
    device keeps the newest: walking the forward backwards, layer l's replay chunks (put after its input),
    then its input (one per segment of ``k``), while they fit; the one that fits partly ends the walk.
    """
    got = {"input": [0, 0], "replay": [0, 0]}
    left = room
    for layer in reversed(range(layers)):
        units = [("replay", replay_b)] if layer < keep and replay_b else []
        units += [("input", input_b)] if layer % k == 0 and input_b else []
        for kind, nbytes in units:
            take = nbytes if left is None else min(nbytes, left)
            got[kind][0] += take
            got[kind][1] += take == nbytes
            if left is not None:
                left -= take
                if left == 0 or take < nbytes:
                    return _Share(got["input"][0], got["replay"][0], got["input"][1], got["replay"][1])
    return _Share(got["input"][0], got["replay"][0], got["input"][1], got["replay"][1])


def _resident_room(raw: int | str | None, cpu: bool, capacity: int | None, working: int, weights: int) -> int | None:
    """The device budget for layer inputs and replay chunks (``None``: no limit). ``"auto"``:
    ``AUTO_DEVICE_SHARE`` of the device's memory less the weights and the planned working set (0 when the
    device's memory is not known); on CPU 0, the device is the host."""
    if cpu:
        return 0
    value = _budget(raw) if raw != "auto" else "auto"
    if value != "auto":
        return value
    if capacity is None:
        return 0
    return max(0, int(AUTO_DEVICE_SHARE * capacity) - weights - working)


def _budget(raw: int | str | None) -> int | None:
    if raw is None:
        return None
    value = parse_bytes(raw)
    if value == "unlimited":
        return None
    if value == "auto":
        return auto_host_memory()
    return int(value)


def _longest(fits, step: int) -> int | None:
    """Largest multiple of ``step`` with ``fits(n)`` (monotone), by doubling then bisection; None if none."""
    if not fits(step):
        return None
    lo, hi = 1, 2
    while fits(hi * step):
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            return lo * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step


__all__ = ["ModelShape", "Plan", "dtype_bytes", "model_shape", "plan", "replay_bytes_per_layer"]
