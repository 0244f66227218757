"""Running one user-pattern row (:mod:`tfdp_bench.patterns`): train it under a strategy, compare
with the single-device reference (max |dw|, metric values) and check that every replica's copy of
every model and optimizer variable is bitwise identical.

Importing this module does not import TensorFlow or Keras.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time

import numpy as np

from tfdp_bench.pattern_base import Row, RowResult, Trained, format_error


# --- running a row -------------------------------------------------------------------------------

def max_diff(ws_a, ws_b) -> float:
    """max |a - b| over matching arrays (float64); nan if any difference is nan."""
    if len(ws_a) != len(ws_b):
        raise ValueError(f"{len(ws_a)} weights vs {len(ws_b)} in the reference")
    out = 0.0
    for a, b in zip(ws_a, ws_b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            raise ValueError(f"weight of shape {a.shape} vs {b.shape} in the reference")
        if a.size == 0:
            continue
        d = float(np.max(np.abs(a - b)))
        if math.isnan(d):
            return float("nan")
        out = max(out, d)
    return out


def _max_rel_diff(values, ref_values) -> float:
    out = 0.0
    for k, ref in ref_values.items():
        if k not in values:
            return float("inf")
        a, b = np.asarray(values[k], np.float64), np.asarray(ref, np.float64)
        if a.shape != b.shape:
            return float("inf")
        d = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-6)))
        if math.isnan(d):
            return float("nan")
        out = max(out, d)
    return out


def replica_variables(trained: Trained) -> list:
    """Every variable of the model and of its optimizers (each once)."""
    out, seen = [], set()
    for v in list(trained.model.variables) + [v for o in trained.optimizers if o is not None
                                               for v in o.variables]:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def differing_replica_copies(strategy, trained: Trained) -> list[str]:
    """Names of variables whose replica copies are not all bitwise identical."""
    bad = []
    for v in replica_variables(trained):
        copies = [np.asarray(c) for c in
                  strategy.experimental_local_results(getattr(v, "value", v))]
        first = copies[0]
        if any(c.shape != first.shape or c.tobytes() != first.tobytes() for c in copies[1:]):
            bad.append(getattr(v, "path", None) or v.name)
    return bad


def digest(weights) -> str:
    h = hashlib.sha256()
    for w in weights:
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


def reference(row: Row) -> Trained:
    """The single-device run (no strategy, no scope)."""
    return row.train(None)


def once_per_job(name: str, compute, rank: int, directory: str, timeout: float = 600.0):
    """``compute()`` (a list of numpy arrays and a JSON-able dict) run once in a job of several
    processes, not once in each: rank 0 runs it and writes the result under ``directory`` (atomic
    renames, no pickle); every other rank waits up to ``timeout`` seconds for it and reads it.
    For one-device references in a multi-worker test: rank 0 computes one before the strategy
    run that needs every rank, so the others wait at most as long as they would at that run's
    first collective, and their CPU goes to the rest of the suite."""
    base = os.path.join(directory, name)
    if rank == 0:
        arrays, info = compute()
        os.makedirs(directory, exist_ok=True)
        with open(base + ".npz.part", "wb") as f:
            np.savez(f, *[np.asarray(a) for a in arrays])
        with open(base + ".json.part", "w", encoding="utf-8") as f:
            json.dump(info, f)
        os.replace(base + ".npz.part", base + ".npz")
        os.replace(base + ".json.part", base + ".json")  # (last: the sign that both are there)
        return arrays, info
    deadline = time.monotonic() + timeout
    while not os.path.exists(base + ".json"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 wrote no {base}.json within {timeout:.0f} s")
        time.sleep(0.05)
    with np.load(base + ".npz", allow_pickle=False) as z:
        arrays = [z[f"arr_{i}"] for i in range(len(z.files))]
    with open(base + ".json", encoding="utf-8") as f:
        return arrays, json.load(f)


def reference_once_per_job(row: Row, rank: int, directory: str) -> Trained:
    """:func:`reference` computed once in a multi-worker job (:func:`once_per_job`): every rank
    compares with rank 0's one-device run. The result holds the reference's weights, values and
    checks (what :func:`run_row` compares), not its model or optimizers."""
    def compute():
        ref = reference(row)
        values = {k: np.asarray(v, np.float64).tolist() for k, v in ref.values.items()}
        return ref.weights, {"values": values,
                             "checks": {k: bool(v) for k, v in ref.checks.items()}}
    weights, info = once_per_job(f"reference-{row.name}", compute, rank, directory)
    return Trained(None, weights, [], values=info["values"], checks=info["checks"])


def run_row(row: Row, strategy_factory, ref: Trained | None = None) -> RowResult:
    """Train ``row`` under ``strategy_factory()`` and compare with the no-strategy reference.

    ``strategy_factory`` returns a fresh strategy (or None: the row runs without one and is
    compared with its reference, a determinism check). ``ref`` (from :func:`reference`) is
    computed when not given. Errors raised by the strategy run (strategy creation included) are
    reported in ``error``; errors of the reference run propagate.
    """
    if ref is None:
        ref = reference(row)
    res = RowResult(row.name, per_replica=row.per_replica, tol=row.tol)
    t0 = time.perf_counter()
    try:
        strategy = strategy_factory() if strategy_factory is not None else None
        trained = row.train(strategy)
    except Exception as e:  # noqa: BLE001 - the point is to report it
        import traceback
        res.error = format_error(e)
        res.traceback = traceback.format_exc()
        res.seconds = time.perf_counter() - t0
        return res
    res.seconds = time.perf_counter() - t0
    try:
        res.max_dw = max_diff(trained.weights, ref.weights)
    except ValueError as e:
        res.error = f"weights do not match the reference: {e}"
        return res
    res.weights_sha256 = digest(trained.weights)
    if ref.values:
        res.max_dvalue = _max_rel_diff(trained.values, ref.values)
    res.failed_checks = [name for name, ok in trained.checks.items() if not ok]
    if strategy is not None:
        res.not_identical = differing_replica_copies(strategy, trained)
        res.identical = not res.not_identical
    return res
