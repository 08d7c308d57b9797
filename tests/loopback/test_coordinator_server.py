"""The coordinator's server in-process on 127.0.0.1 (port 0): real WebSockets, real workers.

Honest workers are real ``client_app.worker.WorkerCore`` instances running in the same
event loop; clients that must misbehave are raw websockets connections speaking
``common.messages``. GEMMs are cut with ``TiledGemm.iter_tiles`` as ``TileOffload`` does,
and every assembled output is checked against ``torch.matmul``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import random
import sqlite3
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from support.memory_pool import PROFILE
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from client_app.config import PinStore, WorkerSettings
from client_app.options import WorkerOptions
from client_app.worker import RunResult, WorkerCore
from common import PROTOCOL_VERSION
from common.auth import answer_challenge, new_nonce
from common.batches import batch_frame
from common.frames import decode_frame, encode_frame
from common.limits import held_tiles_limit
from common.messages import (
    Ack,
    Challenge,
    DeviceProfile,
    Error,
    Heartbeat,
    Message,
    Received,
    Result,
    Task,
    Welcome,
    encode_message,
    parse_messages,
    verify_task,
)
from common.signing import (
    SIGNATURE_FIELD,
    fingerprint,
    generate_private_key,
    public_key_from_hex,
    public_key_hex,
)
from coordinator.plan.planner import GemmShape, PlanConfig, plan_gemm
from coordinator.pool.core import CoreConfig
from coordinator.pool.ledger import Contribution, Ledger
from coordinator.serve import server as server_module
from coordinator.serve.server import CoordinatorServer, ServerConfig
from coordinator.tiles.tiled_gemm import TiledGemm

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
PLAN = PlanConfig(min_offload_flops=1, min_tile_flops=1, target_tiles=8)
K_SPLIT_PLAN = PlanConfig(min_offload_flops=1, min_tile_flops=1, tile_mem_cap_bytes=30_000)
FAST = dict(core=CoreConfig(heartbeat_interval_s=0.1), expire_every_s=0.05)


async def within(aw: Awaitable[T], seconds: float = 15.0) -> T:
    return await asyncio.wait_for(aw, seconds)


async def until(predicate: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds} s waiting for {what}")
        await asyncio.sleep(0.01)


# ---- the coordinator and its GEMMs ------------------------------------------------------


class Coordinator:
    def __init__(self, server: CoordinatorServer, ledger: Ledger) -> None:
        self.server = server
        self.ledger = ledger
        port = server.port
        self.url = f"ws://127.0.0.1:{port}/ws"
        self.http = f"http://127.0.0.1:{port}"

    def conn_ids(self) -> dict[str, str]:
        """Connected workers: name -> worker id (a reconnect would get a new id)."""
        return {c.name: c.worker_id for c in self.server.conns.values()}


@contextlib.asynccontextmanager
async def coordinator(tmp_path: Path, **config: Any) -> AsyncIterator[Coordinator]:
    ledger = Ledger(tmp_path / "state" / "ledger.sqlite")
    server = CoordinatorServer(
        key=generate_private_key(),
        job_name="loopback-job",
        ledger=ledger,
        config=ServerConfig(**{**FAST, **config}),
        status_extra=lambda: {"step": 7},
    )
    await server.start("127.0.0.1", 0)
    try:
        yield Coordinator(server, ledger)
    finally:
        await server.close()
        ledger.close()


class Gemm:
    """One GEMM submitted as tiles; ``result`` resolves with the assembled output."""

    def __init__(
        self,
        server: CoordinatorServer,
        gemm_id: str,
        shape: tuple[int, ...],
        config: PlanConfig = PLAN,
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        *batch, m, k, n = shape
        self.a = torch.randn(*batch, m, k, generator=g)
        self.b = torch.randn(*batch, k, n, generator=g)
        op = "bmm" if batch else "mm"
        plan = plan_gemm(GemmShape(op, batch[0] if batch else 1, m, n, k, 4), config)
        assert plan is not None
        loop = asyncio.get_running_loop()
        self.result: asyncio.Future[torch.Tensor] = loop.create_future()
        self.done_calls = 0

        def on_done(out: torch.Tensor) -> None:  # called on the server's verify thread
            self.done_calls += 1
            loop.call_soon_threadsafe(self.result.set_result, out)

        self.tiled = TiledGemm(gemm_id, plan, self.a, self.b, on_done)
        self.tiles = list(self.tiled.iter_tiles(server.key))
        self.tile_ids = [job.tile_id for job in self.tiles]
        self.flops = sum(job.flops for job in self.tiles)
        server.submit(self.tiles)

    async def check(self, seconds: float = 20.0) -> torch.Tensor:
        out = await within(self.result, seconds)
        want = torch.matmul(self.a, self.b)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
        assert self.done_calls == 1
        return out


# ---- honest workers (the real WorkerCore) -------------------------------------------------


class Honest:
    def __init__(self, url: str, tmp_path: Path, name: str, window: int = 2) -> None:
        settings = WorkerSettings(
            coordinator_url=url, name=name, threads=1, use_gpu=False, window=window
        )
        self.core = WorkerCore(
            settings,
            pin_check=PinStore.in_dir(tmp_path / f"pins-{name}").check,
            options=WorkerOptions(
                profile=PROFILE, backoff_base_s=0.02, backoff_cap_s=0.1, rng=random.Random(0)
            ),
        )
        self.task = asyncio.create_task(self.core.run())

    async def stop(self) -> None:
        self.core.stop()
        assert await within(self.task) is RunResult.STOPPED


@contextlib.asynccontextmanager
async def honest_workers(coord: Coordinator, tmp_path: Path, *names: str) -> AsyncIterator[None]:
    workers = [Honest(coord.url, tmp_path, name) for name in names]
    try:
        await until(lambda: set(names) <= set(coord.conn_ids()), f"workers {names} to join")
        yield
    finally:
        for worker in workers:
            await worker.stop()


# ---- raw clients (for misbehaving) --------------------------------------------------------


class Raw:
    """A websockets client that speaks the protocol by hand."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.welcome: Welcome | None = None
        self.pending: collections.deque[Received] = collections.deque()

    @classmethod
    async def connect(cls, url: str) -> Raw:
        ws = await connect(url, compression=None, max_size=1 << 26, open_timeout=10)
        return cls(ws)

    async def hello(
        self,
        name: str,
        *,
        window: int = 1,
        profile: DeviceProfile = PROFILE,
        key: Ed25519PrivateKey | None = None,
        token: str = "",
        cache_bytes: int = 0,
    ) -> None:
        """Answer the coordinator's challenge with a properly signed hello."""
        challenge = (await self.expect(Challenge)).message
        assert isinstance(challenge, Challenge)
        hello = answer_challenge(
            challenge,
            key=key or generate_private_key(),
            nonce=new_nonce(),
            name=name,
            profile=profile,
            window=window,
            client="raw-test-client",
            token=token,
            cache_bytes=cache_bytes,
        )
        await self.send(hello)

    @classmethod
    async def join(
        cls,
        coord: Coordinator,
        name: str,
        window: int = 1,
        profile: DeviceProfile = PROFILE,
        key: Ed25519PrivateKey | None = None,
        token: str = "",
        cache_bytes: int = 0,
    ) -> Raw:
        raw = await cls.connect(coord.url)
        await raw.hello(
            name, window=window, profile=profile, key=key, token=token, cache_bytes=cache_bytes
        )
        welcome = (await raw.expect(Welcome)).message
        assert isinstance(welcome, Welcome)
        raw.welcome = welcome
        await until(lambda: name in coord.conn_ids(), f"{name} to join")
        return raw

    async def send(
        self, msg: Message, tensors: list[tuple[str, torch.Tensor]] | None = None
    ) -> None:
        await self.ws.send(encode_message(msg, tensors))

    async def recv(self, seconds: float = 10.0) -> Received:
        """The next message (those of a batch one at a time)."""
        if not self.pending:
            data = await within(self.ws.recv(), seconds)
            assert isinstance(data, bytes)
            self.pending.extend(parse_messages(data))
        return self.pending.popleft()

    async def expect(self, cls: type, seconds: float = 10.0) -> Received:
        """The next message other than an Ack; it must be a ``cls``."""
        while True:
            received = await self.recv(seconds)
            if isinstance(received.message, Ack) and cls is not Ack:
                continue
            assert isinstance(received.message, cls), received.message
            return received

    async def until_closed(self, seconds: float = 10.0) -> tuple[int | None, list[Message]]:
        """Read until the server closes: (close code, the messages received before it)."""
        messages: list[Message] = []
        with contextlib.suppress(ConnectionClosed):
            while True:
                data = await within(self.ws.recv(), seconds)
                if isinstance(data, bytes):
                    messages += [r.message for r in parse_messages(data)]
        await within(self.ws.wait_closed(), seconds)
        return self.ws.close_code, messages

    async def close(self) -> None:
        # DESIGN §6: after a 1009 close, tearing down can raise AttributeError.
        with contextlib.suppress(ConnectionClosed, AttributeError, OSError):
            await within(self.ws.close(), 5)


