"""The KV cache's name across transformers 5.x: the one place that knows it.

transformers up to 5.23 passes a model's KV cache as ``past_key_values`` and returns it in the outputs'
``past_key_values`` field; 5.24 renames both to ``cache`` (the old keyword still works, with a ``FutureWarning``,
until 5.40). GPT-NeoX's layers take it as ``layer_past`` in both. hf_fpdt reads a cache under any of these
names and, calling HF or building an output, uses the name the installed transformers has, found from the code
itself (the forward's signature, the output dataclass's fields), never from a version number:

* :func:`cache_from` -- the cache a call was given (a kwargs or bound-arguments dict);
* :func:`pop_cache` -- the same, taking every name out of a kwargs dict (to pass it on under one name);
* :func:`cache_keyword` -- the keyword an HF forward takes its cache under;
* :func:`output_cache` / :func:`with_cache` -- an HF output's cache; an output built with the cache in its field.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from transformers.modeling_outputs import CausalLMOutputWithPast

# Every keyword an HF forward has taken a KV cache under: 5.24's name first, then the older ones.
CACHE_NAMES = ("cache", "past_key_values", "layer_past")


def _cache_field(output_type: type) -> str | None:
    """The field an HF output dataclass holds its cache in (None: it has none)."""
    names = {f.name for f in dataclasses.fields(output_type)}
    return next((name for name in CACHE_NAMES[:2] if name in names), None)


# The outputs' field (and the forwards' keyword) of the installed transformers: "cache" from 5.24 on.
OUTPUT_CACHE_FIELD = _cache_field(CausalLMOutputWithPast)


def cache_from(kwargs: Mapping[str, Any]) -> Any | None:
    """The KV cache in ``kwargs`` (a call's keywords or bound arguments) under any of its names, or None."""
    for name in CACHE_NAMES:
        value = kwargs.get(name)
        if value is not None:
            return value
    return None


def pop_cache(kwargs: dict[str, Any], cache: Any | None = None) -> Any | None:
    """``cache`` or, when it is None, the cache in ``kwargs``; every cache name is taken out of ``kwargs``
    (the caller's own dict of ``**kwargs``, so that the cache goes on under one name only)."""
    found = cache_from(kwargs)
    for name in CACHE_NAMES:
        kwargs.pop(name, None)
    return cache if cache is not None else found


def cache_keyword(forward: Callable) -> str:
    """The keyword ``forward`` (an HF model's forward) takes its cache under: ``cache`` (transformers 5.24 on),
    ``past_key_values`` (before, and remote code), or, for a forward that names neither, the installed
    transformers' name."""
    params = inspect.signature(forward).parameters
    return next((name for name in CACHE_NAMES[:2] if name in params), OUTPUT_CACHE_FIELD)


def output_cache(outputs: Any) -> Any | None:
    """The cache an HF model output holds (in its ``cache`` or ``past_key_values`` field), or None."""
    name = _cache_field(type(outputs)) if dataclasses.is_dataclass(outputs) else None
    return None if name is None else getattr(outputs, name)


def with_cache(output_type: type, cache: Any | None, **fields: Any) -> Any:
    """``output_type(**fields)`` (an HF output dataclass) with ``cache`` in its cache field."""
    name = _cache_field(output_type)
    if name is None:
        raise TypeError(f"{output_type.__name__} has no cache field (neither cache nor past_key_values)")
    return output_type(**fields, **{name: cache})
