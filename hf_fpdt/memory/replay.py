"""Recompute one piece of a token-wise computation with autograd, exactly as its forward ran it.

The chunked projection (:mod:`hf_fpdt.attention.projection`) and the tiles of :mod:`hf_fpdt.memory.tiling` run their
forward under ``no_grad`` (nothing is kept but the input) and rebuild each piece's graph in backward.
For the rebuilt piece to be the *same* function it must see the same random numbers (LoRA dropout,
hidden dropout) and the same autocast settings as in forward; :class:`ReplayState` captures both per
piece in forward and reinstates them in backward, like ``torch.utils.checkpoint`` does per region.

Parameter gradients (:class:`ParamGrads`) reach autograd in one of two ways, both summed over pieces in
float32 by :class:`GradAccumulator`:

* explicit (the default): the parameters are inputs of the tiled Function, which returns their summed
  gradients from ``backward``, so autograd accumulates them once per call (and DDP/FSDP hooks see that);
* delivered (:class:`DeliveredParams`): for parameters that are whole only while their own module runs
  (DeepSpeed ZeRO-3 keeps them partitioned, shape ``[0]``, outside that module's forward, so a Function
  taking them as inputs records the partitioned shape and then refuses their gradient). The Function
  takes an empty *anchor* tensor instead (it requires grad, so backward runs even when no other input
  needs a gradient), reaches the parameters only through their modules (whose hooks make them whole),
  and at the end of its backward hands the sums to ``deliver``, once per parameter and call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch


def _device_module(device: torch.device):
    mod = getattr(torch, device.type, None)
    return mod if mod is not None and hasattr(mod, "get_rng_state") else None


@dataclass
class RngState:
    """The CPU generator's state and, once initialised, that of ``device``'s generator."""

    device: torch.device
    cpu: torch.Tensor
    accelerator: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        """The generators' state now."""
        device = torch.device(device)
        mod = _device_module(device) if device.type != "cpu" else None
        accel = mod.get_rng_state(device) if mod is not None and mod.is_initialized() else None
        return cls(device, torch.get_rng_state(), accel)

    def restore(self) -> None:
        """Set the generators to the captured state (the caller decides what restores them afterwards)."""
        torch.set_rng_state(self.cpu)
        if self.accelerator is not None:
            _device_module(self.device).set_rng_state(self.accelerator, self.device)


