"""Data side of the pipeline: the chunk plan and the one integer chunk size, the rank-ordinal layout, the SP
collator and the demo data sets. Imports only ``config`` and ``models``."""
