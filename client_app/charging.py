"""What a tile costs the CPU-time limit, measured around its GEMM on the compute thread.

The cost is the process's CPU time since the previous tile was charged (this GEMM, plus
the decoding, signature checks and heartbeats done meanwhile, also while resting) over
the thread cap, i.e. the share of the granted cores the worker used. Wall time would
overcharge a GEMM slowed by the owner's own programs, and the compute thread's own CPU
time (``time.thread_time``) misses torch's other intra-op threads. Event-loop work done
meanwhile (decoding the next tile) is the worker's too and is charged with it. On a GPU
the device is what the limit occupies, so a tile costs its wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from client_app.compute import TileComputer


class ChargedTile(NamedTuple):
    c: torch.Tensor  # the product
    seconds: float  # the GEMM's wall time (reported to the coordinator)
    cost: float  # busy seconds at the thread cap (what the duty cycle is charged)


class TileCharger:
    """Computes tiles and charges each one its share of the process's CPU time.

    ``compute`` runs on the (single) compute thread, the only writer of the charge mark;
    ``start_afresh`` runs on the event loop while that thread is idle.
    """

    def __init__(
        self,
        computer: TileComputer,
        *,
        process_time: Callable[[], float] = time.process_time,
        perf_counter: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.computer = computer
        self._process_time = process_time
        self._perf_counter = perf_counter
        self._charge_from: float | None = None  # CPU time at the last charge

    def start_afresh(self) -> None:
        """Whatever runs before the next tile (heartbeats while there was no work) is not
        owed by it: its charge starts when it starts."""
        self._charge_from = None

    def compute(self, op: str, a: torch.Tensor, b: torch.Tensor) -> ChargedTile:
        threads = self.computer.threads
        now_cpu = self._process_time()
        cpu0 = now_cpu if self._charge_from is None else self._charge_from
        start = self._perf_counter()
        c = self.computer.compute(op, a, b)
        seconds = self._perf_counter() - start
        cpu1 = self._process_time()
        self._charge_from = cpu1
        if self.computer.device.type == "cpu":
            cost = (cpu1 - cpu0) / threads
        else:
            cost = seconds
        return ChargedTile(c, seconds, cost)
