"""The user-pattern matrix: Keras training patterns as users write them, one row each.

Every row trains a tiny model (seconds on a CPU) on deterministic data with a fixed seed, once
without a strategy (the single-device reference) and once under a strategy; :func:`run_row`
reports the largest weight difference from the reference (``max |dw|``), whether every replica's
copy of every model and optimizer variable is bitwise identical, and any crash as
``"crashes: <ExceptionType>: <first line>"``.

The same rows drive ``tests/test_user_patterns.py`` (tfdp must be exact on every row: max |dw| <=
1e-5 and identical copies) and ``tfdp bench patterns`` (the table tfdp vs
``tf.distribute.MirroredStrategy``).

Data: 210 examples in global batches of 50 split unevenly over 4 replicas (13,13,13,11 and a last
batch of 10: 3,3,3,1); "even" rows use 200 in batches of 40 (10 per replica); "last batch 1" rows
use 201 in batches of 50 (the last global batch of 1 leaves 3 of 4 replicas empty).

Rows marked ``per_replica`` (plain BatchNormalization in training mode) legitimately differ from
one device, which normalises with the statistics of the whole batch: only replica identity (and
finiteness) is checked for them.

Importing this module does not import TensorFlow or Keras (each row imports them when it runs), so
``tfdp bench patterns --list`` is instant and the CPU can still be split into logical devices.
"""

from __future__ import annotations

import dataclasses
import time

# (re-exported: the rows' vocabulary, the registry and the row runner, as the tests import them)
from tfdp_bench.pattern_base import (  # noqa: F401
    B_EVEN, B_TINY_LAST, B_UNEVEN, EPOCHS, N_EVEN, N_TINY_LAST, N_UNEVEN, TOL, VALUE_RTOL, Row,
    RowResult, Trained, fmt, format_error)
from tfdp_bench.pattern_rows import (  # noqa: F401
    MULTIWORKER_ROWS, ROWS, ROWS_BY_NAME, get_row)
from tfdp_bench.pattern_run import (  # noqa: F401
    differing_replica_copies, digest, max_diff, once_per_job, reference, replica_variables, run_row,
    reference_once_per_job)


# --- the benchmark (tfdp bench patterns) ----------------------------------------------------------

def run_patterns(rows: list[Row], devices: list[str], progress: bool = True,
                 zero_stage: int = 0) -> dict:
    """Every row without a strategy, under MirroredStrategy and under tfdp, on ``devices``
    (tfdp with ``zero_stage``: sharded optimizer state, ``tfdp.zero``)."""
    import tensorflow as tf

    from tfdp_bench import _common
    from tfdp.strategy import DataParallelStrategy
    contenders = {
        # ReductionToOneDevice: MirroredStrategy's CPU default (CollectiveAllReduce) reuses
        # group keys across instances in one process, and a clash aborts every collective of
        # the process (tfdp's too); the reducer does not change MirroredStrategy's semantics.
        "mirrored": lambda: tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()),
        "tfdp": lambda: DataParallelStrategy(devices, zero_stage=zero_stage),
    }
    results = []
    t_all = time.perf_counter()
    for i, row in enumerate(rows, 1):
        t0 = time.perf_counter()
        entry = {"row": row.name, "description": row.description,
                 "per_replica": row.per_replica}
        try:
            ref = reference(row)
        except Exception as e:  # noqa: BLE001
            entry["reference_error"] = format_error(e)
            results.append(entry)
            _common.progress(f"[{i}/{len(rows)}] {row.name}: reference {entry['reference_error']}",
                             progress)
            continue
        for key, factory in contenders.items():
            entry[key] = dataclasses.asdict(run_row(row, factory, ref))
        results.append(entry)
        ms, dp = entry["mirrored"], entry["tfdp"]
        _common.progress(f"[{i}/{len(rows)}] {row.name} ({time.perf_counter() - t0:.1f} s): "
                         f"MirroredStrategy {_cell_dw(ms)}; tfdp {_cell_dw(dp)}, "
                         f"identical {_cell_identical(dp)}", progress)
    return {"benchmark": "patterns", "devices": list(devices), "tolerance": TOL,
            "zero_stage": zero_stage, "rows": results, "seconds": time.perf_counter() - t_all,
            "environment": _common.environment()}


def _cell_dw(r: dict) -> str:
    if r.get("error"):
        return r["error"]
    s = fmt(r["max_dw"])
    if r.get("max_dvalue") is not None:
        s += f" (values {fmt(r['max_dvalue'])})"
    if r.get("failed_checks"):
        s += "; " + "; ".join(f"FAILED: {c}" for c in r["failed_checks"])
    return s


def _cell_identical(r: dict) -> str:
    if r.get("error") or r.get("identical") is None:
        return "-"
    if r["identical"]:
        return "yes"
    return f"no ({len(r['not_identical'])} vars)"


def _md(text: str) -> str:
    return str(text).replace("|", "\\|")


