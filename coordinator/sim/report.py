"""Writes docs/simulation.md and docs/sim/*.svg: `python -m coordinator.sim report`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from coordinator.plan.live import Planner
from coordinator.sim.baselines import restart_recovery_s
from coordinator.sim.config import SimConfig
from coordinator.sim.engine import simulate
from coordinator.sim.population import Device, PoolSpec, make_pool, with_stragglers
from coordinator.sim.report_bytes import section_bytes
from coordinator.sim.report_common import CAMPUS, CMD, HOME, SEED, run_pool, table
from coordinator.sim.report_planner import section_planner
from coordinator.sim.report_ranks import section_ranks
from coordinator.sim.svg import line_chart


def section_step_time(out: list[str], svgs: dict[str, str]) -> None:
    base: dict[str, Any] = {"model": "opt-125m", "batch": 4, "seq": 512}
    rows: list[list[Any]] = []
    series: dict[str, list[tuple[float, float]]] = {}
    local_s = None
    for n in (1, 4, 16, 64, 256, 1024):
        row: list[Any] = [n]
        for label, spec in (("campus", CAMPUS), ("home", HOME)):
            if label == "home" and n > 256:
                row += ["-"] * 7
                continue
            r = run_pool(n, spec, **base)
            plain = run_pool(n, spec, operand_cache=False, **base)
            t, t_plain = r["step_times_s"][0], plain["step_times_s"][0]
            if n <= 256:
                cost = run_pool(n, spec, planner=Planner.COST, steps=2, **base)["step_times_s"]
                row += [f"{cost[0]:.1f}", f"{cost[1]:.1f}"]
                series.setdefault(f"{label}, cost planner", []).append((n, cost[1]))
            else:
                row += ["-", "-"]
            local_s = r["flops_per_step"] / (SimConfig().coordinator_gflops * 1e9)
            row += [
                f"{t:.1f}",
                f"{t_plain:.1f}",
                f"{r['utilisation'] * 100:.2f}%",
                f"{r['down_bytes'] / n / 1e6:.0f}",
                f"{plain['down_bytes'] / n / 1e6:.0f}",
            ]
            series.setdefault(f"{label} links", []).append((n, t))
            series.setdefault(f"{label}, no cache", []).append((n, t_plain))
        rows.append(row)
    out += [
        "## (b) Step time against N on a heterogeneous pool",
        "",
        f"`{CMD}` — opt-125m, batch 4 x seq 512, fp32; the real Scheduler and the grid planner "
        "(`plan_gemm`, target 2N tiles), window 2, devices log-normal 5 GFLOP/s–100 TFLOP/s "
        "(median 200), memory caps 128 MiB–1 GiB, uplink 2–10x slower than downlink, "
        "coordinator egress 10 Gbit/s. Campus: median downlink 1 Gbit/s; home: 100 Mbit/s. With"
        " the operand cache (each device keeps blocks up to its memory cap; the scheduler's "
        "affinity rule) and, for comparison, without it (every tile carries both operands). "
        "Utilisation (with the cache) = useful tile FLOPs / (pool FLOP/s x step time); MB/dev ="
        " downlink MB per device per step. 'cost' columns: the live default planner "
        "(`live.LivePlanning`: grids from the cost model of the devices as estimated so far, "
        "placed by earliest finish where compute binds and as pull would hand them out where "
        "links bind, the coordinator computing the share it would finish first), its first step"
        " (estimates from the devices' claims, links assumed fast until measured) and its "
        "second. N=1024 on home links, and the cost planner at N=1024, are left out to keep the"
        " report run short.",
        "",
        table(
            [
                "N",
                "campus cost s, step 1",
                "step 2",
                "campus grid s",
                "no cache",
                "campus util",
                "campus MB/dev",
                "no cache",
                "home cost s, step 1",
                "step 2",
                "home grid s",
                "no cache",
                "home util",
                "home MB/dev",
                "no cache",
            ],
            rows,
        ),
        "",
        f"For scale: the coordinator alone at 500 GFLOP/s would take {local_s:.1f} s.",
        "",
        "![step time](sim/step_time.svg)",
        "",
    ]
    svgs["step_time.svg"] = line_chart(
        "Step time, opt-125m", "devices N", "seconds per step", series, log_x=True, log_y=True
    )


def section_recovery(out: list[str], svgs: dict[str, str]) -> None:
    base: dict[str, Any] = {"model": "opt-125m", "batch": 4, "seq": 512}
    n = 16
    clean = run_pool(n, CAMPUS, **base)["step_times_s"][0]
    rows = []
    pts: dict[str, list[tuple[float, float]]] = {"Cleave (silent failure)": [], "restart": []}
    devices = make_pool(n, SEED, CAMPUS)
    fastest = max(devices, key=lambda d: d.true_flops)
    restart = restart_recovery_s(clean, restart_s=120.0, checkpoint_every=100)
    for kind in ("leave_at", "fail_at"):
        for spec_after in (None, 2.0):
            failed = [replace(d, **{kind: clean / 2}) if d is fastest else d for d in devices]
            r = simulate(SimConfig(**base, speculate_after=spec_after), failed)
            lost = r["step_times_s"][0] - clean
            ok = r["scheduler"]["pending"] == 0
            label = "disconnect" if kind == "leave_at" else "silent failure"
            rows.append(
                [
                    label,
                    "on" if spec_after else "off",
                    f"{r['step_times_s'][0]:.2f}",
                    f"{lost:.2f}",
                    r["lost_tiles"],
                    "yes" if ok else "NO",
                    f"{restart:.0f}",
                    f"{restart / max(lost, 1e-3):.0f}x",
                ]
            )
    out += [
        "## (c) Recovery after a device failure vs restart from a checkpoint",
        "",
        f"`{CMD}` — opt-125m, batch 4 x seq 512, N={n} campus pool; the fastest device "
        f"({fastest.true_flops / 1e9:.0f} GFLOP/s) dies half-way through the step (clean step "
        f"{clean:.2f} s). Time lost = step time with the failure - without. A disconnect is "
        "seen at once (socket closed); a silent failure only after the 10 s heartbeat "
        "timeout, unless speculation copies its overdue tiles first. Restart baseline: "
        "120 s restart + half of a 100-step checkpoint interval at the same step time.",
        "",
        table(
            [
                "failure",
                "speculation",
                "step s",
                "time lost s",
                "tiles re-queued",
                "all tiles done",
                "restart lost s",
                "restart / Cleave",
            ],
            rows,
        ),
        "",
    ]
    pts["restart"] = [(1, restart)]


def section_speculation(out: list[str], svgs: dict[str, str]) -> None:
    base: dict[str, Any] = {"model": "opt-125m", "batch": 4, "seq": 512}
    n = 16
    rows = []
    series: dict[str, list[tuple[float, float]]] = {"no speculation": [], "speculation": []}
    for stragglers in (0, 1, 2, 4):
        row: list[Any] = [stragglers]
        for label, after in (("no speculation", None), ("speculation", 2.0)):
            r = run_pool(n, CAMPUS, stragglers=stragglers, speculate_after=after, **base)
            t = r["step_times_s"][0]
            row += [f"{t:.2f}", r["scheduler"]["speculated"]]
            series[label].append((stragglers, t))
        plain = run_pool(n, CAMPUS, stragglers=stragglers, operand_cache=False, **base)
        row.append(f"{plain['step_times_s'][0]:.2f}")
        rows.append(row)
    out += [
        "## (e) Speculative copies under stragglers",
        "",
        f"`{CMD}` — opt-125m, batch 4 x seq 512, N={n} campus pool; the first k devices "
        "deliver 1/10 of the GFLOP/s their profile claims. Speculation: "
        "`SchedulerConfig(speculate_after=2.0)`, predictions from the cost model (claimed "
        "speed, EWMA-corrected by finished tiles; an overdue tile is assumed to need as "
        "long again as it has taken). Operand cache on; the last column is the step "
        "without it and without speculation.",
        "",
        table(
            ["stragglers", "step s (off)", "copies", "step s (on)", "copies", "no cache, off"],
            rows,
        ),
        "",
        "![speculation](sim/speculation.svg)",
        "",
    ]
    svgs["speculation.svg"] = line_chart(
        "Step time with 10x stragglers (N=16)", "stragglers", "seconds per step", series
    )


SECTIONS: list[Callable[[list[str], dict[str, str]], None]] = [
    section_bytes,
    section_step_time,
    section_recovery,
    section_planner,
    section_speculation,
    section_ranks,
]


def write_report(docs: Path, intro: str) -> float:
    started = time.perf_counter()
    out: list[str] = [intro]
    svgs: dict[str, str] = {}
    for section in SECTIONS:
        section(out, svgs)
    elapsed = time.perf_counter() - started
    out.append(f"_Report generated by `{CMD}` in {elapsed:.0f} s._\n")
    (docs / "sim").mkdir(parents=True, exist_ok=True)
    for name, svg in svgs.items():
        (docs / "sim" / name).write_text(svg)
    (docs / "simulation.md").write_text("\n".join(out))
    return elapsed


def pool_for_cli(n: int, seed: int, spec: PoolSpec, stragglers: int) -> list[Device]:
    devices = make_pool(n, seed, spec)
    return with_stragglers(devices, stragglers) if stragglers else devices


INTRO = """# Simulated pools

