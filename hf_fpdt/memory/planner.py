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
    backward extra     B * S * H * D * ([es] + 4)                       dO (SP > 1) + fp32 dq accumulators, one layer

With a ring beside Ulysses (``sp = U x ring``, :mod:`hf_fpdt.attention.ring`) the heads split over U and a rank
stores the k, v of every ring member's chunk: ``Hkv'`` above counts ``ring`` times the KV heads of a U-way split.

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

On a GPU the step's peak comes in the backward of the first layer to run it, with the device tier still full:
the weights (and optimizer state), the tier's layer inputs and replay chunks, the attention working set (without
its fetched sets when that layer's chunks are on the tier) and the backward's transients: a layer's recompute +
backward (``ACT_TRANSIENT`` buffers of ``B * S * E``, plus, in a 16-bit dtype, the larger of one MLP tile and
``UPCAST_TRANSIENT`` float32 ``[B, S, E]`` copies: the norms' and LoRA's casts), or the loss tile, whichever is
larger (the loss runs before the layers' backward); where no layer input stays on the device tier, that layer's
input fetched back and the next one's prefetched (``FETCHED_INPUTS`` of ``B * S * E``).
``python -m hf_fpdt.bench plan --trace`` traces the real step and prints both totals and what the traced peak
holds; ``tests/unit/test_trace.py`` holds them within 10%.

Host bytes are counted as the host allocator takes them (:func:`hf_fpdt.memory.host_pool.host_block_nbytes`, the
rule the host store's pool allocates with): on a GPU each pinned buffer (a layer input, each chunk's q, k, v, o,
lse, dO and dq) takes a power-of-two block, so a 1.5 GiB layer input counts 2 GiB on the host tier; the device tier
counts exact bytes, and so does the runtime's replay budget (``Plan.replay_budget``: the kept layers' bytes as the
attention charges them, :func:`hf_fpdt.attention.chunked.replay_nbytes`). On CPU nothing is pinned: exact bytes.

Checked against what the host has (``host_capacity``), the host's peak carries a margin (:func:`host_margin`,
``Plan.host_margin``): what a first step takes beyond its tensors, measured on CPU (the C allocator's one-time and
retained blocks; ``HOST_MARGIN_FIXED + HOST_MARGIN_SHARE * peak``). The kept-layer decision sets it aside, so a
plan that fits leaves it free. Every argument is checked first (:func:`plan` raises ``ValueError`` naming it).

The code: :func:`plan` resolves its arguments once into a :class:`PlanInputs`; ``_step`` makes one plan of
them in pieces (``_sizes``: the bytes of the pieces above; ``_cap`` and ``_kept_layers``: the fit decision;
``_place`` and ``_tier_items``: bytes per tier per category; ``_peaks``; ``_problems``: the message); the
searches (``_segments_needed``, ``_longest_fitting``, the ``"auto"`` rule) vary one input with ``replace``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import AUTO_CHUNK_MAX, format_bytes, parse_bytes, sp_degrees
from ..data.chunks import local_chunk_sizes
from ..data.head_split import HeadSplit
from .host_pool import PinnedRounding, host_block_nbytes, pins
from .plan_types import ModelShape, Plan, PlanInputs, dtype_bytes, model_shape
from .probes import auto_host_memory, host_limits, local_processes
from .working_set import attention_working_set

ACT_TRANSIENT = 10  # [B, S, E] buffers alive at the peak of one layer's recomputation + backward (measured)
MLP_TRANSIENT = 4  # [B, S / tiles, I] buffers of one MLP tile (gate, up, act, grad)
SEGMENT_SAVED = 3  # [B, S, E] buffers a layer inside a checkpoint segment saves in its recomputation (measured)
# float32 [B, S, E] copies a layer's recompute + backward holds on a GPU beyond ACT_TRANSIENT when it computes in a
# 16-bit dtype: the two RMSNorms' float32 inputs and normalised values, PEFT's float32 cast of a LoRA input (read
# off the trace of Llama-3.1-8B LoRA bf16 at 128K and 256K tokens, bench plan --trace: eight float32 buffers at the
# peak, in an input RMSNorm's backward, where the MLP tile's are gone)
UPCAST_TRANSIENT = 4
# layer inputs the first layer to run backward holds in the device's staging when no input stays on the device tier:
# its own, fetched back for its recompute, and the next layer's, prefetched (the trace of Llama-3.1-8B at 2M tokens
# on SP 4: two [B, S, E] staging buffers at the peak)
FETCHED_INPUTS = 2
TRANSIENTS = "backward transients (a layer's recompute + backward, or the loss tile)"
AUTO_DEVICE_SHARE = 0.9  # share of the device's memory the step may plan for (the rest: allocator slack)
# The host margin: what a first step takes on the host beyond the tensors the plan counts
# (tests/scripts/host_margin_table.py measures it; docs/guides/memory.md has the table): one-time allocations, and
# the blocks glibc's allocator keeps after they are freed (its mmap threshold rises with each freed block, so later
# blocks come from the heap and stay resident). Measured: 20-25 MiB on the smallest steps, up to 48 MiB + 0.75 of
# the step's growth on others, runs of one step differing by up to 37%; 64 MiB + 1.0 leaves 15% or more at every
# point. (Under RLIMIT_AS the threads' arenas and stacks come off the limit itself:
# hf_fpdt.memory.probes.THREAD_ADDRESS_SPACE.)
HOST_MARGIN_FIXED = 64 << 20  # bytes
HOST_MARGIN_SHARE = 1.0  # of the step's host growth


