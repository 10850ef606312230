"""What the examples share (a helper, not an example): one rule for existing output, one way to end on a refusal,
and the SP size from ``FPDT_SP_SIZE``.

Output (HF's ``overwrite_output_dir`` convention, the same in every example): a run records what it is (its
arguments, the world size, the launch) in ``run.json`` in its ``--output-dir`` and under ``"run"`` in its
``--metrics-json``. It refuses to write where another run's output is (a record of other arguments, or files
without a record), replaces its own (the same command again), and replaces anything with
``--overwrite-output-dir``. The check runs before the heavy imports, so a refused run ends in a second.

Refusals: :func:`run_main` runs an example's ``main``; a refusal (a ``ValueError`` raised by hf_fpdt, such as an
``SPAgreementError`` or a bad ``FPDT_*`` variable, or by the example itself, :class:`Refusal`) ends the process
with its message as one line on stderr (``[rank N]`` first under a launcher: every rank prints its line) and exit
code 2, without a Python traceback. Under ``accelerate launch`` the launcher then reports the failed processes
itself (its own traceback and summary, exit code 1); the example leaves its message in the launcher's error file
(``TORCHELASTIC_ERROR_FILE``), so the summary's last box ends with it too. Any other exception keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RUN_RECORD = "run.json"  # the record of the run whose output a folder holds
NOT_THE_RUN = ("output_dir", "metrics_json", "overwrite_output_dir")  # where a run writes, not what it is


class Refusal(ValueError):
    """An example refuses its arguments or its launch (ends the process as :func:`run_main` says)."""


def add_overwrite_argument(parser: argparse.ArgumentParser) -> None:
    """``--overwrite-output-dir``: replace another run's output (``--output-dir``, ``--metrics-json``)."""
    parser.add_argument(
        "--overwrite-output-dir",
        action="store_true",
        help="replace the output (--output-dir, --metrics-json) of an earlier run with other arguments",
    )


def resolve_sp_size(given: int | None) -> int:
    """``--sp-size`` if given, else ``FPDT_SP_SIZE`` as hf_fpdt reads it (``FPDTConfig``: a value that is not a
    positive integer is its ``ValueError`` naming the variable), else 1."""
    if given is not None:
        return given
    if not os.environ.get("FPDT_SP_SIZE", "").strip():
        return 1
    from hf_fpdt.config import FPDTConfig

    return FPDTConfig().sp_size


def run_record(args: argparse.Namespace, world: int, **extra: Any) -> dict:
    """What tells this run apart from another one: its arguments (not where it writes), the world size, ``extra``."""
    record = {k: v for k, v in sorted(vars(args).items()) if k not in NOT_THE_RUN}
    return {**record, "world_size": world, **extra}


def check_no_overwrite(args: argparse.Namespace, record: dict, output_dir: str | Path | None, what: str = "the output"):
    """Refuse to replace another run's output: ``output_dir`` (``None``: the example writes no folder) and
    ``args.metrics_json``. The same ``record`` again may, since it writes what is there; anything else needs
    ``--overwrite-output-dir``."""
    if args.overwrite_output_dir:
        return
    if output_dir is not None:
        out = Path(output_dir)
        earlier = None
        if (out / RUN_RECORD).exists():
            earlier = json.loads((out / RUN_RECORD).read_text())
        elif out.is_dir() and any(out.iterdir()):
            earlier = {}  # files without a record: another program's, or an older version's
        if earlier is not None and earlier != record:
            changed = sorted(k for k in set(earlier) | set(record) if earlier.get(k) != record.get(k))
            raise Refusal(
                f"{out} holds {what} of another run (differing in: {', '.join(changed) or 'unknown'}); give this "
                "run its own --output-dir, or pass --overwrite-output-dir to replace it"
            )
    metrics = Path(args.metrics_json) if args.metrics_json else None
    if metrics is not None and metrics.exists():
        previous = json.loads(metrics.read_text() or "{}").get("run")
        if previous != record:
            raise Refusal(
                f"{metrics} holds another run's metrics; pass another --metrics-json, or --overwrite-output-dir to "
                "replace it"
            )


def save_record(output_dir: str | Path, record: dict) -> None:
    """Write ``record`` beside the run's output (the main process, once the run is done)."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / RUN_RECORD).write_text(json.dumps(record, indent=1))


def write_metrics(path: str | None, metrics: dict, record: dict) -> None:
    """``--metrics-json``: ``metrics`` with the run's ``record`` under ``"run"`` (the main process)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({**metrics, "run": record}, indent=1))


def _raised_by_us(err: BaseException) -> bool:
    """Whether ``err`` is a refusal: raised in hf_fpdt or in the examples (not a bug deep in another library)."""
    if isinstance(err, Refusal):
        return True
    spec = importlib.util.find_spec("hf_fpdt")
    ours = [Path(__file__).resolve().parent]
    if spec is not None and spec.origin:
        ours.append(Path(spec.origin).resolve().parent)
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    where = Path(tb.tb_frame.f_code.co_filename).resolve()
    return any(where.is_relative_to(folder) for folder in ours)


def _tell_the_launcher(line: str) -> None:
    """The launcher's failure summary (torch elastic, under ``accelerate launch`` / ``torchrun``) shows the root
    cause's error file: the one line there instead of a pointer to how to get a traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": "0"}}}
    try:
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass


def run_main(main: Callable[[], Any]) -> None:
    """Run ``main()``; on a refusal end the process with one line on stderr and exit code 2 (see the docstring).
    On success every rank leaves together and tears its process groups down itself: a gloo process group left to
    interpreter shutdown can abort the process ("terminate called without an active exception", seen at the end of a
    finished ``grpo.py`` run at SP 2)."""
    try:
        main()
    except ValueError as err:
        if not _raised_by_us(err):
            raise
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        prefix = f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""
        line = f"{prefix}{Path(sys.argv[0]).name}: error: {' '.join(str(err).split())}"
        print(line, file=sys.stderr, flush=True)
        _tell_the_launcher(line)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # a gloo group left to interpreter shutdown can abort the process
        raise SystemExit(2) from None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
