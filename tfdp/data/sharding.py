"""Who reads what: file sharding (each worker its own files) or data sharding (slices of batches).

* ``"files"``: worker ``w`` of ``W`` reads files ``w, w+W, w+2W, ...`` of the list. Cheapest (each
  file is read once in the whole job); needs at least as many files as workers, and workers whose
  files hold different numbers of examples run different numbers of steps.
* ``"data"``: every worker reads the same stream in the same order and keeps its replicas' slices
  of each global batch. Exact global batches and the same number of steps everywhere, at the
  price of every worker reading (not parsing: parsing happens after the split) everything.
* ``"off"``: the input is already this worker's own (e.g. the script sharded it by rank).
* ``"auto"``: ``"files"`` for a file list with at least as many files as workers, else ``"data"``.
"""

from __future__ import annotations

import logging
import os

import tensorflow as tf

from tfdp.data._context import check_input_context
from tfdp.errors import TfdpError, invalid_argument

log = logging.getLogger("tfdp")

SHARD_MODES = ("auto", "data", "files", "off")


def check_shard(shard) -> str:
    if shard not in SHARD_MODES:
        raise invalid_argument("shard", shard, valid=SHARD_MODES)
    return shard


def check_files(files, *, check_exist: bool = True) -> list[str]:
    """Validate a file list: a non-empty list of paths that exist and are not all empty."""
    if isinstance(files, (str, bytes, os.PathLike)) or not isinstance(files, (list, tuple)):
        raise invalid_argument(
            "files", files,
            fix="Pass a list of file paths, e.g. sorted(tf.io.gfile.glob('data/*.tfrecord')).")
    paths = []
    for f in files:
        if not isinstance(f, (str, os.PathLike)):
            raise invalid_argument("files", files, what="Invalid files: every entry must be a path",
                                   fix=f"Entry {f!r} (of type {type(f).__name__}) is not a str.")
        paths.append(os.fspath(f))
    if not paths:
        raise TfdpError("The file list is empty. Received: files=[]. Pass at least one file "
                        "(check the glob pattern or directory that built the list).")
    if len(set(paths)) != len(paths):
        dups = sorted({p for p in paths if paths.count(p) > 1})
        raise TfdpError(f"The file list names some files twice, so their examples would be seen "
                        f"twice per epoch. Received: duplicates {dups[:5]}. Pass each file once.")
    if check_exist:
        missing = [p for p in paths if not tf.io.gfile.exists(p)]
        if missing:
            raise TfdpError(f"Some input files do not exist. Received: {len(missing)} missing of "
                            f"{len(paths)}, e.g. {missing[:3]}. Fix the paths or the glob pattern.")
        if all(tf.io.gfile.stat(p).length == 0 for p in paths):
            raise TfdpError(f"The dataset is empty: every input file has 0 bytes. Received: "
                            f"{len(paths)} empty file(s), e.g. {paths[:3]}. Point to files that "
                            "hold examples.")
    return paths


def shard_files(files, input_context) -> list[str]:
    """This worker's files: ``files[rank::num_workers]`` (the list order is kept).

    Raises:
      TfdpError: fewer files than workers (TF would silently give some worker nothing); the fix
        is data sharding (``shard="data"``) or more files.
    """
    paths = check_files(files, check_exist=False)
    ctx = check_input_context(input_context)
    workers = ctx.num_input_pipelines
    if len(paths) < workers:
        raise TfdpError(
            f"Cannot shard by files: there are fewer files than workers, so some worker would "
            f"get no data. Received: {len(paths)} file(s) for num_workers={workers}. Use "
            f"shard=\"data\" (every worker reads all files and keeps its slice of each global "
            f"batch), or split the data into at least {workers} files.")
    return paths[ctx.input_pipeline_id::workers]


def resolve_shard(shard: str, *, num_workers: int, num_files: int | None) -> str:
    """The concrete mode for ``shard`` ("auto" resolved) given the source and the worker count."""
    shard = check_shard(shard)
    if shard == "files" and num_files is None:
        raise TfdpError(
            "shard=\"files\" needs a list of files. Received: a tf.data.Dataset. Pass the file "
            "list itself (tfdp.data.distribute(strategy, files, ...)), or use shard=\"data\" "
            "(or \"off\" when each worker's dataset is already its own shard).")
    if shard != "auto":
        return shard
    if num_files is None:
        return "data"
    if num_files >= num_workers:
        return "files"
    log.info("tfdp.data: %d file(s) for %d workers: sharding by data (each worker reads all "
             "files and keeps its slices of each global batch)", num_files, num_workers)
    return "data"
