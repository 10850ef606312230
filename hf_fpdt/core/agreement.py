"""The ranks of a sequence-parallel (SP) group agree before they compute, and a rank that fails says so.

Every SP rank runs the same collectives in the same order; ranks that disagree on the shape of a step
(another sequence length, batch size or chunk size) or on the model (another layer count, hidden size or
dtype) would otherwise meet in an all-to-all with buffers of different sizes, which gloo answers by aborting
a process and NCCL by hanging, or compute a result that matches neither rank (another model type, another
attention pattern). Three mechanisms:

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

**Failure notes.** An exception raised on one rank inside the model's forward leaves its peers waiting
in the next all-to-all. Gloo cannot interrupt that wait from another process (aborting or destroying a
gloo group does not close its connections), so the wait is bounded by the group's timeout
(:func:`hf_fpdt.core.groups.build_groups` takes one; ``FPDTPlugin`` sets ``sp_timeout``). Before its exception
leaves the model, the failing rank writes a note into the group's store (:meth:`StepAgreement.note_failure`);
a peer whose collective then fails or times out raises :class:`SPPeerFailure` naming the failing rank,
its step and its error (:func:`peer_failure`, used by :mod:`hf_fpdt.core.all_to_all`'s collectives).

**Guards.** Every collective hf_fpdt issues runs under :func:`guarded` (or, over the world, a
:class:`CollectiveWatch`): an error or timeout of the collective becomes :class:`SPPeerFailure` naming this
rank, the peer (the one that left a note, else the group's other ranks), the collective and the group's
timeout.

**Collectives outside the SP group** (the world's token count and logged loss, DDP's buffer sync and
gradient reduction, Trainer's gathers) are watched by a :class:`CollectiveWatch`: each rank marks in the
world's store which collective it enters (one small store write per watched call, a few per step), and a
collective that fails or times out becomes an :class:`SPPeerFailure` naming the peers that did not reach it
(late, or gone), the collective and the timeout. ``FPDTPlugin`` sets the world group's timeout to its
``sp_timeout`` (:func:`hf_fpdt.core.groups.set_group_timeout`), so these waits end as soon as the SP group's do.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..config import FPDTConfig

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
    "attention mask",
)
MASK_KINDS = ("none", "2D", "4D", "documents")  # the "attention mask" field's values (see mask_kind)
NOTE_KEY = "hf_fpdt/sp_failure"
MARK_KEY = "hf_fpdt/at/"  # + world rank: "<number of watched calls>|<the collective>" (CollectiveWatch)


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
    }


class SPAgreementError(ValueError):
    """The SP ranks disagree on the shape or settings of a step (raised alike on every rank)."""


class SPPeerFailure(RuntimeError):
    """A collective of the SP group failed because another rank raised, died or stalled."""


def _rank(group: dist.ProcessGroup) -> int:
    return dist.get_rank(group)


def _store(group: dist.ProcessGroup | None):
    if group is None:
        return None
    try:
        return group.get_group_store()
    except (AttributeError, RuntimeError):  # a backend without a store: no notes, the timeout still ends the wait
        return None


def group_timeout(group: dist.ProcessGroup | None) -> float | None:
    """The timeout of ``group``'s collectives in seconds (the world for ``None``), or None where torch hides it."""
    group = dist.group.WORLD if group is None else group
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def group_device(group: dist.ProcessGroup) -> torch.device:
    """A device ``group``'s collectives take tensors on: the CPU for gloo, else the current accelerator."""
    backend = str(dist.get_backend(group)).lower()
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if "gloo" in backend or "mpi" in backend or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def peer_failure(
    group: dist.ProcessGroup | None, error: BaseException, what: str | None = None, waited: float | None = None
) -> SPPeerFailure:
    """The error to raise when a collective over ``group`` failed with ``error`` (a gloo/NCCL error or timeout).

    Names this rank, the collective (``what``, after ``waited`` seconds) and the group's timeout, and the
    failing peer, its step and its error when that peer left a note; otherwise the group's other ranks
    (one of which died, raised outside the model's forward, or stalled).
    """
    store, note = _store(group), None
    if store is not None:
        try:
            if store.check([NOTE_KEY]):
                note = store.get(NOTE_KEY).decode()
        except RuntimeError:
            note = None
    me = f"SP rank {_rank(group)} of {dist.get_world_size(group)} (world rank {dist.get_rank()})"
    timeout = group_timeout(group)
    detail = [what or ""]
    if waited is not None:
        detail.append(f"after {waited:.1f} s")
    if timeout is not None:
        detail.append(f"timeout {timeout:g} s")
    detail = [d for d in detail if d]
    where = f" ({'; '.join(detail)})" if detail else ""
    if note is not None:
        cause = f"{note}; this rank's collective of that step could not complete"
    else:
        others = [r for r in dist.get_process_group_ranks(group) if r != dist.get_rank()]
        who = f"world rank {others[0]}" if len(others) == 1 else f"one of world ranks {', '.join(map(str, others))}"
        if any(s in str(error).lower() for s in ("connection closed", "connection reset", "broken pipe")):
            happened = f"{who} closed its connection (it died, or exited with an error)"
        else:
            happened = (
                f"{who} did not arrive: it died, raised outside the model's forward (e.g. in backward or the loss), "
                "or stalled beyond the group's timeout"
            )
        cause = f"no SP rank reported an error: {happened}; see the other ranks' logs"
    return SPPeerFailure(f"{me}: a collective of the sequence-parallel group failed{where}: {cause} ({error})")


