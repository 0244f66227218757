"""The keyword arguments both tfdp strategies accept, validated once at construction.

``DataParallelStrategy`` and ``MultiWorkerDataParallelStrategy`` take the same arguments: the
reduction's (``all_reduce``, ``bucket_bytes``, ``compression``, ``sparse``) and the failure
detection's (``collective_timeout``, ``heartbeat_timeout``; they take effect across workers and
are validated, then unused, in a single process). Each is resolved argument > environment
variable > default (``TFDP_SPARSE``, ``TFDP_COLLECTIVE_TIMEOUT``, ``TFDP_HEARTBEAT_TIMEOUT``).
Sharded optimizer state: ``zero_stage`` (``TFDP_ZERO_STAGE``; ``tfdp.zero``). Micro-batches:
``micro_batches`` and ``elastic_policy`` (``TFDP_ELASTIC_POLICY``, with the job's full size in
``TFDP_ELASTIC_MAX_WORKERS``, both set by ``tfdp launch``; ``tfdp.strategy.micro_batches``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tfdp import failures
from tfdp.cluster import startup
from tfdp.reduce import registry
from tfdp.reduce import sparse as sparse_lib
from tfdp.strategy import micro_batches as micro_lib
from tfdp.zero import validate_stage


@dataclass(frozen=True)
class Settings:
    all_reduce: str                  # the requested algorithm ("auto", "fused", ...)
    bucket_bytes: int | None         # None: the measured default
    compression: str | None          # None, "fp16" or "bf16"
    sparse: str                      # "auto", "gather" or "densify"
    collective_timeout: float | None  # seconds; None: off
    heartbeat_timeout: float         # seconds
    startup_timeout: float = 300.0   # seconds: peers that do not connect by then end the start-up
    zero_stage: int = 0              # 0, 1 or 2: sharded optimizer state (tfdp.zero)
    micro_batches: int | None = None  # each replica's batch in k parts per step (None: policy's)
    elastic_policy: str = "batch"    # "batch" or "accumulate" (tfdp.strategy.micro_batches)
    elastic_max_workers: int | None = None  # the job's workers at its full size (the launcher)

    @classmethod
    def from_arguments(cls, *, all_reduce="auto", bucket_bytes=None, compression=None,
                       sparse=None, collective_timeout=None, heartbeat_timeout=None,
                       startup_timeout=None, zero_stage=None, micro_batches=None,
                       elastic_policy=None):
        return cls(
            all_reduce=registry.validate_algorithm(all_reduce),
            bucket_bytes=registry.validate_bucket_bytes(bucket_bytes),
            compression=registry.validate_compression(compression),
            sparse=sparse_lib.resolve_mode(sparse),
            collective_timeout=failures.seconds_setting(
                collective_timeout, "collective_timeout", failures.COLLECTIVE_TIMEOUT_ENV, None),
            heartbeat_timeout=failures.seconds_setting(
                heartbeat_timeout, "heartbeat_timeout", failures.HEARTBEAT_TIMEOUT_ENV,
                failures.DEFAULT_HEARTBEAT_TIMEOUT, off_ok=False),
            startup_timeout=failures.seconds_setting(
                startup_timeout, "startup_timeout", startup.STARTUP_TIMEOUT_ENV,
                startup.DEFAULT_STARTUP_TIMEOUT, off_ok=False),
            zero_stage=validate_stage(zero_stage),
            micro_batches=micro_lib.validate_count(micro_batches),
            elastic_policy=micro_lib.validate_policy(elastic_policy),
            elastic_max_workers=micro_lib.max_workers_from_env())

    def micro_batches_for(self, num_workers: int) -> int:
        """How many micro-batches each replica's batch is split into in a training step, on a
        job of ``num_workers`` workers: ``micro_batches`` when given, else under the elastic
        policy "accumulate" enough that none is larger than a replica's share at the job's full
        size, else 1."""
        if self.micro_batches is not None:
            return self.micro_batches
        return micro_lib.policy_count(self.elastic_policy, self.elastic_max_workers,
                                      num_workers)


__all__ = ["Settings"]
