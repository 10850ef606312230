"""What every ``python -m hf_fpdt.bench`` subcommand shares on its command line: one spelling of the length option,
and help pages in plain text (the module docstrings the help pages are made from are reST for the docs).

Kept free of heavy imports: ``plan`` runs without torch doing any work.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

LENGTH_FLAGS = ("--seq-len", "--seq-lens", "--lengths", "--length")  # the first is the spelling; the rest aliases


def add_length(parser: argparse.ArgumentParser, dest: str, type: Callable, default: object, help: str) -> None:
    """The subcommand's sequence-length option as ``--seq-len`` (a comma list where the subcommand takes several),
    with the spellings earlier releases had (``--seq-lens``, ``--lengths``, ``--length``) as aliases; ``dest``: the
    attribute the subcommand reads."""
    parser.add_argument(LENGTH_FLAGS[0], dest=dest, type=type, default=default, help=help, metavar="N[,N...]")
    for alias in LENGTH_FLAGS[1:]:  # not in the help page; an error names the spelling the user typed
        parser.add_argument(alias, dest=dest, type=type, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


_ROLE = re.compile(r":(?:mod|func|meth|class|attr|data|obj|exc):`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]*)``")


def plain(text: str | None) -> str | None:
    """``text`` without reST markup: a literal's double backquotes dropped, a cross-reference role's target as its
    name (``:mod:`a.b` `` -> ``a.b``; with a ``~``, the last part only)."""
    if text is None:
        return None

    def role(match: re.Match) -> str:
        name = match.group(1)
        return name.rsplit(".", 1)[-1] if match.group(0).split("`", 1)[1].startswith("~") else name

    return _LITERAL.sub(r"\1", _ROLE.sub(role, text))


_FLAGS = {  # plan()'s argument -> this command's option
    "model": "--model", "seq_len": "--seq-len", "batch": "--batch", "sp_size": "--sp", "dp_size": "--dp",
    "lora_rank": "--lora-rank", "dtype": "--dtype", "device": "--device", "device_memory": "--device-memory",
    "host_memory": "--host-memory", "resident_memory": "--resident-memory", "chunk_size": "--chunk-size",
    "segments": "--segments", "host_capacity": "--host-capacity", "ring_degree": "--ring",
}  # fmt: skip


def offload_setting(raw: str) -> bool | str:
    """``bench plan --offload`` as ``FPDTConfig.offload``: ``"auto"``, ``True`` (``on``) or ``False`` (``off``)."""
    return {"on": True, "off": False}.get(raw, "auto")


def _flag_of(message: str) -> str:
    """``"argument --sp: "`` for a message of plan() that starts with ``sp_size=`` (the option to change)."""
    name = message.split("=", 1)[0]
    return f"argument {_FLAGS[name]}: " if "=" in message and name in _FLAGS else ""


def plan_error(err: Exception) -> str:
    """The one stderr line of ``bench plan`` (with or without ``--trace``) for an argument plan() refused."""
    return f"python -m hf_fpdt.bench plan: error: {_flag_of(str(err))}{err}"
