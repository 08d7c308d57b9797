"""One coordinator, N real WebSocket workers on loopback: handshakes, heartbeats, tiles.

Three kinds of process, so that the load never shares the coordinator's event loop:

- the coordinator: a real ``CoordinatorServer`` (ledger, scheduler, Freivalds checks on
  its verify thread) plus a feeder that keeps a backlog of small GEMMs submitted (cut
  with ``TiledGemm.iter_tiles`` on a worker thread, as the training thread does) and
  checks every assembled GEMM against ``torch.matmul``;
- one or more load processes, each a single asyncio loop holding its share of the N
  connections. Every simulated worker has its own Ed25519 key and speaks the real
  protocol: challenge -> signed hello -> signed welcome (checked), heartbeats at the
  coordinator's interval (ack latency measured here), and every task signature-checked,
  multiplied with ``torch.matmul`` and returned as a ``Result``;
- a probe process holding ``--probes`` of the N connections (25), which has little else
  to do: the heartbeat acks it times are the coordinator's answer, while a load
  process that shares the cores with the coordinator adds its own event-loop lag to
  every ack it times;
- this process, which drives the phases (connect, steady, drain, leave) over pipes and
  samples the coordinator's RSS and CPU with psutil.

Run: ``python bench/bench_load.py [--workers 1000] [--seconds 20] [--tile 64] [--json F]``.
``--ranks R`` starts R coordinator processes, each serving its share of the connections
as coordinator ranks do (``--ledger postgresql://...`` for one ledger they share).
The pieces are importable: ``tests/loopback/test_load_smoke.py`` runs ``run_load`` with 30 workers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import json
import math
import multiprocessing as mp
import random
import resource
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402
import torch  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import (  # noqa: E402
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from websockets.asyncio.client import ClientConnection, connect  # noqa: E402
from websockets.exceptions import ConnectionClosed, InvalidHandshake  # noqa: E402

from common.auth import answer_challenge, check_welcome, new_nonce  # noqa: E402
from common.batches import packed  # noqa: E402
from common.errors import ProtocolError  # noqa: E402
from common.limits import DEFAULT_LIMITS, held_tiles_limit  # noqa: E402
from common.messages import (  # noqa: E402
    Ack,
    Bye,
    Cancel,
    Challenge,
    DeviceProfile,
    Error,
    Heartbeat,
    Received,
    Result,
    Task,
    Welcome,
    encode_message,
    parse_message,
    parse_messages,
    verify_task,
)
from common.signing import generate_private_key, public_key_from_hex, public_key_hex  # noqa: E402
from coordinator.plan.planner import GemmPlan, GemmShape, PlanConfig, plan_gemm  # noqa: E402
from coordinator.pool.core import CoreConfig  # noqa: E402
from coordinator.run import open_ledger  # noqa: E402
from coordinator.serve.gc_policy import settle_after_start  # noqa: E402
from coordinator.serve.server import CoordinatorServer, ServerConfig  # noqa: E402
from coordinator.step.cpu_costs import COSTS  # noqa: E402
from coordinator.step.heap import keep_freed_memory  # noqa: E402
from coordinator.step.torch_threads import orchestrate_on_one_thread  # noqa: E402
from coordinator.tiles.tiled_gemm import SignedTile, TiledGemm  # noqa: E402

PROFILE = DeviceProfile("cpu", "bench-load simulated worker", 1, 1 << 30, 1 << 28, 10.0)
MAX_FRAME = 64 << 20  # far above a 64^3 tile; the coordinator never sends more than a tile
CONNECT_ATTEMPTS = 30  # per worker; a refused handshake (1013, "retry later") is retried
PIPE_TIMEOUT_S = 180.0  # no phase of a default run takes this long: something hung
ACK_WAIT_S = 5.0  # at the stop, how long a worker waits for the acks still owed to it


@dataclass(frozen=True)
class LoadConfig:
    workers: int = 1000
    seconds: float = 20.0  # steady phase: everyone connected and fed
    tile: int = 64  # tiles are tile x tile x tile fp32
    grid: int = 8  # each GEMM is (grid*tile) x tile @ tile x (grid*tile): grid^2 tiles
    window: int = 2  # tiles in flight per worker (the real worker's default)
    procs: int = 1  # load processes sharing the N connections
    # Of the N connections, this many are held by a process of their own that has little
    # else to do: their heartbeat acks time the coordinator, not the load processes'
    # own event loops (which lag when they share the cores with the coordinator).
    probes: int = 25
    # Coordinator processes, each serving its share of the connections, as coordinator
    # ranks do (per tile, a rank's work is its own; ranks meet only at the gradient
    # all-reduce, once a step, and in a shared --ledger).
    ranks: int = 1
    ledger: str = ""  # a PostgreSQL URL shared by the ranks; "": each its own SQLite
    heartbeat_s: float = 2.0  # ServerConfig's default interval
    connect_concurrency: int = 64  # handshakes in progress at once, per load process
    warmup_s: float = 2.0  # between first GEMM and the steady phase's clock
    drain_timeout_s: float = 60.0


# ---- coordinator process ---------------------------------------------------------------


def tile_plan(tile: int, grid: int) -> GemmPlan:
    """The plan that cuts a (grid*tile) x tile x (grid*tile) GEMM into tile^3 tiles."""
    side = tile * grid
    flops = 2 * tile**3
    config = PlanConfig(
        min_offload_flops=1,
        max_tile_flops=flops,
        min_tile_flops=flops,
        min_tile_side=tile,
        target_tiles=1,
    )
    plan = plan_gemm(GemmShape("mm", 1, side, side, tile, 4), config)
    assert plan is not None and len(plan.tiles) == grid * grid
    assert all(region.dims == (1, tile, tile, tile) for region in plan.tiles), plan.grid
    return plan


@dataclass
class GemmStreamReport:
    gemms_submitted: int = 0
    gemms_done: int = 0
    gemms_correct: int = 0
    gemms_wrong: list[str] = field(default_factory=list)
    tiles_submitted: int = 0
    tiles_lost: int = 0  # submitted, never verified nor computed here, after the drain
    drained: bool = False


class GemmStream:
    """Keeps ``backlog`` tiles outstanding, so every worker's window stays full, and
    checks each assembled GEMM against ``torch.matmul`` as it completes."""

    def __init__(self, server: CoordinatorServer, cfg: LoadConfig) -> None:
        self.server = server
        self.plan = tile_plan(cfg.tile, cfg.grid)
        tiles_per_gemm = len(self.plan.tiles)
        # Every window full (small tiles share its slots: as many as a worker accepts)
        # plus two GEMMs queued: the queue never runs dry while the next GEMM is being
        # cut and signed.
        self.backlog = cfg.workers * held_tiles_limit(cfg.window) + 2 * tiles_per_gemm
        self.report = GemmStreamReport()
        self._outstanding: dict[str, int] = {}  # gemm id -> its tile count
        self._outstanding_tiles = 0
        self._changed = asyncio.Event()
        self._feeder: asyncio.Task[None] | None = None
        self._checks: set[asyncio.Task[None]] = set()
        # CPU seconds of this bench's own comparisons with torch.matmul: they run in the
        # coordinator's process but are no part of the coordinator, so the figures leave
        # them out.
        self.bench_check_cpu_s = 0.0

    def start(self) -> None:
        self._feeder = asyncio.create_task(self._feed())

    async def _feed(self) -> None:
        loop = asyncio.get_running_loop()
        for seq in range(1 << 62):
            while self._outstanding_tiles >= self.backlog:
                self._changed.clear()
                await self._changed.wait()
            gemm_id = f"load{seq}"
            # Cutting and signing is the training thread's job in production: keep it
            # off the event loop here too.
            jobs = await asyncio.to_thread(self._cut, gemm_id, seq, loop)
            self._outstanding[gemm_id] = len(jobs)
            self._outstanding_tiles += len(jobs)
            self.report.gemms_submitted += 1
            self.report.tiles_submitted += len(jobs)
            self.server.submit(jobs)

    def _cut(self, gemm_id: str, seq: int, loop: asyncio.AbstractEventLoop) -> list[SignedTile]:
        orchestrate_on_one_thread()  # as the training thread, which cuts in production
        g = torch.Generator().manual_seed(seq)
        m, n, k = self.plan.shape.m, self.plan.shape.n, self.plan.shape.k
        a = torch.randn(m, k, generator=g)
        b = torch.randn(k, n, generator=g)

        def on_done(out: torch.Tensor) -> None:  # on the server's verify thread
            loop.call_soon_threadsafe(self._finished, gemm_id, a, b, out)

        tiled = TiledGemm(gemm_id, self.plan, a, b, on_done)
        return list(tiled.iter_tiles(self.server.key))

    def _finished(self, gemm_id: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        self._outstanding_tiles -= self._outstanding.pop(gemm_id)
        self.report.gemms_done += 1
        self._changed.set()
        task = asyncio.create_task(self._check(gemm_id, a, b, out))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _check(
        self, gemm_id: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor
    ) -> None:
        ok, cpu_s = await asyncio.to_thread(_matches, a, b, out)
        self.bench_check_cpu_s += cpu_s
        if ok:
            self.report.gemms_correct += 1
        else:
            self.report.gemms_wrong.append(gemm_id)

    async def drain(self, timeout_s: float) -> GemmStreamReport:
        """Stop submitting, wait for every submitted GEMM, then count what is missing."""
        await self.stop_feeding()
        deadline = time.monotonic() + timeout_s
        while self._outstanding and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._checks:
            await asyncio.gather(*self._checks)
        self.report.drained = not self._outstanding
        # Tiles still in the server's job map were never verified (nor computed here).
        self.report.tiles_lost = len(self.server.tiles)
        return self.report

    async def stop_feeding(self) -> None:
        if self._feeder is not None:
            self._feeder.cancel()
            await asyncio.gather(self._feeder, return_exceptions=True)
            self._feeder = None


def _matches(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuple[bool, float]:
    """Whether ``out`` is ``a @ b``, and the CPU seconds this thread spent finding out."""
    orchestrate_on_one_thread()  # a team's helpers would spend CPU this does not count
    start = time.thread_time()
    want = torch.matmul(a, b)
    try:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
        ok = True
    except AssertionError:
        ok = False
    return ok, time.thread_time() - start


class LoopLag:
    """How late a 50 ms sleep wakes up: the time any ready callback (an ack to send, a
    frame to read) waits for this process's event loop. Tells which side is saturated."""

    PERIOD_S = 0.05

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (woke at, lateness s)
        # Garbage collections (ended at, generation, wall s, this thread's CPU s): a full
        # collection stops the loop as a whole; wall far above CPU means the process was
        # waiting for a core, not collecting.
        self.collections: list[tuple[float, int, float, float]] = []
        self._gc_start = (0.0, 0.0)
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.create_task(self._probe())

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now, cpu = time.monotonic(), time.thread_time()
        if phase == "start":
            self._gc_start = (now, cpu)
        else:
            wall_s, cpu_s = now - self._gc_start[0], cpu - self._gc_start[1]
            self.collections.append((now, info["generation"], wall_s, cpu_s))

    async def _probe(self) -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(self.PERIOD_S)
            now = time.monotonic()
            self.samples.append((now, now - start - self.PERIOD_S))

    def stop(self) -> None:
        self._task.cancel()
        gc.callbacks.remove(self._on_gc)

    def report(self) -> dict[str, list[Any]]:
        return {"lag": self.samples, "gc": self.collections}


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + 256  # sockets plus what Python, torch and SQLite hold
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard < 0 else min(want, hard), hard))


