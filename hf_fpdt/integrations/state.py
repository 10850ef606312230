"""What hf_fpdt keeps on a model: one :class:`FPDTState`, one reference to it, and the forwards it installs.

Everything ``hf_fpdt.apply`` (or ``hf_fpdt.configure``) leaves on a user's model is described here, so that
``hf_fpdt.unapply`` can take all of it away again:

* **One state object per model**, :class:`FPDTState`: the runtime (settings, process group, host stores,
  autotuner, device budget), the parts ``apply`` chunked, the layer-input offloader, the SP step agreement,
  the handles of the forward hooks ``apply`` registered and the attention implementation it replaced. A
  plain dataclass, not an ``nn.Module``: it never enters ``state_dict``; ``copy.deepcopy`` of the model
  copies it with the model (the hook handles then point at the copy's hook dicts, torch's handles follow
  a deepcopy); ``save_pretrained`` and PEFT wrapping never see it.
* **One reference attribute**, ``fpdt`` (:data:`ATTR`), on the modules that look the state up: the HF model
  (so ``model.fpdt`` also answers through a PEFT or ``torch.compile`` wrapper, which forward attribute
  look-ups), its causal LM heads, and its attention modules, since transformers' attention interface hands
  the registered function the attention module and nothing else (:mod:`.registration`).
* **Instance forwards**, :class:`InstalledForward`: a ``functools.partial`` that remembers the forward it
  replaced, so the wrappers stack (a decoder layer: input offload, recompute marker, checkpoint segment),
  come off in order, and a module whose forward was its class's gets it back by losing the instance
  attribute. The wrappers hold their module strongly (not a ``weakref``), so a deep copy's wrappers call
  the copy.

The attention-only path (``attn_implementation="fpdt"`` without ``apply`` or ``configure``) has no place on
the model to keep its state without writing into it: :class:`ModelStates` keeps those, one per model,
keyed by the HF config object the model's attention modules share (see its docstring).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn
from torch.utils.hooks import RemovableHandle

from ..attention.runtime import FPDTRuntime
from ..distributed.agreement import StepAgreement
from ..memory.checkpointing import LayerInputOffloader

ATTR = "fpdt"  # the one attribute hf_fpdt sets on a user's modules: the reference to the model's FPDTState


@dataclass(eq=False)
class FPDTState:
    """hf_fpdt's state of one model (``model.fpdt`` after ``hf_fpdt.apply`` / ``hf_fpdt.configure``).

    Args:
        runtime: the model's one :class:`~hf_fpdt.attention.runtime.FPDTRuntime` (one tuner, one device budget, one
            chunk size), shared by every layer.
        parts: what ``apply`` chunked (``hf_fpdt.integrations.apply.ALL_PARTS`` order); ``()`` where only the
            attention's settings were given (``configure``, or the attention-only path's defaults).
        layer_offloader: the pool the checkpointed layer inputs go to (``apply`` with
            ``offload_layer_inputs``), sharing ``runtime.residency``.
        agreement: the SP ranks' per-step agreement (``apply`` under sequence parallelism).
        attn_implementation: the model's attention implementation before ``apply`` (``unapply`` puts it
            back); ``None`` where hf_fpdt did not change it.
        hooks: the forward hooks ``apply`` registered on the model.
        layer_classes: the decoder layers' class changes (transformers up to 5.22:
            :mod:`hf_fpdt.integrations.checkpointed_forward`), each with a ``remove()`` that ``unapply`` calls.
        whole: the token mixers ``apply`` left whole (a hybrid's linear-attention or state-space layers, which
            run over the whole local sequence as in HF), one ``"layer <i>: <attribute> (<class>)"`` each.
    """

    runtime: FPDTRuntime
    parts: tuple[str, ...] = ()
    layer_offloader: LayerInputOffloader | None = None
    agreement: StepAgreement | None = None
    attn_implementation: str | None = None
    hooks: list[RemovableHandle] = field(default_factory=list, repr=False)
    layer_classes: list = field(default_factory=list, repr=False)
    whole: tuple[str, ...] = ()

    @property
    def applied(self) -> bool:
        """Whether ``hf_fpdt.apply`` made this state (else only the attention's settings are in it)."""
        return bool(self.parts)


def state_of(model: nn.Module) -> FPDTState | None:
    """The :class:`FPDTState` ``model`` holds (through PEFT / ``torch.compile`` wrappers too), or None."""
    state = getattr(model, ATTR, None)
    return state if isinstance(state, FPDTState) else None


def attach(state: FPDTState, modules: Iterable[nn.Module]) -> None:
    """Give each of ``modules`` the reference to ``state`` (its one hf_fpdt attribute)."""
    for module in modules:
        setattr(module, ATTR, state)


def detach(modules: Iterable[nn.Module]) -> None:
    """Remove the reference to an :class:`FPDTState` from each of ``modules`` that holds one."""
    for module in modules:
        if isinstance(module.__dict__.get(ATTR), FPDTState):
            delattr(module, ATTR)


class InstalledForward(functools.partial):
    """``module.forward`` as hf_fpdt installs it on a module instance (:func:`install_forward`).

    Calls ``func(*args, inner, module, *call_args, **call_kwargs)``: ``inner`` is the forward it replaced
    (HF's, or an earlier wrapper), ``module`` the module it is installed on. ``kind`` names the wrapper;
    ``own`` says whether ``inner`` was the instance's own attribute (else it is the class's forward, which
    the instance gets back by losing its attribute)."""

    kind: str
    own: bool

    @property
    def inner(self) -> Callable:
        return self.args[-2]


def install_forward(module: nn.Module, kind: str, func: Callable, *args) -> InstalledForward:
    """Replace ``module.forward`` by ``func(*args, <the forward found>, module, ...)`` (see :class:`InstalledForward`).

    The wrapper answers ``inspect.signature`` with the replaced forward's parameters (Trainer's column filter,
    PEFT and ``generate`` read them)."""
    inner = module.forward
    wrapper = InstalledForward(func, *args, inner, module)
    functools.update_wrapper(wrapper, inner)
    wrapper.kind, wrapper.own = kind, "forward" in module.__dict__
    module.forward = wrapper
    return wrapper


def installed_forwards(module: nn.Module) -> list[InstalledForward]:
    """hf_fpdt's wrappers on ``module``, outermost first (empty where its forward is not one of them)."""
    found, forward = [], module.__dict__.get("forward")
    while isinstance(forward, InstalledForward):
        found.append(forward)
        forward = forward.inner if forward.own else None
    return found


def find_forward(module: nn.Module, kind: str) -> InstalledForward | None:
    """The wrapper of ``kind`` on ``module``, or None."""
    return next((f for f in installed_forwards(module) if f.kind == kind), None)


def remove_forward(module: nn.Module, kind: str) -> None:
    """Take the outermost wrapper off ``module`` if it is of ``kind`` (a no-op otherwise)."""
    wrappers = installed_forwards(module)
    if wrappers and wrappers[0].kind == kind:
        _unwrap(module, wrappers[0])


def restore_forwards(module: nn.Module) -> None:
    """Take every hf_fpdt wrapper off ``module``: its forward is the one it had before."""
    for wrapper in installed_forwards(module):
        _unwrap(module, wrapper)


def hidden_forward(module: nn.Module) -> bool:
    """Whether an hf_fpdt wrapper sits under a forward someone else installed later (found through the
    ``__wrapped__`` chain ``functools.wraps`` leaves): it cannot be taken off without dropping theirs."""
    forward = module.__dict__.get("forward")
    if forward is None or isinstance(forward, InstalledForward):
        return False
    seen = 0
    while forward is not None and seen < 64:
        forward, seen = getattr(forward, "__wrapped__", None), seen + 1
        if isinstance(forward, InstalledForward):
            return True
    return False


def _unwrap(module: nn.Module, wrapper: InstalledForward) -> None:
    if wrapper.own:
        module.forward = wrapper.inner
    else:
        del module.forward  # the class's forward again


class ModelStates:
    """The attention-only path's states: one :class:`FPDTState` per model, made by its first fpdt call.

    A model loaded with ``attn_implementation="fpdt"`` and neither applied nor configured calls the
    registered attention function with one attention module at a time; a module knows neither its model
    nor its siblings. What the modules of one model do share is their HF config object (``from_pretrained``
    and ``from_config`` give every model its own, deep-copied; a deepcopy of a model copies it too), so
    the state is keyed by the identity of that object, and dropped when it is collected
    (``weakref.finalize``). Nothing is stored on the config itself: configs are serialised and
    deep-copied, and ``PretrainedConfig`` defines ``__eq__``, so it is unhashable and cannot key a
    ``WeakKeyDictionary``. A module without a config (an attention module used alone) is its own key.

    Models built by hand from one config object (``LlamaForCausalLM(config)`` twice) share that object,
    and with it one runtime; ``hf_fpdt.configure`` gives a model its own.
    """

    def __init__(self) -> None:
        self._states: dict[int, FPDTState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def get(self, key: object) -> FPDTState | None:
        """The state made for ``key``, or None."""
        return self._states.get(id(key))

    def get_or_make(self, key: object, make: Callable[[], FPDTState]) -> FPDTState:
        """The state of ``key``, made by ``make()`` on the first call and kept until ``key`` is collected."""
        state = self._states.get(id(key))
        if state is None:
            state = self._states[id(key)] = make()
            # runs before the object's memory (and so its id) can be reused
            weakref.finalize(key, self._states.pop, id(key), None).atexit = False
        return state