def credit_one(ledger: Ledger, worker: str) -> None:
    """One verified FLOP for ``worker``, queued in the ledger as a tile's credit is."""
    ledger.credit(
        worker,
        name=worker,
        flops=1,
        bytes_down=1,
        bytes_up=1,
        compute_s=0.1,
        reputation=1.0,
        now=1.0,
    )


def ledger_row(coord: Coordinator, name: str) -> Contribution:
    """The ledger row of the worker that joined as ``name`` (tests give unique names)."""
    rows = [c for c in coord.ledger.all() if c.name == name]
    assert len(rows) <= 1, rows
    return rows[0] if rows else Contribution("", name)


def http_get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read()


# ---- happy path ----------------------------------------------------------------------------


async def test_two_workers_compute_every_tile_get_credit_and_show_in_status(tmp_path: Path) -> None:
    async with coordinator(tmp_path) as coord, honest_workers(coord, tmp_path, "alice", "bob"):
        server = coord.server
        mm = Gemm(server, "s0:mm", (96, 80, 72))
        bmm = Gemm(server, "s0:bmm", (3, 40, 300, 24), K_SPLIT_PLAN, seed=1)
        assert bmm.tiled.plan.k_split and len(mm.tiles) >= 8
        await mm.check()
        await bmm.check()
        tiles = len(mm.tiles) + len(bmm.tiles)
        counters = server.counters
        assert counters.tiles_verified == counters.tiles_sent == tiles
        assert (counters.rejected, counters.refused, counters.duplicates) == (0, 0, 0)
        assert server.tiles == {} and server.scheduler.pending() == 0
        # Each worker caches operand blocks: tiles that share a row block of A (or a
        # column block of B) send it once per worker, not once per tile.
        assert counters.bytes_down_uncached == sum(len(j.bundle) for j in mm.tiles + bmm.tiles)
        assert counters.bytes_down < 0.9 * counters.bytes_down_uncached

        # The pump commits the credit on its own (no read of the ledger asked for it).
        await until(lambda: coord.ledger.queued == 0, "the ledger to be committed")
        with sqlite3.connect(tmp_path / "state" / "ledger.sqlite") as db:
            (on_disk,) = db.execute("SELECT SUM(tiles) FROM contributions").fetchone()
        assert on_disk == tiles
        rows = {c.name: c for c in coord.ledger.all()}
        assert set(rows) == {"alice", "bob"}
        assert rows["alice"].tiles > 0 and rows["bob"].tiles > 0
        assert rows["alice"].tiles + rows["bob"].tiles == tiles
        assert rows["alice"].flops + rows["bob"].flops == mm.flops + bmm.flops
        assert sum(r.bytes_down for r in rows.values()) == counters.bytes_down
        assert sum(r.bytes_up for r in rows.values()) == counters.bytes_up > 0
        assert all(r.rejected == 0 and r.compute_s > 0 for r in rows.values())

        status, ctype, body = await asyncio.to_thread(http_get, coord.http + "/api/status")
        assert status == 200 and ctype == "application/json"
        doc = json.loads(body)
        assert doc["job"] == "loopback-job" and doc["step"] == 7
        assert doc["coordinator_key"] == fingerprint(server.key)
        assert {w["name"] for w in doc["workers"]} == {"alice", "bob"}
        for w in doc["workers"]:
            assert w["contribution"]["tiles"] == rows[w["name"]].tiles
            assert w["tiles_session"] == rows[w["name"]].tiles
            assert w["in_flight"] == 0 and w["device"] == "test cpu"
        assert doc["tiles"]["verified"] == doc["tiles"]["sent"] == tiles
        assert doc["tiles"]["queued"] == doc["tiles"]["pending"] == 0
        assert doc["tiles"]["rejected"] == doc["tiles"]["reissued"] == 0
        assert {row["name"] for row in doc["ledger"].values()} == {"alice", "bob"}

        status, _, _ = await asyncio.to_thread(http_get, coord.http + "/no/such/page")
        assert status == 404
        status, _, body = await asyncio.to_thread(http_get, coord.http + "/")
        assert status == 200 and b"loopback-job" in body

    assert coord.server.conns == {}  # both said bye and were forgotten


