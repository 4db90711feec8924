"""The engine's unit of work: one ``Sequence`` per sample stream of a request.

A request with ``n`` samples becomes ``n`` sequences with the same ``request_id`` and
``sample_index`` 0..n-1. A sequence's tokens are its prompt followed by its outputs; the one
number that drives scheduling is ``num_computed_tokens``: how many of ``token_ids`` already have
their K/V in the cache. A step computes tokens ``[num_computed_tokens, num_computed_tokens + k)``;
when that reaches ``num_tokens`` a new token is sampled.

With async scheduling (see ``engine``) a sampled token may still be on the device when the next
step is planned: ``token_ids`` then ends in ``num_pending_tokens`` placeholders (-1) that the
engine fills in when it reads the token. Outputs never show placeholders.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field

from .lora.request import AdapterRef
from .sampling_params import SamplingParams
from .tenant import DEFAULT_TENANT, Tenant


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not yet scheduled, or preempted (its blocks were freed; it recomputes)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    sample_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    tenant: Tenant = DEFAULT_TENANT
    status: SequenceStatus = SequenceStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + output, appended in place
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first scheduling
    block_table: list[int] = field(default_factory=list)
    table_row: int = -1  # the scheduler's block-table row for this sequence while it runs (-1: none)
    num_planned_blocks: int = 0  # entries of block_table that step plans already carried
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks, in order
    cached_probe: tuple[int, int] = (-1, 0)  # BlockManager.num_cached_blocks' memo: (its removals then, blocks)
    num_preemptions: int = 0
    num_pending_tokens: int = 0  # trailing placeholders in token_ids: sampled, not yet read back
    # speculative decoding: tokens a proposer drafted to follow token_ids, verified by the next step
    # that schedules this sequence's decode (never part of token_ids until accepted)
    draft_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    grammar: Future | None = None  # structured output: the compiled grammar (podium.structured), else None
    lora: AdapterRef | None = None  # the LoRA adapter it runs with (podium.lora), else the base model
    lora_slot: int = -1  # the device slot of its adapter while it runs (lora.slots), -1: none

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens known on the host (placeholders excluded)."""
        return self.token_ids[len(self.prompt_token_ids):len(self.token_ids) - self.num_pending_tokens]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