Everything below is produced by `python -m coordinator.sim report` (seed 1, ~20 minutes
on 2 cores) and can be re-run; `python -m coordinator.sim run --help` simulates one pool and
writes JSON (`--json FILE`).

## What is simulated, and what is simplified

- A discrete-event loop with a simulated clock drives the **live coordinator's core**,
  `coordinator.pool.core.CoordinatorCore`, as the server's pump does: joins, heartbeats,
  results and the expiry tick go in, and its task frames, cancels, closes and stranded
  tiles act on the simulated devices. Every decision is the server's own: the real
  `Scheduler` (assign, complete, expire, stranded/take_over, speculate), the finish
  predictions, the operand-cache mirror, what the core learns of each device from its
  tiles and the pool view the planner reads. Stages are planned with the real planners:
  `planner.plan_gemm` (the old default, still `serve --planner grid`) and
  `live.LivePlanning` (the live default: the cost model of the devices as estimated so
  far; tiles placed by earliest finish, each naming its worker, where compute binds and
  links are measured, else as pull would hand them out; after the work earlier plans
  committed, the coordinator computing the share it would finish first).
- A training step is the GEMMs of a real model's shapes (`coordinator/sim/models.py`):
  every linear's forward mm and two backward mm's, the attention bmm's (2 forward, 4
  backward) and the LM head, grouped into stages with a barrier after each (stricter
  than the dataflow executor, so steps err slow). Element-wise ops, softmax, layer norm
  and the optimizer are not timed.