# ---- hostile clients -------------------------------------------------------------------------


MAX_MESSAGE = 1 << 20


def hostile_frame(kind: str) -> str | bytes:
    if kind == "truncated":
        beat = encode_message(Heartbeat(seq=1, state="working", in_flight=0))
        return beat[:10]  # the header's length prefix runs past the end
    if kind == "oversize":
        return b"\0" * (MAX_MESSAGE + 64)
    raise AssertionError(kind)


@pytest.mark.parametrize(
    ("kind", "code", "error"),
    [
        ("truncated", 1008, "bad_frame"),  # the core's verdict, carried out by the pump
        ("oversize", 1009, None),  # websockets' own limit
    ],
)
async def test_a_hostile_connection_is_closed_and_the_honest_worker_finishes(
    tmp_path: Path, kind: str, code: int, error: str | None
) -> None:
    async with (
        coordinator(tmp_path, max_message_bytes=MAX_MESSAGE) as coord,
        honest_workers(coord, tmp_path, "honest"),
    ):
        honest_id = coord.conn_ids()["honest"]
        raw = await Raw.join(coord, "mallory", window=2)
        gemm = Gemm(coord.server, "g", (96, 64, 80), seed=2)
        held = [(await raw.expect(Task)).message for _ in range(2)]  # mallory's share
        try:
            with contextlib.suppress(ConnectionClosed, AttributeError, OSError):
                await raw.ws.send(hostile_frame(kind))
            close_code, messages = await raw.until_closed()
        finally:
            await raw.close()
        assert close_code == code
        errors = [m for m in messages if isinstance(m, Error)]
        if error is not None:
            assert [e.code for e in errors] == [error]
        await gemm.check()
        assert coord.conn_ids() == {"honest": honest_id}  # never dropped or reconnected
        assert coord.server.scheduler.stats.reissued >= len(held)
        assert ledger_row(coord, "mallory").tiles == 0
        assert ledger_row(coord, "honest").tiles == len(gemm.tiles)


