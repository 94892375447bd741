"""CTB: Continuous Task Batching on rollout ranks (paper Sec. 4)."""
