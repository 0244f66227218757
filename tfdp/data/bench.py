"""Moved: the input benchmark is :mod:`tfdp.bench.input` (``tfdp bench input``).

This alias keeps ``from tfdp.data.bench import run_input_bench`` working until its last user
(``tests/test_data.py``) imports :mod:`tfdp.bench.input`; then delete this file.
"""

from tfdp.bench.input import format_input_bench, run_input_bench

__all__ = ["run_input_bench", "format_input_bench"]

if __name__ == "__main__":  # python -m tfdp.data.bench, as before
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    run_input_bench()
