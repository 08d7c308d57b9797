"""The real worker against a small fake coordinator on 127.0.0.1 (real websockets, port 0).

The fake speaks the protocol through ``common`` only, so these tests pin the worker to
the wire format, not to another implementation's quirks. Once in-process (asyncio task,
fast backoff) and once as a real ``python -m client_app`` process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.fake_coordinator import PROFILE, FakeCoordinator, HeldComputer, operands, stop, within

from client_app import pumps as worker_module  # the send loop's send_frames
from client_app.config import PinStore, WorkerSettings
from client_app.options import WorkerOptions
from client_app.status import WorkerStatus
from client_app.worker import RunResult, WorkerCore
from common.frames import FrameParts
from common.messages import (
    Bye,
    Cancel,
    Error,
    Pause,
    Received,
    Result,
    Resume,
    encode_message,
    encode_task,
    parse_messages,
)
from common.signing import fingerprint, generate_private_key, public_key_hex

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def check_result(received: Received, tile_id: str, a: torch.Tensor, b: torch.Tensor) -> None:
    assert isinstance(received.message, Result)
    assert received.message.tile_id == tile_id and received.message.compute_s >= 0
    c = received.tensors()["c"]
    torch.testing.assert_close(c, torch.matmul(a, b), rtol=1e-5, atol=1e-5)


def make_core(
    url: str,
    config: Path,
    statuses: list[WorkerStatus] | None = None,
    cpu_percent: int = 100,
    **kwargs: Any,
) -> WorkerCore:
    settings = WorkerSettings(
        coordinator_url=url,
        name="loop-w",
        threads=1,
        use_gpu=False,
        window=2,
        cpu_percent=cpu_percent,
    )
    observer = statuses.append if statuses is not None else None
    fast: dict[str, Any] = dict(
        profile=PROFILE, backoff_base_s=0.02, backoff_cap_s=0.1, rng=random.Random(0)
    )
    options = WorkerOptions(**{**fast, **kwargs})
    return WorkerCore(
        settings, pin_check=PinStore.in_dir(config).check, options=options, observer=observer
    )


# ---- in-process ---------------------------------------------------------------------------


async def test_worker_computes_refuses_heartbeats_reconnects_and_leaves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    statuses: list[WorkerStatus] = []
    caplog.set_level(logging.INFO, logger="client_app")

    async with FakeCoordinator() as coord:
        core = make_core(coord.url, tmp_path, statuses, summary_every=2, summary_min_interval_s=0.0)
        run = asyncio.create_task(core.run())
        link = await coord.next_link()
        assert link.hello.name == "loop-w" and link.hello.window == 2
        assert link.hello.profile == PROFILE
        assert link.extensions_offered is None  # compression=None: no deflate offer

        # Tiles: results equal a @ b (fp32 mm, then a bmm).
        tiles = {f"t-{i}": operands(i) for i in range(3)}
        tiles["t-bmm"] = operands(9, (2, 8, 12, 4))
        for tile_id, (a, b) in tiles.items():
            await link.send(coord.task(tile_id, a, b, "bmm" if a.dim() == 3 else "mm"))
        for tile_id, (a, b) in tiles.items():
            check_result(await link.expect(Result), tile_id, a, b)

        # A bundle signed by another key: an error reply, and nothing computed.
        a, b = operands(7)
        await link.send(encode_task("t-evil", "mm", a, b, generate_private_key()))
        error = (await link.expect(Error)).message
        assert isinstance(error, Error)
        assert (error.code, error.tile_id) == ("bad_signature", "t-evil")
        await link.send(coord.task("t-after", a, b))
        check_result(await link.expect(Result), "t-after", a, b)
        # Heartbeats from here on were sent after the last result, when the worker held
        # nothing; only their Acks carry the fake's credit of 5 (its count of results).
        n = len(link.heartbeats)

        # Heartbeats arrive on the Welcome's interval, and Acks become credit. However
        # long the work above took (many heartbeats may predate result 5), wait for a
        # heartbeat sent after it, and for the worker to have applied such a one's Ack.
        def idle_and_credited() -> bool:
            after = link.heartbeats[n:]
            return (
                len(link.heartbeats) >= 3
                and any(hb.state == "idle" for hb in after)
                and core.status.credit_tiles == 5
            )

        deadline = time.monotonic() + 10
        while not idle_and_credited() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert [hb.seq for hb in link.heartbeats[:3]] == [1, 2, 3]
        assert any(hb.state == "idle" for hb in link.heartbeats[n:]), link.heartbeats[n:]
        assert core.status.credit_tiles == 5 and core.status.credit_gflop == 0.5, core.status

        # The coordinator drops the connection: the worker comes back by itself.
        await link.ws.close()
        relink = await coord.next_link()
        assert coord.connections == 2
        a, b = operands(11)
        await relink.send(coord.task("t-again", a, b))
        check_result(await relink.expect(Result), "t-again", a, b)

        assert await stop(core, run) is RunResult.STOPPED
        bye = (await relink.expect(Bye)).message
        assert isinstance(bye, Bye) and bye.reason == "worker stopping"
        await within(relink.closed.wait())
        assert PinStore.in_dir(tmp_path).get(coord.url) == public_key_hex(coord.key)
        expected_fp = fingerprint(coord.key)

    states = [s.state for s in statuses]
    assert {"connecting", "waiting", "computing", "reconnecting"} <= set(states)
    assert states[-1] == "stopped"
    final = statuses[-1]
    assert final.tiles_done == 6 and final.tiles_refused == 1
    assert final.coordinator_fingerprint == expected_fp
    assert final.bytes_in > 0 and final.bytes_out > 0 and final.compute_s > 0
    assert any(s.line == "Computing tile t-0" for s in statuses)
    assert any(s.line.startswith("Reconnecting in ") for s in statuses)
    assert f"pinned its key, fingerprint {expected_fp}" in caplog.text
    assert "matches the pin" in caplog.text  # the second join checked, not re-pinned
    # A summary once at least 2 tiles were sent since the last (tiles computed back to
    # back may go out together, so a window may hold 3 or 4); the rejoin starts afresh.
    counts = [int(n) for n in re.findall(r"computed (\d+) tiles in the last", caplog.text)]
    assert counts and all(n >= 2 for n in counts) and sum(counts) <= 5, counts


async def test_changed_coordinator_key_is_refused_without_retrying(tmp_path: Path) -> None:
    statuses: list[WorkerStatus] = []

    async with FakeCoordinator() as coord:
        # Pinned at an "earlier" join, to a key the coordinator no longer has.
        PinStore.in_dir(tmp_path).check(coord.url, public_key_hex(generate_private_key()))
        core = make_core(coord.url, tmp_path, statuses)
        run = asyncio.create_task(core.run())
        link = await coord.next_link()
        bye = (await link.expect(Bye)).message
        assert isinstance(bye, Bye) and "key changed" in bye.reason
        assert await within(run) is RunResult.REFUSED
        await asyncio.sleep(0.3)  # many backoff periods: no second attempt
        assert coord.connections == 1
    assert statuses[-1].state == "refused"
    assert statuses[-1].line == "Refused: coordinator key changed"
    assert "--forget" in statuses[-1].detail


async def test_cancelled_tile_is_not_answered(tmp_path: Path) -> None:
    computer = HeldComputer()
    async with FakeCoordinator() as coord:
        core = make_core(coord.url, tmp_path, computer=computer)
        run = asyncio.create_task(core.run())
        link = await coord.next_link()
        held, queued = operands(1), operands(2)
        # "t-held" keeps the compute thread busy until the Cancel, which follows its
        # task on the same stream, has been read: "t-cancelled" is then queued behind it
        # on the compute thread, not started.
        await link.send(coord.task("t-held", *held))
        assert await asyncio.to_thread(computer.started.wait, 10)
        await link.send(coord.task("t-cancelled", *queued))
        await link.send(encode_message(Cancel("t-cancelled")))
        a, b = operands(3)
        await link.send(coord.task("t-next", a, b))
        session = core.session
        assert session is not None
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if session.holds("t-next") and not session.holds("t-cancelled"):
                    break
                await asyncio.sleep(0.01)
            assert session.holds("t-next") and not session.holds("t-cancelled")
        finally:
            computer.release.set()
        check_result(await link.expect(Result), "t-held", *held)
        check_result(await link.expect(Result), "t-next", a, b)
        assert session.stats.tiles_cancelled == 1
        assert computer.computed == 2  # the cancelled tile was skipped, never multiplied
        assert await stop(core, run) is RunResult.STOPPED
        await link.expect(Bye)
        assert link.inbox.empty()


async def test_the_next_tile_computes_while_a_result_is_still_being_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sending (and encoding) a result must not keep the compute thread idle.
    release = asyncio.Event()
    real_send = worker_module.send_frames

    async def held_results(ws: Any, *frames: bytes | FrameParts) -> None:
        joined = [f.join() if isinstance(f, FrameParts) else f for f in frames]
        if any(isinstance(r.message, Result) for f in joined for r in parse_messages(f)):
            await release.wait()
        await real_send(ws, *frames)

    monkeypatch.setattr(worker_module, "send_frames", held_results)
    async with FakeCoordinator() as coord:
        core = make_core(coord.url, tmp_path)
        run = asyncio.create_task(core.run())
        link = await coord.next_link()
        tiles = {f"t{i}": operands(10 + i) for i in range(2)}
        for tile_id, (a, b) in tiles.items():
            await link.send(coord.task(tile_id, a, b))
        for _ in range(500):  # bounded: 5 s
            if core.session is not None and core.session.stats.tiles_done == 2:
                break
            await asyncio.sleep(0.01)
        assert core.session is not None and core.session.stats.tiles_done == 2
        assert coord.results == 0  # the first result is still held, the second computed
        release.set()
        for tile_id, (a, b) in tiles.items():
            check_result(await link.expect(Result), tile_id, a, b)
        assert await stop(core, run) is RunResult.STOPPED


class SecondTileSeen(HeldComputer):
    """``HeldComputer`` that also says when the tile after the held one starts."""

    def __init__(self) -> None:
        super().__init__()
        self.second = threading.Event()

    def compute(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.started.is_set():
            self.second.set()
        return super().compute(op, a, b)


@pytest.mark.parametrize("cpu_percent", [100, 50])
async def test_the_next_tile_starts_without_waiting_for_the_event_loop(
    tmp_path: Path, cpu_percent: int
) -> None:
    # When a GEMM ends, the event loop may be busy (receiving and checking the tile
    # after): the next tile, already handed to the compute thread, starts at once. Under
    # a CPU-time limit it waits for the event loop, which rests between tiles.
    computer = SecondTileSeen()
    async with FakeCoordinator() as coord:
        core = make_core(coord.url, tmp_path, computer=computer, cpu_percent=cpu_percent)
        run = asyncio.create_task(core.run())
        link = await coord.next_link()
        tiles = {f"t{i}": operands(20 + i) for i in range(2)}
        for tile_id, (a, b) in tiles.items():
            await link.send(coord.task(tile_id, a, b))
        assert await asyncio.to_thread(computer.started.wait, 10)
        session = core.session
        assert session is not None
        for _ in range(1000):  # bounded: 10 s
            if session.holds("t1"):
                break
            await asyncio.sleep(0.01)
        assert session.holds("t1")
        # The event loop is blocked from here until the wait below ends.
        computer.release.set()
        started_while_blocked = computer.second.wait(5 if cpu_percent == 100 else 0.5)
        assert started_while_blocked is (cpu_percent == 100)
        for tile_id, (a, b) in tiles.items():
            check_result(await link.expect(Result), tile_id, a, b)
        assert await stop(core, run) is RunResult.STOPPED


async def test_oversized_frames_either_way_end_the_connection_not_the_worker(
    tmp_path: Path,
) -> None:
    # The coordinator accepts 64 KiB frames but announces more, so the worker sends
    # a too-big result (the peer closes with 1009; leaving the connection can then
    # raise AttributeError inside websockets, see DESIGN §6).
    async with FakeCoordinator(max_size=64 << 10, announced_max_frame_bytes=1 << 26) as coord:
        core = make_core(coord.url, tmp_path, max_frame_bytes=256 << 10)
        run = asyncio.create_task(core.run())
        link = await coord.next_link()
        await link.send(coord.task("t-huge-result", *operands(1, (1500, 1, 1500))))
        await within(link.closed.wait())
        link = await coord.next_link()
        # And a task frame over the worker's own max_size: it closes, then rejoins.
        await link.send(coord.task("t-huge-task", *operands(2, (256, 256, 8))))
        await within(link.closed.wait())
        link = await coord.next_link()
        a, b = operands(3)
        await link.send(coord.task("t-fine", a, b))
        check_result(await link.expect(Result), "t-fine", a, b)
        assert await stop(core, run) is RunResult.STOPPED
        assert not run.exception()


class CeilingSpy(random.Random):
    """Records the jitter ceiling of every backoff draw (the delay's upper bound)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.ceilings: list[float] = []

    def uniform(self, a: float, b: float) -> float:
        self.ceilings.append(b)
        return super().uniform(a, b)


async def test_backoff_grows_while_failing_and_restarts_after_a_welcome(tmp_path: Path) -> None:
    spy = CeilingSpy()
    async with FakeCoordinator(reject_first=3) as coord:
        core = make_core(coord.url, tmp_path, backoff_base_s=0.02, backoff_cap_s=0.1, rng=spy)
        run = asyncio.create_task(core.run())
        link = await coord.next_link()  # the 4th connection is welcomed
        await link.ws.close()
        await coord.next_link()
        assert await stop(core, run) is RunResult.STOPPED
    assert spy.ceilings == pytest.approx([0.02, 0.04, 0.08, 0.02])


async def test_stop_while_the_coordinator_is_unreachable(tmp_path: Path) -> None:
    async with FakeCoordinator() as coord:
        url = coord.url  # a port that is closed once the fake is gone
    statuses: list[WorkerStatus] = []
    core = make_core(url, tmp_path, statuses, backoff_base_s=0.05, backoff_cap_s=0.05)
    run = asyncio.create_task(core.run())
    deadline = time.monotonic() + 5
    while sum(s.state == "reconnecting" for s in statuses) < 3:
        assert time.monotonic() < deadline, statuses
        await asyncio.sleep(0.01)
    assert await stop(core, run) is RunResult.STOPPED
    assert statuses[-1].state == "stopped"


async def test_stop_does_not_wait_out_a_hanging_handshake(tmp_path: Path) -> None:
    accepted = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()  # TCP accepted, WebSocket handshake never answered
        await reader.read()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        core = make_core(f"ws://127.0.0.1:{port}/ws", tmp_path)
        run = asyncio.create_task(core.run())
        await within(accepted.wait())
        started = time.monotonic()
        assert await stop(core, run) is RunResult.STOPPED
        assert time.monotonic() - started < 2.0  # not the 10 s open timeout


async def test_a_worker_paused_before_it_joins_says_so_first(tmp_path: Path) -> None:
    async with FakeCoordinator() as coord:
        core = make_core(coord.url, tmp_path)
        core.pause("on battery")
        run = asyncio.create_task(core.run())
        link = await coord.next_link()
        assert (await link.expect(Pause)).message == Pause("on battery")
        while not link.heartbeats:
            await within(asyncio.sleep(0.01))
        assert link.heartbeats[0].state == "paused"
        assert await stop(core, run) is RunResult.STOPPED


async def test_a_gui_can_drive_the_core_from_another_thread(tmp_path: Path) -> None:
    """start in a background thread, observe, change threads live, pause, stop."""
    seen: list[WorkerStatus] = []

    async with FakeCoordinator() as coord:
        core = make_core(coord.url, tmp_path)
        core.add_observer(seen.append)
        outcome: list[RunResult] = []
        thread = threading.Thread(
            target=lambda: outcome.append(asyncio.run(core.run())), daemon=True
        )
        thread.start()  # what a GUI's "Join" button does
        try:
            link = await coord.next_link()
            await asyncio.to_thread(core.set_threads, 2)
            await asyncio.to_thread(core.pause, "owner is busy")
            assert (await link.expect(Pause)).message == Pause("owner is busy")
            await asyncio.to_thread(core.resume)
            await link.expect(Resume)
            a, b = operands(4)
            await link.send(coord.task("t-gui", a, b))
            check_result(await link.expect(Result), "t-gui", a, b)
        finally:
            await asyncio.to_thread(core.stop)  # the "Leave" button, from the GUI thread
            await asyncio.to_thread(thread.join, 10)
        assert not thread.is_alive() and outcome == [RunResult.STOPPED]
    assert seen[0].line == "Not started"  # add_observer delivers the current status at once
    assert any(s.state == "paused" and s.line == "Paused: owner is busy" for s in seen)
    assert any(s.threads == 2 for s in seen) and seen[-1].state == "stopped"


# ---- a real process -----------------------------------------------------------------------


async def test_cli_process_joins_pins_computes_and_leaves_on_sigint(tmp_path: Path) -> None:
    config = tmp_path / "config"
    env = dict(os.environ, CLEAVE_CONFIG_DIR=str(config), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])

    async with FakeCoordinator() as coord:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "client_app",
            "--coordinator",
            coord.url,
            "--threads",
            "1",
            "--no-gpu",
            "--backoff-base",
            "0.05",
            "--log-level",
            "DEBUG",
            cwd=tmp_path,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert proc.stdout is not None
        try:
            link = await coord.next_link(timeout=30)  # python + torch start-up
            settings = json.loads((config / "settings.json").read_text())
            assert link.hello.name == settings["name"]  # generated, then persisted
            assert link.hello.profile.threads == 1 and link.hello.profile.gflops > 0
            for i in range(2):
                a, b = operands(20 + i)
                await link.send(coord.task(f"p-{i}", a, b))
                check_result(await link.expect(Result), f"p-{i}", a, b)
            a, b = operands(5)
            await link.send(encode_task("p-bad", "mm", a, b, generate_private_key()))
            error = (await link.expect(Error)).message
            assert isinstance(error, Error) and error.code == "bad_signature"
            await link.ws.close()
            link = await coord.next_link()  # reconnected
            while not link.heartbeats:
                await within(asyncio.sleep(0.01))
            proc.send_signal(signal.SIGINT)
            bye = (await link.expect(Bye)).message
            assert isinstance(bye, Bye)
            code = await within(proc.wait(), 15)
            output = (await within(proc.stdout.read())).decode(errors="replace")
            pinned = PinStore.in_dir(config).get(coord.url)
            assert pinned == public_key_hex(coord.key)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    assert code == 0, output
    fp = fingerprint(coord.key)
    assert f"pinned its key, fingerprint {fp}" in output
    assert "refused tile p-bad: bad_signature" in output
    assert "tile p-0: mm" in output  # every tile at DEBUG
    assert "left ws://127.0.0.1" in output
