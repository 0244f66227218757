"""The one argument parser of ``tfdp bench`` and the checks every command shares.

Every command module of :mod:`tfdp_bench` (``allreduce``, ``fit``, ``patterns``, ``workers``,
``input``, ``sparse``, ``scaling``, ``gpu``) exposes the same three functions, which
:mod:`tfdp_bench.cli` dispatches to:

* ``build_parser() -> BenchParser``: its options (``--help`` is argparse's own);
* ``parse_args(argv) -> argparse.Namespace``: parses and validates, raising :class:`UsageError`
  (one line, exit code 2) before TensorFlow starts;
* ``run(args) -> int``: runs the benchmark and prints its table.

This module imports no other module of :mod:`tfdp_bench` and never imports TensorFlow.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tfdp.errors import TfdpError, UsageError
from tfdp.reduce.registry import ALGORITHMS


class BenchParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one-line :class:`UsageError` s naming the help to read.

    ``prog`` is the full command (``"tfdp bench fit"``); abbreviations of options are refused.
    """

    def __init__(self, prog: str, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(prog=prog, **kwargs)

    def error(self, message):
        raise UsageError(f"{message[:1].upper()}{message[1:]}. "
                         f"Run '{self.prog} --help' for usage.")


def add_common_options(p: BenchParser, cpu_replicas: int | None = 4) -> None:
    """``--cpu-replicas K``, ``--json FILE`` and ``--quiet``, as every in-process bench has them."""
    p.add_argument("--cpu-replicas", type=int, default=cpu_replicas, metavar="K",
                   help="split the host CPU into K logical devices, one replica each "
                        "(default: 4)")
    p.add_argument("--json", metavar="FILE", help="write every raw figure to FILE as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def check_positive(option: str, value, minimum: int = 1) -> None:
    """UsageError unless ``value >= minimum`` (``option`` as typed, e.g. ``"--steps"``)."""
    if value is None or value < minimum:
        raise UsageError(f"Invalid {option}. Received: {option} {value}. "
                         f"Give an integer >= {minimum}.")


def split_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [t.strip() for t in text.split(",") if t.strip()]


def check_writable(option: str, path) -> None:
    """UsageError unless ``path`` can be created as a file (checked before anything runs)."""
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK) or os.path.isdir(path):
        raise UsageError(f"Cannot write {option} here. Received: {option} {path!r}. Give a file "
                         "path in an existing, writable directory.")


def check_directory(option: str, path) -> None:
    """UsageError unless ``path`` is a writable directory or can be created as one."""
    if not path:
        return
    full = os.path.abspath(path)
    if os.path.exists(full):
        ok = os.path.isdir(full) and os.access(full, os.W_OK)
    else:
        parent = os.path.dirname(full)
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        ok = os.path.isdir(parent) and os.access(parent, os.W_OK)
    if not ok:
        raise UsageError(f"Cannot write {option} here. Received: {option} {path!r}. Give a "
                         "directory that exists and is writable, or can be created.")


def write_json(path: str, result: dict, option: str = "--json") -> None:
    """Write ``result`` as indented JSON; a TfdpError naming the option if that fails."""
    try:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    except OSError as e:
        raise TfdpError(f"Cannot write the JSON file. Received: {option} {path!r} "
                        f"({e.strerror}). Give a writable path.") from None


def quiet_tensorflow() -> None:
    """Hide TensorFlow's C++ INFO/WARNING lines (``tfdp.logs``), only before TF starts."""
    if "tensorflow" not in sys.modules:
        from tfdp.logs import quiet_tensorflow as quiet
        quiet()


def all_reduce_names() -> tuple[str, ...]:
    """DataParallelStrategy's ``all_reduce`` names: ``tfdp.reduce.registry.ALGORITHMS``'s keys
    (importing the registry starts no TensorFlow, so usage errors stay fast and quiet)."""
    return tuple(ALGORITHMS)


__all__ = ["BenchParser", "add_common_options", "check_positive", "split_list",
           "check_writable", "check_directory", "write_json", "quiet_tensorflow",
           "all_reduce_names"]


def run_standalone(command: str, parse_args, run, argv=None) -> int:
    """``python -m tfdp_bench.COMMAND``: parse, run; errors as one line on stderr, no traceback.

    Usage errors exit 2, other tfdp errors 1 (as ``tfdp bench COMMAND`` does through
    ``tfdp.cli``, whose prefix is ``tfdp bench: error:``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        quiet_tensorflow()
        return int(run(parse_args(argv)) or 0)
    except UsageError as e:
        print(f"tfdp bench {command}: error: {e}", file=sys.stderr)
        return 2
    except TfdpError as e:
        print(f"tfdp bench {command}: error: {e}", file=sys.stderr)
        return 1


__all__.append("run_standalone")
