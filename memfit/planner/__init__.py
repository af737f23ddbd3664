"""The planner: predicted per-rank peak memory and relative step time of every plan, without the GPU."""
