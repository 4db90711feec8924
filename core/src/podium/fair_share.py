"""The scheduler's waiting queue: weighted fair queuing over tenants, by tokens served.

The rule. Every tenant has a virtual time: the tokens computed for it (prefill chunks and decodes,
of running and newly admitted sequences alike) divided by its weight. The next sequence admitted
is the head of the waiting tenant with the least virtual time (a tie goes to the head that came
first), so a tenant flooding the queue delays only itself, and a tenant of weight 2 gets about
twice the tokens of a tenant of weight 1 while both wait. Within a tenant, sequences keep the
scheduler's order: arrival (FCFS), or (priority, arrival); a preempted sequence goes back to the
front of its tenant's queue.

Idleness earns no credit: a tenant that starts waiting again starts no earlier than the virtual
clock (the virtual time of the last admission), so one quiet for an hour cannot then take the
engine for an hour. With a single tenant (every request's default) this is exactly the plain
queue, and the per-token accounting is skipped.
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .request import Sequence


@dataclass(eq=False)
class _TenantQueue:
    weight: float = 1.0
    vtime: float = 0.0  # tokens served / weight
    served_tokens: int = 0
    queue: deque[Sequence] = field(default_factory=deque)


class FairQueue:
    """Waiting sequences grouped by tenant; ``head()`` is the next to admit.

    ``order_key(seq)`` is the scheduler's order within a tenant (it also breaks virtual-time ties);
    ``keep_sorted``: insert by that key (the priority policy) rather than at the ends (FCFS).
    """

    def __init__(self, order_key: Callable[[Sequence], Any], keep_sorted: bool) -> None:
        self._order_key = order_key
        self._keep_sorted = keep_sorted
        self._tenants: dict[str, _TenantQueue] = {}
        self._size = 0
        self._clock = 0.0
        self._picked: _TenantQueue | None = None  # head()'s tenant, until the queue changes

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence: tenants by virtual time, each in its own order."""
        for tenant in sorted(self._waiting_tenants(), key=self._tenant_key):
            yield from tenant.queue

    @property
    def multi_tenant(self) -> bool:
        """Whether more than one tenant has been seen (only then is the accounting needed)."""
        return len(self._tenants) > 1

    def tenant_tokens(self) -> dict[str, int]:
        """Tokens served per tenant so far (a copy)."""
        return {name: t.served_tokens for name, t in self._tenants.items()}

    # ---- in and out --------------------------------------------------------------------------

    def push(self, seq: Sequence, front: bool) -> None:
        self._picked = None
        tenant = self._tenant(seq)
        if not tenant.queue:
            tenant.vtime = max(tenant.vtime, self._clock)  # no credit for having been idle
        if self._keep_sorted:
            insort(tenant.queue, seq, key=self._order_key)
        elif front:
            tenant.queue.appendleft(seq)
        else:
            tenant.queue.append(seq)
        self._size += 1

    def head(self) -> Sequence:
        """The next sequence to admit (the queue must not be empty)."""
        self._picked = self._next_tenant()
        return self._picked.queue[0]

    def pop_head(self) -> Sequence:
        tenant = self._picked or self._next_tenant()
        self._picked = None
        self._clock = max(self._clock, tenant.vtime)
        self._size -= 1
        return tenant.queue.popleft()

    def remove(self, seq: Sequence) -> None:
        self._picked = None
        self._tenants[seq.tenant.name].queue.remove(seq)
        self._size -= 1

    def clear(self) -> None:
        """Drop every waiting sequence (a scheduler reset adds them again); the tenants keep their
        virtual times, so a recovery changes nobody's share."""
        for tenant in self._tenants.values():
            tenant.queue.clear()
        self._size = 0
        self._picked = None

    def charge_plan(self, scheduled: list) -> None:
        """A step's ``ScheduledSequence`` items were planned: charge each tenant its tokens."""
        per_tenant: dict[str, int] = {}
        get = per_tenant.get
        for item in scheduled:
            name = item.seq.tenant.name
            per_tenant[name] = get(name, 0) + item.num_new_tokens
        self._picked = None
        for name, num_tokens in per_tenant.items():
            tenant = self._tenants[name]
            tenant.served_tokens += num_tokens
            tenant.vtime += num_tokens / tenant.weight

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        """``num_tokens`` of ``seq`` were scheduled: its tenant's virtual time moves on."""
        self._picked = None
        tenant = self._tenants.get(seq.tenant.name)
        if tenant is None:
            tenant = self._tenant(seq)
        tenant.served_tokens += num_tokens
        tenant.vtime += num_tokens / tenant.weight

    # ---- helpers -------------------------------------------------------------------------------

    def _tenant(self, seq: Sequence) -> _TenantQueue:
        name, weight = seq.tenant.name, seq.tenant.weight
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = _TenantQueue(weight=weight)
        tenant.weight = weight  # the newest request's weight wins (a keys file may change it)
        return tenant

    def _waiting_tenants(self) -> Iterator[_TenantQueue]:
        return (t for t in self._tenants.values() if t.queue)

    def _tenant_key(self, tenant: _TenantQueue) -> tuple[float, Any]:
        return tenant.vtime, self._order_key(tenant.queue[0])

    def _next_tenant(self) -> _TenantQueue:
        if len(self._tenants) == 1:
            return next(iter(self._tenants.values()))
        return min(self._waiting_tenants(), key=self._tenant_key)
