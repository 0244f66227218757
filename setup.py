"""tfdp: data-parallel training for TensorFlow / Keras 3.

TensorFlow flavour: the default requirement is ``tensorflow-cpu``. On a machine with NVIDIA GPUs
install the CUDA build instead, *before* tfdp, so pip does not pull the CPU wheel::

    pip install "tensorflow[and-cuda]>=2.19,<2.23" && pip install -e . --no-deps && pip install -e .

or simply ``TFDP_TF_PACKAGE=gpu pip install -e .`` which makes this setup.py require
``tensorflow[and-cuda]`` instead of ``tensorflow-cpu``.
"""

import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "tfdp", "_version.py"), encoding="utf-8") as f:
    VERSION = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)

_tf_flavour = os.environ.get("TFDP_TF_PACKAGE", "cpu").strip().lower()
if _tf_flavour not in ("cpu", "gpu"):
    raise SystemExit(
        f"Invalid TFDP_TF_PACKAGE. Received: TFDP_TF_PACKAGE={_tf_flavour!r}. "
        "Valid: 'cpu' (tensorflow-cpu) or 'gpu' (tensorflow[and-cuda]).")
# Supported releases (tests/test_versions.py checks .ci/run tests both ends of each range).
# TensorFlow 2.19, 2.20, 2.21: the whole suite runs on the newest, the compatibility subset
# (.ci/compat_subset.txt) on the others. Keras from 3.12, as TF 2.21 itself requires (TF 2.19
# accepts keras>=3.5, TF 2.20 keras>=3.10): before 3.10 Keras creates metric variables
# sync-on-write (MirroredVariables that all-reduce every metric update), which breaks tfdp's
# metrics and accumulation; with 3.10 and 3.11, compile(jit_compile=True) on several CPU replicas
# fails (a replica's XLA step reads another replica's variable).
TF_RANGE = ">=2.19,<2.23"
KERAS_RANGE = ">=3.12,<3.17"
TF_REQ = ("tensorflow-cpu" if _tf_flavour == "cpu" else "tensorflow[and-cuda]") + TF_RANGE
# ml_dtypes (TensorFlow's own requirement, >=0.5.1,<1.0 on every supported TF) except 0.7.0:
# `import ml_dtypes` 0.7.0 takes 0.7-1.2 CPU-seconds (numpy's ufunc loop registration, quadratic
# in the loops it adds) against 0.01 with 0.6.0 and 0.5.4, in every process that imports
# TensorFlow (docs/install.md: Install).
ML_DTYPES_REQ = "ml_dtypes!=0.7.0"

# The documentation site (mkdocs.yml): MkDocs + Material + mkdocstrings, pinned so that
# `mkdocs build --strict` (tests/test_docs.py, in the test extra) sees the same warnings everywhere.
DOCS_REQ = ["mkdocs==1.6.1", "mkdocs-material==9.8.1", "mkdocstrings[python]==1.0.8",
            "mkdocstrings-python==2.0.11", "black==26.10.1"]  # (black: API signatures formatted)

setup(
    name="tfdp",
    version=VERSION,
    description="Fast, correct data-parallel training for TensorFlow / Keras 3",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # tfdp: the library. tfdp_bench: the benchmarks and the pattern / fault harnesses behind
    # `tfdp bench` (it imports tfdp; tfdp never imports it: it is found through the entry point
    # below), installed alongside so that `tfdp bench ...` works from any install.
    packages=find_packages(include=["tfdp", "tfdp.*", "tfdp_bench", "tfdp_bench.*"]),
    install_requires=[
        TF_REQ,
        "keras" + KERAS_RANGE,
        ML_DTYPES_REQ,
        "absl-py",
        "numpy",
        "portpicker",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "tensorflow-datasets",
                 "scikit-learn", "matplotlib", "pyyaml"] + DOCS_REQ,
        "docs": DOCS_REQ,
        "data": ["tensorflow-datasets"],
        "examples": ["scikit-learn", "tensorflow-datasets"],
        "bench": ["matplotlib"],
        # Ray Train integration (tfdp.ray, tests/test_ray.py); tested with Ray 2.60.
        "ray": ["ray[default,train]>=2.60"],
    },
    entry_points={"console_scripts": ["tfdp=tfdp.cli:main"],
                  # commands of other packages for the tfdp command line (tfdp/cli.py)
                  "tfdp.commands": ["bench=tfdp_bench.cli"]},
)