- Devices: GFLOP/s log-normal (median 200, 5 GFLOP/s to 100 TFLOP/s), memory caps 128 MiB
  to 1 GiB, downlink log-normal, uplink 2-10x slower. Each tile is download (device link
  and the coordinator's shared 10 Gbit/s egress, FIFO) -> compute -> upload, with a
  prefetch window of 2 tiles (the live server lets tiles under a 128³ GEMM share window
  slots and travel in batches; the simulator keeps a tile a slot and a message a tile,
  which its models' tiles are far above). Results are always correct. The coordinator's
  own CPU (cutting, sending, checking) costs nothing, except in section (f), which models
  it per tile and
  per byte, and where coordinator ranks are simulated.
- The operand cache is the live server's (`coordinator/pool/workers.py` `Worker.task_frame`): each
  device keeps the operand blocks it was sent (A block `{gemm}/a/{b}.{m}.{k}`, B block
  `{gemm}/b/{b}.{k}.{n}`), up to its memory cap, least recently used first out; the
  coordinator mirrors each device's cache, sends only the blocks a device lacks, and
  `Scheduler.assign(prefers=...)` hands a tile to one of the next 16 devices in turn
  that holds one of its blocks, and a lone ready device takes, from the next 16 tiles
  of the same GEMM, one whose block it holds.
  The live server keys blocks by content (BLAKE3), so a block that recurs in another
  GEMM of the step is reused too (~10% of a step's block bytes on the built-in job);
  the simulator has shapes, not contents, so it reuses blocks within a GEMM only and
  errs high. `SimConfig(operand_cache=False)` (CLI
  `--no-operand-cache`) turns it off: every tile then carries both operands. Misses
  (`missing_block`) do not happen here: the mirror is exact.
- Bytes per device for N up to 4096 (table a) are counted in closed form from the
  planner's grids instead of being simulated tile by tile; the cached column's closed
  form is checked against the simulated engine for N <= 64.
- Baselines come from their published cost structure (`coordinator/sim/baselines.py`):
  Megatron tensor parallelism's 4 ring all-reduces per layer and step, and a pipeline
  that restarts from a checkpoint (120 s restart + half a 100-step interval).

## What the numbers say (honestly)

- (a) Cleave's per-device bytes fall with N (total / N, while the total grows only as
  tiles shrink), but they start far above tensor parallelism's, because operands
  (weights included) go out again every step and to every device that needs them. The
  operand cache cuts the downlink by 60% at N = 1 (one device keeps what fits), 31% at
  16 and 10-15% from 64 on, where a device gets ~2 tiles of a GEMM and they share a
  block only when the grid lines up with N. Either way Cleave crosses TP's flat ~50 GB
  between 16 and 64 devices. The closed form deals tiles in turn, as one `assign` call
  does (the server's mirror of a cache changes only after the call, so tiles dealt in
  one call to idle workers are never matched to blocks the same call hands out). Later
  calls mostly find one device ready, the one that just freed a slot: it takes, from
  the next 16 tiles of the same GEMM, one whose block it holds. The simulated engine
  sends 9% more downlink than the closed form at N = 4 and 2-8% less at 16 and 64 (it
  sent 9-17% more when that device took the next tile whatever it held, and table
  (b)'s steps took up to 10% longer).
- (b) In fp32 over real links the pool is bandwidth-bound: with the old planner
  (`plan_gemm`, every GEMM sent) utilisation is ~1% or less, steps take 24-2500 s, and
  past ~16 devices the coordinator's shared 10 Gbit/s egress makes them slower again.
  The cost planner (the live default) sees this in its estimates and keeps what the
  links cannot feed at the coordinator: 3.3-3.6 s per step on campus links up to 16
  devices from the second step (the coordinator alone: 3.3 s), 3.3 s on home links up to
  64 devices from the second step. The first step pays for assuming unmeasured links are
  fast (4.2-4.6 s on campus links, 4.3-8.3 s on home links): the core learns a device's
  links only from tiles that waited behind no other, as the server does. It is not
  faster than a 500 GFLOP/s coordinator for this small model, and at 64-256 campus
  devices it is 30-40% slower (4.3-4.6 s: tiles pulled by slow devices). The operand cache makes the
  old planner's steps 3-12% faster up to 64 devices.
- (c) A disconnect costs almost nothing (the tiles re-queue at once); a silent failure
  costs about the heartbeat timeout. Both are >= 100x below the restart baseline.
- (d) Placed by earliest estimated finish, the planner's makespan is within 1.01-1.06x
  of total work / total speed (the coordinator's included) wherever compute is what
  binds ('unlimited' links: CPU pools with a 100x speed spread and pools with GPUs, 2 to
  64 devices): the 1.25x goal is met there. On a 10 Gbit/s LAN it is 1.2-1.9x for CPU
  pools up to 16 devices and 1.5-7.3x with GPUs (the bound ignores communication, and
  attention's scores bmm, K = 64, moves more bytes than FLOPs: worst GEMM 2.2-15.7x);
  on home links the coordinator does nearly everything and the ratio is the coordinator
  alone's. What the server runs, executed on the simulated clock with the real
  `LivePlanning` and `Scheduler` ('live, executed'): **1.01-1.12x** wherever compute
  binds, CPUs and GPUs, 2 to 64 devices: the 1.25x goal is met by the live code. The
  tiles name the worker the plan placed them on and wait for it (a worker that would
  return one clearly sooner steals it), instead of going to the first free slot, which
  gave 1.03-85x (slow devices taking tiles a fast one would have finished sooner). On
  a 10 Gbit/s LAN: 1.2-6.2x for CPUs, 1.5-14x with GPUs (pull: up to 81x); on home
  links it is pull's plan, and the coordinator alone's ratio.
- (e) With a pull scheduler and a window of 2, 10x stragglers in a bandwidth-bound pool
  cost little; speculative copies change the step by 0.3 s or less here (the cache saves
  ~3 s). Their benefit shows in compute-bound pools (see
  tests/unit/test_sim.py::test_speculation_rescues_stragglers).
- (f) Coordinator ranks, with the coordinator's CPU modelled from the benches: where
  every GEMM is sent (grid), that CPU is what binds, 97-100% busy on every rank, and a
  step shrinks with the workers each rank serves: 1,000 workers take 964 s a step with
  one rank and 429, 203, 100 s with 2, 4, 8; 10,000 take 508, 243, 123 s with 8, 16, 32
  ranks. The all-reduce (0.4-0.8 s over 10 Gbit/s) is small beside it. The grid cuts
  2N/R tiles a GEMM, so a bigger pool means more, smaller tiles and more CPU per step:
  10,000 workers need 32 ranks to step as fast as 1,000 do with 4. With the cost
  planner (the default) the ranks mostly add coordinator compute, each computing its
  slice of the batch: 56 s with one rank to 4.0 s with 8 at 1,000 workers, 46 s with 8
  to 2.7 s with 32 at 10,000. At 10,000 workers and 8 ranks it sends 40% of the FLOPs
  and steps slower than at 1,000: its cost model counts a tile's fixed CPU but not the
  CPU its bytes cost the coordinator.

"""