def rank_heads(shape: ModelShape, sp_size: int) -> tuple[int, int]:
    """``(query, key/value)`` heads of the largest rank's share, times ``sp_size``: the heads a formula over the
    whole sequence's ``[B, l, heads, D]`` counts so that it gives the largest rank's bytes. Even splits: the
    model's heads, and ``max(Hkv, P)`` key/value heads where they are replicated; uneven ones: ``P`` times the
    largest rank's query heads and its kernels' key/value heads (:mod:`hf_fpdt.data.head_split`)."""
    split = HeadSplit.of(shape.heads, shape.kv_heads, sp_size)
    if split.even:
        return shape.heads, max(shape.kv_heads, sp_size) if sp_size > shape.kv_heads else shape.kv_heads
    return sp_size * split.max_heads, sp_size * split.max_kv_heads


def replay_bytes_per_layer(shape: ModelShape, batch: int, local_len: int, sp_size: int, es: int, ring: int = 1) -> int:
    """What one layer's attention stores for backward (q, k, v, o and the fp32 lse), on the largest rank. With a
    ring of ``ring`` Ulysses groups (``sp_size = U x ring``) the heads split over U, and a rank stores the k, v of
    every member's chunk: ``ring`` times its own (:mod:`hf_fpdt.attention.ring`)."""
    heads, kv = rank_heads(shape, sp_size // ring)
    return batch * local_len * ((heads + ring * kv) * shape.head_dim * 2 * es + heads * 4)


def host_chunk_bytes(
    shape: ModelShape,
    batch: int,
    local_len: int,
    sp_size: int,
    es: int,
    chunk_size: int,
    pinned: bool,
    ring: int = 1,
) -> tuple[int, int]:
    """``(replay, backward)``: one layer's replay chunks (q, k, v, o, lse per chunk) and the attention backward's
    dO (under SP; at one rank the backward reads views of dout) + fp32 dq chunks, per rank, as host buffers take
    them (:func:`host_block_nbytes` of each chunk's buffer:
    ``[B, P * l_i, heads / P, D]`` for global chunk i of local length ``l_i``; the largest rank's heads where they
    split unevenly, :func:`rank_heads`). With a ring, the heads of ``U = sp_size / ring`` and ``ring`` k, v chunks
    per local chunk."""
    heads, kv = rank_heads(shape, sp_size // ring)
    rounding = PinnedRounding.from_env() if pinned else None
    replay = backward = 0
    for rows in local_chunk_sizes(local_len, chunk_size, sp_size):
        rows *= batch  # B * l_i: the bytes of a chunk buffer are the same over all ranks' heads
        q, k, lse = rows * heads * shape.head_dim * es, rows * kv * shape.head_dim * es, rows * heads * 4
        blocks = [host_block_nbytes(n, pinned, rounding) for n in (q, k, lse, rows * heads * shape.head_dim * 4)]
        replay += 2 * blocks[0] + 2 * ring * blocks[1] + blocks[2]
        backward += (blocks[0] if sp_size > 1 else 0) + blocks[3]  # dO: at one rank views of dout, not stored
    return replay, backward


def plan(
    model: object,
    seq_len: int,
    *,
    batch: int = 1,
    sp_size: int = 1,
    ring_degree: int | str = "auto",
    dp_size: int = 1,
    lora_rank: int | None = None,
    trainable_params: int | None = None,
    dtype: object = "bfloat16",
    device: str = "cuda",
    device_memory: int | str | None = None,
    host_memory: int | str | None = "auto",
    chunk_size: int | str = 65536,
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
        ring_degree: R, the ring of Ulysses groups (``FPDTConfig.ring_degree``; ``"auto"``: a ring only where
            ``sp_size`` exceeds the query heads, :func:`hf_fpdt.config.sp_degrees`).
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
        chunk_size: tokens of the sequence per attention chunk; ``"auto"``: the largest the measured rule may
            pick (``AUTO_CHUNK_MAX``, at most the sequence), the largest working set it may bring.
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
            (not checked: planning for another machine), or ``(bytes, what sets them)``. The step's host peak
            plus its margin (:func:`host_margin`, ``Plan.host_margin``) must fit it. (Under ``RLIMIT_AS`` the
            probe's bytes are already less what the threads may map, :meth:`HostLimits.per_process`.)

    Raises:
        ValueError: an argument out of its range, naming it and what to pass: lengths, batch, ``dp_size`` and
            ``sp_size`` below 1, an ``sp_size`` the model's heads cannot be split over (the runtime's rule,
            :func:`check_sp_heads`), a chunk size, segment or tile count below 1, a negative LoRA rank or
            parameter count, a budget that is not bytes, an unknown dtype or model.
    """
    _check_counts(seq_len=seq_len, batch=batch, sp_size=sp_size, dp_size=dp_size)
    _check_counts(lora_rank=lora_rank, trainable_params=trainable_params, least=0, optional=True)
    _check_counts(mlp_chunks=mlp_chunks, loss_chunks=loss_chunks, optional=True)
    if segments != "auto":
        _check_counts(segments=segments, fix="or 'auto'")
    if chunk_size != "auto":
        _check_counts(chunk_size=chunk_size, fix="or 'auto'")
    device = getattr(device, "type", device)  # a torch.device: its type
    if not isinstance(device, str) or not device:
        raise ValueError(f"device={device!r}: use a device type such as 'cuda' or 'cpu'")
    host_capacity = _capacity(host_capacity)
    shape = _shape(model)
    ring = sp_degrees(shape.heads, shape.kv_heads, sp_size, ring_degree)[1]
    es = dtype_bytes(dtype)
    host_budget, device_budget = _budget(host_memory, "host_memory"), _budget(device_memory, "device_memory")
    if resident_memory != "auto":
        _budget(resident_memory, "resident_memory")  # checked here, resolved with the step's working set
    if chunk_size == "auto":  # the largest chunk the measured rule may pick: the device's working set at its most
        chunk_size = min(AUTO_CHUNK_MAX, -(-seq_len // sp_size) * sp_size)
    if trainable_params is None:
        trainable_params = shape.params if lora_rank is None else shape.lora_params(lora_rank)
    inputs = PlanInputs(
        shape, seq_len, batch, sp_size, dp_size, trainable_params, es, device, device_budget, host_budget, chunk_size,
        mlp_chunks, loss_chunks, checkpointing, offload, offload_layer_inputs, optimizer, segments, resident_memory,
        host_capacity, ring,
    )  # fmt: skip
    return _planned(inputs, search_longest)


_COUNT_MEANING = {
    "seq_len": "tokens per sample, over all SP ranks",
    "batch": "samples per rank",
    "sp_size": "sequence-parallel ranks; 1: none",
    "dp_size": "data-parallel ranks; 1: none",
    "lora_rank": "LoRA rank on every linear layer; None: a full finetune",
    "trainable_params": "parameters that get gradients; None: from lora_rank",
    "mlp_chunks": "MLP tiles per layer; None: twice the attention chunks",
    "loss_chunks": "LM head + loss tiles; None: 2 * vocab / hidden",
    "segments": "layers per checkpoint segment",
    "chunk_size": "tokens per attention chunk",
}


def _check_counts(*, least: int = 1, optional: bool = False, fix: str = "", **values: object) -> None:
    """A ``ValueError`` naming the first of ``values`` that is not an int ``>= least`` (or ``None`` when
    ``optional``), what it counts, and what to pass instead."""
    for name, value in values.items():
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            allowed = f"an int >= {least}" + (" or None" if optional else "") + (f" {fix}" if fix else "")
            raise ValueError(f"{name}={value!r}: use {allowed} ({_COUNT_MEANING[name]})")


def _shape(model: object) -> ModelShape:
    """:func:`model_shape`, a ``ValueError`` naming ``model`` for what is none of its forms."""
    try:
        return model_shape(model)
    except (AttributeError, TypeError) as err:
        raise ValueError(
            f"model={model!r}: use a ModelShape, an HF config, a preset name or an HF config path ({err})"
        ) from None


def _capacity(raw: object) -> tuple[int, str] | None:
    """``host_capacity`` as ``(bytes, what sets them)`` or ``None`` (not checked); a ``ValueError`` naming it."""
    if raw == "auto":
        return host_limits().per_process(local_processes())
    if raw is None or raw == "unlimited":
        return None
    if isinstance(raw, (int, str)):
        nbytes = _budget(raw, "host_capacity")
        return None if nbytes is None else (nbytes, "host_capacity")
    if isinstance(raw, tuple) and len(raw) == 2 and isinstance(raw[1], str):
        nbytes = _budget(raw[0], "host_capacity")
        return None if nbytes is None else (nbytes, raw[1])
    raise ValueError(
        f"host_capacity={raw!r}: use bytes, a size like '64GiB', 'auto', 'unlimited', None or (bytes, source)"
    )


def _planned(x: PlanInputs, search_longest: bool) -> Plan:
    """The plan of ``x`` with its searches: the smallest k of checkpoint segments that fits when per-layer
    checkpointing does not fit the host (the ``"auto"`` rule applies it), the longest sequence that fits."""
    if x.segments == "auto":
        return _auto_segments(x, search_longest)
    p = _step(x)
    if p.problems and p.segments == 1 and x.checkpointing and not p.host_fits:
        p = replace(p, segments_needed=_segments_needed(x))
    return replace(p, longest=_longest_fitting(x)) if search_longest else p


def _auto_segments(x: PlanInputs, search_longest: bool) -> Plan:
    """The runtime's rule (``checkpoint_segments="auto"``): per-layer checkpointing when it fits the host (or
    no k does), else checkpoint segments of the smallest k that fits."""
    per_layer = replace(x, segments=1)
    first = _planned(per_layer, search_longest=False)
    if not first.host_fits and first.segments_needed is not None:
        return _planned(replace(x, segments=first.segments_needed), search_longest)
    return replace(first, longest=_longest_fitting(per_layer)) if search_longest else first


def _segments_needed(x: PlanInputs) -> int | None:
    """The smallest k > 1 of checkpoint segments with which the step fits; None if none does."""
    return next((k for k in range(2, x.shape.layers + 1) if _step(replace(x, segments=k)).fits), None)


def _longest_fitting(x: PlanInputs) -> int | None:
    """The longest sequence (a multiple of sp_size) that fits ``x``'s budgets; None without budgets or if none."""
    if not (x.host_budget or x.device_budget or x.host_capacity):
        return None
    return _longest(lambda n: _step(replace(x, seq_len=n)).fits, x.sp_size)


@dataclass(frozen=True)
class _Sizes:
    """The bytes one step is made of, per rank, from its inputs' shapes (the module docstring's table)."""

    padded: int  # seq_len padded to a multiple of sp_size
    local: int  # S, the local length
    k: int  # layers per checkpoint segment in effect (1 without checkpointing)
    layer_input: int  # B * S * E * es: one kept layer input, and the unit of activation buffers
    n_inputs: int  # kept layer inputs (one per segment)
    replay: int  # one layer's replay chunks
    bwd_extra: int  # dO (SP > 1) + fp32 dq of one layer's attention backward
    input_host: int  # one layer input as a host buffer takes it (host_block_nbytes)
    replay_host: int  # one layer's replay chunks as host buffers take them
    bwd_extra_host: int  # dO + dq chunks as host buffers take them
    grads: int
    grads_at_peak: int  # the gradients made at the peak (LM head + one layer in a full finetune)
    opt: int
    loss_tile: int
    act: int  # one layer's recomputation + backward transients
    act_device: int  # the same on a GPU: with the 16-bit dtype's float32 copies (UPCAST_TRANSIENT)
    saved_no_ckpt: int  # activations saved without checkpointing
    segment_held: int  # a segment's recomputed activations while its backward runs
    placed_inputs: int  # the layer inputs the two tiers place (0: they stay on the device)
    chunks_on_host: bool  # whether replay chunks and the pool go to the tiers

    @property
    def inputs(self) -> int:
        return self.n_inputs * self.layer_input


def _sizes(x: PlanInputs) -> _Sizes:
    """The bytes of the pieces of one step (the table above)."""
    shape, batch, es = x.shape, x.batch, x.es
    padded = -(-x.seq_len // x.sp_size) * x.sp_size
    local = padded // x.sp_size
    bse = batch * local * shape.hidden * es
    k = min(x.segments, shape.layers) if x.checkpointing else 1
    full_ft = x.trainable_params >= shape.params
    grads = x.trainable_params * es
    n_chunks = max(1, -(-padded // x.chunk_size))
    mlp_tiles = x.mlp_chunks or 2 * n_chunks
    loss_tiles = x.loss_chunks or max(1, 2 * shape.vocab // shape.hidden)
    mlp_tile = MLP_TRANSIENT * batch * -(-local // mlp_tiles) * shape.intermediate * es
    upcast = UPCAST_TRANSIENT * batch * local * shape.hidden * 4 if es < 4 else 0
    n_inputs = -(-shape.layers // k)
    pinned = not x.cpu and pins(x.device)
    replay_host, bwd_host = host_chunk_bytes(shape, batch, local, x.sp_size, x.es, x.chunk_size, pinned, x.ring)
    heads = rank_heads(shape, x.sp_size // x.ring)[0]
    return _Sizes(
        padded=padded,
        local=local,
        k=k,
        layer_input=bse,
        n_inputs=n_inputs,
        replay=replay_bytes_per_layer(shape, batch, local, x.sp_size, es, x.ring),
        bwd_extra=batch * local * heads * shape.head_dim * ((es if x.sp_size > 1 else 0) + 4),
        input_host=host_block_nbytes(bse, pinned),
        replay_host=replay_host,
        bwd_extra_host=bwd_host,
        grads=grads,
        grads_at_peak=(shape.vocab * shape.hidden + shape.layer_params) * es if full_ft else grads,
        opt=x.trainable_params * 8 if x.optimizer else 0,
        loss_tile=2 * batch * -(-local // loss_tiles) * shape.vocab * 4,  # fp32 logits of one tile and their grad
        act=ACT_TRANSIENT * bse + mlp_tile,
        act_device=ACT_TRANSIENT * bse + max(mlp_tile, upcast),
        saved_no_ckpt=0 if x.checkpointing else shape.layers * 2 * bse,  # projection input + MLP tile inputs
        # a segment's recomputation runs its k layers without inner checkpoints: their saved activations live
        # on the device while the segment's backward runs (autograd's, not the offloader's)
        segment_held=SEGMENT_SAVED * k * bse if k > 1 else 0,
        placed_inputs=n_inputs * bse if x.cpu or x.offload_layer_inputs else 0,
        chunks_on_host=x.cpu or x.offload,
    )


def _fixed_items(x: PlanInputs, s: _Sizes, fetched: bool = True) -> dict[str, int]:
    """The device's categories that do not depend on placement (on CPU the host's: the device is the host).
    ``fetched``: the first layer to run its backward fetches its chunks from the host (else they are on the device
    tier, and its attention working set has no fetched sets: the step's peak is in that layer's backward)."""
    items = {"weights": x.shape.params * x.es, "gradients": s.grads}
    if s.opt:
        items["optimizer state (Adam, fp32)"] = s.opt
    if x.cpu:
        items["layer recompute transients"] = s.act
        items["loss tile (fp32 logits + grad)"] = s.loss_tile
    else:  # the loss runs before the layers' backward: its tile and a layer's transients are not alive together
        items[TRANSIENTS] = max(s.act_device, s.loss_tile)
    if s.saved_no_ckpt:
        items["saved activations (no checkpointing)"] = s.saved_no_ckpt
    if s.segment_held:
        items[f"a segment's recomputed activations ({s.k} layers)"] = s.segment_held
    if not x.cpu:
        # what the chunk pipeline holds at its largest block (the backward's: accumulators, the block's gradients,
        # the kernel's dq accumulator, and with offload the fetched sets in flight): hf_fpdt.memory.working_set
        u = x.sp_size // x.ring  # the Ulysses degree: a ring's attention chunk is 1 / R of the chunk, U ranks wide
        heads, kv = rank_heads(x.shape, u)  # the largest rank's share (KV heads replicated when U > Hkv)
        items["attention working set (chunks)"] = attention_working_set(
            -(-min(x.chunk_size, s.padded) // x.ring),
            width=heads * x.shape.head_dim,
            kv_ratio=kv / heads,
            heads=heads,
            batch=x.batch,
            sp_size=u,
            elem_bytes=x.es,
            copies=x.offload and fetched,
            ring=x.ring,
        )
    return items


def host_margin(growth: int) -> int:
    """Bytes a CPU step takes on the host beyond what the plan counts, for a step whose host growth is ``growth``
    bytes: ``HOST_MARGIN_FIXED + HOST_MARGIN_SHARE * growth`` (the constants' comment says what they cover). A
    GPU step's host tier (pinned buffers, not the C allocator's heap) gets the fixed part: not yet measured."""
    return HOST_MARGIN_FIXED + int(HOST_MARGIN_SHARE * growth)


def _host_room(x: PlanInputs, s: _Sizes, weights: int) -> int:
    """The largest host peak (``Plan.host_need``) whose margin still fits ``host_capacity``."""
    capacity, fixed = x.host_capacity[0], host_margin(0)
    if not x.cpu:
        return capacity - fixed
    before = weights + s.opt  # on CPU the margin is a share of the growth above these
    return before + int((capacity - before - fixed) / (1 + HOST_MARGIN_SHARE))


def _cap(x: PlanInputs, s: _Sizes, weights: int, room: int | None) -> int | None:
    """What the two tiers may keep across layers (None: no limit): the host budget and the device tier
    ``room``, and no more than what the host really has, its margin set aside (on CPU less the rest of the
    host's peak, with a recomputing layer's chunks in the pool)."""
    cap = None if x.host_budget is None or room is None else x.host_budget + room
    if x.host_capacity is not None and room is not None:
        limit = _host_room(x, s, weights)
        if x.cpu:
            limit -= weights + s.opt + s.grads_at_peak + s.saved_no_ckpt + s.segment_held - s.bwd_extra
            limit -= max(s.replay * s.k + s.bwd_extra + s.act, s.loss_tile + s.layer_input)
        cap = limit + room if cap is None else min(cap, limit + room)
    return cap


def _kept_layers(x: PlanInputs, s: _Sizes, cap: int | None, room: int | None) -> int:
    """The fit decision: how many layers keep their replay chunks. Every layer while the two tiers hold them,
    else as many as fit beside one layer's working set (the recomputing layer's chunks), else none (the floor).
    What the host keeps (:func:`_place`, as host buffers take it) is checked against ``cap`` less the device tier."""
    layers = x.shape.layers
    if not x.checkpointing:
        return layers  # nothing is recomputed: every layer's chunks survive until its backward
    if s.k > 1:
        return 0  # inside a checkpoint segment attention is computed again in the recomputation (no replay)
    if cap is None or room is None or not s.chunks_on_host:
        return layers

    def fits(n: int) -> bool:
        return _place(x, s, n, room).host_kept <= cap - room

    if fits(layers):
        return layers
    lo, hi = 0, layers - 1  # the host grows with n: the largest n < layers that fits (0, the floor, if none)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


@dataclass(frozen=True)
class _Placement:
    keep: int  # layers keeping their replay chunks
    working: int  # pooled while one layer's backward runs (a segment's chunks + dO/dq)
    share: _Share  # what of the lasting bytes the device tier holds
    resident: int  # bytes on the device tier at the end of the forward
    host_inputs: int  # what the host keeps across layers, as its buffers take it: layer inputs,
    host_replay: int  # ... replay chunks,
    host_pool: int  # ... and the pool's working set

    @property
    def host_kept(self) -> int:
        return self.host_inputs + self.host_replay + self.host_pool

    @property
    def pool_on_device(self) -> int:
        return self.resident - self.share.input_bytes - self.share.replay_bytes


def _as_host(nbytes: int, unit: int, unit_host: int) -> int:
    """``nbytes`` of whole units of ``unit`` exact bytes (and a part of one), as host buffers take them."""
    if unit <= 0:
        return 0
    whole, part = divmod(nbytes, unit)
    return whole * unit_host + -(-part * unit_host // unit)


def _place(x: PlanInputs, s: _Sizes, keep: int, room: int | None) -> _Placement:
    """The device tier (``room``, exact bytes) holds the last layers' inputs and chunks, the host the rest
    (_device_share), counted as its buffers take them."""
    # a segment's recomputation stores the chunks of its k layers before their backward runs
    recomputing = keep < x.shape.layers
    working = (s.replay * s.k if recomputing else 0) + s.bwd_extra
    working_host = (s.replay_host * s.k if recomputing else 0) + s.bwd_extra_host
    input_b = s.layer_input if s.placed_inputs else 0
    share = _device_share(x.shape.layers, s.k, keep, input_b, s.replay if s.chunks_on_host else 0, room)
    lasting = s.placed_inputs + (keep * s.replay if s.chunks_on_host else 0)
    transient = working if s.chunks_on_host else 0
    resident = lasting + transient if room is None else min(room, lasting + transient)
    pool_on_device = resident - share.input_bytes - share.replay_bytes
    host_inputs = s.n_inputs * s.input_host - _as_host(share.input_bytes, s.layer_input, s.input_host)
    host_replay = keep * s.replay_host - _as_host(share.replay_bytes, s.replay, s.replay_host)
    host_pool = working_host - _as_host(pool_on_device, working, working_host)
    on_host = s.chunks_on_host
    return _Placement(
        keep, working, share, resident, host_inputs if s.placed_inputs else 0, host_replay if on_host else 0,
        host_pool if on_host else 0,
    )  # fmt: skip


def _pool_name(k: int) -> str:
    return f"chunks of a segment ({k} layers) + dO/dq (pool)" if k > 1 else "one layer's chunks + dO/dq (pool)"


def _tier_items(x: PlanInputs, s: _Sizes, fixed: dict, pl: _Placement) -> tuple[dict, dict]:
    """Bytes per category on the device and on the host (on CPU one dict, the host, for both)."""
    dev = dict(fixed)
    host = dev if x.cpu else {}
    share, on_host = pl.share, s.chunks_on_host
    if not x.cpu and s.placed_inputs:
        dev[f"layer inputs (last {share.input_layers} of {s.n_inputs})"] = share.input_bytes
        if not share.input_layers:  # the first layer to run backward fetches its input back (and the next one's)
            dev["layer inputs fetched back (the backward's and the next)"] = FETCHED_INPUTS * s.layer_input
    if not x.cpu and on_host:
        dev[f"replay chunks (last {share.replay_layers} of {pl.keep} layers)"] = share.replay_bytes
        dev["chunk working set (in the budget)"] = pl.pool_on_device
    tier_chunks = host if on_host else dev
    tier_inputs = host if s.placed_inputs else dev
    tier_inputs["layer inputs"] = pl.host_inputs if s.placed_inputs else s.inputs
    tier_chunks[f"replay chunks ({pl.keep} layers)"] = pl.host_replay if on_host else pl.keep * s.replay
    tier_chunks[_pool_name(s.k)] = pl.host_pool if on_host else pl.working
    return dev, host


def _peaks(x: PlanInputs, s: _Sizes, dev: dict, host: dict, pl: _Placement) -> tuple[int, int]:
    """The step's peak growth and the host's peak."""
    if x.cpu:  # one tier: the kept bytes, then the larger of a layer's backward and the loss tile
        peak = s.grads_at_peak + s.inputs + pl.keep * s.replay + s.saved_no_ckpt + s.segment_held
        peak += max(pl.working + s.act, s.loss_tile + s.layer_input)
        peak = max(peak, s.grads)  # a full finetune ends with every gradient, the input embedding's last
        return peak, dev["weights"] + s.opt + peak
    # the device's growth: what the step allocates there (weights and optimizer state exist before)
    peak = sum(nbytes for name, nbytes in dev.items() if name != "weights" and not name.startswith("optimizer"))
    return peak, sum(host.values())


def _rounded(s: _Sizes) -> bool:
    """Whether host buffers take more than their bytes (pinned blocks rounded up)."""
    return (s.input_host, s.replay_host, s.bwd_extra_host) != (s.layer_input, s.replay, s.bwd_extra)


def _problems(x: PlanInputs, s: _Sizes, pl: _Placement, dev: dict, host_need: int, margin: int) -> list[str]:
    """Why the plan does not fit: the host budget, the host's capacity, the device's memory."""
    problems = []
    if x.host_budget is not None and x.host_budget > 0 and pl.host_kept > x.host_budget:
        pool = _pool_name(s.k).replace(" (pool)", "")
        problems.append(
            f"hf_fpdt would keep {format_bytes(pl.host_kept)} on the host across layers "
            f"(layer inputs {format_bytes(pl.host_inputs)}"
            + (f", replay chunks {format_bytes(pl.host_replay)}" if pl.host_replay else "")
            + (f", {pool} {format_bytes(pl.host_pool)}" if s.chunks_on_host else "")
            + (", counted as the pinned allocator takes them" if _rounded(s) else "")
            + (f"; {format_bytes(pl.resident)} more stay on the device" if pl.resident and not x.cpu else "")
            + f") but host_memory is {format_bytes(x.host_budget)}"
        )
    if x.host_capacity is not None and host_need + margin > x.host_capacity[0]:
        problems.append(
            f"the step's host peak is about {format_bytes(host_need)} + margin {format_bytes(margin)} (what the "
            f"allocator takes beyond the tensors) but this process may allocate {format_bytes(x.host_capacity[0])} "
            f"({x.host_capacity[1]})"
        )
    need = sum(dev.values())
    if x.device_budget is not None and not x.cpu and need > x.device_budget:
        problems.append(f"the device needs about {format_bytes(need)} but has {format_bytes(x.device_budget)}")
    return problems


def _step(x: PlanInputs) -> Plan:
    """The plan of ``x`` (an int ``segments``) without the searches."""
    s = _sizes(x)
    fixed = _fixed_items(x, s)
    weights = fixed["weights"]
    room = _resident_room(x.resident_memory, x.cpu, x.device_budget, sum(fixed.values()) - weights, weights)
    pl = _place(x, s, _kept_layers(x, s, _cap(x, s, weights, room), room), room)
    if not x.cpu and x.offload and pl.share.replay_layers:  # the peak layer's chunks stay on the device: no fetches
        fixed = _fixed_items(x, s, fetched=False)
        room = _resident_room(x.resident_memory, x.cpu, x.device_budget, sum(fixed.values()) - weights, weights)
        pl = _place(x, s, _kept_layers(x, s, _cap(x, s, weights, room), room), room)
    dev, host = _tier_items(x, s, fixed, pl)
    peak, host_need = _peaks(x, s, dev, host, pl)
    margin = host_margin(peak if x.cpu else 0)  # the share on CPU: the step's tensors come from the C allocator
    capacity, limit = x.host_capacity if x.host_capacity is not None else (None, "")
    return Plan(
        x.seq_len, s.local, x.batch, x.sp_size, x.dp_size, x.device, x.host_budget, x.device_budget, pl.keep,
        s.replay, s.layer_input, x.shape.layers, {} if x.cpu else dev, host, peak, pl.host_kept,
        _problems(x, s, pl, dev, host_need, margin), segments=s.k, resident_budget=room,
        resident=0 if x.cpu else pl.resident, resident_inputs=pl.share.input_layers,
        resident_replay=pl.share.replay_layers, host_need=host_need, host_capacity=capacity, host_limit=limit,
        host_margin=margin, layer_input_host=s.input_host, replay_host_per_layer=s.replay_host,
        backward_bytes=s.bwd_extra, backward_host=s.bwd_extra_host, heads=heads_line(x.shape, x.sp_size, x.ring),
        ring=x.ring,
    )  # fmt: skip


def heads_line(shape: ModelShape, sp_size: int, ring: int = 1) -> str:
    """How the heads split over the SP group (over each Ulysses group of ``sp_size / ring`` ranks, with a ring), for
    the plan's text (``""`` at one rank)."""
    if sp_size == 1:
        return ""
    split = HeadSplit.of(shape.heads, shape.kv_heads, sp_size // ring)
    q = ",".join(map(str, split.counts))
    kv = ",".join(map(str, split.kv_counts))
    where = "rank" if ring == 1 else f"rank of each Ulysses group (U {sp_size // ring} x R {ring}: a ring of {ring})"
    if split.even:
        return f"{q} query heads, {kv} key/value heads per {where} (even)"
    return (
        f"{q} query heads, {kv} key/value heads per {where} (uneven: the KV heads each rank's query heads use, in "
        f"its kernels' layout); planned for the largest share, {split.max_heads} and {split.max_kv_heads}"
    )


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


def resident_setting(device_memory: int | str | None, offload: bool | str, device_type: str) -> int | str | None:
    """``FPDTConfig.device_memory`` as :func:`plan`'s ``resident_memory`` for a step with ``offload``: bytes,
    ``None`` (``"unlimited"``) or ``"auto"``; ``"auto"`` is 0 with ``offload=True`` (everything to the host, as
    asked) and on CPU (the device is the host). The runtime (``integrations.step_plan``) and ``bench plan`` both
    read the settings through this rule."""
    if device_memory in ("unlimited", None):
        return None
    if device_memory == "auto":
        return 0 if device_type == "cpu" or offload is True else "auto"
    return device_memory if isinstance(device_memory, int) else parse_bytes(device_memory, "device_memory")


def _resident_room(raw: int | str | None, cpu: bool, capacity: int | None, working: int, weights: int) -> int | None:
    """The device budget for layer inputs and replay chunks (``None``: no limit). ``"auto"``:
    ``AUTO_DEVICE_SHARE`` of the device's memory less the weights and the planned working set (0 when the
    device's memory is not known); on CPU 0, the device is the host."""
    if cpu:
        return 0
    value = _budget(raw, "resident_memory") if raw != "auto" else "auto"
    if value != "auto":
        return value
    if capacity is None:
        return 0
    return max(0, int(AUTO_DEVICE_SHARE * capacity) - weights - working)


def _budget(raw: int | str | None, name: str) -> int | None:
    """A budget argument in bytes (``None``: no limit); a ``ValueError`` naming ``name`` when it is not one."""
    if raw is None:
        return None
    value = parse_bytes(raw, name)
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


__all__ = [
    "ModelShape", "Plan", "PlanInputs", "dtype_bytes", "host_margin", "model_shape", "plan", "resident_setting",
    "replay_bytes_per_layer",
]  # fmt: skip
