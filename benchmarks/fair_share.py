"""What fair share between tenants costs the scheduler: one step's ``schedule()`` + ``advance()``.

    python benchmarks/fair_share.py [--num-seqs 256] [--tenants 8] [--steps 400]

The scheduler alone (no model): ``num_seqs`` running decodes and as many waiting, every step a
token is appended to each sampled sequence and finished ones are replaced by new requests. The
same workload runs with every request in one tenant (the plain FCFS path: no accounting) and
spread over ``--tenants`` tenants, interleaved in rounds. Prints the median step time of each, and
for the tenants' run the time spent in the fair queue's accounting and picks (timed around those
calls) as a share of the step: the two runs admit in different orders, so their difference mixes
the accounting's cost with a different workload; the timed share is the accounting's own.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import podium.fair_share
from podium.block_manager import BlockManager
from podium.request import Sequence
from podium.sampling_params import SamplingParams
from podium.scheduler import Scheduler
from podium.tenant import Tenant

_ids = itertools.count()


def new_request(tenant: Tenant, rng: int) -> Sequence:
    seq_id = next(_ids)
    return Sequence(seq_id, f"r{seq_id}", 0, [seq_id % 1000, *range(1, 24 + rng % 40)],
                    SamplingParams(max_tokens=16 + rng % 48), tenant=tenant)


class Stopwatch:
    """Sums the time spent in the wrapped methods of the fair queue."""

    def __init__(self) -> None:
        self.total = 0.0

    def wrap(self, cls, name: str) -> None:
        fn = getattr(cls, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        setattr(cls, name, timed)


def run(num_seqs: int, tenants: list[Tenant], steps: int) -> list[float]:
    scheduler = Scheduler(BlockManager(64 * num_seqs, 16, True), num_seqs, 8192, 4096)
    for i in range(2 * num_seqs):
        scheduler.add(new_request(tenants[i % len(tenants)], i))
    times = []
    for step in range(steps):
        start = time.perf_counter()
        plan = scheduler.schedule()
        scheduler.advance(plan)
        times.append(time.perf_counter() - start)
        for item in plan.scheduled:
            seq = item.seq
            if item.samples and not seq.is_finished:
                seq.append_token(7)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    scheduler.finish(seq, "length")
                    scheduler.add(new_request(seq.tenant, step + seq.seq_id))
    return times[steps // 10:]  # the first steps are the prefills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    one = [Tenant()]
    many = [Tenant(f"t{i}", weight=1.0 + i % 3) for i in range(args.tenants)]
    plain, fair, fair_total, accounting = [], [], 0.0, 0.0
    watch = Stopwatch()
    for name in ("charge_plan", "charge", "head", "pop_head"):  # what schedule() calls
        watch.wrap(podium.fair_share.FairQueue, name)
    for _ in range(args.rounds):
        plain += run(args.num_seqs, one, args.steps)
        before = watch.total
        times = run(args.num_seqs, many, args.steps)
        fair += times
        fair_total += sum(times)
        accounting += watch.total - before  # includes the prefill steps run() leaves out of ``times``
    p, f = statistics.median(plain) * 1e6, statistics.median(fair) * 1e6
    print(f"schedule+advance per step, {args.num_seqs} running: one tenant {p:.0f} us, "
          f"{args.tenants} tenants {f:.0f} us (ratio {f / p:.2f}); fair-queue calls "
          f"{accounting / fair_total:.1%} of the tenants' step time")


if __name__ == "__main__":
    main()
