"""The owner plan: which replica owns each trainable variable (keeps its optimizer state and
applies its update).

Sorted-greedy by bytes, as PyTorch's ZeroRedundancyOptimizer: the variables are taken largest
first (ties: the earlier in the optimizer's list first) and each goes to the owner holding the
fewest bytes so far (ties: the lowest index). Deterministic: the same variables in the same
order give the same plan in every process, so every worker computes it alone. A later optimizer
(a second optimizer of the same model) continues from the loads the earlier ones left.

Pure Python (no TensorFlow): ``tfdp bench zero`` and the tests use it on shapes alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def assign_owners(sizes, owners: int, loads=None) -> list[int]:
    """The owner of each item of ``sizes`` (bytes), sorted-greedy; ``loads`` (bytes per owner
    already held) is updated in place when given."""
    if owners < 1:
        raise ValueError(f"owners must be >= 1, got {owners}")
    loads = [0] * owners if loads is None else loads
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda k: (-int(sizes[k]), k)):
        j = min(range(owners), key=lambda o: (loads[o], o))
        out[i] = j
        loads[j] += int(sizes[i])
    return out


@dataclass(frozen=True)
class Entry:
    """One planned variable: its name, bytes and owner (a local replica index), and, for a
    table split by rows, the rows each owner keeps (``rows[o]``; empty otherwise)."""
    name: str
    nbytes: int
    owner: int
    rows: tuple = ()


@dataclass
class OwnerPlan:
    """The plan of one optimizer build: entries, owner count, where the owners live."""
    owners: int
    entries: list = field(default_factory=list)
    optimizer: str = ""
    devices: tuple = ()
    note: str = ""   # e.g. why a dominant table was not split

    def loads(self) -> list[int]:
        """Bytes of model variables each owner updates (its slot bytes are proportional)."""
        out = [0] * self.owners
        for e in self.entries:
            if e.rows:
                total = sum(e.rows)
                for o, r in enumerate(e.rows):
                    out[o] += e.nbytes * r // max(total, 1)
            else:
                out[e.owner] += e.nbytes
        return out

    def counts(self) -> list[int]:
        out = [0] * self.owners
        for e in self.entries:
            if e.rows:
                for o, r in enumerate(e.rows):
                    out[o] += 1 if r else 0
            else:
                out[e.owner] += 1
        return out

    @property
    def total(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def largest_share(self) -> float:
        """The largest owner's fraction of all planned bytes (ideal: 1 / owners)."""
        total = self.total
        return max(self.loads()) / total if total else 0.0

    def balance(self) -> float:
        """Largest owner's bytes / the ideal (total / owners): 1.0 is perfect."""
        return self.largest_share() * self.owners

    def table(self) -> str:
        """The plan as a markdown table (what the strategy logs once per optimizer build)."""
        loads, counts, total = self.loads(), self.counts(), self.total
        lines = ["| owner | device | variables | bytes | share |", "|---|---|---|---|---|"]
        for o in range(self.owners):
            dev = self.devices[o] if o < len(self.devices) else "-"
            share = loads[o] / total if total else 0.0
            lines.append(f"| {o} | {dev} | {counts[o]} | {human_bytes(loads[o])} | "
                         f"{100 * share:.1f} % |")
        split = [e for e in self.entries if e.rows]
        lines.append(f"balance: largest owner {100 * self.largest_share():.1f} % of "
                     f"{human_bytes(total)} (ideal {100 / self.owners:.1f} %)"
                     + (f"; split by rows: {', '.join(e.name for e in split)}" if split else "")
                     + (f"; {self.note}" if self.note else ""))
        return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} GB"  # pragma: no cover


__all__ = ["Entry", "OwnerPlan", "assign_owners", "human_bytes"]
