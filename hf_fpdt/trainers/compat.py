"""The contract with the libraries the trainers adapt: one record per name hf_fpdt relies on, and its check.

Each library's names live in its own module (:mod:`.compat_trl`, :mod:`.compat_transformers`,
:mod:`.compat_accelerate`) as a tuple of :class:`Hook` records: a method hf_fpdt overrides or calls (its
parameters by name and position), an attribute the library sets on its objects, the fields of a result or a
config, the order of a returned tuple. :func:`problems` checks them against the installed release; the contract
test (``tests/unit/test_compat_contract.py``, run in both CI environments) fails on any with the library, its
version, the hook and where hf_fpdt uses it, so that a renamed or changed private hook is a test failure, not an
override that silently stops being called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import inspect
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Hook:
    """One name of a library that hf_fpdt relies on.

    Args:
        where: the owner, ``"module:Class"`` or ``"module"`` (a module-level function).
        name: the method, attribute or function name.
        kind: ``"method"`` (a callable whose leading parameters are ``params``, in that order, any others
            optional), ``"attribute"`` (set as ``<object>.<name> =`` in the owner's source), ``"fields"``
            (the dataclass fields, parameters or members ``params`` exist), ``"returns"`` (the method's last
            ``return`` starts with ``params`` in that order), ``"keys"`` (the dict literal assigned to
            ``self.<name>`` has the keys ``params``).
        params: as ``kind`` says (without ``self``).
        used_by: where hf_fpdt uses it (module and what it does), for the failure message.
    """

    where: str
    name: str
    kind: str
    params: tuple[str, ...] = ()
    used_by: str = ""

    @property
    def library(self) -> str:
        return self.where.split(".", 1)[0].split(":", 1)[0]

    @property
    def label(self) -> str:
        owner = self.where.split(":", 1)[1] if ":" in self.where else self.where
        return f"{owner}.{self.name}"


def _owner(where: str) -> Any:
    module, _, cls = where.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, cls) if cls else obj


class _Sources:
    """Sources read for one contract check, each once (a class's lookup parses its whole module); a new reader per
    check, so nothing outlives it (no module-level cache)."""

    def __init__(self) -> None:
        self._texts: dict[int, tuple[Any, str]] = {}

    def text(self, obj: Any) -> str:
        """``obj``'s source ("" where it has none)."""
        if id(obj) not in self._texts:
            try:
                text = inspect.getsource(obj)
            except (OSError, TypeError):
                text = ""
            self._texts[id(obj)] = (obj, text)  # obj kept: its id stays unique while the reader lives
        return self._texts[id(obj)][1]

    def of_owner(self, owner: Any) -> str:
        """The owner's source and, for a class, its bases' up to the library's root (attributes set by a base)."""
        if not inspect.isclass(owner):
            return self.text(owner)
        skip = ("builtins", "torch")
        bases = [c for c in owner.__mro__ if c is not object and c.__module__.split(".")[0] not in skip]
        return "\n".join(self.text(c) for c in bases)


def _check_one(hook: Hook, sources: _Sources) -> str | None:
    """``None`` when the installed library has ``hook`` as hf_fpdt relies on it, else what is different."""
    try:
        owner = _owner(hook.where)
    except (ImportError, AttributeError) as exc:
        return f"{hook.where} cannot be imported ({exc})"
    if hook.kind == "method":
        fn = inspect.getattr_static(owner, hook.name, None)
        if fn is None:
            return "not found"
        fn = getattr(owner, hook.name)
        if not callable(fn):
            return f"not a method ({type(fn).__name__})"
        params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
        names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        if names[: len(hook.params)] != hook.params:
            return f"parameters ({', '.join(names)}), hf_fpdt relies on ({', '.join(hook.params)})"
        rest = params[len(hook.params) :]
        required = [p.name for p in rest if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if required:
            return f"new required parameters ({', '.join(required)})"
        return None
    if hook.kind == "fields":
        if dataclasses.is_dataclass(owner):
            have = {f.name for f in dataclasses.fields(owner)}
        else:  # a function's parameters, a class's members (set in its source too: instance attributes)
            have = set(dir(owner)) | set(re.findall(r"self\.(\w+)\s*[:=]", sources.of_owner(owner)))
            if callable(owner):
                with contextlib.suppress(TypeError, ValueError):
                    have |= set(inspect.signature(owner).parameters)
        missing = [f for f in hook.params if f not in have]
        return f"no field(s) {', '.join(missing)}" if missing else None
    source = sources.of_owner(owner)
    if hook.kind == "attribute":
        return None if re.search(rf"\.{re.escape(hook.name)}\s*(:[^=]|=[^=])", source) else "never set"
    if hook.kind == "returns":
        method = sources.text(getattr(owner, hook.name))
        returns = re.findall(r"^\s*return\s+(.+)$", method, flags=re.M)
        if not returns:
            return "returns nothing"
        got = tuple(x.strip() for x in returns[-1].split(","))
        if got[: len(hook.params)] != hook.params:
            return f"returns ({', '.join(got)}), hf_fpdt reads ({', '.join(hook.params)}) by position"
        return None
    if hook.kind == "keys":
        match = re.search(rf"self\.{re.escape(hook.name)}\s*=\s*\{{(.*?)\n\s*\}}", source, flags=re.S)
        if match is None:
            return "not assigned a dict literal"
        keys = tuple(re.findall(r"^\s*[\"'](\w+)[\"']\s*:", match.group(1), flags=re.M))
        if set(keys) != set(hook.params):
            return f"keys ({', '.join(keys)}), hf_fpdt's copy has ({', '.join(hook.params)})"
        return None
    raise ValueError(f"unknown hook kind {hook.kind!r}")


def version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def problem(hook: Hook, sources: _Sources | None = None) -> str | None:
    """The failure message for ``hook`` (library, installed version, hook, where hf_fpdt uses it), or None."""
    what = _check_one(hook, sources or _Sources())
    if what is None:
        return None
    return (
        f"{hook.library} {version(hook.library)}: {hook.label} is gone or changed ({what}): hf_fpdt "
        f"{hook.used_by}; see hf_fpdt/trainers/compat_{hook.library}.py"
    )


def problems(hooks: tuple[Hook, ...]) -> list[str]:
    """Every hook of ``hooks`` the installed libraries do not have as hf_fpdt relies on them (messages)."""
    sources = _Sources()  # each module's source read once for the whole check
    return [p for p in (problem(hook, sources) for hook in hooks) if p is not None]
