"""tfdp's version (read by setup.py and ``tfdp --version``)."""

__version__ = "0.1.0"
