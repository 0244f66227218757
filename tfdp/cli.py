"""The ``tfdp`` command line (also ``python -m tfdp``).

Each subcommand lives in its own module exposing ``main(argv: list[str]) -> int``; this file only
dispatches and turns tfdp errors into one clear line (exit code 2 for usage errors).
"""

from __future__ import annotations

import importlib
import sys

from tfdp.errors import TfdpError, UsageError

# name -> (module, one-line help)
SUBCOMMANDS = {
    "train": ("tfdp.train.cli", "train from a TOML config (configs/*.toml): fit, summary, targets"),
    "launch": ("tfdp.launch.cli", "start workers with TF_CONFIG (one node or several) and run CMD"),
    "bench": ("tfdp.bench.cli", "benchmarks: tfdp vs tf.distribute.MirroredStrategy, side by side"),
}

USAGE = ("usage: tfdp [-h] [-V] {" + ",".join(SUBCOMMANDS) + "} [args...]   "
         "(tfdp COMMAND --help for details)")

# The wording every subcommand uses for its shared options (tfdp train, tfdp launch).
HELP_HELP = "show this help and exit"
VERBOSE_HELP = ("show TensorFlow's C++ INFO/WARNING log lines (hidden by default unless "
                "TF_CPP_MIN_LOG_LEVEL is set)")

EPILOG = """\
exit codes: 0 success; 1 error; 2 usage error (bad command line, config or environment variable);
a command may add its own (tfdp COMMAND --help)."""


def _help() -> str:
    lines = [USAGE, "", "commands:"]
    for name, (_, text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<8} {text}")
    lines += ["", "options:", f"  -h, --help     {HELP_HELP}",
              "  -V, --version  show tfdp's version and exit", "", EPILOG]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_help())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from tfdp._version import __version__
        print(f"tfdp {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"tfdp: error: Unknown command. Received: {name!r}. "
              f"Valid: {', '.join(SUBCOMMANDS)}.", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except UsageError as e:
        print(f"tfdp {name}: error: {e}", file=sys.stderr)
        return 2
    except TfdpError as e:
        print(f"tfdp {name}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"tfdp {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
