"""`python -m coordinator.sim run ...` simulates a pool; `... report` writes the docs."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from coordinator.plan.live import Planner
from coordinator.sim.config import SimConfig
from coordinator.sim.engine import simulate
from coordinator.sim.models import MODELS
from coordinator.sim.population import PoolSpec
from coordinator.sim.report import INTRO, pool_for_cli, write_report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m coordinator.sim", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="simulate training steps on one pool; print a summary")
    run.add_argument("--model", choices=sorted(MODELS), default="opt-125m")
    run.add_argument("--batch", type=int, default=4)
    run.add_argument("--seq", type=int, default=512)
    run.add_argument("--steps", type=int, default=1)
    run.add_argument("--devices", type=int, default=16)
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--planner", choices=[p.value for p in Planner], default=Planner.GRID.value)
    run.add_argument("--median-gflops", type=float, default=200.0)
    run.add_argument("--median-down-mbit", type=float, default=100.0)
    run.add_argument("--stragglers", type=int, default=0, help="devices 10x slower than claimed")
    run.add_argument("--speculate-after", type=float, default=None)
    run.add_argument(
        "--leave-for-faster",
        type=float,
        default=None,
        help="SchedulerConfig.leave_for_faster: earliest-finish holds in assign()",
    )
    run.add_argument(
        "--placement",
        choices=("auto", "finish", "pull"),
        default="auto",
        help="how the cost-model planner places tiles (LivePlanning.rule)",
    )
    run.add_argument(
        "--pull",
        action="store_true",
        help="tiles name no planned worker: each goes to the first free slot",
    )
    run.add_argument(
        "--no-operand-cache",
        action="store_true",
        help="every tile carries both operands (workers keep no blocks)",
    )
    run.add_argument("--fail-rate-per-h", type=float, default=0.0)
    run.add_argument("--leave-rate-per-h", type=float, default=0.0)
    run.add_argument("--join-rate-per-h", type=float, default=0.0)
    run.add_argument(
        "--ranks", type=int, default=1, help="coordinator ranks (the batch must split across them)"
    )
    run.add_argument(
        "--rank-link-gbit", type=float, default=10.0, help="the ranks' link, for the all-reduce"
    )
    run.add_argument(
        "--coordinator-cpu-us-per-tile",
        type=float,
        default=0.0,
        help="the coordinator's CPU per tile handed out (default 0: its CPU is free)",
    )
    run.add_argument(
        "--coordinator-cpu-ns-per-byte",
        type=float,
        default=0.0,
        help="the coordinator's CPU per tile byte sent or received (default 0)",
    )
    run.add_argument("--json", type=Path, help="write the full result here")
    report = sub.add_parser("report", help="write docs/simulation.md and docs/sim/*.svg")
    report.add_argument("--docs", type=Path, default=Path("docs"))
    return parser


def main(argv: list[str] | None = None) -> int:
    # The core logs what it decides about each worker, for operators; simulated devices
    # joining, lagging and dying by the thousand are not news.
    logging.getLogger("cleave.coordinator").setLevel(logging.ERROR)
    args = build_parser().parse_args(argv)
    if args.command == "report":
        elapsed = write_report(args.docs, INTRO)
        print(f"wrote {args.docs / 'simulation.md'} in {elapsed:.0f} s")
        return 0
    spec = PoolSpec(
        median_gflops=args.median_gflops,
        median_down_mbit=args.median_down_mbit,
        fail_rate_per_h=args.fail_rate_per_h,
        leave_rate_per_h=args.leave_rate_per_h,
        join_rate_per_h=args.join_rate_per_h,
    )
    config = SimConfig(
        model=args.model,
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        planner=args.planner,
        speculate_after=args.speculate_after,
        leave_for_faster=args.leave_for_faster,
        operand_cache=not args.no_operand_cache,
        placement=args.placement,
        follow_plan=not args.pull,
        ranks=args.ranks,
        rank_link_bps=args.rank_link_gbit * 1e9 / 8,
        coordinator_cpu_per_tile_s=args.coordinator_cpu_us_per_tile * 1e-6,
        coordinator_cpu_per_byte_s=args.coordinator_cpu_ns_per_byte * 1e-9,
    )
    result = simulate(config, pool_for_cli(args.devices, args.seed, spec, args.stragglers))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in result.items() if k not in ("devices", "config")}
    json.dump(summary, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
