"""The TensorFlow / Keras versions tfdp is tested with, and what ``import tfdp`` says outside
them: read from package metadata only (nothing is imported, so ``import tfdp`` stays free of
TensorFlow). What a release that lacks a private name does: ``tfdp.compat.names``."""

from __future__ import annotations

import logging

log = logging.getLogger("tfdp")

# Tested: the whole suite on the newest release, a compatibility subset on the others and on the
# next pre-releases (.ci/run's compat and next stages).
TESTED_TENSORFLOW = ("2.19", "2.22")   # inclusive, major.minor
TESTED_KERAS = ("3.12", "3.16")  # (the lower bound: .ci/run installs it with TF 2.19)

_TF_DISTS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tf-nightly", "tf-nightly-cpu")
_KERAS_DISTS = ("keras", "keras-nightly")


def _version(dist_names):
    from importlib import metadata
    for name in dist_names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _minor(version: str):
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def untested_versions() -> list[str]:
    """``["tensorflow 2.23.0 (tested: 2.19-2.22)", ...]`` for installed versions outside the
    tested range (package metadata only; nothing is imported)."""
    out = []
    for label, dists, (low, high) in (("tensorflow", _TF_DISTS, TESTED_TENSORFLOW),
                                      ("keras", _KERAS_DISTS, TESTED_KERAS)):
        version = _version(dists)
        minor = version and _minor(version)
        if minor and not _minor(low) <= minor <= _minor(high):
            out.append(f"{label} {version} (tested: {low}-{high})")
    return out


_warned = False


def warn_if_untested() -> None:
    """Log one warning (once per process) naming installed versions outside the tested range."""
    global _warned
    if _warned:
        return
    _warned = True
    bad = untested_versions()
    if bad:
        log.warning("tfdp: untested version(s): %s. tfdp relies on private TensorFlow/Keras "
                    "names (tfdp/compat/names.py): a missing one turns its feature off with a "
                    "warning, or refuses with one line when the feature is essential; run "
                    "`python -m pytest tests/test_compat.py` to check them, or install a tested "
                    "version.", ", ".join(bad))


def installed() -> str:
    """``tensorflow X, keras Y`` (package metadata)."""
    tf_version = _version(_TF_DISTS) or "not installed"
    keras_version = _version(_KERAS_DISTS) or "not installed"
    return f"tensorflow {tf_version}, keras {keras_version}"


def tested() -> str:
    return (f"tested: TensorFlow {TESTED_TENSORFLOW[0]}-{TESTED_TENSORFLOW[1]}, Keras "
            f"{TESTED_KERAS[0]}-{TESTED_KERAS[1]}")


def install_hint() -> str:
    """The pip command that installs a tested pair."""
    tf_low, tf_high = TESTED_TENSORFLOW
    k_low, k_high = TESTED_KERAS
    major, minor = tf_high.split(".")
    k_major, k_minor = k_high.split(".")
    return (f'pip install "tensorflow-cpu>={tf_low},<{major}.{int(minor) + 1}" '
            f'"keras>={k_low},<{k_major}.{int(k_minor) + 1}"')


__all__ = ["TESTED_KERAS", "TESTED_TENSORFLOW", "install_hint", "installed", "tested",
           "untested_versions", "warn_if_untested"]
