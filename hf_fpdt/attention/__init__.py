"""The attention pipeline: block kernels per backend and the dtypes they compute in, block masks and block-sparse
patterns, the runtime each model's attention runs with (settings, host store, CPU threads), chunked attention
with its nested backward, the projections fused into it, cached attention for generate, and the autotuner that
measures it. Sits above ``distributed/`` (the chunks' all-to-all) and ``memory/``."""