@dataclass
class ReplayState:
    """RNG and autocast state of one piece's forward, to replay it in backward."""

    rng: RngState
    autocast: tuple[tuple[str, bool, torch.dtype], ...]

    @classmethod
    def capture(cls, device: torch.device) -> ReplayState:
        """Capture now (call right before the piece's forward)."""
        rng = RngState.capture(device)
        kinds = {"cpu", rng.device.type}
        autocast = tuple((k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in sorted(kinds))
        return cls(rng, autocast)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body with the captured RNG streams (restored afterwards) and autocast settings."""
        devices = [self.rng.device] if self.rng.accelerator is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.rng.device.type):
            self.rng.restore()
            with contextlib.ExitStack() as stack:
                for kind, enabled, dtype in self.autocast:
                    stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
                yield


def trainable(modules: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Parameters of ``modules`` that need gradients, each once, in a stable order.

    Looked up per call (not at ``apply`` time) because PEFT or the user may freeze/unfreeze later.
    """
    seen: set[int] = set()
    out = []
    for m in modules:
        for p in m.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def needed(params: Sequence[torch.Tensor], needs: Sequence[bool]) -> list[torch.Tensor]:
    """The parameters whose ``needs`` flag (e.g. ``ctx.needs_input_grad``) is set, in order."""
    return [p for p, need in zip(params, needs) if need]


def spread(grads: Sequence[torch.Tensor | None], needs: Sequence[bool]) -> tuple[torch.Tensor | None, ...]:
    """Inverse of :func:`needed`: one entry per flag, the next of ``grads`` where set, ``None`` elsewhere."""
    it = iter(grads)
    return tuple(next(it, None) if need else None for need in needs)


class GradAccumulator:
    """Sums per-piece parameter gradients in float32 (a bf16 running sum would round once per piece)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self._params = list(params)
        self._sums: list[torch.Tensor | None] = [None] * len(self._params)

    def add(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Add one piece's gradients (``None`` entries are skipped)."""
        for n, g in enumerate(grads):
            if g is None:
                continue
            if self._sums[n] is None:  # a copy: autograd may hand back a tensor aliasing its inputs
                self._sums[n] = g.to(torch.promote_types(g.dtype, torch.float32), copy=True)
            else:
                self._sums[n].add_(g)

    def add_matmul(self, n: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """``sum[n] += a @ b``, in place (no [M, N] temporary) when ``a, b`` are already float32/64."""
        if self._sums[n] is None:
            self._sums[n] = torch.zeros(
                a.shape[0], b.shape[1], dtype=torch.promote_types(a.dtype, torch.float32), device=a.device
            )
        if a.dtype == self._sums[n].dtype:
            self._sums[n].addmm_(a, b)
        else:
            self._sums[n] += torch.mm(a, b)

    def result(self, scale: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
        """The sums in each parameter's dtype (times ``scale`` if given); ``None`` where never touched.

        Consumes the accumulator: the scaling is in place (no second [V, E]-sized buffer for a head).
        """
        out = []
        for p, s in zip(self._params, self._sums):
            if s is not None and scale is not None:
                s.mul_(scale.to(s.dtype))
            out.append(None if s is None else s.to(p.dtype))
        self._sums = [None] * len(self._params)
        return tuple(out)


def piece_grads(
    fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
    x: torch.Tensor,
    need_x: bool,
    params: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    state: ReplayState,
) -> tuple[torch.Tensor | None, tuple[torch.Tensor | None, ...]]:
    """Rebuild ``fn(x)`` with grad under ``state`` and return ``(dx, dparams)`` for ``grad_outputs``.

    ``x`` is one piece of the saved input (a view); it is detached so only this piece's graph is built,
    and that graph is freed on return: backward memory is one piece's activations.
    """
    x = x.detach().requires_grad_(need_x)
    with torch.enable_grad(), state.replay():
        outs = fn(x)
    pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
    wrt = ([x] if need_x else []) + list(params)
    if not pairs or not wrt:
        return None, (None,) * len(params)
    grads = torch.autograd.grad(
        [o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True, materialize_grads=False
    )
    dx = grads[0] if need_x else None
    return dx, tuple(grads[1:] if need_x else grads)


def accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Accumulate ``grads`` into the leaves ``params`` through autograd (``.grad`` and its hooks), skipping None."""
    pairs = [(p, g) for p, g in zip(params, grads) if g is not None]
    if pairs:
        torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])


@dataclass(frozen=True)
class DeliveredParams:
    """Trainable parameters a tiled Function must not take as inputs (see the module docstring).

    ``deliver(params, grads)`` runs at the end of the Function's backward with one summed gradient (or
    None: never touched) per parameter; the default accumulates them through autograd, a wrapper that
    partitions parameters brings its own (:mod:`hf_fpdt.integrations.deepspeed`).
    """

    params: tuple[torch.Tensor, ...]
    deliver: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor | None]], None] = field(default=accumulate)


class ParamGrads:
    """The trainable parameters of one tiled Function call: explicit inputs, or :class:`DeliveredParams`.

    The Function is applied with ``*inputs`` after its own tensors; in backward, :meth:`live` names the
    parameters to differentiate (from the saved inputs and ``ctx.needs_input_grad`` of those slots) and
    :meth:`finish` turns their summed gradients into the Function's return values for those slots.
    """

    def __init__(self, params: Sequence[torch.Tensor] | DeliveredParams, device: torch.device) -> None:
        self.delivered = params if isinstance(params, DeliveredParams) else None
        if self.delivered is None:
            self.inputs: tuple[torch.Tensor, ...] = tuple(params)
            self._live: list[torch.Tensor] = []
        else:
            self._live = [p for p in self.delivered.params if p.requires_grad]
            anchor = self._live and torch.is_grad_enabled()
            self.inputs = (torch.empty(0, device=device, requires_grad=True),) if anchor else ()

    def live(self, saved: Sequence[torch.Tensor], needs: Sequence[bool]) -> list[torch.Tensor]:
        """The parameters that get gradients: the explicit inputs whose flag is set, else the delivered ones."""
        if self.delivered is None:
            return needed(saved, needs)
        return list(self._live) if any(needs) else []

    def finish(self, grads: Sequence[torch.Tensor | None], needs: Sequence[bool]) -> tuple[torch.Tensor | None, ...]:
        """Return values for the parameter slots; delivered parameters get their gradients now instead."""
        if self.delivered is None:
            return spread(grads, needs)
        if any(needs):
            grads = list(grads) + [None] * (len(self._live) - len(grads))
            self.delivered.deliver(self._live, grads)
        return (None,) * len(needs)
