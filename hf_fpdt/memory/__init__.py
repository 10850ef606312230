"""Memory tiers: host store and device budget, memory probes, replay of recomputed pieces, checkpointing,
tiling and the planner. Sits below ``attention/`` (the attention pipeline uses the tiers); never imports it."""
