"""The ranks of a sequence-parallel (SP) group agree before they compute (a rank that fails: :mod:`.peers`).

Every SP rank runs the same collectives in the same order; ranks that disagree on the shape of a step
(another sequence length, batch size or chunk size) or on the model (another layer count, hidden size or
dtype) would otherwise meet in an all-to-all with buffers of different sizes, which gloo answers by aborting
a process and NCCL by hanging, or compute a result that matches neither rank (another model type, another
attention pattern). Two mechanisms:

**Agreement on the model, once** (:func:`agree`, run by ``hf_fpdt.apply`` under SP before anything else):
the ranks all-gather one fixed-size int64 digest per field (:func:`digest`: the first 8 bytes of a sha256),
so the exchange itself cannot mismatch in size whatever the ranks hold. Only when a field differs do the ranks
exchange its readable values (``all_gather_object``, which sizes itself), to name them in the error.

**Agreement on the step, once per forward.** :meth:`StepAgreement.check` all-gathers one small int64 vector
per rank (step number, batch size, local sequence length, chunk size, the kind of attention mask, the
settings that decide the collectives, and one digest of the call's context: for ``generate`` the prompts and
the generation arguments) over the SP group: one collective of ``P x (len(FIELDS) + 1)`` integers per step,
never per chunk. A mismatch raises :class:`SPAgreementError` (a ``ValueError``) with the same message on every
rank, naming each rank's value.

**Failures.** How a rank that fails tells its peers, and how a collective that a peer never reaches ends
with an error naming it (failure notes, guarded collectives, the world's :class:`CollectiveWatch`), is
:mod:`hf_fpdt.distributed.peers`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..config import FPDTConfig
from .peers import SPPeerFailure, clear_note, gather_rows, group_device, guarded, leave_note

FIELDS = (
    "step",
    "batch size",
    "local sequence length",
    "chunk size",
    "position_ids given",
    "training",
    "grad enabled",
    "offload",
    "offload_layer_inputs",
    "mlp_chunks",
    "loss_chunks",
    "checkpoint_segments",
    "gradient checkpointing",
    "sync_exchanges",
    "ring_degree",
    "attention mask",
)
MASK_KINDS = ("none", "2D", "4D", "documents")  # the "attention mask" field's values (see mask_kind)


SP_ADVICE = (
    "Every SP rank must run the same FPDT settings on its shard of the same batch: build the same FPDTConfig on "
    "every rank and shard batches with hf_fpdt.FPDTPlugin (or hf_fpdt.data.layout.shard_batch) using that config's "
    "chunk_size"
)


def settings_values(config: FPDTConfig, model: nn.Module) -> dict[str, int]:
    """The settings part of :data:`FIELDS` for one forward of ``model`` (what decides the collectives and
    the step's plan besides the shape). The memory budgets are not compared: ranks may be given different
    ones, and the plan agrees on the smallest (:func:`hf_fpdt.integrations.step_plan.plan_step`)."""
    segments = config.checkpoint_segments
    return {
        "training": model.training,
        "grad enabled": torch.is_grad_enabled(),
        "offload": {True: 1, False: 0}.get(config.offload, 2),
        "offload_layer_inputs": bool(config.offload_layer_inputs),
        "mlp_chunks": config.mlp_chunks or 0,
        "loss_chunks": config.loss_chunks or 0,
        "checkpoint_segments": segments if isinstance(segments, int) else 0,  # 0: "auto"
        # what HF's is_activation_checkpointing reads (its deprecated alias is_gradient_checkpointing warns)
        "gradient checkpointing": any(bool(getattr(m, "gradient_checkpointing", False)) for m in model.modules()),
        "sync_exchanges": bool(config.sync_exchanges),  # the order of the attention's all-to-alls
        "ring_degree": config.ring_degree if isinstance(config.ring_degree, int) else 0,  # 0: "auto"; the layout
    }


class SPAgreementError(ValueError):
    """The SP ranks disagree on the shape or settings of a step (raised alike on every rank)."""


# --- digests: what the ranks compare, fixed-size -----------------------------------------------------------

_MAX_DEPTH = 6  # how deep fingerprint follows containers, closures and object attributes
# positions a mask_mod is evaluated at (queries x keys) for its digest: the start, and two stretches further on
MASK_MOD_GRID = ((0, 64), (1000, 1032), (8192, 8224))


def tensor_digest(t: torch.Tensor) -> str:
    """``"[shape] dtype sha256:<16 hex>"`` of ``t``'s values (copied to the host)."""
    data = t.detach().to("cpu").contiguous().reshape(-1)
    raw = data.view(torch.uint8) if data.numel() else data.to(torch.uint8)
    hexdigest = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')} sha256:{hexdigest[:16]}"


def _const(value: object) -> str:
    if isinstance(value, types.CodeType):
        return _code_digest(value)
    if isinstance(value, frozenset):  # its repr's order follows the process's string hashing
        return "frozenset(" + ",".join(sorted(_const(v) for v in value)) + ")"
    if isinstance(value, tuple):
        return "(" + ",".join(_const(v) for v in value) + ")"
    return repr(value)


def _code_digest(code: types.CodeType) -> str:
    text = "|".join([code.co_qualname, code.co_code.hex(), _const(code.co_consts), ",".join(code.co_names)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def callable_fingerprint(fn: object, depth: int = 0) -> dict:
    """What identifies a function across processes: its qualified name, its code (bytecode, constants and
    names, nested functions' too), and the values it closes over and defaults to (:func:`fingerprint`);
    a ``functools.partial`` by its function and arguments; another callable object by its class, its
    ``__call__``'s code and its attributes."""
    if isinstance(fn, functools.partial):
        return {"partial": fingerprint(fn.func, depth + 1), "args": fingerprint(fn.args, depth + 1),
                "keywords": fingerprint(fn.keywords, depth + 1)}  # fmt: skip
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):  # a callable object
        call = type(fn).__call__ if callable(fn) else None
        out = {"object": f"{type(fn).__module__}.{type(fn).__qualname__}"}
        if isinstance(getattr(call, "__code__", None), types.CodeType):
            out["call"] = _code_digest(call.__code__)
        if hasattr(fn, "__dict__"):
            out["attributes"] = fingerprint(vars(fn), depth + 1)
        return out
    out = {"function": f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}", "code": _code_digest(code)}
    cells = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            cells.append(fingerprint(cell.cell_contents, depth + 1))
        except ValueError:  # an empty cell
            cells.append("<empty>")
    if cells:
        out["closure"] = cells
    if getattr(fn, "__defaults__", None):
        out["defaults"] = fingerprint(fn.__defaults__, depth + 1)
    return out


def fingerprint(value: object, depth: int = 0) -> object:
    """A JSON-able stand-in for ``value``, equal in every process exactly when the values are equal (as far as
    the ranks' collectives and results go): numbers and strings as they are, tensors by :func:`tensor_digest`,
    containers item by item, callables by :func:`callable_fingerprint`, devices by their type (each rank has its
    own index), other objects by their class (never by a ``repr`` that holds a memory address)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if depth > _MAX_DEPTH:
        return f"<{type(value).__qualname__}>"
    if isinstance(value, torch.device):  # ranks hold their own device index (cuda:0, cuda:1): compare the type
        return f"device {value.type}"
    if isinstance(value, torch.dtype | torch.Size):
        return str(value)
    if torch.is_tensor(value):
        return tensor_digest(value)
    if isinstance(value, Mapping):
        return {str(k): fingerprint(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, set | frozenset):
        return sorted((fingerprint(v, depth + 1) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, list | tuple):
        return [fingerprint(v, depth + 1) for v in value]
    if isinstance(value, type):
        return f"<class {value.__module__}.{value.__qualname__}>"
    if callable(value):
        return callable_fingerprint(value, depth)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def digest(value: object) -> int:
    """A signed 64-bit digest of ``value`` (the first 8 bytes of the sha256 of its :func:`fingerprint`)."""
    text = json.dumps(fingerprint(value), sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def mask_mod_fingerprint(mask_mod: object) -> str:
    """How two ranks' ``mask_mod``s are compared (the rule): the same qualified name and code
    (:func:`callable_fingerprint`: bytecode, constants, closed-over values, nested functions) **and** the same
    values at ``b = h = 0`` on the grid of query x key positions :data:`MASK_MOD_GRID` (0-63, 1000-1031,
    8192-8223; a mask_mod that raises there is compared by its exception's type)."""
    code = hashlib.sha256(json.dumps(callable_fingerprint(mask_mod), sort_keys=True).encode()).hexdigest()[:12]
    idx = torch.cat([torch.arange(a, b) for a, b in MASK_MOD_GRID])
    zero = torch.zeros((), dtype=torch.long)
    try:
        with torch.no_grad():
            out = torch.as_tensor(mask_mod(zero, zero, idx.unsqueeze(1), idx.unsqueeze(0)))
            grid = tensor_digest(out.expand(idx.numel(), idx.numel()).to(torch.bool)).split("sha256:")[1][:12]
    except Exception as exc:  # a mask_mod that fails on the CPU grid: compared by its code alone
        grid = f"raises {type(exc).__name__}"
    name = getattr(mask_mod, "__qualname__", type(mask_mod).__qualname__)
    return f"mask_mod {name} (code {code}, grid {grid})"


def pattern_fingerprint(setting: object, layers: int) -> list[str]:
    """``FPDTConfig.attention_pattern`` as each of ``layers`` layers sees it, one readable entry per layer:
    ``"dense"``, or the pattern's name, its ``mask_mod`` (:func:`mask_mod_fingerprint`) and its
    ``block_kind``'s code; layers a per-layer dict names beyond ``layers`` are listed after them."""
    seen: dict[int, str] = {}

    def text(pattern: object) -> str:
        if pattern is None:
            return "dense"
        if id(pattern) not in seen:
            mask_mod = getattr(pattern, "mask_mod", None)
            if mask_mod is None:  # a bare mask_mod
                seen[id(pattern)] = mask_mod_fingerprint(pattern)
            else:
                kind = getattr(pattern, "block_kind", None)
                kind_text = (
                    "none" if kind is None else f"code {digest(callable_fingerprint(kind)) & 0xFFFFFFFFFFFF:012x}"
                )
                seen[id(pattern)] = (
                    f"{getattr(pattern, 'name', '?')}: {mask_mod_fingerprint(mask_mod)}, block_kind {kind_text}"
                )
        return seen[id(pattern)]

    if isinstance(setting, Mapping):
        out = [f"layer {i}: {text(setting.get(i))}" for i in range(layers)]
        out += [f"layer {k!r}: {text(v)}" for k, v in setting.items() if not (isinstance(k, int) and 0 <= k < layers)]
        return out
    return [f"layer {i}: {text(setting)}" for i in range(layers)]


def _show(value: object, quote: bool = True) -> str:
    return repr(value) if quote and isinstance(value, str) else str(value)


def describe(name: str, values: list[object], quote: bool = True) -> str:
    """``"<name>: rank 0 has A, rank 1 has B"`` for one field the ranks disagree on (``values`` in rank order):
    short lists whole, others by their length and first differing entry, dicts by the keys that differ;
    strings quoted unless ``quote`` is False."""
    ranks = range(len(values))
    if all(isinstance(v, dict) for v in values):
        keys = sorted({k for v in values for k in v}, key=str)
        differ = [k for k in keys if len({json.dumps(v.get(k, "<absent>"), sort_keys=True) for v in values}) > 1]
        return "; ".join(describe(f"{name} {k}", [v.get(k, "<absent>") for v in values]) for k in differ) or name
    if all(isinstance(v, list) for v in values) and any(len(v) > 4 or len(str(v)) > 120 for v in values):
        longest = max(len(v) for v in values)
        first = next(
            (i for i in range(longest) if len({_show(v[i]) if i < len(v) else None for v in values}) > 1), longest
        )
        shown = [f"{len(v)} entries" + (f", #{first}: {_show(v[first])}" if first < len(v) else "") for v in values]
        return f"{name}: " + ", ".join(f"rank {r} has {shown[r]}" for r in ranks)
    return f"{name}: " + ", ".join(f"rank {r} has {_show(values[r], quote)}" for r in ranks)


def readable(value: object) -> object:
    """``value`` as the ranks exchange it to name it in an error: plain data (:func:`fingerprint`)."""
    return fingerprint(value)


def exchange_readable(group: dist.ProcessGroup, values: Mapping[str, object], what: str) -> list[dict]:
    """Every rank's readable ``values`` (the fields found to differ), in rank order: one guarded
    ``all_gather_object`` (it sizes itself, so ranks holding values of different sizes still meet)."""
    mine = {name: readable(v) for name, v in values.items()}
    out: list = [None] * dist.get_world_size(group)
    with guarded(group, f"{what} (the values that differ)"):
        dist.all_gather_object(out, mine, group=group)
    return out


def agree(
    group: dist.ProcessGroup,
    values: Mapping[str, object],
    *,
    what: str,
    advice: str,
    scope: str = "sequence-parallel group",
    device: torch.device | None = None,
) -> None:
    """The ranks of ``group`` agree on ``values`` (field name -> anything :func:`fingerprint` takes), or every
    rank raises the same :class:`SPAgreementError` naming each differing field and every rank's value.

    One guarded all-gather of ``1 + len(values)`` int64 digests (the field names' digest first, then one per
    field), plus one ``all_gather_object`` of the differing fields' values only when some differ. Every rank
    of ``group`` must call it with the same field names.
    """
    names = list(values)
    words = [digest(names)] + [digest(values[n]) for n in names]
    device = device if device is not None else group_device(group)
    table = gather_rows(group, torch.tensor([words], dtype=torch.int64, device=device), what, True).tolist()
    if len({row[0] for row in table}) > 1:
        raise SPAgreementError(
            f"the {len(table)} ranks of the {scope} compare different fields for {what}: they run different "
            f"versions of hf_fpdt. {advice}"
        )
    differ = [n for i, n in enumerate(names, 1) if len({row[i] for row in table}) > 1]
    if not differ:
        return
    shown = exchange_readable(group, {n: values[n] for n in differ}, what)
    parts = [describe(n, [rank[n] for rank in shown]) for n in differ]
    raise SPAgreementError(
        f"the {len(table)} ranks of the {scope} disagree on {what}: " + "; ".join(parts) + f". {advice}"
    )


def mask_kind(attention_mask: object, documents: bool = False) -> int:
    """The ``"attention mask"`` field: the index in :data:`MASK_KINDS` of a call's mask (``documents``: packed
    documents given as such, e.g. the flattening collator's ``cu_seq_lens_q``, and no mask)."""
    if attention_mask is None:
        return MASK_KINDS.index("documents") if documents else 0
    dim = getattr(attention_mask, "dim", lambda: -1)()
    return {2: 1, 4: 2}.get(dim, len(MASK_KINDS) + max(dim, 0))  # other shapes: their own (refused later) kinds


def _shown(name: str, value: int) -> object:
    if name == "attention mask":
        return MASK_KINDS[value] if 0 <= value < len(MASK_KINDS) else f"{value - len(MASK_KINDS)}D"
    return value


@dataclass
class StepAgreement:
    """The per-step agreement of one model's SP ranks (``hf_fpdt.apply`` installs one per model).

    Args:
        group: the SP process group (at least two ranks), or another group whose ranks must make the same
            calls (DeepSpeed ZeRO-3's partition group, :mod:`hf_fpdt.integrations.deepspeed`).
        scope: how the error names the group.
        advice: what the error tells the user to do.
    """

    group: dist.ProcessGroup
    step: int = 0
    scope: str = "sequence-parallel group"
    advice: str = SP_ADVICE
    _failed: bool = field(default=False, repr=False)  # a failure was seen since the last agreed step

    def check(self, device: torch.device, context: Mapping[str, object] | None = None, **values: int) -> None:
        """All-gather ``values`` (keys: :data:`FIELDS` except ``step``) and a digest of ``context`` over the group
        and compare them.

        ``context``: what else the ranks must hold alike for this call, by name (e.g. a prompt's token ids and
        the generation arguments; :func:`fingerprint` takes it); it travels as one int64, and only when the
        ranks' digests differ are the values exchanged to name them. One collective per call (call it once per
        forward). Raises :class:`SPAgreementError` on every rank when any value differs;
        :class:`SPPeerFailure` when a peer never arrives.
        """
        self.step += 1
        names = FIELDS[1:]
        if sorted(values) != sorted(names):
            raise ValueError(f"StepAgreement.check takes {names}, got {sorted(values)}")
        context = dict(context or {})
        row = [self.step] + [int(values[n]) for n in names] + [digest(context)]
        mine = torch.tensor(row, dtype=torch.int64, device=device)
        what = f"the ranks' agreement on step {self.step}"
        table = gather_rows(self.group, mine[None], what, equal_rows=True).tolist()  # one host sync per step
        if self._failed:  # every rank got here, so the note of the failed step is stale now
            self._failed = False
            clear_note(self.group)
        differ = [i for i, name in enumerate(FIELDS) if len({row[i] for row in table}) > 1]
        parts = [describe(FIELDS[i], [_shown(FIELDS[i], row[i]) for row in table], quote=False) for i in differ]
        if len({row[-1] for row in table}) > 1:  # the context: exchange it to name what differs
            shown = exchange_readable(self.group, context, f"the ranks' agreement on step {self.step}")
            keys = sorted({k for rank in shown for k in rank})
            for key in keys:
                per_rank = [rank.get(key, "<absent>") for rank in shown]
                if len({json.dumps(v, sort_keys=True) for v in per_rank}) > 1:
                    parts.append(describe(key, per_rank))
        if parts:
            raise SPAgreementError(
                f"the {len(table)} ranks of the {self.scope} disagree at step {table[0][0]} on "
                + "; ".join(parts)
                + ". "
                + self.advice
            )

    def __getstate__(self) -> dict:
        raise unpicklable_group()  # it holds the group (a model pickled under SP: see unpicklable_group)

    def note_failure(self, error: BaseException) -> None:
        """Called on a rank whose forward raised ``error``: leave a note for the peers it leaves waiting."""
        self._failed = True
        if isinstance(error, (SPAgreementError, SPPeerFailure)):
            return  # raised alike on every rank, or a consequence of another rank's failure
        rank = dist.get_rank(self.group)
        note = f"SP rank {rank} (world rank {dist.get_rank()}) raised {type(error).__name__} in step {self.step}: "
        leave_note(self.group, note + str(error)[:500])


def unpicklable_group() -> TypeError:
    """The error of pickling a model that hf_fpdt applied over a process group (``torch.save(model)``)."""
    return TypeError(
        "hf_fpdt: this model was applied over a sequence-parallel process group (a live connection to the other "
        "ranks), which cannot be pickled, so torch.save(model) cannot save it. Save its weights instead "
        "(torch.save(model.state_dict(), path) or model.save_pretrained(path)) and apply hf_fpdt again after "
        "loading; or call hf_fpdt.unapply(model) first to pickle the plain model"
    )


def from_first_rank(group: dist.ProcessGroup | None, values: torch.Tensor | None, what: str) -> torch.Tensor | None:
    """``values`` as the first rank of ``group`` (an SP group: one data-parallel rank) holds them, on every rank.

    What a group needs once (GRPO's rewards and advantages, SP generation's next-token logits) is SP rank 0's and
    broadcast, instead of each rank's own copy compared: the ranks may compute it differently (a reward model's last
    bit, a reward function that reads the rank) and still train as one process does. The ranks hold the same shape
    (they scored the same completions); ``None`` (one process, or no values) passes through."""
    if group is None or values is None or dist.get_world_size(group) < 2:
        return values
    moved = values.detach().to(group_device(group), copy=True).contiguous()  # the caller's tensor stays as it is
    with guarded(group, f"broadcast of {what} from SP rank 0"):
        dist.broadcast(moved, src=dist.get_global_rank(group, 0), group=group)
    return moved.to(values.device)
