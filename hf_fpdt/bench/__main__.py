"""``python -m hf_fpdt.bench speed|memory|eval|plan|acceptance|masked|exchange [options]``: each prints a table."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

SUBCOMMANDS = {
    "speed": ("hf_fpdt.bench.speed", "step time, tokens/s, MFU of hf_fpdt against HF sdpa + checkpointing"),
    "memory": ("hf_fpdt.bench.memory", "peak step memory against sequence length, and the longest that fits"),
    "eval": ("hf_fpdt.bench.eval", "passkey retrieval accuracy per length and depth (table, heat map), perplexity"),
    "plan": ("hf_fpdt.bench.plan", "bytes per rank and tier of one step, the placement, the longest that fits"),
    "acceptance": ("hf_fpdt.bench.acceptance", "the GPU acceptance run: speed, 8B LoRA, chunk pick, prefill, transfer"),
    "masked": ("hf_fpdt.bench.masked", "peak memory of masked and softcapped blocks against causal"),
    "exchange": ("hf_fpdt.bench.exchange", "SP step time with the all-to-alls synchronous against overlapped"),
}


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line on stderr (what is wrong and where ``--help`` is), exit
    code 2; the usage of a subcommand is many lines, the error's line would scroll away under it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; its exit code. Bad arguments: one line on stderr and exit code 2 (``SystemExit(2)``
    from argparse's checks, the options' types, :mod:`hf_fpdt.bench.common`'s for ``speed``, ``memory`` and
    ``eval``; the return value 2 from a subcommand's own, e.g. ``plan``'s)."""
    parser = _Parser(prog="python -m hf_fpdt.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__))
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
