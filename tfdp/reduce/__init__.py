"""Cross-device reduction: algorithms, fusion buckets, compression codecs."""

from tfdp.reduce.local import DataParallelReduce
from tfdp.reduce.packing import DEFAULT_BUCKET_BYTES
from tfdp.reduce.registry import ALGORITHMS, COMPRESSIONS, choose

__all__ = ["DataParallelReduce", "DEFAULT_BUCKET_BYTES", "ALGORITHMS", "COMPRESSIONS", "choose"]
