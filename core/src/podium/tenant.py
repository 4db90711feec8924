"""Who a request is for, as the scheduler's fair share between tenants sees it (``fair_share``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tenant:
    """Who a request is for, as fair share between tenants sees it (``fair_share``): a name and a
    scheduling weight (twice the weight, about twice the tokens while both wait)."""

    name: str = ""
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"tenant: the name must be a string, got {type(self.name).__name__}")
        if not (isinstance(self.weight, (int, float)) and 0 < self.weight < float("inf")):
            raise ValueError(f"tenant: the weight must be a positive number, got {self.weight!r}")


DEFAULT_TENANT = Tenant()
