"""The algorithm: block kernels, block masks and block-sparse patterns, process groups, rank agreement,
all-to-all, SP loss, the runtime, chunked attention with its nested backward, projections, cached attention
for generate, and the autotuner."""