def coordinator_process(pipe: Connection, cfg: LoadConfig, profile: str = "") -> None:
    """Entry point of the coordinator process: serve, then obey the driver's commands.

    ``profile``: write cProfile stats of the event-loop thread (where heartbeats wait)
    over the tile phase (from the first GEMM fed until the drain) to this file: what
    the loop spends per tile, without the joins and leaves around it.
    """
    _raise_fd_limit(cfg.workers)
    keep_freed_memory()  # as the coordinator's process entry does
    # Timed by the thread's CPU clock: on shared cores a wall clock charges the time the
    # thread sat preempted to whatever call it was in.
    profiler = cProfile.Profile(timer=time.thread_time) if profile else None
    asyncio.run(_coordinator(pipe, cfg, profiler))
    if profiler is not None:
        profiler.dump_stats(profile)


async def _coordinator(
    pipe: Connection, cfg: LoadConfig, profiler: cProfile.Profile | None = None
) -> None:
    with tempfile.TemporaryDirectory(prefix="cleave-load-") as tmp:
        ledger = open_ledger(cfg.ledger or Path(tmp) / "ledger.sqlite")
        key = generate_private_key()
        server = CoordinatorServer(
            key=key,
            job_name="load-test",
            ledger=ledger,
            config=ServerConfig(core=CoreConfig(heartbeat_interval_s=cfg.heartbeat_s)),
        )
        port = await server.start("127.0.0.1", 0)
        settle_after_start()  # as the coordinator's process does once it listens
        stream = GemmStream(server, cfg)
        lag = LoopLag()
        pipe.send({"port": port, "key": public_key_hex(key)})
        try:
            while True:
                try:
                    command = await asyncio.to_thread(pipe.recv)
                except EOFError:  # the driver is gone
                    break
                if command == "snapshot":
                    pipe.send({**_snapshot(server), "bench_check_cpu_s": stream.bench_check_cpu_s})
                elif command == "status":
                    # What one /api/status request costs the event loop at this pool size.
                    start = time.perf_counter()
                    body = json.dumps(server.status())
                    build_s = time.perf_counter() - start
                    # What a full collection must walk: objects the GC tracks right now.
                    tracked = len(gc.get_objects())
                    pipe.send({"build_s": build_s, "bytes": len(body), "gc_objects": tracked})
                elif command == "feed":
                    if profiler is not None:
                        profiler.enable()  # this thread's calls: the event loop's
                    stream.start()
                    pipe.send("ok")
                elif command == "drain":
                    if profiler is not None:
                        profiler.disable()
                    report = await stream.drain(cfg.drain_timeout_s)
                    pipe.send({"stream": asdict(report), "loop": lag.report(), **_snapshot(server)})
                elif command == "quit":
                    break
        finally:
            lag.stop()
            await stream.stop_feeding()
            await server.close()
            ledger.close()


