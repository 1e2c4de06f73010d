"""Tensor parallelism: shard the target across ranks (torch.distributed) and drive the ranks in lockstep."""

from blockspec.parallel.tp import RankGroup, check_shardable, shard_model

__all__ = ["RankGroup", "check_shardable", "shard_model"]
