"""Where hf_fpdt's own lines go: the ``hf_fpdt`` logger, shown by default once the plugin is set up.

The step's plan (:mod:`.step_plan`: segments, replay, bytes per tier, budgets) and the resolved ``auto``
values (chunk size) are logged at INFO, which Python hides unless a program configures logging.
:func:`show_info` gives the logger a stderr handler that shows them on the main process (warnings on every
process), unless the program configured logging itself (a handler or level on ``hf_fpdt``, or a root handler):
then its configuration decides.
"""

from __future__ import annotations

import logging

LOGGER = "hf_fpdt"


class _MainProcessInfo(logging.Filter):
    """INFO and below on the main process only; warnings and errors on every process."""

    def __init__(self, main_process: bool) -> None:
        super().__init__()
        self.main_process = main_process

    def filter(self, record: logging.LogRecord) -> bool:
        return self.main_process or record.levelno >= logging.WARNING


def show_info(main_process: bool) -> None:
    """Show hf_fpdt's INFO lines on stderr (main process), unless logging is configured already (idempotent)."""
    logger = logging.getLogger(LOGGER)
    if logger.handlers or logger.level != logging.NOTSET or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_MainProcessInfo(main_process))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