def _snapshot(server: CoordinatorServer) -> dict[str, Any]:
    return {
        "t": time.monotonic(),
        "conns": len(server.conns),
        "queued": server.scheduler.queued_count(),
        "pending": server.scheduler.pending(),
        "counters": asdict(server.counters),
        # CPU seconds by stage and by named thread (``COSTS``), the bench's own threads
        # (cutting, comparing with torch.matmul) not among them.
        "costs": COSTS.snapshot(),
    }


# ---- load process: N simulated workers on one event loop --------------------------------


@dataclass
class WorkerStats:
    welcomed: bool = False
    handshake_s: float = math.nan  # TCP connect to checked Welcome, last attempt
    retries: int = 0  # attempts refused or failed before the one that joined
    failure: str = ""  # why it never joined
    dropped: str = ""  # why the coordinator closed it before the run ended
    tiles: int = 0
    cancels: int = 0
    errors: list[str] = field(default_factory=list)
    beats: int = 0
    acks: list[tuple[float, float]] = field(default_factory=list)  # (sent at, latency s)
    unacked: list[float] = field(default_factory=list)  # when each unanswered beat was sent


class SimWorker:
    """The protocol of ``client_app.worker`` without its threads and owner limits: a
    64^3 matmul takes microseconds, so computing on the event loop is cheaper than a hop."""

    def __init__(
        self,
        name: str,
        key: Ed25519PrivateKey,
        coordinator_key: str,
        window: int,
        rng: random.Random,
    ) -> None:
        self.name = name
        self.key = key
        self.coordinator_key = coordinator_key
        self.coordinator_public: Ed25519PublicKey = public_key_from_hex(coordinator_key)
        self.window = window
        self.rng = rng
        self.stats = WorkerStats()
        self.interval = 2.0  # replaced by the Welcome's heartbeat interval
        self.joined: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._beat_sent: dict[int, float] = {}

    async def run(self, url: str, gate: asyncio.Semaphore, stop: asyncio.Event) -> None:
        ws = None
        try:
            ws = await self._join(url, gate)
        finally:
            # Also on an unexpected exception, so that the ramp-up never waits forever.
            self.joined.set_result(ws is not None)
        if ws is None:
            return
        beating = asyncio.create_task(self._heartbeats(ws))
        leaving = asyncio.create_task(self._leave_when(stop, ws, beating))
        try:
            await self._serve(ws)
        finally:
            beating.cancel()
            leaving.cancel()
            await asyncio.gather(beating, leaving, return_exceptions=True)
            self.stats.unacked = list(self._beat_sent.values())
        if not stop.is_set():
            self.stats.dropped = f"{ws.close_code}: {ws.close_reason}"

    async def _join(self, url: str, gate: asyncio.Semaphore) -> ClientConnection | None:
        for attempt in range(CONNECT_ATTEMPTS):
            async with gate:
                start = time.perf_counter()
                ws: ClientConnection | None = None
                try:
                    ws = await connect(url, compression=None, max_size=MAX_FRAME, open_timeout=30)
                    welcome = await asyncio.wait_for(self._handshake(ws), 30)
                except (OSError, ConnectionClosed, InvalidHandshake, TimeoutError) as exc:
                    # A coordinator busy with other handshakes says "retry later" (1013).
                    self.stats.retries += 1
                    self.stats.failure = f"{type(exc).__name__}: {exc}"
                    if ws is not None:
                        with contextlib.suppress(Exception):
                            await ws.close()
                except ProtocolError as exc:  # a bad signature or an Error: never retried
                    self.stats.failure = f"{type(exc).__name__}: {exc}"
                    if ws is not None:
                        await ws.close()
                    return None
                else:
                    self.stats.handshake_s = time.perf_counter() - start
                    self.stats.welcomed = True
                    self.stats.failure = ""
                    self.interval = welcome.heartbeat_interval_s
                    return ws
            # Capped exponential backoff with jitter, as the real worker does.
            await asyncio.sleep(self.rng.uniform(0.5, 1.0) * min(2.0, 0.05 * 2**attempt))
        return None

    async def _handshake(self, ws: ClientConnection) -> Welcome:
        received = parse_message(_binary(await ws.recv()))
        challenge = received.message
        if not isinstance(challenge, Challenge):
            raise ProtocolError(f"expected a challenge, got {challenge.TYPE}")
        if challenge.coordinator_key != self.coordinator_key:
            raise ProtocolError("the coordinator's key is not the pinned one")
        hello = answer_challenge(
            challenge,
            key=self.key,
            nonce=new_nonce(),
            name=self.name,
            profile=PROFILE,
            window=self.window,
            client="bench-load",
        )
        await ws.send(encode_message(hello))
        received = parse_message(_binary(await ws.recv()))
        welcome = received.message
        if isinstance(welcome, Error):
            raise ProtocolError(f"refused: {welcome.code}: {welcome.message}")
        if not isinstance(welcome, Welcome):
            raise ProtocolError(f"expected a welcome, got {welcome.TYPE}")
        check_welcome(welcome, received.frame.header, challenge, hello)
        return welcome

    async def _heartbeats(self, ws: ClientConnection) -> None:
        # Real workers join at different moments; a random phase spreads the beats the
        # same way instead of N of them landing in the same millisecond.
        await asyncio.sleep(self.rng.uniform(0.0, self.interval))
        with contextlib.suppress(ConnectionClosed):
            for seq in range(1, 1 << 62):
                self._beat_sent[seq] = time.monotonic()
                await ws.send(encode_message(Heartbeat(seq, "working", 0)))
                self.stats.beats += 1
                await asyncio.sleep(self.interval)

    async def _serve(self, ws: ClientConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for data in ws:
                assert isinstance(data, bytes), "the coordinator sends binary frames only"
                frames = parse_messages(data)
                # The results of a batch's tasks go back together, as the worker's
                # send loop returns the results finished while it sent.
                results = [r for r in map(self._take, frames) if r is not None]
                for out in packed(results, DEFAULT_LIMITS.max_batch_frames):
                    await ws.send(out)

    def _take(self, received: Received) -> bytes | None:
        """Handle one message; the result frame to send for a task."""
        msg = received.message
        if isinstance(msg, Task):
            try:
                a, b = verify_task(received, self.coordinator_public)
            except ProtocolError as exc:  # never expected: counted, and the run fails
                self.stats.errors.append(f"bad task: {exc.code}")
                return None
            start = time.perf_counter()
            c = torch.matmul(a, b)
            result = Result(msg.tile_id, compute_s=time.perf_counter() - start)
            self.stats.tiles += 1
            return encode_message(result, [("c", c)])
        if isinstance(msg, Ack):
            sent = self._beat_sent.pop(msg.seq, None)
            if sent is not None:
                self.stats.acks.append((sent, time.monotonic() - sent))
        elif isinstance(msg, Cancel):
            self.stats.cancels += 1
        elif isinstance(msg, Error):
            self.stats.errors.append(msg.code)
        return None

    async def _leave_when(
        self, stop: asyncio.Event, ws: ClientConnection, beating: asyncio.Task[None]
    ) -> None:
        await stop.wait()
        beating.cancel()
        # Beats sent before the stop are owed an ack: wait for them (bounded), so that an
        # unanswered beat is one the coordinator missed, not one the leave cut off.
        stopped = time.monotonic()
        while any(sent < stopped for sent in self._beat_sent.values()):
            if time.monotonic() - stopped > ACK_WAIT_S:
                break
            await asyncio.sleep(0.01)
        with contextlib.suppress(ConnectionClosed):
            await ws.send(encode_message(Bye("load test over")))
        # The coordinator closes after a bye; close ourselves if it does not.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ws.wait_closed(), 10)
        await ws.close()


def _binary(data: str | bytes) -> bytes:
    if isinstance(data, str):
        raise ProtocolError("the coordinator sent a text frame")
    return data


def load_process(
    pipe: Connection, cfg: LoadConfig, url: str, coordinator_key: str, names: list[str]
) -> None:
    """Entry point of a load process: a simulated worker for each of ``names``."""
    _raise_fd_limit(len(names))
    torch.set_num_threads(1)  # tiny matmuls: a thread pool only adds hand-offs
    asyncio.run(_load(pipe, cfg, url, coordinator_key, names))


async def _load(
    pipe: Connection, cfg: LoadConfig, url: str, coordinator_key: str, names: list[str]
) -> None:
    rng = random.Random(names[0] if names else "")
    workers = [
        SimWorker(name, generate_private_key(), coordinator_key, cfg.window, rng) for name in names
    ]
    pipe.send("ready")
    if await asyncio.to_thread(pipe.recv) != "connect":
        return
    lag = LoopLag()
    stop = asyncio.Event()
    gate = asyncio.Semaphore(cfg.connect_concurrency)
    start = time.perf_counter()
    runs = [asyncio.create_task(w.run(url, gate, stop)) for w in workers]
    await asyncio.gather(*(w.joined for w in workers))
    pipe.send({"ramp_s": time.perf_counter() - start})
    with contextlib.suppress(EOFError):
        await asyncio.to_thread(pipe.recv)  # "stop" (or the driver went away)
    stop.set()
    _, late = await asyncio.wait(runs, timeout=30)
    for task in late:
        task.cancel()
    await asyncio.gather(*runs, return_exceptions=True)
    lag.stop()
    pipe.send({"workers": [asdict(w.stats) for w in workers], "loop": lag.report()})


# ---- the driver ---------------------------------------------------------------------------


def _recv(pipe: Connection, what: str, timeout_s: float = PIPE_TIMEOUT_S) -> Any:
    if not pipe.poll(timeout_s):
        raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
    return pipe.recv()


def _ask(pipe: Connection, command: str, what: str) -> Any:
    pipe.send(command)
    return _recv(pipe, what)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def run_load(cfg: LoadConfig, profile: str = "") -> dict[str, Any]:
    """Run the whole load test and return its measurements (see ``format_table``)."""
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    try:
        coord_pipes: list[Connection] = []
        for rank in range(cfg.ranks):
            coord_pipe, child = ctx.Pipe()
            coord = ctx.Process(
                target=coordinator_process,
                args=(child, cfg, profile if rank == 0 else ""),
                name=f"coordinator-{rank}",
            )
            coord.start()
            procs.append(coord)
            coord_pipes.append(coord_pipe)
        hellos = [_recv(pipe, "coordinator start") for pipe in coord_pipes]
        coord_ps = [psutil.Process(proc.pid) for proc in procs]

        # Each load process serves one rank's share of the connections; the probes
        # (rank 0's) come last, in a process of their own.
        n_load = max(cfg.procs, cfg.ranks)
        probes = min(cfg.probes, cfg.workers // 2)
        loaded = cfg.workers - probes
        load_pipes: list[Connection] = []
        shares = [loaded // n_load + (i < loaded % n_load) for i in range(n_load)]
        first = 0
        for i, share in enumerate([*shares, probes] if probes else shares):
            hello = hellos[i % cfg.ranks if i < n_load else 0]
            url = f"ws://127.0.0.1:{hello['port']}/ws"
            prefix = "load" if i < n_load else "probe"
            names = [f"{prefix}-{first + j}" for j in range(share)]
            pipe, child = ctx.Pipe()
            args = (child, cfg, url, hello["key"], names)
            load = ctx.Process(target=load_process, args=args, name=f"{prefix}-{i}")
            load.start()
            procs.append(load)
            load_pipes.append(pipe)
            first += share
        for pipe in load_pipes:
            _recv(pipe, "load process start")

        time.sleep(0.5)  # the idle coordinators settle (imports done, servers listening)
        rss_before = sum(ps.memory_info().rss for ps in coord_ps)
        ramp_start = time.perf_counter()
        for pipe in load_pipes:
            pipe.send("connect")
        for pipe in load_pipes:
            _recv(pipe, "connections")
        ramp_s = time.perf_counter() - ramp_start

        # RSS with everyone connected and beating, before any tile exists: connections only.
        time.sleep(cfg.heartbeat_s)
        connected = _merged(_ask_all(coord_pipes, "snapshot"))
        rss_connected = sum(ps.memory_info().rss for ps in coord_ps)
        status = _ask(coord_pipes[0], "status", "status")

        _ask_all(coord_pipes, "feed")
        time.sleep(cfg.warmup_s)
        # psutil: the first call of cpu_percent only starts the interval.
        load_ps = [psutil.Process(proc.pid) for proc in procs[cfg.ranks :]]
        for ps in [*coord_ps, *load_ps]:
            ps.cpu_percent()
        psutil.cpu_percent()
        steady_a = _merged(_ask_all(coord_pipes, "snapshot"))
        rss_peak = rss_connected
        deadline = time.monotonic() + cfg.seconds
        while time.monotonic() < deadline:
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            rss_peak = max(rss_peak, sum(ps.memory_info().rss for ps in coord_ps))
        # The whole processes, the bench's checks too; the ranks' together.
        cpu_percent = sum(ps.cpu_percent() for ps in coord_ps)
        load_cpu_percent = [ps.cpu_percent() for ps in load_ps[:n_load]]
        machine_cpu_percent = psutil.cpu_percent() * psutil.cpu_count()
        steady_b = _merged(_ask_all(coord_pipes, "snapshot"))

        final = _merged(_ask_all(coord_pipes, "drain"))
        stats: list[dict[str, Any]] = []
        load_loop: list[dict[str, list[Any]]] = []
        for pipe in load_pipes:
            pipe.send("stop")
        probe_stats: list[dict[str, Any]] = []
        for i, pipe in enumerate(load_pipes):
            report = _recv(pipe, "worker stats")
            stats.extend(report["workers"])
            if i < n_load:
                load_loop.append(report["loop"])  # the probes' loop is not the load's
            else:
                probe_stats = report["workers"]
        for pipe in coord_pipes:
            pipe.send("quit")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():  # pragma: no cover - only when a phase hung
                proc.kill()
                proc.join()
    return _measurements(
        cfg,
        stats,
        probe_stats,
        ramp_s=ramp_s,
        rss_before=rss_before,
        rss_connected=rss_connected,
        rss_peak=rss_peak,
        cpu_percent=cpu_percent,
        status=status,
        load_cpu_percent=load_cpu_percent,
        machine_cpu_percent=machine_cpu_percent,
        load_loop=load_loop,
        connected=connected,
        steady_a=steady_a,
        steady_b=steady_b,
        final=final,
    )


def _ask_all(pipes: list[Connection], command: str) -> list[Any]:
    """``command`` to every coordinator at once, then each one's reply."""
    for pipe in pipes:
        pipe.send(command)
    return [_recv(pipe, command) for pipe in pipes]


def _merged(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """The coordinators' snapshots (or drain reports) as one: counts summed, the window
    the one they all cover (the latest start, the earliest end: each replied within
    moments of the others), their event loops' samples pooled."""
    if len(replies) == 1:
        return replies[0]
    out: dict[str, Any] = {}
    names = dict.fromkeys(name for reply in replies for name in reply)  # CPU stages may differ
    for name in names:
        values = [reply[name] for reply in replies if name in reply]
        value = values[0]
        if name == "t":
            out[name] = values
        elif isinstance(value, bool):
            out[name] = all(values)
        elif isinstance(value, (int, float)):
            out[name] = sum(values)
        elif isinstance(value, list):
            out[name] = [item for v in values for item in v]
        elif isinstance(value, dict):
            out[name] = _merged(values)
        else:
            out[name] = value
    return out


def _latest(t: float | list[float]) -> float:
    return max(t) if isinstance(t, list) else t


def _earliest(t: float | list[float]) -> float:
    return min(t) if isinstance(t, list) else t


def _per_tile_parts(
    before: dict[str, float], after: dict[str, float], tiles: int, total_us: float
) -> dict[str, float]:
    """Microseconds of coordinator CPU per verified tile by part, largest first: the
    stages timed where they run, what each named thread spent beyond them, and what is
    left of ``total_us`` (the process's CPU per tile): threads without a name (the
    bench's cutting threads beyond their stages, Python's own), measured over about the
    same window."""
    if tiles <= 0:
        return {}
    spent = {k: v - before.get(k, 0.0) for k, v in after.items()}
    # Stages that run on a named thread, taken out of its total so nothing counts twice.
    on_thread = {
        "thread:event_loop": ("check_on_loop", "sign_variant"),
        "thread:checks": ("decode", "check", "assemble", "stranded_tiles"),
    }
    parts = {k: v for k, v in spent.items() if not k.startswith("thread:")}
    for thread, stages in on_thread.items():
        if thread in spent:
            parts[f"{thread[7:]} rest"] = spent[thread] - sum(spent.get(s, 0.0) for s in stages)
    for k, v in spent.items():
        if k.startswith("thread:") and k not in on_thread:
            parts[k[7:]] = v
    per_tile = {k: 1e6 * v / tiles for k, v in parts.items()}
    per_tile["unnamed threads"] = total_us - sum(per_tile.values())
    return dict(sorted(per_tile.items(), key=lambda kv: -kv[1]))


def _measurements(
    cfg: LoadConfig,
    stats: list[dict[str, Any]],
    probe_stats: list[dict[str, Any]],
    *,
    ramp_s: float,
    rss_before: int,
    rss_connected: int,
    rss_peak: int,
    cpu_percent: float,
    status: dict[str, Any],
    load_cpu_percent: list[float],
    machine_cpu_percent: float,
    load_loop: list[dict[str, list[Any]]],
    connected: dict[str, Any],
    steady_a: dict[str, Any],
    steady_b: dict[str, Any],
    final: dict[str, Any],
) -> dict[str, Any]:
    welcomed = [s for s in stats if s["welcomed"]]
    handshakes = [s["handshake_s"] for s in welcomed]
    t_a, t_b = _latest(steady_a["t"]), _earliest(steady_b["t"])
    all_acks = [ack for s in stats for ack in s["acks"]]
    steady_acks = [latency for sent, latency in all_acks if t_a <= sent <= t_b]
    probe_acks = [lat for s in probe_stats for sent, lat in s["acks"] if t_a <= sent <= t_b]
    # Beats sent in the steady phase that never got an ack (the last beat of each
    # worker, sent as the run ended, is not counted: its ack may have crossed the bye).
    steady_unacked = sum(1 for s in stats for sent in s["unacked"] if t_a <= sent <= t_b)
    coord_lag = [lag for t, lag in final["loop"]["lag"] if t_a <= t <= t_b]
    steady_load_lag = [lag for loop in load_loop for t, lag in loop["lag"] if t_a <= t <= t_b]

    def full_gc(loops: list[dict[str, list[Any]]]) -> list[tuple[float, float]]:
        return [
            (wall, cpu)
            for loop in loops
            for t, gen, wall, cpu in loop["gc"]
            if gen == 2 and t_a <= t <= t_b
        ]

    coord_gc, load_gc = full_gc([final["loop"]]), full_gc(load_loop)
    steady_s = t_b - t_a
    # The coordinator's own CPU: the process's, less this bench's comparisons in it.
    bench_check_s = steady_b["bench_check_cpu_s"] - steady_a["bench_check_cpu_s"]
    cpu_percent = max(0.0, cpu_percent - 100 * bench_check_s / steady_s)
    a, b, end = steady_a["counters"], steady_b["counters"], final["counters"]
    verified = b["tiles_verified"] - a["tiles_verified"]
    verified_per_s = verified / steady_s
    cpu_us_per_tile = 1e4 * cpu_percent / verified_per_s if verified_per_s else 0.0
    stream = final["stream"]
    errors = Counter(code for s in stats for code in s["errors"])
    return {
        "config": asdict(cfg),
        "workers_welcomed": len(welcomed),
        "workers_failed": [s["failure"] for s in stats if not s["welcomed"]],
        "workers_dropped": [s["dropped"] for s in stats if s["dropped"]],
        "handshake_retries": sum(s["retries"] for s in stats),
        "coordinator_conns_seen": connected["conns"],
        "ramp_s": ramp_s,
        "handshake_p50_ms": 1e3 * percentile(handshakes, 50),
        "handshake_p99_ms": 1e3 * percentile(handshakes, 99),
        "heartbeats_sent": sum(s["beats"] for s in stats),
        "heartbeats_acked": len(all_acks),
        "workers_with_acks": sum(1 for s in stats if s["acks"]),
        "ack_p50_ms": 1e3 * percentile(steady_acks, 50),
        "ack_p99_ms": 1e3 * percentile(steady_acks, 99),
        "ack_max_ms": 1e3 * max(steady_acks, default=math.nan),
        "probes": len(probe_stats),
        "probe_ack_p50_ms": 1e3 * percentile(probe_acks, 50),
        "probe_ack_p99_ms": 1e3 * percentile(probe_acks, 99),
        "probe_ack_max_ms": 1e3 * max(probe_acks, default=math.nan),
        "heartbeats_unacked_steady": steady_unacked,
        "coordinator_loop_lag_p50_ms": 1e3 * percentile(coord_lag, 50),
        "coordinator_loop_lag_p99_ms": 1e3 * percentile(coord_lag, 99),
        "load_loop_lag_p50_ms": 1e3 * percentile(steady_load_lag, 50),
        "load_loop_lag_p99_ms": 1e3 * percentile(steady_load_lag, 99),
        "coordinator_full_gc_steady": len(coord_gc),
        "coordinator_full_gc_max_ms": 1e3 * max((w for w, _ in coord_gc), default=0.0),
        "coordinator_full_gc_max_cpu_ms": 1e3 * max((c for _, c in coord_gc), default=0.0),
        "load_full_gc_steady": len(load_gc),
        "load_full_gc_max_ms": 1e3 * max((w for w, _ in load_gc), default=0.0),
        "load_full_gc_max_cpu_ms": 1e3 * max((c for _, c in load_gc), default=0.0),
        "rss_before_mb": rss_before / 2**20,
        "rss_connected_mb": rss_connected / 2**20,
        "rss_per_conn_kb": (rss_connected - rss_before) / max(1, len(welcomed)) / 1024,
        "rss_peak_steady_mb": rss_peak / 2**20,
        "cpu_percent_steady": cpu_percent,
        "bench_check_cpu_percent_steady": 100 * bench_check_s / steady_s,
        "status_build_ms": 1e3 * status["build_s"],
        "status_kib": status["bytes"] / 1024,
        "coordinator_gc_objects": status["gc_objects"],
        "load_cpu_percent_steady": load_cpu_percent,
        "machine_cpu_percent_steady": machine_cpu_percent,
        "machine_cores": psutil.cpu_count(),
        "steady_s": steady_s,
        "tiles_sent_per_s": (b["tiles_sent"] - a["tiles_sent"]) / steady_s,
        "tiles_verified_per_s": verified_per_s,
        "cpu_us_per_tile": cpu_us_per_tile,
        "cpu_us_per_tile_by_part": _per_tile_parts(
            steady_a["costs"], steady_b["costs"], verified, cpu_us_per_tile
        ),
        "workers_with_tiles": sum(1 for s in stats if s["tiles"]),
        "tiles_computed_by_workers": sum(s["tiles"] for s in stats),
        "tiles_submitted": stream["tiles_submitted"],
        "tiles_verified": end["tiles_verified"],
        "tiles_reissued": end["reissued"],
        "tiles_rejected": end["rejected"],
        "tiles_computed_here": end["computed_here"],
        "tiles_lost": stream["tiles_lost"],
        "gemms_submitted": stream["gemms_submitted"],
        "gemms_correct": stream["gemms_correct"],
        "gemms_wrong": stream["gemms_wrong"],
        "drained": stream["drained"],
        "worker_errors": dict(errors),
    }


def format_table(m: dict[str, Any]) -> str:
    cfg = m["config"]
    rows = [
        ("connections welcomed", f"{m['workers_welcomed']} / {cfg['workers']}"),
        ("ramp-up, all connections", f"{m['ramp_s']:.2f} s ({cfg['connect_concurrency']} at once)"),
        ("handshake p50 / p99", f"{m['handshake_p50_ms']:.0f} / {m['handshake_p99_ms']:.0f} ms"),
        ("handshake retries (1013 busy)", f"{m['handshake_retries']}"),
        ("heartbeat -> ack p50 / p99", f"{m['ack_p50_ms']:.1f} / {m['ack_p99_ms']:.1f} ms"),
        ("heartbeat -> ack max", f"{m['ack_max_ms']:.1f} ms"),
        (
            f"heartbeat -> ack p50 / p99 / max, {m['probes']} probes",
            f"{m['probe_ack_p50_ms']:.1f} / {m['probe_ack_p99_ms']:.1f} / "
            f"{m['probe_ack_max_ms']:.1f} ms (connections in a process of their own)",
        ),
        ("heartbeats unacked, steady", f"{m['heartbeats_unacked_steady']}"),
        (
            "event-loop lag p50 / p99, coordinator",
            f"{m['coordinator_loop_lag_p50_ms']:.1f} / {m['coordinator_loop_lag_p99_ms']:.1f} ms",
        ),
        (
            "event-loop lag p50 / p99, load",
            f"{m['load_loop_lag_p50_ms']:.1f} / {m['load_loop_lag_p99_ms']:.1f} ms",
        ),
        (
            "full GCs, steady (max wall / CPU), coordinator",
            f"{m['coordinator_full_gc_steady']} ({m['coordinator_full_gc_max_ms']:.0f} / "
            f"{m['coordinator_full_gc_max_cpu_ms']:.0f} ms)",
        ),
        ("objects tracked by the coordinator's GC", f"{m['coordinator_gc_objects']:,}"),
        (
            "full GCs, steady (max wall / CPU), load",
            f"{m['load_full_gc_steady']} ({m['load_full_gc_max_ms']:.0f} / "
            f"{m['load_full_gc_max_cpu_ms']:.0f} ms)",
        ),
        (
            "heartbeats acked",
            f"{m['heartbeats_acked']} / {m['heartbeats_sent']} "
            f"(every {cfg['heartbeat_s']:g} s, {m['workers_with_acks']} workers)",
        ),
        ("coordinator RSS idle", f"{m['rss_before_mb']:.0f} MiB"),
        ("coordinator RSS connected", f"{m['rss_connected_mb']:.0f} MiB"),
        ("coordinator RSS per connection", f"{m['rss_per_conn_kb']:.0f} KiB"),
        ("coordinator RSS peak, steady", f"{m['rss_peak_steady_mb']:.0f} MiB"),
        (
            "coordinator CPU, steady",
            f"{m['cpu_percent_steady']:.0f} % (of one core; the bench's own GEMM checks, "
            f"{m['bench_check_cpu_percent_steady']:.0f} %, left out)",
        ),
        (
            "load process CPU, steady",
            " + ".join(f"{p:.0f} %" for p in m["load_cpu_percent_steady"]),
        ),
        (
            "machine CPU, steady (all processes)",
            f"{m['machine_cpu_percent_steady']:.0f} % of {m['machine_cores']}00 %",
        ),
        (
            "/api/status build, all connected",
            f"{m['status_build_ms']:.0f} ms on the event loop ({m['status_kib']:.0f} KiB)",
        ),
        ("tiles dispatched / s", f"{m['tiles_sent_per_s']:.0f}"),
        ("tiles verified / s", f"{m['tiles_verified_per_s']:.0f}"),
        (
            "coordinator CPU per verified tile",
            f"{m['cpu_us_per_tile']:.0f} us (one core: {1e6 / m['cpu_us_per_tile']:.0f} tiles/s)"
            if m["cpu_us_per_tile"]
            else "-",
        ),
        (
            "the same, by part (us)",
            ", ".join(f"{k} {v:.0f}" for k, v in m["cpu_us_per_tile_by_part"].items() if v >= 1)
            or "-",
        ),
        ("workers that computed tiles", f"{m['workers_with_tiles']} / {cfg['workers']}"),
        ("tiles submitted / verified", f"{m['tiles_submitted']} / {m['tiles_verified']}"),
        ("tiles re-issued", f"{m['tiles_reissued']}"),
        ("tiles lost", f"{m['tiles_lost']}"),
        (
            "GEMMs correct (vs torch.matmul)",
            f"{m['gemms_correct']} / {m['gemms_submitted']}",
        ),
        ("connections dropped", f"{len(m['workers_dropped'])}"),
    ]
    width = max(len(name) for name, _ in rows)
    ranks = cfg.get("ranks", 1)
    title = (
        (
            f"{ranks} coordinator ranks (each its share of the connections; sums below), "
            if ranks > 1
            else ""
        )
        + f"{cfg['workers']} workers, {max(cfg['procs'], ranks)} load process(es), "
        f"{cfg['tile']}^3 fp32 tiles, window {cfg['window']}, steady {m['steady_s']:.1f} s"
    )
    lines = [title, f"| {'what'.ljust(width)} | value |", f"| {'-' * width} | --- |"]
    lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    defaults = LoadConfig()
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--seconds", type=float, default=defaults.seconds)
    parser.add_argument("--tile", type=int, default=defaults.tile)
    parser.add_argument("--grid", type=int, default=defaults.grid, help="tiles per GEMM side")
    parser.add_argument("--window", type=int, default=defaults.window)
    parser.add_argument("--procs", type=int, default=defaults.procs, help="load processes")
    parser.add_argument(
        "--probes",
        type=int,
        default=defaults.probes,
        help="connections in a process of their own, whose acks time the coordinator",
    )
    parser.add_argument("--heartbeat", type=float, default=defaults.heartbeat_s)
    parser.add_argument(
        "--ranks", type=int, default=defaults.ranks, help="coordinator processes sharing the load"
    )
    parser.add_argument(
        "--ledger", default=defaults.ledger, help="a PostgreSQL URL the coordinators share"
    )
    parser.add_argument("--json", type=Path, help="also write the measurements here")
    parser.add_argument(
        "--profile", type=Path, help="cProfile the coordinator's event loop into this file"
    )
    args = parser.parse_args()
    cfg = LoadConfig(
        workers=args.workers,
        seconds=args.seconds,
        tile=args.tile,
        grid=args.grid,
        window=args.window,
        procs=args.procs,
        probes=args.probes,
        heartbeat_s=args.heartbeat,
        ranks=args.ranks,
        ledger=args.ledger,
    )
    measured = run_load(cfg, str(args.profile.resolve()) if args.profile else "")
    print(format_table(measured))
    if args.json:
        args.json.write_text(json.dumps(measured, indent=2) + "\n")
    ok = (
        measured["workers_welcomed"] == cfg.workers
        and measured["tiles_lost"] == 0
        and not measured["gemms_wrong"]
        and measured["drained"]
    )
    if not ok:
        print("FAILED: a connection was refused, a tile lost or a GEMM wrong", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