async def test_a_client_that_never_says_hello_is_closed_after_the_handshake_timeout(
    tmp_path: Path,
) -> None:
    async with coordinator(tmp_path, handshake_timeout_s=0.2) as coord:
        started = time.monotonic()
        raw = await Raw.connect(coord.url)
        try:
            close_code, messages = await raw.until_closed(seconds=5)
        finally:
            await raw.close()
        elapsed = time.monotonic() - started
        assert close_code == 1008 and [type(m) for m in messages] == [Challenge]
        assert 0.2 <= elapsed < 4
        assert coord.server.conns == {}


# ---- known bugs --------------------------------------------------------------------------------


async def test_a_bad_hello_with_non_ascii_text_is_closed_with_policy_violation(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with coordinator(tmp_path) as coord:
        raw = await Raw.connect(coord.url)
        try:
            await raw.ws.send(encode_frame({"type": "\u00e9" * 64, "v": PROTOCOL_VERSION}))
            close_code, messages = await raw.until_closed()
        finally:
            await raw.close()
        assert [m.code for m in messages if isinstance(m, Error)] == ["unknown_type"]
        assert close_code == 1008
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_client_that_leaves_during_the_handshake_leaves_no_ghost(tmp_path: Path) -> None:
    async with coordinator(tmp_path) as coord:
        for i in range(5):
            raw = await Raw.connect(coord.url)
            await raw.hello(f"ghost-{i}", window=2)
            await raw.close()
        honest = await Raw.join(coord, "real", window=1)
        await until(lambda: coord.server.pool.workers == 1, "only the real worker to remain")
        assert set(coord.conn_ids()) == {"real"}
        assert coord.server.scheduler.workers() == [coord.conn_ids()["real"]]
        await honest.close()


# ---- identity, join tokens and hostile handshakes -------------------------------------------


async def test_an_honest_worker_core_joins_a_private_pool_with_its_token(tmp_path: Path) -> None:
    async with coordinator(tmp_path, join_token="pool-secret") as coord:
        settings = WorkerSettings(
            coordinator_url=coord.url,
            name="with-token",
            threads=1,
            use_gpu=False,
            join_token="pool-secret",
        )
        pins = PinStore.in_dir(tmp_path / "pins")
        core = WorkerCore(settings, pin_check=pins.check, options=WorkerOptions(profile=PROFILE))
        task = asyncio.create_task(core.run())
        await until(lambda: "with-token" in coord.conn_ids(), "the member to join")
        gemm = Gemm(coord.server, "g", (64, 48, 40), seed=3)
        await gemm.check()
        # Credit follows the worker's key, which the ledger names it by.
        row = coord.ledger.get(public_key_hex(core.identity))
        assert row.name == "with-token" and row.tiles == len(gemm.tiles)
        core.stop()
        assert await within(task) is RunResult.STOPPED

        # Without the token the same worker stops for good instead of retrying.
        settings = replace(settings, name="no-token", join_token="")
        outsider = WorkerCore(
            settings, pin_check=pins.check, options=WorkerOptions(profile=PROFILE)
        )
        assert await within(outsider.run()) is RunResult.REFUSED
        assert "join token" in outsider.status.detail
        assert outsider.status.line == "Refused: the coordinator needs the right join token"


async def test_too_many_simultaneous_handshakes_are_told_to_come_back(tmp_path: Path) -> None:
    async with coordinator(tmp_path, max_handshakes=3) as coord:
        silent = [await Raw.connect(coord.url) for _ in range(3)]
        for raw in silent:
            await raw.expect(Challenge)  # each holds a handshake slot, saying nothing
        extra = await Raw.connect(coord.url)
        code, _ = await extra.until_closed()
        await extra.close()
        assert code == 1013
        for raw in silent:
            await raw.close()
        await until(lambda: coord.server._handshaking == 0, "the slots to free up")
        late = await Raw.join(coord, "late")
        await late.close()


async def test_the_ledger_commits_one_batch_at_a_time_each_taking_what_waited(
    tmp_path: Path,
) -> None:
    # A commit in progress must not make every later turn of the loop hand the ledger's
    # thread a flush of its own: the writes of all those turns wait for one commit.
    ledger = Ledger(tmp_path / "ledger.sqlite")
    committing, release = asyncio.Event(), threading.Event()
    loop = asyncio.get_running_loop()
    commit, flushes, batches = ledger.store.commit, [], []

    def held_commit(changes: Any, payouts: Any = ()) -> None:
        loop.call_soon_threadsafe(committing.set)
        assert release.wait(30), "the test never released the commit"
        batches.append(sorted(changes))
        commit(changes, payouts)

    def counted_flush(flush: Callable[[], None] = ledger.flush) -> None:
        flushes.append(1)
        flush()

    ledger.store.commit = held_commit  # type: ignore[method-assign]
    ledger.flush = counted_flush  # type: ignore[method-assign]
    server = CoordinatorServer(key=generate_private_key(), job_name="j", ledger=ledger)

    def credit_in_a_turn(worker: str) -> None:
        credit_one(ledger, worker)
        server.kept_here("g", 0, False)  # any input the server applies

    try:
        credit_in_a_turn("first")
        await asyncio.wait_for(committing.wait(), 10)
        for i in range(5):
            credit_in_a_turn(f"later{i}")
            await asyncio.sleep(0.01)
        release.set()
        await until(lambda: ledger.queued == 0, "the ledger to be committed")
        assert batches == [["first"], [f"later{i}" for i in range(5)]]
        assert len(flushes) == 2
    finally:
        release.set()
        await server.close()
        ledger.close()


async def test_a_failed_ledger_commit_is_logged_and_its_writes_go_with_a_later_try(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "LEDGER_RETRY_S", 0.3)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    commit, tries = ledger.store.commit, []

    def failing_twice(changes: Any, payouts: Any = ()) -> None:
        tries.append(time.monotonic())
        if len(tries) <= 2:
            raise sqlite3.OperationalError("disk I/O error")
        commit(changes, payouts)

    ledger.store.commit = failing_twice  # type: ignore[method-assign]
    server = CoordinatorServer(
        key=generate_private_key(), job_name="j", ledger=ledger, config=ServerConfig(**FAST)
    )
    await server.start("127.0.0.1", 0)  # its timer is what tries again
    try:
        for worker in ("failed", "later"):
            credit_one(ledger, worker)
            server.kept_here("g", 0, False)
            await asyncio.sleep(0.01)
        await until(lambda: ledger.queued == 0, "the writes to be committed")
        assert "could not write the ledger" in caplog.text
        # A store that is down is tried again after a pause, not at every turn of the loop.
        assert len(tries) == 3
        assert all(later - earlier >= 0.25 for earlier, later in itertools.pairwise(tries))
    finally:
        await server.close()
        ledger.close()
    reopened = Ledger(tmp_path / "ledger.sqlite")
    try:
        assert {c.worker: c.tiles for c in reopened.all()} == {"failed": 1, "later": 1}
    finally:
        reopened.close()


async def test_small_tiles_reach_a_worker_in_one_batch_under_one_signature(tmp_path: Path) -> None:
    async with coordinator(tmp_path) as coord:
        raw = await Raw.join(coord, "batched", window=2)
        assert raw.welcome is not None
        gemm = Gemm(coord.server, "g", (128, 64, 64), seed=3)
        assert 2 < len(gemm.tiles) <= held_tiles_limit(2)  # small tiles: more than the window
        while True:  # past acks and the job's state, to the tasks
            data = await within(raw.ws.recv(), 10)
            assert isinstance(data, bytes)
            if decode_frame(data).header["type"] in ("batch", "task"):
                break
        assert decode_frame(data).header["type"] == "batch"
        tasks = parse_messages(data)
        assert [r.message.tile_id for r in tasks] == gemm.tile_ids  # type: ignore[union-attr]
        key = public_key_from_hex(raw.welcome.coordinator_key)
        results = []
        for received, tile_id in zip(tasks, gemm.tile_ids, strict=True):
            assert SIGNATURE_FIELD not in received.frame.header  # the batch's signature
            a, b = verify_task(received, key)
            results.append(encode_message(Result(tile_id, 0.01), [("c", a @ b)]))
        await raw.ws.send(batch_frame(results))  # the results back in one message too
        await gemm.check()
        assert ledger_row(coord, "batched").tiles == len(gemm.tiles)
        await raw.close()
