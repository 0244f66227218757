"""Sharded optimizer state on one strategy (``ZeroState``): owners, slot placement, updates.

One ``ZeroState`` per strategy with ``zero_stage`` 1 or 2 (``extended.tfdp_zero``). Three of
the extended's hooks call it:

* ``_create_variable``: a slot Keras creates inside ``colocate_vars_with(model_variable)`` for a
  variable that has an owner becomes ONE plain variable on the owner's device (instead of a
  copy on every device), except the slots that must stay per replica: Keras's
  ``gradient_accumulator`` (each replica's own unreduced sum) and ``average`` (EMA, updated by
  every replica in its replica context).
* ``_update`` (a merge_call's ``extended.update(var, fn)``: Keras's update step, weight decay,
  the EMA overwrite): ``fn`` runs on the owner's copy only, then the new value is copied to the
  other copies (``tfdp.reduce.owner.broadcast_local``). ``fn`` runs in cross-replica context
  without an update context, so optimizer state written outside slots (Adafactor's row / column
  statistics: mirrored variables) is written to every copy by TF itself (a mirrored assign in
  cross-replica context assigns every copy), and reads of mirrored values take the copy on the
  owner's device: all copies stay identical.
* ``_replica_ctx_update`` (inside Keras's gradient-accumulation ``tf.cond``, no merge_call):
  only the owner's replica runs ``fn`` (only it touches its slots: every replica touching one
  shared slot chains the replicas' conds and their collectives hang), then every replica takes
  part in one replica-context collective that carries the owner's new value
  (``tfdp.reduce.owner.replica_broadcast``).

A variable split by rows (``rows.SplitTable``, element-wise optimizers) has no single owner:
``handles`` covers both, and ``update`` runs ``fn`` once per owner on its row block.

Owners are local replica indices: every worker shards its optimizer state over its own devices
and keeps the same plan, so slots are replicated across workers (owners spanning every worker
were measured slower: one more cross-worker broadcast of the updated weights each step; see
``tfdp.zero``).
"""

from __future__ import annotations

import logging
import threading
import weakref

import tensorflow as tf

from tfdp import compat as tfp
from tfdp import devices as devices_lib
from tfdp.errors import TfdpError, message
from tfdp.zero import plan as plan_lib

log = logging.getLogger("tfdp")


# Slots that stay one copy per replica (Keras names a slot "<variable path>_<name>").
PER_REPLICA_SLOTS = ("gradient_accumulator", "average")

# Keras optimizers whose mirrored non-slot state is written in replica context (outside
# update_step), so it stays identical on every replica with sharded updates too.
_STATE_WRITTEN_OUTSIDE_UPDATE = ("Nadam", "LossScaleOptimizer")


def storage(v):
    """The tf variable behind a Keras variable (itself otherwise)."""
    inner = tfp.keras_variable_storage(v)
    return inner if inner is not None else v


def container(v):
    """The distributed variable ``v`` is, or is a copy of, or None."""
    v = storage(v)
    if tfp.is_distributed_values(v):
        return v
    get = getattr(v, "_distributed_container", None)
    if callable(get):
        return get()
    return None


