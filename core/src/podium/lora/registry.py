"""The adapters an engine serves, by name and id (rank 0's, the engine's own).

An adapter is registered once (``add``: read from its folder, checked against the model and the
engine's limits, kept in the host cache), then requests name it. A ``LoRARequest`` naming an adapter
the engine does not know registers it (vLLM's offline behaviour); one that reuses a known name or id
for another adapter is refused, naming both. ``remove`` forgets the name: new requests cannot use it,
requests already accepted finish with it, and its slot and cached prefix blocks are never reused for
another adapter (each registration has its own ``AdapterRef.key``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from ..errors import AdapterNotFound, InvalidParameter
from .request import AdapterRef, LoRARequest


class AdapterRegistry:
    """Registered adapters; ``register(ref)`` reads and checks one (raising what is wrong), ``forget(key)``
    drops it from the host cache."""

    def __init__(self, register: Callable[[str, str, int], int], forget: Callable[[int], None]) -> None:
        self._register, self._forget = register, forget
        self._by_name: dict[str, AdapterRef] = {}
        self._keys = itertools.count(1)
        self._ids = itertools.count(1)  # ids handed out to adapters loaded by name and path (the server)

    def __len__(self) -> int:
        return len(self._by_name)

    def adapters(self) -> list[AdapterRef]:
        """Every registered adapter, in registration order."""
        return list(self._by_name.values())

    def find(self, name: str) -> AdapterRef | None:
        return self._by_name.get(name)

    def resolve(self, lora: LoRARequest | str | None) -> AdapterRef | None:
        """The adapter a request runs with: None for the base model; a name must be registered; a
        ``LoRARequest`` is registered if it is new."""
        if lora is None:
            return None
        if isinstance(lora, str):
            ref = self._by_name.get(lora)
            if ref is None:
                raise AdapterNotFound(self._unknown(lora), lora)
            return ref
        if not isinstance(lora, LoRARequest):
            raise InvalidParameter(f"lora_request must be a LoRARequest or an adapter name, got "
                                   f"{type(lora).__name__}", param="lora_request")
        return self.add(lora)

    def add(self, lora: LoRARequest) -> AdapterRef:
        """Register ``lora`` (or return it, registered already); InvalidParameter if it clashes."""
        known = self._by_name.get(lora.lora_name)
        if known is not None:
            if known.lora_int_id != lora.lora_int_id or (lora.lora_path and known.path != lora.lora_path):
                raise InvalidParameter(f"LoRA adapter {lora.lora_name!r} is already loaded as id {known.lora_int_id} "
                                       f"from {known.path}; this request gives id {lora.lora_int_id} from "
                                       f"{lora.lora_path or '(no path)'}. Unload it first, or use another name",
                                       param="lora_request")
            return known
        clash = next((r for r in self._by_name.values() if r.lora_int_id == lora.lora_int_id), None)
        if clash is not None:
            raise InvalidParameter(f"LoRA id {lora.lora_int_id} is already adapter {clash.name!r}; adapter "
                                   f"{lora.lora_name!r} needs an id of its own", param="lora_request")
        if not lora.lora_path:
            raise AdapterNotFound(self._unknown(lora.lora_name) + "; a LoRARequest for a new adapter needs its "
                                  "lora_path", lora.lora_name)
        key = next(self._keys)
        rank = self._register(lora.lora_name, lora.lora_path, key)
        ref = AdapterRef(key, lora.lora_name, lora.lora_int_id, lora.lora_path, rank)
        self._by_name[ref.name] = ref
        return ref

    def load(self, name: str, path: str) -> AdapterRef:
        """Register adapter ``name`` from ``path`` with an id of its own (the server's load endpoint)."""
        if name in self._by_name:
            raise InvalidParameter(f"LoRA adapter {name!r} is already loaded (from {self._by_name[name].path}); "
                                   f"unload it first", param="lora_name")
        used = {r.lora_int_id for r in self._by_name.values()}
        lora_id = next(i for i in self._ids if i not in used)
        return self.add(LoRARequest(name, lora_id, path))

    def remove(self, name: str) -> AdapterRef:
        """Forget adapter ``name``; AdapterNotFound if it is not loaded."""
        ref = self._by_name.pop(name, None)
        if ref is None:
            raise AdapterNotFound(self._unknown(name), name, param="lora_name")
        self._forget(ref.key)
        return ref

    def _unknown(self, name: str) -> str:
        served = ", ".join(repr(n) for n in self._by_name) or "none"
        return f"The LoRA adapter {name!r} is not loaded (loaded adapters: {served})"
