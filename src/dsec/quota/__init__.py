"""Elastic memory quotas: a pure planner that grows, clamps and reclaims per-worker grants in a pool."""

from dsec.quota.elastic import PoolMemory, QuotaConfig, QuotaPlan, WorkerMemory, plan

__all__ = ["PoolMemory", "QuotaConfig", "QuotaPlan", "WorkerMemory", "plan"]