@contextmanager
def guarded(group: dist.ProcessGroup | None, what: str) -> Iterator[None]:
    """Run collectives over ``group``: an error or timeout they raise (a peer died, raised or stalled) becomes
    :class:`SPPeerFailure` naming ``what`` (see :func:`peer_failure`); other errors pass unchanged."""
    start = time.monotonic()
    try:
        yield
    except RuntimeError as exc:
        if group is None or not is_collective_error(exc):
            raise
        raise peer_failure(group, exc, what, time.monotonic() - start) from exc


def gather_rows(group: dist.ProcessGroup, tensor: torch.Tensor, what: str, equal_rows: bool = False) -> torch.Tensor:
    """Every rank's ``tensor`` of ``group`` concatenated along dim 0, in group rank order, guarded (``what``
    names the collective in a failure). Bool tensors come back as bool (gloo gathers none); a 0-d tensor is one
    row; the dims after the first must match.

    ``equal_rows``: every rank holds the same number of rows (the agreement's fixed-size digest rows): one
    all-gather. Otherwise the row counts may differ (results of an uneven last batch): an all-gather of the
    counts first, then of the rows padded to the longest.
    """
    if tensor.dtype == torch.bool:
        return gather_rows(group, tensor.to(torch.uint8), what, equal_rows).bool()
    flat = tensor if tensor.dim() else tensor.reshape(1)
    world = dist.get_world_size(group)
    if equal_rows:
        rows = [flat.shape[0]] * world
    else:
        size = torch.tensor([flat.shape[0]], dtype=torch.int64, device=flat.device)
        sizes = [torch.empty_like(size) for _ in range(world)]
        with guarded(group, f"{what}: the row counts"):
            dist.all_gather(sizes, size, group=group)
        rows = [int(s.item()) for s in sizes]
    padded = flat
    if max(rows) != flat.shape[0]:
        padded = flat.new_zeros((max(rows), *flat.shape[1:]))
        padded[: flat.shape[0]] = flat
    pieces = [torch.empty_like(padded) for _ in rows]
    with guarded(group, what):
        dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(pieces, rows)])


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
            store = _store(self.group)
            if store is not None and _rank(self.group) == 0:
                store.delete_key(NOTE_KEY)
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
        store = _store(self.group)
        if store is None:
            return
        rank = _rank(self.group)
        note = f"SP rank {rank} (world rank {dist.get_rank()}) raised {type(error).__name__} in step {self.step}: "
        note += str(error)[:500]
        try:
            store.set(NOTE_KEY, note)
        except RuntimeError:
            pass  # the store is gone too: the peers' timeout still ends their wait


def unpicklable_group() -> TypeError:
    """The error of pickling a model that hf_fpdt applied over a process group (``torch.save(model)``)."""
    return TypeError(
        "hf_fpdt: this model was applied over a sequence-parallel process group (a live connection to the other "
        "ranks), which cannot be pickled, so torch.save(model) cannot save it. Save its weights instead "
        "(torch.save(model.state_dict(), path) or model.save_pretrained(path)) and apply hf_fpdt again after "
        "loading; or call hf_fpdt.unapply(model) first to pickle the plain model"
    )


def is_collective_error(error: BaseException) -> bool:
    """Whether ``error`` is what a collective raises when a peer died, left or stalled past the timeout."""
    if isinstance(error, SPPeerFailure):
        return False  # already explained
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("gloo", "nccl", "timed out", "connection closed", "connection reset", "broken pipe")
    )


