"""The ``tfdp`` command line (also ``python -m tfdp``).

Each subcommand lives in its own module exposing ``main(argv: list[str]) -> int``; this file only
dispatches and turns tfdp errors into one clear line (exit code 2 for usage errors).

Commands of other packages plug in through the ``tfdp.commands`` entry-point group: the name is the
command, the value a module with ``main(argv)`` and a one-line ``HELP`` (``tfdp bench`` is
``tfdp_bench.cli``, registered by setup.py). The library itself imports none of them: a plug-in
module is loaded only to run it or to print ``tfdp --help``.
"""

from __future__ import annotations

import importlib
import sys

from tfdp.errors import TfdpError, UsageError

# name -> (module, one-line help): tfdp's own commands
SUBCOMMANDS = {
    "train": ("tfdp.train.cli", "train from a TOML config (configs/*.toml): fit, summary, targets"),
    "launch": ("tfdp.launch.cli", "start workers with TF_CONFIG (one node or several) and run CMD"),
}

# The entry-point group other packages register commands in (setup.py: bench = tfdp_bench.cli).
COMMANDS_GROUP = "tfdp.commands"


def plugin_commands() -> dict:
    """{name: entry point} of the ``tfdp.commands`` group (installed packages; none loaded)."""
    from importlib.metadata import entry_points
    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)
            if ep.name not in SUBCOMMANDS}


def _commands() -> dict:
    """{name: (module name, help or None)}: tfdp's own commands, then the plug-ins, sorted."""
    out = dict(SUBCOMMANDS)
    for name, ep in sorted(plugin_commands().items()):
        out[name] = (ep.value, None)
    return out


def _usage(commands) -> str:
    return ("usage: tfdp [-h] [-V] {" + ",".join(commands) + "} [args...]   "
            "(tfdp COMMAND --help for details)")

# The wording every subcommand uses for its shared options (tfdp train, tfdp launch).
HELP_HELP = "show this help and exit"
VERBOSE_HELP = ("show TensorFlow's C++ INFO/WARNING log lines (hidden by default unless "
                "TF_CPP_MIN_LOG_LEVEL is set)")

EPILOG = """\
exit codes: 0 success; 1 error; 2 usage error (bad command line, config or environment variable);
a command may add its own (tfdp COMMAND --help)."""


def _help() -> str:
    commands = _commands()
    lines = [_usage(commands), "", "commands:"]
    for name, (module, text) in commands.items():
        if text is None:  # a plug-in's one line (its module imports no TensorFlow)
            text = getattr(importlib.import_module(module), "HELP", "")
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
    commands = _commands()
    if name not in commands:
        print(f"tfdp: error: Unknown command. Received: {name!r}. "
              f"Valid: {', '.join(commands)}.", file=sys.stderr)
        return 2
    module = importlib.import_module(commands[name][0])
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
