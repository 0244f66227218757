"""Sharded optimizer state (ZeRO): ``tfdp.DataParallelStrategy(zero_stage=1 | 2)``.

Plain data parallelism keeps the whole optimizer state on every replica, and every replica
applies the same update to its own copy of every variable. With ``zero_stage=1`` every trainable
variable has one owner replica (``plan.py``: sorted-greedy by bytes, deterministic, logged once
per optimizer as a table); its optimizer slots exist only on the owner's device; the owner
applies Keras's unchanged update, and the new value is copied to every other copy
(``state.py``, through ``tfdp.reduce.owner``). With ``zero_stage=2`` each gradient is also summed
onto its owner only (no copy back to the other replicas) before the owner updates.

With an element-wise optimizer (SGD, Adam, AdamW, Adamax, Nadam, RMSprop, Adagrad, Adadelta,
Ftrl, Lion), a variable larger than 1.25 x an owner's share (a recommender's embedding table) is
split by rows among all owners instead (``rows.py``), so the largest device holds about 1/N of
the slot bytes; other optimizers (Lamb, Adafactor, Muon) own whole variables, as the plan table
says. Across workers, every worker shards over its own replicas with the same plan (slots
replicated across workers): owners spanning every worker were measured slower than unsharded
(``tfdp bench zero --workers 2``: one more cross-worker broadcast of the updated weights every
step). Checkpoints hold the whole state in every format and restore on any replica count.

* ``plan.py``: the owner plan (pure Python).
* ``state.py``: ``ZeroState``: owners, slot placement, owner-only updates (what the strategy's
  ``_create_variable``, ``_update`` and ``_replica_ctx_update`` call).
* ``rows.py``: a variable split by rows among the owners.
* ``hooks.py``: the Keras hooks (plan at ``build``, refusals before the first update, which
  variable each gradient belongs to for stage 2).

Importing ``tfdp.zero`` does not start TensorFlow (``validate_stage`` is pure Python).
"""

from __future__ import annotations

import os

STAGES = (0, 1, 2)
ENV = "TFDP_ZERO_STAGE"


def validate_stage(value, env: str = ENV) -> int:
    """``zero_stage`` from the argument, else ``TFDP_ZERO_STAGE``, else 0."""
    from tfdp.errors import invalid_argument
    fix = ("0: every replica keeps the whole optimizer state (default); 1: each variable's "
           "optimizer state on one owner replica; 2: also its gradient summed onto the owner "
           "only.")
    if value is None:
        raw = os.environ.get(env, "").strip()
        if not raw:
            return 0
        if raw not in ("0", "1", "2"):
            raise invalid_argument(env, raw, valid=STAGES, fix=fix)
        return int(raw)
    if isinstance(value, bool) or not isinstance(value, int) or value not in STAGES:
        raise invalid_argument("zero_stage", value, valid=STAGES, fix=fix)
    return int(value)


__all__ = ["ENV", "STAGES", "validate_stage"]