class ZeroState:
    """Owners and sharded updates of one strategy (see the module docstring)."""

    def __init__(self, extended, stage: int):
        self.stage = int(stage)
        self._extended = weakref.ref(extended)
        self.devices = tuple(extended.worker_devices)
        # Owners span this worker's replicas (the design chosen: see the module docstring).
        self.num_owners = len(self.devices)
        self._owners = {}     # id(distributed variable) -> (weakref, owner)
        self._loads = [0] * self.num_owners
        self.plans: list[plan_lib.OwnerPlan] = []
        self._slots = []      # weakrefs of the sharded slots (figures, tests)
        self._checked = weakref.WeakSet()
        self._grad_owners = {}  # local replica -> {id(gradient): (gradient, owner)}
        self._pending = {}      # id(optimizer) -> (weakref, [(weakref(var), Entry)])
        self._slot_count = {}   # id(distributed variable) -> sharded slots created for it
        self._splits = {}       # id(distributed variable) -> rows.SplitTable
        self._notes = {}        # id(optimizer) -> a note for its plan table
        self.owner_reductions = 0  # traced reductions to owners (zero_stage=2; tests read it)
        self._lock = threading.Lock()
        self._effect_shown = False  # the effect line (show_effect_once): once per strategy

    def __repr__(self):
        return f"ZeroState(stage={self.stage}, owners={self.num_owners})"

    @property
    def extended(self):
        return self._extended()


    # --- the plan ------------------------------------------------------------------------------

    def owner_of(self, v):
        """The owner (local replica index) of a model variable, or None (not sharded)."""
        c = container(v)
        if c is None:
            return None
        hit = self._owners.get(id(c))
        if hit is None or hit[0]() is not c:
            return None
        return hit[1]

    def split_of(self, v):
        """The ``rows.SplitTable`` of a variable split by rows, or None."""
        c = container(v)
        table = None if c is None else self._splits.get(id(c))
        return table if table is not None and table.container is c else None

    def handles(self, v) -> bool:
        """Whether updates of ``v`` are sharded (an owner, or rows split among owners)."""
        return self.owner_of(v) is not None or self.split_of(v) is not None

    def plan(self, optimizer, variables):
        """Give every not yet owned distributed variable of ``variables`` an owner (called when
        ``optimizer`` builds, before it creates its slots); with an element-wise optimizer, a
        variable larger than 1.25 x an owner's share is split by rows among all owners
        (``rows.py``). ``finalize`` keeps the owners of the variables that got sharded slots
        and logs the table."""
        from tfdp.zero import rows as rows_lib
        todo, seen = [], set()
        for v in variables:
            c = container(v)
            if (c is None or id(c) in seen or self.handles(c)
                    or getattr(v, "overwrite_with_gradient", False)
                    or len(getattr(c, "values", ())) != len(self.devices)):
                continue
            seen.add(id(c))
            todo.append((v, c))
        if not todo:
            return
        sizes = [_nbytes(c) for _, c in todo]
        n = self.num_owners
        total = sum(sizes) + sum(self._loads)
        from tfdp.keras.gradient_path import updates_in_cond
        # (an update Keras runs inside a tf.cond is each owner's alone: no row pieces there)
        in_cond = updates_in_cond(optimizer)
        can_split = n > 1 and rows_lib.elementwise(optimizer) and not in_cond
        split = [can_split and size > rows_lib.SPLIT_ABOVE * total / n
                 and len(c.shape) >= 1 and c.shape[0] is not None and c.shape[0] >= n
                 for (_, c), size in zip(todo, sizes)]
        with self._lock:
            pending = self._pending.setdefault(id(optimizer), (weakref.ref(optimizer), []))[1]
            for (v, c), size, s in zip(todo, sizes, split):
                if s:
                    bounds = rows_lib.row_bounds(int(c.shape[0]), n)
                    self._splits[id(c)] = rows_lib.SplitTable(c, bounds, self.devices)
                    for o, (r0, r1) in enumerate(bounds):
                        self._loads[o] += size * (r1 - r0) // int(c.shape[0])
                    pending.append((weakref.ref(c), plan_lib.Entry(
                        _name(v), size, -1, tuple(r1 - r0 for r0, r1 in bounds))))
            whole = [(vc, size) for vc, size, s in zip(todo, sizes, split) if not s]
            owners = plan_lib.assign_owners([size for _, size in whole], n, self._loads)
            for ((v, c), size), owner in zip(whole, owners):
                self._owners[id(c)] = (weakref.ref(c), owner)
                pending.append((weakref.ref(c), plan_lib.Entry(_name(v), size, owner)))
            if not can_split and n > 1 and max(sizes) > rows_lib.SPLIT_ABOVE * total / n:
                self._notes[id(optimizer)] = (
                    f"{type(optimizer).__name__} "
                    + ("updates inside a tf.cond (gradient accumulation or an EMA "
                       "overwrite)" if in_cond else "is not element-wise")
                    + ": whole-variable ownership, no variable split by rows")

    def finalize(self, optimizer):
        """After ``optimizer`` built (before its first update): refuse what cannot be sharded
        exactly; variables for which it created no sharded slot (plain SGD) lose their owner
        (every replica keeps updating them: nothing to save); log the plan table once."""
        for o in (optimizer, getattr(optimizer, "inner_optimizer", None)):
            if o is None or o in self._checked:
                continue
            self.check(o)
            with self._lock:
                ref_pending = self._pending.pop(id(o), None)
                self._checked.add(o)
            if ref_pending is None or ref_pending[0]() is not o:
                continue
            kept, dropped = [], []
            for ref, entry in ref_pending[1]:
                c = ref()
                if c is None:
                    continue
                if self._slot_count.get(id(c), 0):
                    kept.append(entry)
                    table = self.split_of(c)
                    if table is not None:
                        table.bind(o.variables)
                else:
                    self._owners.pop(id(c), None)
                    self._splits.pop(id(c), None)
                    dropped.append(entry)
            plan = plan_lib.OwnerPlan(self.num_owners, kept, type(o).__name__, tuple(
                devices_lib.short_name(d) for d in self.devices))
            notes = [self._notes.pop(id(o), "")]
            if dropped:
                notes.append(f"{len(dropped)} variable(s) without per-variable optimizer "
                             "state stay updated on every replica")
            plan.note = "; ".join(x for x in notes if x)
            self.plans.append(plan)
            if kept:
                log.info("tfdp: zero_stage=%d: %s optimizer state of %d variable(s) sharded "
                         "over %d replica(s):\n%s", self.stage, plan.optimizer, len(kept),
                         plan.owners, plan.table())
            else:
                log.info("tfdp: zero_stage=%d: %s keeps no per-variable optimizer state: "
                         "nothing to shard, every replica updates its variables", self.stage,
                         plan.optimizer)

    # --- slots -----------------------------------------------------------------------------

    def create_slot(self, next_creator, kwargs):
        """One variable on the owner's device for a slot of an owned variable, else None (the
        extended then creates the variable as usual)."""
        colocate = kwargs.get("colocate_with")
        if colocate is None or not tfp.is_distributed_values(colocate):
            return None
        owner = self.owner_of(colocate)
        name = str(kwargs.get("name") or "")
        if name.endswith(PER_REPLICA_SLOTS):
            return None
        table = self.split_of(colocate) if owner is None else None
        if table is not None:
            v = table.make_slot(next_creator, kwargs)
            self._slot_count[id(colocate)] = self._slot_count.get(id(colocate), 0) + 1
            return v
        if owner is None:
            return None
        kwargs = dict(kwargs)
        kwargs.pop("colocate_with")
        with tf.device(self.devices[owner % len(self.devices)]):
            v = next_creator(**kwargs)
        self._slots.append(weakref.ref(v))
        self._slot_count[id(colocate)] = self._slot_count.get(id(colocate), 0) + 1
        return v

    def slot_bytes(self) -> list[int]:
        """Bytes of sharded slots on each local device."""
        out = [0] * len(self.devices)
        alive = []
        for ref in self._slots:
            v = ref()
            if v is None:
                continue
            alive.append(ref)
            dev = devices_lib.canonical(v.device)
            for i, d in enumerate(self.devices):
                if devices_lib.canonical(d) == dev:
                    out[i] += _nbytes(v)
        self._slots = alive
        for table in self._splits.values():
            for i, b in enumerate(table.slot_bytes(self.devices)):
                out[i] += b
        return out

    def state_bytes_per_device(self) -> list[int]:
        """Bytes of every planned optimizer's variables held on each local device (slots on
        their owners, row pieces on theirs, the rest, e.g. ``iterations``, on every device)."""
        canonical = [devices_lib.canonical(d) for d in self.devices]
        out = [0] * len(self.devices)
        for optimizer in list(self._checked):
            for v in optimizer.variables:
                value = getattr(v, "value", v)
                comps = (value.values if tfp.is_distributed_values(value)
                         else getattr(value, "variables", None) or [value])  # (row pieces)
                for c in comps:
                    dev = devices_lib.canonical(c.device)
                    if dev in canonical:
                        out[canonical.index(dev)] += _nbytes(c)
        return out

    def effect_line(self) -> str | None:
        """The plan's effect in one line, once the optimizers built (None before): optimizer
        state on the largest device unsharded -> sharded, e.g. ``102.5 MB -> 25.7 MB``."""
        if not self.plans:
            return None
        head = f"tfdp: zero_stage={self.stage}:"
        sharded = [p for p in self.plans if p.entries]
        if not sharded:
            names = ", ".join(dict.fromkeys(p.optimizer for p in self.plans))
            return (f"{head} nothing to shard: {names} keeps no per-variable optimizer state "
                    "(every replica updates its variables, as with zero_stage=0)")
        per_device = self.state_bytes_per_device()
        slots = self.slot_bytes()
        replicated = max(d - s for d, s in zip(per_device, slots))
        before, after = replicated + sum(slots), max(per_device)
        variables = sum(len(p.entries) for p in sharded)
        split = sum(1 for p in sharded for e in p.entries if e.rows)
        names = ", ".join(dict.fromkeys(p.optimizer for p in sharded))
        n = len(self.devices)
        return (f"{head} optimizer state per device {plan_lib.human_bytes(before)} -> "
                f"{plan_lib.human_bytes(after)} (the largest of {n} replica"
                f"{'s' if n != 1 else ''}; {names}: {variables} variable(s) sharded"
                + (f", {split} split by rows" if split else "")
                + "; the owner plan is logged at INFO)")

    def show_effect_once(self) -> None:
        """Show :meth:`effect_line` where the strategy's line goes (``announce.show``), at the
        first training step (when the optimizers have built), once per strategy."""
        if self._effect_shown or not self.plans:
            return
        line = self.effect_line()
        with self._lock:
            if self._effect_shown:
                return
            self._effect_shown = True
        from tfdp.strategy.announce import show
        show(line)

    # --- checks ------------------------------------------------------------------------

    def check(self, o):
        """Refuse what cannot be sharded exactly (one clear error naming the fix)."""
        state = _unslotted_state(o) if getattr(o, "gradient_accumulation_steps", None) else []
        if state:
            raise TfdpError(message(
                f"zero_stage={self.stage} cannot shard {type(o).__name__} with "
                "gradient_accumulation_steps exactly: its update writes optimizer state that "
                f"is not a per-variable slot ({', '.join(state[:3])}), and inside Keras's "
                "accumulation branch only the owner's copy would change",
                f"{type(o).__name__}(gradient_accumulation_steps="
                f"{o.gradient_accumulation_steps}) with zero_stage={self.stage}",
                "Fix: use zero_stage=0 for this optimizer, or drop gradient_accumulation_steps "
                "(accumulate with a larger batch instead)."))

    # --- zero_stage=2: gradients reduced onto their owners ------------------------------------

    def remember_gradients(self, grads, variables):
        """This replica's gradients of an ``apply`` and their variables (the gradient reduction
        that follows finds each gradient's owner by the tensor)."""
        replica = tfp.current_replica_id()
        owners = self._grad_owners.setdefault(replica, {})
        if len(owners) > 4096:  # (a long eager loop: keep the newest apply only)
            owners.clear()
        for g, v in zip(grads, variables):
            if g is not None:
                owner = self.owner_of(v)
                if owner is not None:
                    owners[id(g)] = (g, owner)

    def _owner_of_gradient(self, value):
        comps = list(value.values) if tfp.is_distributed_values(value) else [value]
        owner = None
        for r, c in enumerate(comps):
            hit = self._grad_owners.get(r, {}).get(id(c))
            if hit is None or hit[0] is not c or (owner is not None and hit[1] != owner):
                return None
            owner = hit[1]
        return owner

    def reduce_gradients(self, values, options):
        """zero_stage=2's sum of every replica's gradients (merge context): each gradient of an
        owned variable summed onto its owner only; others all-reduced as usual. ``options``: the
        call's ``tfdp.reduce.ReduceOptions`` (per-replica weights, densify_ok).

        A gradient summed to its owner comes back as that one tensor for every replica: the
        owner's update reads it where it is, and a replica that reads it elsewhere (a global
        norm for ``global_clipnorm``, LossScaleOptimizer's finite check) reads the same exact
        sum, so clipping and finiteness stay global.
        """
        ext = self.extended
        ops = ext.tfdp_reduce
        owners = [self._owner_of_gradient(v) for v in values]
        self._grad_owners.clear()
        owned = [i for i, o in enumerate(owners) if o is not None]
        rest = [i for i, o in enumerate(owners) if o is None]
        multiworker = ext._num_workers_in_job() > 1  # pylint: disable=protected-access
        if multiworker:  # sparse gradients across workers: all-gathered as usual
            rest += [i for i in owned if isinstance(values[i].values[0], tf.IndexedSlices)]
            owned = [i for i in owned if not isinstance(values[i].values[0], tf.IndexedSlices)]
        results = [None] * len(values)
        if rest:
            reduced = ops.batch_reduce(
                tf.distribute.ReduceOp.SUM, [(values[i], values[i]) for i in rest], options)
            for i, r in zip(rest, reduced):
                results[i] = r
        if owned:
            self.owner_reductions += 1
            sums = ops.reduce_to_owners([values[i] for i in owned],
                                        [owners[i] for i in owned], options)
            for i, t in zip(owned, sums):
                results[i] = t
        return results

    # --- updates ---------------------------------------------------------------------------

    def update(self, var, fn, args, kwargs, group):
        """``extended.update`` of a sharded variable (``handles``) in cross-replica context."""
        ext = self.extended
        comps = list(var.values)
        from tfdp.reduce import owner as owner_lib
        owner = self.owner_of(var)
        if owner is None:  # split by rows
            self.split_of(var).update(var, fn, args, kwargs)
            return tfp.update_regroup(ext, [None] * len(comps), group)
        with tf.device(comps[owner].device), tf.name_scope(f"update_{owner}"):
            result = fn(comps[owner], *tfp.select_replica(owner, args),
                        **tfp.select_replica(owner, kwargs))
        owner_lib.broadcast_local(comps, owner)
        return tfp.update_regroup(ext, [result] * len(comps), group)

    def replica_update(self, var, fn, args, kwargs):
        """``extended.update`` of an owned variable from a replica context without merge_call
        (Keras's accumulation branch): the owner updates, every replica joins one collective
        that carries the new value."""
        ext = self.extended
        if tf.executing_eagerly():
            raise TfdpError(message(
                f"zero_stage={self.stage} with gradient_accumulation_steps needs the step in a "
                "tf.function (eager replicas run one after another and cannot share the owner's "
                "update)", "an eager strategy.run", "Fix: wrap the step in tf.function (Keras "
                "fit does), or use zero_stage=0."))
        if tfp.in_xla_context():
            raise TfdpError(message(
                f"zero_stage={self.stage} cannot run inside an XLA-compiled step",
                "jit_compile=True around the whole step", "Fix: compile(jit_compile=False), or "
                "zero_stage=0."))
        owner = self.owner_of(var)
        if owner is None:  # (never planned: optimizers that update in a tf.cond are not split)
            raise TfdpError(message(
                "A variable split by rows cannot be updated inside a Keras tf.cond (gradient "
                "accumulation, an EMA overwrite)", _name(var),
                "Fix: zero_stage=0, or an optimizer without gradient_accumulation_steps / "
                "ema_overwrite_frequency."))
        replica = tfp.current_replica_id()
        comp = var.values[replica]
        result = None
        source = replica == owner
        if source:
            with tf.device(comp.device), tf.name_scope(f"update_{owner}"):
                result = fn(comp, *args, **kwargs)
        from tfdp.strategy.role import worker_role
        rank = worker_role(tf.distribute.get_replica_context().strategy).index
        ext.tfdp_reduce.replica_broadcast(comp, source, replica, rank)
        return result


def _nbytes(v) -> int:
    shape = v.shape
    n = shape.num_elements() if hasattr(shape, "num_elements") else None
    return int(n or 0) * tf.as_dtype(v.dtype).size


def _name(v) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", "?"))


def _unslotted_state(optimizer) -> list[str]:
    """Names of an optimizer's mirrored variables that are neither its counters nor per-variable
    slots and may be written inside ``update_step`` (Adafactor's row / column statistics)."""
    if type(optimizer).__name__ in _STATE_WRITTEN_OUTSIDE_UPDATE:
        return []
    skip = {id(storage(getattr(optimizer, a, None))) for a in ("_iterations", "_learning_rate")}
    out = []
    for v in getattr(optimizer, "variables", ()):
        s = storage(v)
        if id(s) in skip or not tfp.is_distributed_values(s):
            continue
        if str(getattr(v, "name", "")).endswith(PER_REPLICA_SLOTS):
            continue
        out.append(str(getattr(v, "path", None) or v.name))
    return out


__all__ = ["PER_REPLICA_SLOTS", "ZeroState", "container", "storage"]
