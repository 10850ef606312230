"""Where hf_fpdt's own lines go: the ``hf_fpdt`` logger, shown by default once the plugin is set up.

The step's plan (:mod:`.step_plan`: segments, replay, bytes per tier, budgets) and the resolved ``auto``
values (chunk size) are logged at INFO, which Python hides unless a program configures logging.
:func:`show_info` gives the logger a stderr handler that shows them on the main process (warnings on every
process), unless the program configured logging itself (a handler or level on ``hf_fpdt``, or a root handler):
then its configuration decides. The handler writes through ``tqdm.write``, so a line logged while a progress bar
is drawn (Trainer's) lands above the bar, not inside its line.

:func:`quiet_library_deprecations` silences, within a ``with`` block, the deprecation warnings that PEFT and TRL
raise by calling transformers' old ``gradient_checkpointing*`` names: a user cannot act on them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

LOGGER = "hf_fpdt"
# transformers >= 5.24 names gradient_checkpointing* activation_checkpointing* and warns on the old names; PEFT's
# get_peft_model and TRL's generation / reference-model contexts still call them.
LIBRARY_DEPRECATION = r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated"


class _MainProcessInfo(logging.Filter):
    """INFO and below on the main process only; warnings and errors on every process."""

    def __init__(self, main_process: bool) -> None:
        super().__init__()
        self.main_process = main_process

    def filter(self, record: logging.LogRecord) -> bool:
        return self.main_process or record.levelno >= logging.WARNING


class _AboveProgressBars(logging.StreamHandler):
    """A stderr handler that writes through ``tqdm.write``: open progress bars are cleared, the line is written,
    the bars are drawn again below it (a plain stream write when tqdm is not installed)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm comes with transformers; without it there are no bars to keep apart
            super().emit(record)
            return
        try:
            tqdm.write(self.format(record), file=self.stream or sys.stderr)
            self.flush()
        except Exception:  # a logging handler never raises into the program (as logging.StreamHandler)
            self.handleError(record)


def show_info(main_process: bool) -> None:
    """Show hf_fpdt's INFO lines on stderr (main process), unless logging is configured already (idempotent)."""
    logger = logging.getLogger(LOGGER)
    if logger.handlers or logger.level != logging.NOTSET or logging.getLogger().handlers:
        return
    handler = _AboveProgressBars(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_MainProcessInfo(main_process))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


@contextlib.contextmanager
def quiet_library_deprecations() -> Iterator[None]:
    """Within the block, drop transformers' ``FutureWarning`` on its deprecated ``gradient_checkpointing*`` names
    (raised when PEFT or TRL call them); every other warning shows as before."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=LIBRARY_DEPRECATION, category=FutureWarning)
        yield
