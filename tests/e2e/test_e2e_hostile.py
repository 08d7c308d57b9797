"""A hostile client attacks a coordinator while it trains: every class of bad input.

The coordinator runs as a real process with two honest workers in a private pool. The
attacker connects over loopback again and again: garbage, oversized and truncated
frames, silence, forged and replayed handshakes, a missing token, then (as an insider
with its own key and the token) unknown messages, forged, duplicate, wrong, malformed
and late results, and a message flood. Each attack must get the documented answer; the
run must finish with the local reference's losses, in the same coordinator process.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from support.procs import Coordinator, Worker, assert_losses_match
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from common import PROTOCOL_VERSION
from common.auth import answer_challenge, new_nonce
from common.frames import encode_frame
from common.messages import (
    Ack,
    Cancel,
    Challenge,
    DeviceProfile,
    Error,
    Heartbeat,
    Hello,
    Message,
    Pause,
    Result,
    Task,
    Welcome,
    encode_message,
    parse_message,
    parse_messages,
    verify_task,
)
from common.signing import generate_private_key, public_key_from_hex, public_key_hex
from coordinator import train_locally
from coordinator.jobs.tiny_gpt import make_job as make_tiny_gpt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TOKEN = "hostile-test-pool"
STEPS = 25
HANDSHAKE_TIMEOUT_S = 2.0
MAX_MESSAGE_BYTES = 256 << 20  # coordinator.serve.server.ServerConfig default
PROFILE = DeviceProfile("cpu", "attacker", 1, 1 << 30, 1 << 28, 1.0)


@dataclass
class Link:
    ws: ClientConnection
    challenge: Challenge
    received: list[Message] = field(default_factory=list)
    beating: asyncio.Task[None] | None = None
    tasks: list[tuple[Task, Any]] = field(default_factory=list)  # held, not yet used
    pending: deque[Message] = field(default_factory=deque)  # read, not yet returned by next

    def _keep(self, data: bytes) -> list[Message]:
        kept = []
        for received in parse_messages(data):
            self.received.append(received.message)
            if isinstance(received.message, Task):
                self.tasks.append((received.message, received))
            kept.append(received.message)
        return kept

    async def send(self, data: bytes | str) -> None:
        await self.ws.send(data)

    async def next(self, cls: type, seconds: float = 15.0) -> Any:
        """The next message of type ``cls`` (others are kept in ``received``)."""
        async with asyncio.timeout(seconds):
            while True:
                while self.pending:  # the rest of a batch, first
                    msg = self.pending.popleft()
                    if isinstance(msg, cls):
                        return msg
                data = await self.ws.recv()
                assert isinstance(data, bytes)
                self.pending.extend(self._keep(data))

    async def closed(self, seconds: float = 15.0) -> tuple[int | None, list[Message]]:
        """Read until the coordinator closes: its close code and what came before."""
        with contextlib.suppress(ConnectionClosed):
            async with asyncio.timeout(seconds):
                while True:
                    data = await self.ws.recv()
                    if isinstance(data, bytes):
                        self._keep(data)
        return self.ws.close_code, self.received

    def errors(self) -> list[str]:
        return [m.code for m in self.received if isinstance(m, Error)]


async def open_link(url: str) -> Link:
    ws = await connect(url, compression=None, max_size=1 << 26, open_timeout=10)
    data = await asyncio.wait_for(ws.recv(), 10)
    assert isinstance(data, bytes)
    challenge = parse_message(data).message
    assert isinstance(challenge, Challenge)
    return Link(ws, challenge)


def hello_frame(link: Link, name: str, token: str = TOKEN, window: int = 2) -> bytes:
    hello = answer_challenge(
        link.challenge,
        key=generate_private_key(),
        nonce=new_nonce(),
        name=name,
        profile=PROFILE,
        window=window,
        client="attacker",
        token=token,
    )
    return encode_message(hello)


async def insider(url: str, name: str, window: int = 2) -> Link:
    """An attacker that joins properly (its own key, the pool's token) and heartbeats, so
    only what it does wrong on purpose can get it dropped."""
    link = await open_link(url)
    await link.send(hello_frame(link, name, window=window))
    await link.next(Welcome)
    link.beating = asyncio.create_task(_heartbeats(link))
    return link


async def _heartbeats(link: Link) -> None:
    with contextlib.suppress(ConnectionClosed):
        for seq in range(1_000_000, 1_000_600):
            await link.send(encode_message(Heartbeat(seq=seq, state="working", in_flight=0)))
            await asyncio.sleep(1.0)


def product(link: Link, frame_task: tuple[Task, Any]) -> torch.Tensor:
    _, received = frame_task
    a, b = verify_task(received, public_key_from_hex(link.challenge.coordinator_key))
    return torch.matmul(a, b)


async def next_task(link: Link) -> tuple[Task, Any]:
    """A task the insider holds (received now, or earlier while it waited for something)."""
    if not link.tasks:
        await link.next(Task, seconds=30)
    return link.tasks.pop(0)


async def still_served(link: Link, seq: int) -> None:
    await link.send(encode_message(Heartbeat(seq=seq, state="working", in_flight=0)))
    while (await link.next(Ack)).seq != seq:  # background heartbeats get acks too
        pass


# ---- the attacks: each returns nothing and asserts the documented outcome -------------


async def attack_handshakes(url: str) -> None:
    # A text frame instead of a hello.
    link = await open_link(url)
    await link.send("hello?")
    assert (await link.closed())[0] == 1008

    # A truncated frame: the length prefix promises more header than there is.
    link = await open_link(url)
    await link.send(struct.pack(">I", 4096) + b'{"type": "hel')
    code, _ = await link.closed()
    assert code == 1008 and "bad_frame" in link.errors()

    # A header length past the named limit (max_header_bytes).
    link = await open_link(url)
    await link.send(struct.pack(">I", 1 << 30) + b"{}")
    code, _ = await link.closed()
    assert code == 1008 and "limit_exceeded" in link.errors()

    # Silence: closed once the handshake timeout runs out.
    link = await open_link(url)
    code, _ = await link.closed(seconds=HANDSHAKE_TIMEOUT_S + 10)
    assert code == 1008

    # Not a hello first.
    link = await open_link(url)
    await link.send(encode_message(Heartbeat(seq=1, state="idle", in_flight=0)))
    code, _ = await link.closed()
    assert code == 1008 and "unexpected_message" in link.errors()

    # A hello that claims someone else's key (signed with another).
    link = await open_link(url)
    parsed = parse_message(hello_frame(link, "impostor")).message
    victim = public_key_hex(generate_private_key())
    assert isinstance(parsed, Hello)
    await link.send(encode_message(replace(parsed, worker_key=victim)))
    code, _ = await link.closed()
    assert code == 1008 and "auth_failed" in link.errors()

    # A hello recorded on one connection, replayed on another.
    first = await open_link(url)
    recorded = hello_frame(first, "recorded")
    await first.ws.close()
    link = await open_link(url)
    await link.send(recorded)
    code, _ = await link.closed()
    assert code == 1008 and "auth_failed" in link.errors()

    # A properly signed hello without the private pool's token.
    link = await open_link(url)
    await link.send(hello_frame(link, "outsider", token=""))
    code, _ = await link.closed()
    assert code == 1008 and "bad_token" in link.errors()

    # A frame past the WebSocket size limit: refused by its declared length, before a
    # byte of it is read. Written by hand: building (and masking) 256 MiB in the client
    # would take longer than the handshake timeout on a loaded machine.
    link = await open_link(url)
    mask = bytes(4)
    header = bytes([0x82, 0x80 | 127]) + struct.pack(">Q", MAX_MESSAGE_BYTES + 1) + mask
    link.ws.transport.write(header + bytes(1024))
    code, _ = await link.closed()
    assert code == 1009


async def attack_as_insider(url: str) -> None:
    link = await insider(url, "insider")
    seq = 0

    # Not understood, but well framed: an error each, and the link stays open.
    for frame, code in (
        (encode_frame({"type": "gimme-credit", "v": PROTOCOL_VERSION}), "unknown_type"),
        (encode_frame({"type": "heartbeat", "v": PROTOCOL_VERSION + 7}), "version"),
        (encode_message(Welcome("w", "00", 1.0, 1, "j")), "unexpected_message"),
        (encode_message(Cancel("x")), "unexpected_message"),
    ):
        await link.send(frame)
        assert (await link.next(Error)).code == code
        seq += 1
        await still_served(link, seq)

    # A result for a tile that does not exist: ignored (counted, never credited).
    forged = Result(tile_id="no-such-tile", compute_s=0.1)
    await link.send(encode_message(forged, [("c", torch.zeros(4, 4))]))
    seq += 1
    await still_served(link, seq)

    # A result for a tile assigned to another worker (a replay or a forgery): refused.
    other = await insider(url, "insider-other", window=1)
    task = await next_task(link)
    c = product(link, task)
    await other.send(encode_message(Result(task[0].tile_id, 0.01), [("c", c)]))
    error = await other.next(Error)
    assert error.code == "not_assigned" and error.tile_id == task[0].tile_id
    # It leaves now: tiles it holds and never answers would hold up the step (copies to
    # idle workers are off in this test, see below).
    await other.ws.close()

    # The right result from the right worker, sent twice: credited once, the copy ignored.
    for _ in range(2):
        await link.send(encode_message(Result(task[0].tile_id, 0.01), [("c", c)]))

    # A wrong result: rejected and re-issued, the insider's reputation halves.
    task = await next_task(link)
    wrong = product(link, task) + 1.0
    await link.send(encode_message(Result(task[0].tile_id, 0.01), [("c", wrong)]))
    verdict = await link.next(Error)
    assert verdict.code == "failed_check" and verdict.tile_id == task[0].tile_id

    # A result whose tensor is not what the tile needs (int64, wrong shape).
    task = await next_task(link)
    int64_result = {
        "type": "result",
        "v": PROTOCOL_VERSION,
        "tile_id": task[0].tile_id,
        "compute_s": 0.01,
        "tensors": [{"name": "c", "dtype": "int64", "shape": [3], "offset": 0, "nbytes": 24}],
    }
    await link.send(encode_frame(int64_result, [bytes(24)]))
    assert (await link.next(Error)).code == "bad_tensor"
    assert (await link.next(Error)).code == "failed_check"

    # A late result: paused, so its tile moved elsewhere; then the result arrives.
    task = await next_task(link)
    late = product(link, task)
    await link.send(encode_message(Pause(reason="stepping away")))
    await link.send(encode_message(Result(task[0].tile_id, 0.01), [("c", late)]))
    seq += 1
    await still_served(link, seq)  # ignored or refused, never fatal
    await link.ws.close()

    # A result declaring a tensor far past the shape limits: refused by name, and
    # counted against the sender like any wrong result.
    second = await insider(url, "insider-2")
    task = await next_task(second)
    header = {
        "type": "result",
        "v": PROTOCOL_VERSION,
        "tile_id": task[0].tile_id,
        "compute_s": 0.0,
        "tensors": [
            {"name": "c", "dtype": "float32", "shape": [1 << 40, 2], "offset": 0, "nbytes": 8}
        ],
    }
    await second.send(encode_frame(header, [bytes(8)]))
    error = await second.next(Error)
    assert error.code == "limit_exceeded" and "max_dim" in error.message
    await second.ws.close()

    # A flood of messages: closed for its rate, alone.
    third = await insider(url, "insider-3")
    with contextlib.suppress(ConnectionClosed):
        for i in range(2000):
            await third.send(encode_message(Heartbeat(seq=i, state="idle", in_flight=0)))
    code, _ = await third.closed()
    assert code == 1008 and "rate_limited" in third.errors()


def test_hostile_client_during_a_run_changes_nothing(tmp_path: Path) -> None:
    coord = Coordinator(
        tmp_path,
        "--steps",
        str(STEPS),
        "--min-workers",
        "2",
        "--join-token",
        TOKEN,
        "--handshake-timeout",
        str(HANDSHAKE_TIMEOUT_S),
        # No copies of late tiles: the insider's own tiles must still be its own when it
        # answers them (copies are tested in test_coordinator_server).
        "--speculate-after",
        "0",
    )
    workers = [Worker(tmp_path, coord.url, f"honest-{i}", "--token", TOKEN) for i in range(2)]
    pid = coord.proc.pid
    try:
        from support.procs import wait_until

        wait_until(lambda: coord.status()["step"] >= 1, 120, "training to start")
        asyncio.run(attack_handshakes(coord.url))
        asyncio.run(attack_as_insider(coord.url))
        status = coord.status()  # still serving, mid-run, the same process
        assert coord.proc.poll() is None and coord.proc.pid == pid
        assert status["step"] < STEPS, "the attacks must land while the run is in progress"
        assert coord.wait(240) == 0, coord.output()
    finally:
        for worker in workers:
            worker.stop()
    records = coord.steps()
    assert_losses_match([r["loss"] for r in records], train_locally(make_tiny_gpt(), STEPS))
    tiles = status["tiles"]
    assert tiles["rejected"] >= 3 and tiles["not_assigned"] >= 1 and tiles["duplicates"] >= 1
    assert status["connections"]["refused_handshakes"] >= 8
    assert status["banned"] == []  # two failures halve twice; a third would ban
    out = coord.output()
    assert "Traceback" not in out, out