def _torch_collective(error: BaseException) -> str | None:
    """The torch.distributed / DDP function a collective error came from, read off its traceback."""
    names = []
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        path = code.co_filename.replace("\\", "/")
        if ("torch/distributed/" in path or "torch/nn/parallel/" in path or "accelerate/" in path) and (
            "c10d_logger" not in path
        ):
            names.append(getattr(code, "co_qualname", code.co_name))
        tb = tb.tb_next
    if not names:
        return None
    return names[0] if len(names) == 1 else f"{names[0]} -> {names[-1]}"


class CollectiveWatch:
    """Names the peer and the collective when a collective over ``group`` (the world) fails or times out.

    Every rank calls the watched points in the same order (:meth:`guard` around a collective, or
    :meth:`mark` before code that runs collectives); each call writes ``"<count>|<what>"`` under
    :data:`MARK_KEY` in the group's store. A failed collective then reads every rank's mark: a peer
    whose count is behind this rank's has not reached it (late or dead), one that reached it and closed
    its connection has died or left with an error.

    Args:
        group: the group whose collectives are watched (the world).
        timeout: that group's timeout in seconds (named in the error).
    """

    def __init__(self, group: dist.ProcessGroup, timeout: float) -> None:
        self.group, self.timeout = group, timeout
        self.calls = 0
        self.where = "(no watched collective yet)"
        self.since = time.monotonic()

    def mark(self, where: str) -> None:
        """This rank enters ``where`` (a collective, or a stretch of code that runs collectives)."""
        self.calls += 1
        self.where, self.since = where, time.monotonic()
        store = _store(self.group)
        if store is None:
            return
        try:
            store.set(f"{MARK_KEY}{dist.get_rank()}", f"{self.calls}|{where}")
        except RuntimeError:
            pass  # the store is gone: the collective itself will fail and be explained

    @contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Mark ``where`` and turn a collective error raised inside into :class:`SPPeerFailure`."""
        self.mark(where)
        try:
            yield
        except RuntimeError as exc:
            if not is_collective_error(exc):
                raise
            raise self.failure(exc) from exc

    def failure(self, error: BaseException, where: str | None = None) -> SPPeerFailure:
        """The :class:`SPPeerFailure` for ``error`` raised by a collective in ``where`` (default: the last mark)."""
        where = where or self.where
        inner = _torch_collective(error)
        what = where if inner is None or inner in where else f"{where} [{inner}]"
        rank, world = dist.get_rank(), dist.get_world_size()
        waited = time.monotonic() - self.since
        closed = any(s in str(error).lower() for s in ("connection closed", "connection reset", "broken pipe"))
        peers = self._peers(rank, world, closed)
        return SPPeerFailure(
            f"world rank {rank} of {world}: the collective {what} failed after {waited:.1f} s "
            f"(timeout {self.timeout:g} s, FPDTPlugin(sp_timeout=...)): {peers} ({error})"
        )

    def _peers(self, rank: int, world: int, closed: bool) -> str:
        store = _store(self.group)
        if store is None:
            return "a peer rank died or stalled; see the other ranks' logs"
        late, gone, unknown = [], [], []
        for peer in range(world):
            if peer == rank:
                continue
            key = f"{MARK_KEY}{peer}"
            try:
                mark = store.get(key).decode() if store.check([key]) else None
            except RuntimeError:
                unknown.append(f"world rank {peer}")
                continue
            if mark is None:
                state = "closed its connection (died) before" if closed else "has not reached"
                late.append(f"world rank {peer} ({state} any watched collective)")
                continue
            count, _, at = mark.partition("|")
            if int(count) < self.calls:
                state = "closed its connection (died) at" if closed else "still at"
                late.append(f"world rank {peer} ({state} {at}, watched call {count}; this rank: {self.calls})")
            elif closed:
                gone.append(f"world rank {peer} (reached {at}, watched call {count})")
        parts = []
        if late:
            parts.append("did not arrive: " + ", ".join(late))
        if gone:
            parts.append("closed its connection (died or exited with an error): " + ", ".join(gone))
        if unknown:
            parts.append("the store is unreachable (its host may have died): " + ", ".join(unknown))
        if not parts:
            parts.append("a peer rank died or stalled inside this collective; see the other ranks' logs")
        return "; ".join(parts)
