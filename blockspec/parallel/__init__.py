"""Tensor parallelism: shard the target across ranks (torch.distributed) and drive the ranks in lockstep."""

from blockspec.parallel.tp import TPLLM, check_shardable, shard_model

__all__ = ["TPLLM", "check_shardable", "shard_model"]
