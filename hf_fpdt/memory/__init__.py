"""Memory tiers: host store and device budget, the host pool (pinned memory as the allocator takes it) and the
device staging ring, memory probes, replay of recomputed pieces, checkpointing, tiling and the planner. Sits below
``attention/`` (the attention pipeline uses the tiers); never imports it."""
