"""The worker's tile path vs bare ``torch.matmul`` on the same shapes, in one process.

Worker path per tile, exactly as ``cleave-worker`` runs it: ``WorkerSession.receive``
(frame decode, BLAKE3 + Ed25519 signature check, operand decode), ``TileComputer.compute``
(the matmul under the thread cap), ``WorkerSession.tile_done`` and ``result_frame``
(result encode), the result's payload masked as the worker's connection writes it
(``common.frame_writes.payload_writes``), and the product's memory given back for the
next one (``TileComputer.give_back``).

- sequential: one thread does everything, one tile after another.
- pipelined: as the real worker does, the next tile is received and verified, and the
  last one's result encoded, on the I/O thread while the compute thread multiplies.

The ratio is tiles/s of the worker path over tiles/s of bare ``torch.matmul(a, b,
out=c)`` into one reused ``c`` (the GEMM alone: fresh memory for each product would add
the kernel's page faults to the baseline) with the same thread count, taken within one
round of bare, sequential, pipelined and streamed runs in turn; the table shows medians
over rounds. A round runs as many tiles as bare matmul does in ``--seconds`` (at least
8): a worker fed by its coordinator's window streams tiles, and the pipeline's fill and
drain (the first tile's receive, the last one's encode) are paid once per stream, not
once per handful of tiles.

*Streamed* is bare matmul too, on the operands as the worker path meets them: each task
frame's own copy, in turn, rather than one pair of operands that stays in the caches
from one multiply to the next. A GEMM on operands it has not read before is slower by
itself; ``pipelined/streamed`` is what the worker path costs beyond that.
Run: ``python bench/bench_tile.py [--quick]``.
"""

from __future__ import annotations

import argparse
import queue
import secrets
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from client_app.compute import TileComputer  # noqa: E402
from client_app.session import WorkerSession  # noqa: E402
from common.auth import make_welcome, new_nonce  # noqa: E402
from common.frame_writes import payload_writes  # noqa: E402
from common.frames import FrameParts  # noqa: E402
from common.messages import (  # noqa: E402
    Challenge,
    DeviceProfile,
    Hello,
    encode_message,
    encode_task,
    parse_message,
)
from common.signing import generate_private_key, public_key_hex  # noqa: E402

SHAPES = [  # (m, k, n, dtype)
    (512, 512, 512, torch.float32),
    (1024, 1024, 1024, torch.float32),
    (1024, 4096, 1024, torch.float32),
    (2048, 2048, 2048, torch.float32),
    (1024, 1024, 1024, torch.bfloat16),
    (2048, 2048, 2048, torch.bfloat16),
]


def _written(frame: FrameParts) -> None:
    """What the worker's connection does with a result's frame before the socket: it
    masks the payload, part by part, into the buffers it writes."""
    payload_writes(frame.parts, secrets.token_bytes(4))


def _session(key: Ed25519PrivateKey) -> WorkerSession:
    """A session past its handshake with ``key``'s coordinator, as a joined worker's is."""
    session = WorkerSession(
        "ws://bench/ws",
        name="bench",
        identity=generate_private_key(),
        profile=DeviceProfile(),
        pin_check=lambda url, key: False,
        window=64,
    )
    session.connect(0.0)
    challenge = encode_message(Challenge(new_nonce(), public_key_hex(key)))
    hello = parse_message(session.receive(challenge, 0.0).send[0]).message
    assert isinstance(hello, Hello)
    welcome = make_welcome(
        key, hello, worker_id="w1", heartbeat_interval_s=3600.0, max_frame_bytes=1 << 30, job="b"
    )
    session.receive(encode_message(welcome), 0.0)
    return session


def _interleaved(fns: list, count: int, repeat: int) -> list[list[float]]:
    """Tiles/s of each of ``fns``, ``repeat`` rounds, each round running every fn once in
    turn: a ratio is taken within a round, so the machine's speed moving between rounds
    (other tenants, clock changes) moves both sides of it alike."""
    for fn in fns:
        fn(1)  # warm-up: allocator, thread pool
    rounds = []
    for _ in range(repeat):
        rates = []
        for fn in fns:
            start = time.perf_counter()
            fn(count)
            rates.append(count / (time.perf_counter() - start))
        rounds.append(rates)
    return rounds


@dataclass(frozen=True)
class ShapeRates:
    """One shape's medians over interleaved rounds: bare tiles/s, and ratios taken
    within each round."""

    bare: float  # tiles/s of bare matmul on one pair of operands, hot in cache
    sequential: float  # the worker path, one thread, over bare
    pipelined: float  # the worker path as the worker runs it, over bare
    streamed: float  # bare matmul on each frame's operands in turn, over bare
    pipelined_streamed: float  # pipelined over streamed
    count: int  # tiles in a round


