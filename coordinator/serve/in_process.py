"""A coordinator inside your own training loop: ``with pool.offload():`` around a step.

For people who keep their own loop rather than writing a ``Job``: ``Pool`` runs the
coordinator's server on a background thread (workers join it like any coordinator),
and ``offload()`` is a context in which every GEMM that torch runs, forward and
backward, is cut into tiles for the pool's workers, checked and put back, while
everything else (and the optimizer step after it) runs in the script as usual. It is
the eager path of ``coordinator.step.eager``: any Python the model runs is fine, and GEMMs
go out one at a time as the step reaches them.

    with Pool(local_workers=2) as pool:
        pool.wait_for_workers(2)
        for x, y in batches:
            with pool.offload():
                loss = loss_fn(model(x), y)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from common.signing import fingerprint, load_or_create_private_key
from coordinator.plan.keep_home import CPU_S_PER_BYTE
from coordinator.plan.live import LivePlanning
from coordinator.plan.planner import plan_config_for
from coordinator.pool.ledger import Ledger
from coordinator.serve.local_workers import LocalWorkers
from coordinator.serve.offload import TileOffload
from coordinator.serve.server import WS_PATH, CoordinatorServer, ServerConfig
from coordinator.step.eager import EagerOffloadMode
from coordinator.step.flops import FlopTally, describe, mostly_kept

log = logging.getLogger("cleave.coordinator")


class Pool:
    def __init__(
        self,
        *,
        name: str = "training",
        host: str = "127.0.0.1",
        port: int = 0,
        state_dir: Path | str = "cleave-state",
        local_workers: int = 0,
        join_token: str = "",
        min_offload_mflop: float = 1.0,
    ) -> None:
        self.name = name
        self._host, self._port = host, port
        self.state_dir = Path(state_dir)
        self._local_count = local_workers
        self._join_token = join_token
        self._min_offload_mflop = min_offload_mflop
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cleave-pool")
        self._cancel = threading.Event()
        self._steps = 0
        self.url = ""
        self.last_step = FlopTally()  # FLOPs of the last offloaded step, by who computed them
        self._said_kept: set[str] = set()  # ops a warning named as keeping a step here
        self._server: CoordinatorServer | None = None
        self._ledger: Ledger | None = None
        self._local: LocalWorkers | None = None
        self._offload: TileOffload | None = None

    def start(self) -> str:
        """Listen, start the local workers; returns the URL local workers join (others
        use this machine's name with the same port and path)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        key = load_or_create_private_key(self.state_dir / "coordinator.key")
        self._ledger = Ledger(self.state_dir / "ledger.sqlite")
        self._server = CoordinatorServer(
            key=key,
            job_name=self.name,
            ledger=self._ledger,
            config=ServerConfig(join_token=self._join_token),
        )
        self._thread.start()
        port = self._call(self._server.start(self._host, self._port))
        # Listening on every address: local workers (and the printed URL) use loopback.
        wildcard = self._host in ("0.0.0.0", "::", "")
        self.url = f"ws://{'127.0.0.1' if wildcard else self._host}:{port}{WS_PATH}"
        self.fingerprint = fingerprint(key)
        self._offload = TileOffload(
            self._server,
            self._loop,
            key,
            plan_config_for(self._min_offload_mflop),
            LivePlanning(
                cost_model=True, coordinator_flops_per_s=0.0, cpu_s_per_byte=CPU_S_PER_BYTE
            ),
        )
        if self._local_count:
            self._local = LocalWorkers(self._local_count, self.url, self.state_dir)
            self._local.start()
        return self.url

    def wait_for_workers(self, count: int, timeout: float | None = None) -> None:
        """Block until ``count`` workers are connected and active."""
        assert self._server is not None, "start() the pool first"
        self._call(asyncio.wait_for(self._server.wait_for_workers(count), timeout))

    @contextmanager
    def offload(self) -> Iterator[EagerOffloadMode]:
        """Every GEMM torch runs inside goes to the pool's workers; ``.stats`` of the
        yielded mode says how many and what share of the FLOPs they computed."""
        assert self._offload is not None, "start() the pool first"
        mode = EagerOffloadMode(self._offload, self._cancel, f"s{self._steps}")
        self._steps += 1
        with mode:
            yield mode
        self.last_step = mode.stats.flops
        kept = mostly_kept(self.last_step)
        if kept is not None and kept not in self._said_kept:  # once per op, not every step
            self._said_kept.add(kept)
            log.warning("%s", describe(self.last_step.summary()))

    def close(self) -> None:
        self._cancel.set()
        if self._local is not None:
            self._local.stop()
        if self._server is not None and self._thread.is_alive():
            self._call(self._server.close())
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()
        if self._ledger is not None:
            self._ledger.close()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> Pool:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
