"""``python -m hf_fpdt.bench speed|memory|eval|plan|acceptance|masked|exchange [options]``: each prints a table.

Every subcommand takes its sequence lengths as ``--seq-len`` (a comma list where it runs several)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from .cli import plain

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


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, object]:
    """The arguments of one subcommand and its module (nothing runs). Bad arguments: one line on stderr and exit code
    2 (``SystemExit(2)``); an option the subcommand does not know is answered with the subcommand's usage first."""
    parser = _Parser(prog="python -m hf_fpdt.bench", description=plain(__doc__))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    modules, parsers = {}, {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        modules[name] = module
        parsers[name] = sub.add_parser(name, help=help_text, description=plain(module.__doc__))
        module.add_arguments(parsers[name])
        for action in parsers[name]._actions:  # the options' help in plain text too
            action.help = plain(action.help)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parsers[args.command].print_usage(sys.stderr)
        parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args, modules[args.command]


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; its exit code. Bad arguments: one line on stderr and exit code 2 (``SystemExit(2)``
    from argparse's checks, the options' types, :mod:`hf_fpdt.bench.common`'s for ``speed``, ``memory`` and
    ``eval``; the return value 2 from a subcommand's own, e.g. ``plan``'s)."""
    args, module = parse(argv)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