def bench_shape(
    m: int, k: int, n: int, dtype: torch.dtype, threads: int, seconds: float, repeat: int
) -> ShapeRates:
    """The worker path's tiles/s against bare matmul's on the same shape."""
    key = generate_private_key()
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    # Distinct tile ids, reused in turn: a tile is never held twice at once.
    frames = [encode_task(f"t{i}", "mm", a, b, key) for i in range(8)]
    computer = TileComputer(threads, use_gpu=False)
    torch.set_num_threads(threads)
    torch.matmul(a, b)
    start = time.perf_counter()
    torch.matmul(a, b)
    count = max(8, round(seconds / (time.perf_counter() - start)))

    product = torch.matmul(a, b)
    # The operands as the worker path meets them: each frame's own copy, in turn.
    streamed_operands = [(a.clone(), b.clone()) for _ in frames]

    def bare(c: int) -> None:
        for _ in range(c):
            torch.matmul(a, b, out=product)

    def streamed(c: int) -> None:
        for i in range(c):
            x, y = streamed_operands[i % len(streamed_operands)]
            torch.matmul(x, y, out=product)

    def sequential(c: int) -> None:
        session = _session(key)
        for i in range(c):
            session.receive(frames[i % len(frames)], 0.0)
            job = session.next_tile()
            assert job is not None, "tile was refused"
            out = computer.compute(job.op, job.a, job.b)
            result = session.tile_done(job, 0.0)
            assert result is not None
            _written(session.result_frame(result, out))
            computer.give_back(out)

    def pipelined(c: int) -> None:
        session = _session(key)
        # The real worker touches its session only on the event loop thread; this lock
        # stands in for that, and the GEMM itself runs outside it, as in the worker.
        session_lock = threading.Lock()
        verified: queue.Queue = queue.Queue(maxsize=2)
        finished: queue.Queue = queue.Queue(maxsize=1)

        def io_thread() -> None:
            # The worker's event loop: it receives and verifies the next tiles and
            # encodes each finished tile's result, while the compute thread multiplies.
            received = encoded = 0
            while encoded < c:
                can_receive = received < c and not verified.full()
                try:
                    result, out = finished.get(block=not can_receive)
                except queue.Empty:
                    with session_lock:
                        actions = session.receive(frames[received % len(frames)], 0.0)
                    verified.put(actions)
                    received += 1
                    continue
                with session_lock:
                    frame = session.result_frame(result, out)
                _written(frame)
                computer.give_back(out)
                encoded += 1

        feeder = threading.Thread(target=io_thread)
        feeder.start()
        done = 0
        while done < c:
            verified.get()
            with session_lock:
                job = session.next_tile()
            if job is None:
                continue
            out = computer.compute(job.op, job.a, job.b)
            with session_lock:
                result = session.tile_done(job, 0.0)
            finished.put((result, out))
            done += 1
        feeder.join()

    rounds = _interleaved([bare, sequential, pipelined, streamed], count, repeat)
    return ShapeRates(
        bare=statistics.median(r[0] for r in rounds),
        sequential=statistics.median(r[1] / r[0] for r in rounds),
        pipelined=statistics.median(r[2] / r[0] for r in rounds),
        streamed=statistics.median(r[3] / r[0] for r in rounds),
        pipelined_streamed=statistics.median(r[2] / r[3] for r in rounds),
        count=count,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    parser.add_argument(
        "--seconds", type=float, default=0.25, help="bare matmul time a round's tiles take"
    )
    args = parser.parse_args()
    seconds, repeat = (0.05, 2) if args.quick else (args.seconds, 7)
    print(
        f"{'shape m x k x n':>20} {'dtype':>9} {'thr':>4} {'bare GFLOP/s':>13} "
        f"{'sequential':>11} {'ratio':>6} {'pipelined':>10} {'ratio':>6} {'tiles':>6} "
        f"{'streamed':>9} {'ratio':>6} {'pipelined/streamed':>19}"
    )
    for threads in args.threads:
        for m, k, n, dtype in SHAPES:
            r = bench_shape(m, k, n, dtype, threads, seconds, repeat)
            bare_gflops = r.bare * 2 * m * k * n / 1e9
            print(
                f"{f'{m} x {k} x {n}':>20} {str(dtype).removeprefix('torch.'):>9} {threads:>4} "
                f"{bare_gflops:>13.1f} {r.sequential * bare_gflops:>11.1f} {r.sequential:>6.2f} "
                f"{r.pipelined * bare_gflops:>10.1f} {r.pipelined:>6.2f} {r.count:>6} "
                f"{r.streamed * bare_gflops:>9.1f} {r.streamed:>6.2f} "
                f"{r.pipelined_streamed:>19.2f}"
            )
    print(
        f"(medians over {repeat} rounds, each running bare, sequential, pipelined and "
        f"streamed in turn on the tiles bare matmul takes {seconds:g} s for; a ratio is "
        "taken within its round; streamed: bare matmul on each task frame's own copy of "
        "the operands in turn, as the worker path meets them, rather than on one pair "
        "that stays in cache)"
    )


if __name__ == "__main__":
    main()
