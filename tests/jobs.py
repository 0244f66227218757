"""Shared by test modules that check command lines, in this process (core tier).

:func:`command_in_process` runs a command's entry point as its process would (behind conftest's
``tfdp_cli`` fixture too: ``tfdp ARGS``); :func:`standalone_in_process` is ``python -m MODULE
ARGS`` through it (``runpy``). tests/conftest.py's guard fails a test whose command starts a
process. Each command keeps one test through its real entry point, as a process (e2e).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command_in_process(monkeypatch, capsys, call):
    """Run ``call()`` (a command's entry point) as its process would: in the repository root,
    without TF_CONFIG / TFDP_CPU_REPLICAS, its exit code taken from its return value or
    ``SystemExit`` (``sys.exit("message")``: the message on stderr, exit code 1).
    Returns (exit code, stdout, stderr)."""
    monkeypatch.chdir(ROOT)
    for var in ("TFDP_CPU_REPLICAS", "TF_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    capsys.readouterr()
    try:
        code = call()
    except SystemExit as e:  # argparse, or a command's sys.exit: what the process would do
        code = e.code
    out, err = capsys.readouterr()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        err, code = err + f"{code}\n", 1
    return int(code), out, err


def standalone_in_process(monkeypatch, capsys, module, *args):
    """``python -m MODULE ARGS`` in this process (``runpy``, as ``-m`` runs it: the module's
    ``__main__`` block), through :func:`command_in_process`: (exit code, stdout, stderr)."""
    import runpy
    import warnings
    monkeypatch.setattr(sys, "argv", [module, *args])

    def call():
        with warnings.catch_warnings():  # (runpy: "found in sys.modules", it was imported)
            warnings.simplefilter("ignore", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)

    return command_in_process(monkeypatch, capsys, call)
