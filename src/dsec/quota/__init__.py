"""Elastic memory quotas: a pure planner that grows, clamps and reclaims per-worker grants in a pool."""

from dsec.quota.elastic import PoolMemory, QuotaConfig, QuotaPlan, WorkerMemory, plan
from dsec.quota.trend import MemoryTrend

__all__ = ["MemoryTrend", "PoolMemory", "QuotaConfig", "QuotaPlan", "WorkerMemory", "plan"]
