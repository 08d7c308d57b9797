"""What the CPU-time limit charges a tile, with injected CPU and wall clocks."""

from __future__ import annotations

import pytest
import torch

from client_app.charging import TileCharger
from client_app.compute import TileComputer


class Ticks:
    """A CPU clock and a wall clock that move only when told."""

    def __init__(self) -> None:
        self.cpu = 10.0
        self.wall = 100.0

    def process_time(self) -> float:
        return self.cpu

    def perf_counter(self) -> float:
        return self.wall


class StubComputer(TileComputer):
    """A GEMM that takes ``wall_s`` seconds and ``cpu_s`` CPU seconds of the process."""

    def __init__(self, ticks: Ticks, threads: int, *, wall_s: float, cpu_s: float) -> None:
        super().__init__(threads, use_gpu=False)
        self.ticks, self.wall_s, self.cpu_s = ticks, wall_s, cpu_s

    def compute(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.ticks.wall += self.wall_s
        self.ticks.cpu += self.cpu_s
        return torch.zeros(a.shape[0], b.shape[1])


def charger_for(ticks: Ticks, computer: TileComputer) -> TileCharger:
    return TileCharger(computer, process_time=ticks.process_time, perf_counter=ticks.perf_counter)


A, B = torch.zeros(2, 3), torch.zeros(3, 4)


def test_a_tile_costs_its_cpu_time_over_the_thread_cap() -> None:
    ticks = Ticks()
    # Two granted cores, busy 0.5 CPU seconds over 0.4 s of wall time (slowed down).
    charger = charger_for(ticks, StubComputer(ticks, 2, wall_s=0.4, cpu_s=0.5))
    charged = charger.compute("mm", A, B)
    assert charged.c.shape == (2, 4)
    assert charged.seconds == pytest.approx(0.4) and charged.cost == pytest.approx(0.25)


def test_cpu_used_between_tiles_is_charged_with_the_next_unless_started_afresh() -> None:
    ticks = Ticks()
    charger = charger_for(ticks, StubComputer(ticks, 2, wall_s=0.4, cpu_s=0.5))
    charger.compute("mm", A, B)
    ticks.cpu += 0.1  # decoding the next tile, heartbeats: the worker's CPU time too
    assert charger.compute("mm", A, B).cost == pytest.approx((0.1 + 0.5) / 2)
    ticks.cpu += 3.0  # a long wait for work: heartbeats over minutes are not owed
    charger.start_afresh()
    assert charger.compute("mm", A, B).cost == pytest.approx(0.25)


def test_the_thread_cap_in_force_is_the_divisor() -> None:
    ticks = Ticks()
    computer = StubComputer(ticks, 4, wall_s=1.0, cpu_s=2.0)
    charger = charger_for(ticks, computer)
    assert charger.compute("mm", A, B).cost == pytest.approx(0.5)
    computer.threads = 1  # the owner lowered the cap while the worker ran
    assert charger.compute("mm", A, B).cost == pytest.approx(2.0)


def test_on_a_gpu_a_tile_costs_its_wall_time() -> None:
    ticks = Ticks()
    computer = StubComputer(ticks, 2, wall_s=0.3, cpu_s=0.01)
    computer.device = torch.device("cuda")  # only its type is read: no GPU needed
    assert charger_for(ticks, computer).compute("mm", A, B).cost == pytest.approx(0.3)
