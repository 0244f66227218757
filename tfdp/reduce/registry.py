"""Algorithm names -> implementations, and the "auto" choice (pure logic, unit-tested with fakes)."""

from __future__ import annotations

from dataclasses import dataclass

from tfdp.errors import invalid_argument

# name -> one-line description (the order is the order errors list them in)
ALGORITHMS = {
    "auto": "NCCL when every device is a physical GPU and TF's NCCL kernel exists, else 'fused'",
    "fused": "bucketed reduction: small tensors packed, pairwise tree of adds spread over devices",
    "ring": "bucketed reduce-scatter + all-gather: each device sums 1/N of every bucket",
    "one_device": "bucketed reduction summed on the first device, then broadcast",
    "nccl": "TF's NCCL all-reduce on each bucket (GPUs only)",
}
COMPRESSIONS = (None, "none", "fp16", "bf16")


@dataclass(frozen=True)
class Choice:
    algorithm: str
    reason: str


def validate_algorithm(name) -> str:
    if not isinstance(name, str) or name.lower() not in ALGORITHMS:
        raise invalid_argument("all_reduce", name, valid=list(ALGORITHMS))
    return name.lower()


def validate_compression(name):
    if name is not None and (not isinstance(name, str) or name.lower() not in COMPRESSIONS[1:]):
        raise invalid_argument("compression", name, valid=list(COMPRESSIONS))
    if name is None or name.lower() == "none":
        return None
    return name.lower()


def validate_bucket_bytes(value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid_argument("bucket_bytes", value, fix="Pass a non-negative int (bytes per "
                               "fused bucket; 0 turns fusion off) or None for the measured "
                               "default.")
    return value


def choose(requested: str, devices: list[str], *, physical_gpus: int,
           nccl_kernel: bool) -> Choice:
    """Pick the local reduction algorithm.

    Args:
      requested: a validated name from ALGORITHMS.
      devices: the strategy's canonical device strings.
      physical_gpus: how many physical GPUs this process sees.
      nccl_kernel: whether TF's NCCL all-reduce kernel is registered.
    """
    from tfdp.devices import is_gpu, short_name
    gpu_devices = [d for d in devices if is_gpu(d)]
    all_gpu = len(gpu_devices) == len(devices)
    distinct_physical = all_gpu and len(devices) <= physical_gpus
    nccl_ok = all_gpu and distinct_physical and nccl_kernel
    why_not = (
        "not every device is a GPU" if not all_gpu else
        f"{len(devices)} replicas share {physical_gpus} physical GPU(s)" if not distinct_physical
        else "this TensorFlow build has no NCCL kernel")
    if requested == "auto":
        if nccl_ok and len(devices) > 1:
            return Choice("nccl", f"all {len(devices)} devices are physical GPUs with NCCL")
        return Choice("fused", f"NCCL not usable ({why_not})" if len(devices) > 1
                      else "one device: nothing to communicate")
    if requested == "nccl" and not nccl_ok:
        raise invalid_argument(
            "all_reduce", requested, what=f"all_reduce='nccl' cannot run here: {why_not}",
            fix="Use all_reduce='auto' (or 'fused'/'ring') on these devices: "
                f"{[short_name(d) for d in devices]}.")
    return Choice(requested, "requested")
