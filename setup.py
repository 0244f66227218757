"""tfdp: data-parallel training for TensorFlow / Keras 3.

TensorFlow flavour: the default requirement is ``tensorflow-cpu``. On a machine with NVIDIA GPUs
install the CUDA build instead, *before* tfdp, so pip does not pull the CPU wheel::

    pip install "tensorflow[and-cuda]==2.21.*" && pip install -e . --no-deps && pip install -e .

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
TF_REQ = "tensorflow-cpu==2.21.*" if _tf_flavour == "cpu" else "tensorflow[and-cuda]==2.21.*"

setup(
    name="tfdp",
    version=VERSION,
    description="Fast, correct data-parallel training for TensorFlow / Keras 3",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["tfdp", "tfdp.*"]),
    install_requires=[
        TF_REQ,
        "keras==3.15.*",
        "absl-py",
        "numpy",
        "portpicker",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "tensorflow-datasets", "scikit-learn", "matplotlib"],
        "data": ["tensorflow-datasets"],
        "examples": ["scikit-learn", "tensorflow-datasets"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["tfdp=tfdp.cli:main"]},
)
