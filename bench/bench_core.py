"""The coordinator's decisions per verified tile, as the pool grows: CPU of the sans-I/O core
(``CoordinatorCore``: crediting a result, the scheduler handing out the next tile, the
ledger) with 100 to 10,000 workers joined, over the same with the smallest pool.

No sockets, no tensors and no checks: the workers are driven as the simulator drives
them (``coordinator.sim``), so what is measured is what the core's own bookkeeping costs
and how it grows with the number of connections. Each worker has a window of 2 slots;
the pool holds ``--backlog`` tiles per slot (0.5: half the slots hold one, as in a pool
larger than its work, where every tile goes out as soon as it is submitted), each
result is for a tile picked at random among those out, and brings the next tile.
Heartbeats are left out (``bench_load.py`` has them, over real connections).

A second table: a reconnect storm. With three tiles queued per worker, the workers
join one after another (each join hands out tiles), then half of them leave (each
leave re-queues its tiles and asks which tiles nobody left may take): the core's CPU
per join and per leave.

A third table: the training thread's planning of one GEMM (``LivePlanning.plan``, as
the offload calls it before cutting each GEMM: grid, placement, commitments) for a pool
of that many workers of mixed speeds whose links were measured, over the same for 2.

Run: ``python bench/bench_core.py [--tiles 20000] [--backlog 0.5]``.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.messages import DeviceProfile, Hello, Result  # noqa: E402
from common.signing import generate_private_key  # noqa: E402
from coordinator.plan.estimates import DeviceEstimate  # noqa: E402
from coordinator.plan.live import Commitments, LivePlanning  # noqa: E402
from coordinator.plan.planner import GemmShape, plan_config_for  # noqa: E402
from coordinator.pool.core import CoordinatorCore, CoreConfig  # noqa: E402
from coordinator.pool.effects import Checked, Effects  # noqa: E402
from coordinator.pool.ledger import Ledger  # noqa: E402
from coordinator.schedule.scheduler import TileTicket  # noqa: E402
from coordinator.sim.devices import SimGemm, SimTile  # noqa: E402
from coordinator.tiles.verify import CheckResult  # noqa: E402

POOLS = [100, 1_000, 3_000, 10_000]
PLANNED_POOLS = [2, 100, 1_000, 10_000]
PLANNED = GemmShape("mm", 1, 1024, 768, 768, 4)  # a GPT-2-small layer's, at 1,024 tokens
TILE = 128  # side of the tiles' GEMMs, a slot each (their sizes only: nothing is multiplied)
TILES_PER_GEMM = 64
PASSED = CheckResult(ok=True, margin=0.0)


class Pool:
    """``workers`` joined to a fresh core, which is fed tiles and sent results."""

    def __init__(self, workers: int, backlog: float) -> None:
        self.core = CoordinatorCore(
            key=generate_private_key(),
            ledger=Ledger(Path(":memory:")),
            config=CoreConfig(max_messages_per_s=0.0),
        )
        self.out: list[tuple[str, str]] = []  # (worker, tile) sent and not back
        self.tiles = round(backlog * 2 * workers)  # in the pool at any time
        self._next_tile = 0
        self._gemm = SimGemm("g0")
        self.now = 0.0
        for i in range(workers):
            self.join(f"w{i}")

    def join(self, worker_id: str) -> None:
        hello = Hello(
            name=worker_id,
            profile=DeviceProfile(mem_cap_bytes=1 << 30, gflops=100.0, threads=1),
            window=2,
            worker_key=hashlib.sha256(worker_id.encode()).hexdigest(),
            cache_bytes=1 << 30,  # as cleave-worker keeps blocks: the core mirrors them
        )
        self._apply(self.core.admit(worker_id, hello, self.now))

    def submit(self, count: int) -> None:
        tiles = []
        for _ in range(count):
            n = self._next_tile
            self._next_tile += 1
            if n % TILES_PER_GEMM == 0:
                self._gemm = SimGemm(f"g{n // TILES_PER_GEMM}")
            side = TILE * TILE * 4
            blocks = (f"a{n}", f"b{n}")
            ticket = TileTicket(
                f"t{n}", self._gemm.gemm_id, 2 * TILE**3, 2 * side, side, blocks=blocks
            )
            tiles.append(SimTile(ticket.tile_id, ticket, blocks, (side, side), 4, self._gemm))
        self._apply(self.core.submit(tiles, self.now))

    def result(self, rng: random.Random) -> None:
        """A result back for a tile out, picked at random; then a new tile to queue."""
        i = rng.randrange(len(self.out))
        self.out[i], self.out[-1] = self.out[-1], self.out[i]
        worker_id, tile_id = self.out.pop()
        self.now += 1e-4
        self._apply(self.core.handle(worker_id, Result(tile_id, compute_s=1e-4), self.now))
        self.submit(1)

    def _apply(self, effects: Effects) -> None:
        for send in effects.sends:
            if send.tile_id:
                self.out.append((send.worker_id, send.tile_id))
        for check in effects.checks:
            self._apply(self.core.checked(check, Checked(PASSED, False), self.now))


def per_tile(workers: int, tiles: int, backlog: float) -> float:
    """CPU seconds of the core per verified tile, after the pool has joined and filled."""
    pool = Pool(workers, backlog)
    pool.submit(pool.tiles)
    rng = random.Random(0)
    for _ in range(min(tiles // 10, 1000)):  # warm: the ledger, the estimates
        pool.result(rng)
    verified = pool.core.counters.tiles_verified
    start = time.process_time()
    for _ in range(tiles):
        pool.result(rng)
    seconds = time.process_time() - start
    assert pool.core.counters.tiles_verified - verified == tiles, "a result was not credited"
    return seconds / tiles


def storm_seconds(workers: int) -> tuple[float, float]:
    """CPU seconds per join and per leave: ``workers`` join a core with three tiles
    queued for each, then half of them leave."""
    pool = Pool(0, 0.0)
    pool.submit(3 * workers)
    start = time.process_time()
    for i in range(workers):
        pool.join(f"w{i}")
    joined = time.process_time()
    for i in range(workers // 2):
        pool.now += 1e-3
        pool._apply(pool.core.disconnected(f"w{i}", pool.now))
    left = time.process_time()
    return (joined - start) / workers, (left - joined) / (workers // 2)


def plan_seconds(workers: int, gemms: int = 20) -> float:
    """CPU seconds to plan one GEMM for ``workers``, each planned after the last."""
    rng = random.Random(0)
    estimates = [
        DeviceEstimate(f"w{i}", rng.uniform(5e9, 5e10), 1.25e7, 1.25e7, 1 << 30, 0.0, 3)
        for i in range(workers)
    ]
    planning, commitments = LivePlanning(), Commitments()
    config = plan_config_for(1.0)(workers, 1 << 30)
    planning.plan(PLANNED, estimates, config, commitments)
    start = time.process_time()
    for i in range(gemms):
        planning.plan(PLANNED, estimates, config, commitments, now=float(i))
    return (time.process_time() - start) / gemms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", type=int, default=20_000, help="results timed per pool")
    parser.add_argument(
        "--backlog", type=float, default=0.5, help="tiles in the pool per worker slot"
    )
    parser.add_argument("--workers", type=int, nargs="*", default=POOLS)
    args = parser.parse_args()
    print(f"{'workers':>8} {'core µs/tile':>13} {'ratio':>6}")
    base = None
    for workers in args.workers:
        seconds = per_tile(workers, args.tiles, args.backlog)
        base = base or seconds
        print(f"{workers:>8} {seconds * 1e6:>13.1f} {seconds / base:>6.2f}")
    print(
        f"(CPU of the coordinator's core per verified tile, {args.tiles} results each; "
        f"tiles in the pool: {args.backlog:g} per worker slot; ratio: over the first pool)"
    )
    print(f"\n{'workers':>8} {'µs/join':>9} {'ratio':>6} {'µs/leave':>9} {'ratio':>6}")
    bases = None
    storm_seconds(POOLS[0])  # warm: what a core does once (imports, first hand-outs)
    for workers in POOLS:
        join, leave = storm_seconds(workers)
        bases = bases or (join, leave)
        print(
            f"{workers:>8} {join * 1e6:>9.1f} {join / bases[0]:>6.2f} "
            f"{leave * 1e6:>9.1f} {leave / bases[1]:>6.2f}"
        )
    print("(CPU of the core per join and per leave, three tiles queued per worker)")
    print(f"\n{'workers':>8} {'plan ms/GEMM':>13} {'ratio':>6}")
    base = None
    for workers in PLANNED_POOLS:
        seconds = plan_seconds(workers)
        base = base or seconds
        print(f"{workers:>8} {seconds * 1e3:>13.2f} {seconds / base:>6.2f}")
    shape = f"{PLANNED.m}x{PLANNED.k} @ {PLANNED.k}x{PLANNED.n} fp32"
    print(f"(CPU to plan one {shape} GEMM; ratio: over 2 workers)")


if __name__ == "__main__":
    main()
