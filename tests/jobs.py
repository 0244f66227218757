"""Shared by test modules that check command lines: ``python -m MODULE ARGS`` in this process.

:func:`standalone_in_process` runs a module's ``__main__`` block in this process (``runpy``), for
core-tier tests of a command's usage errors (tests/conftest.py's guard fails the test if the
command starts a process); ``tfdp ARGS`` in this process is conftest's ``tfdp_cli`` fixture. Each
command keeps one test through its real entry point, as a process (e2e).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def standalone_in_process(monkeypatch, capsys, module, *args):
    """``python -m MODULE ARGS`` in this process (``runpy``, as ``-m`` runs it: the module's
    ``__main__`` block), in the repository root without TF_CONFIG / TFDP_CPU_REPLICAS:
    (exit code, stdout, stderr)."""
    import runpy
    import warnings
    monkeypatch.chdir(ROOT)
    for var in ("TFDP_CPU_REPLICAS", "TF_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", [module, *args])
    capsys.readouterr()
    code = 0
    with warnings.catch_warnings():  # (runpy: "found in sys.modules", the module was imported)
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code
    out, err = capsys.readouterr()
    return (0 if code is None else code), out, err
