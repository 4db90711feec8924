"""The scheduler's view of the device's ``max_loras`` adapter slots: which adapter each holds and
how many running sequences use it.

The rule. A sequence with an adapter is admitted only when its adapter has a slot or can get one:
a slot no adapter holds, else the slot whose adapter no running sequence uses and has been idle the
longest (that adapter then leaves the device; its host copy stays). Otherwise the sequence waits,
and admission stops behind it as it does for blocks (FCFS, no skipping): the slots free up as the
running sequences finish, so it is never starved. A slot's adapter is fixed while any sequence
using it runs, so no step computes with weights another adapter overwrote. A newly assigned slot
goes into the next plan's ``lora_loads``, which every rank applies before that step's forward.
"""

from __future__ import annotations

from collections import OrderedDict

from ..request import Sequence
from .request import AdapterRef


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._holder: list[AdapterRef | None] = [None] * num_slots
        self._users = [0] * num_slots
        self._slot_of: dict[int, int] = {}  # adapter key -> its slot
        self._idle: OrderedDict[int, None] = OrderedDict()  # held slots no sequence uses, least recent first
        self._loads: list[tuple[int, AdapterRef]] = []  # assigned since the last plan
        self.num_users = 0  # running sequences with an adapter

    def holder(self, slot: int) -> AdapterRef | None:
        return self._holder[slot]

    def users(self, slot: int) -> int:
        return self._users[slot]

    def acquire(self, seq: Sequence) -> bool:
        """Give ``seq`` its adapter's slot (loading it if needed): False, changing nothing for ``seq``,
        when every slot is in use by another adapter. A sequence without an adapter always fits."""
        ref = seq.lora
        if ref is None:
            return True
        slot = self._slot_of.get(ref.key)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self._assign(slot, ref)
        self._users[slot] += 1
        self.num_users += 1
        self._idle.pop(slot, None)
        seq.lora_slot = slot
        return True

    def release(self, seq: Sequence) -> None:
        """``seq`` stopped running (finished, preempted): its use of the slot ends."""
        slot = seq.lora_slot
        if slot < 0:
            return
        seq.lora_slot = -1
        self._users[slot] -= 1
        self.num_users -= 1
        if self._users[slot] == 0:
            self._idle[slot] = None

    def take_loads(self) -> list[tuple[int, AdapterRef]]:
        """The (slot, adapter) pairs assigned since the last call, for the next plan."""
        loads, self._loads = self._loads, []
        return loads

    def reset(self) -> None:
        """Recovery after a failed step: no slot is trusted to hold anything (every adapter reloads)."""
        self._holder = [None] * self.num_slots
        self._users = [0] * self.num_slots
        self._slot_of.clear()
        self._idle.clear()
        self._loads.clear()
        self.num_users = 0

    def _free_slot(self) -> int | None:
        for slot, holder in enumerate(self._holder):
            if holder is None:
                return slot
        if self._idle:
            slot, _ = self._idle.popitem(last=False)
            return slot
        return None

    def _assign(self, slot: int, ref: AdapterRef) -> None:
        old = self._holder[slot]
        if old is not None:
            del self._slot_of[old.key]
        self._holder[slot] = ref
        self._slot_of[ref.key] = slot
        self._loads = [(s, r) for s, r in self._loads if s != slot]  # a load not yet planned is superseded
        self._loads.append((slot, ref))