def format_patterns(result: dict) -> str:
    """A markdown table: row | MirroredStrategy max|dw| | tfdp max|dw| | tfdp identical | ok."""
    n = len(result["devices"])
    loose = ", ".join(f"{e['row']} <= {e['tfdp']['tol']:g}" for e in result["rows"]
                      if "tfdp" in e and e["tfdp"]["tol"] != TOL)
    stage = result.get("zero_stage") or 0
    lines = [f"User-pattern matrix on {n} CPU replicas: max |dw| vs one device without a "
             f"strategy (exact: <= {TOL:g}{'; ' + loose if loose else ''})"
             + (f"; tfdp with zero_stage={stage}." if stage else "."), "",
             "| row | MirroredStrategy max\\|dw\\| | tfdp max\\|dw\\| | tfdp replicas identical "
             "| tfdp exact |",
             "|---|---|---|---|---|"]
    n_ok = 0
    for e in result["rows"]:
        name = e["row"] + (" (per-replica semantics)" if e["per_replica"] else "")
        if "reference_error" in e:
            lines.append(f"| {_md(name)} | reference {_md(e['reference_error'])} | - | - | - |")
            continue
        dp = e["tfdp"]
        ok = RowResult(**dp).exact
        n_ok += ok
        lines.append(f"| {_md(name)} | {_md(_cell_dw(e['mirrored']))} | {_md(_cell_dw(dp))} | "
                     f"{_cell_identical(dp)} | {'yes' if ok else '**no**'} |")
    lines += ["", f"tfdp exact on {n_ok}/{len(result['rows'])} rows "
                  f"({result['seconds']:.0f} s)."]
    if result.get("command"):
        lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines)


__all__ = ["MULTIWORKER_ROWS", "ROWS", "ROWS_BY_NAME", "Row", "RowResult", "TOL", "Trained",
           "format_patterns", "get_row", "once_per_job", "reference", "run_patterns", "run_row",
           "reference_once_per_job"]


# --- command line: tfdp bench patterns -----------------------------------------------------------

def build_parser():
    from tfdp_bench.parser import BenchParser, add_common_options
    p = BenchParser("tfdp bench patterns",
                    usage="tfdp bench patterns [--rows NAME,...] [--list] [--cpu-replicas K] "
                          "[--zero-stage S] [--json FILE] [--quiet]",
                    description="The user-pattern matrix (tfdp_bench.patterns, also run by "
                                "tests/test_user_patterns.py): every row trains a tiny Keras "
                                "model as a user writes it, without a strategy (the one-device "
                                "reference), under tf.distribute.MirroredStrategy and under tfdp "
                                "DataParallelStrategy on the same K CPU replicas, and prints a "
                                "markdown table: max |dw| vs the reference (or 'crashes: ...') "
                                "and whether tfdp's replica copies of every variable are bitwise "
                                "identical.",
                    epilog="tfdp promises max |dw| <= 1e-5 on every row; rows marked "
                           "per-replica semantics (plain BatchNormalization) only promise "
                           "identical copies.")
    add_common_options(p)
    p.add_argument("--rows", metavar="NAME,...",
                   help="run only these rows (default: all; --list shows them)")
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2), default=0, metavar="S",
                   help="tfdp's zero_stage (sharded optimizer state; default 0)")
    return p


def parse_args(argv):
    from tfdp_bench.parser import check_positive, check_writable, split_list
    from tfdp.errors import UsageError
    args = build_parser().parse_args(argv)
    if args.list:
        return args
    check_positive("--cpu-replicas", args.cpu_replicas)
    if args.rows is None:
        args.rows = [r.name for r in ROWS]
    else:
        names = split_list(args.rows)
        bad = [n for n in names if n not in ROWS_BY_NAME]
        if bad or not names:
            raise UsageError(f"Invalid --rows. Received: --rows {args.rows}. Valid: "
                             f"{', '.join(ROWS_BY_NAME)} (comma-separated; see --list).")
        args.rows = list(dict.fromkeys(names))
    check_writable("--json", args.json)
    return args


def command_line(args) -> str:
    """The ``tfdp bench patterns`` command that gives this table (the page that shows the table
    shows it, with the time it took)."""
    words = ["tfdp", "bench", "patterns"]
    if args.rows != [r.name for r in ROWS]:
        words += ["--rows", ",".join(args.rows)]
    if args.cpu_replicas != 4:
        words += ["--cpu-replicas", str(args.cpu_replicas)]
    if args.zero_stage:
        words += ["--zero-stage", str(args.zero_stage)]
    return " ".join(words)


def run(args) -> int:
    from tfdp_bench import _common
    from tfdp_bench.parser import write_json
    if args.list:
        width = max(len(r.name) for r in ROWS)
        for r in ROWS:
            print(f"{r.name.ljust(width)}  {r.description}")
        return 0
    devices = _common.configure_replicas(args.cpu_replicas)  # before the TF runtime starts
    result = run_patterns([ROWS_BY_NAME[n] for n in args.rows], devices, progress=not args.quiet,
                          zero_stage=args.zero_stage)
    result["command"] = command_line(args)
    print(format_patterns(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":  # python -m tfdp_bench.patterns
    import sys

    from tfdp_bench.parser import run_standalone
    sys.exit(run_standalone("patterns", parse_args, run))
