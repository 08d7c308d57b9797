"""Prometheus text exposition (format 0.0.4) of the coordinator's status, for ``GET /metrics``.

``render_metrics`` is a pure function of the ``/api/status`` dictionary, so the page and
the metrics can never disagree and the format is tested without a server. Fields that a
status lacks (an older server, no training yet) are simply left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# status["tiles"] key -> counter name and help. Counters only grow for a process's life;
# Prometheus treats the drop to zero at a restart as a counter reset.
TILE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("sent", "cleave_tiles_sent_total", "Tile bundles sent to workers, re-issues included."),
    ("verified", "cleave_tiles_verified_total", "Tile results that passed verification."),
    ("reissued", "cleave_tiles_reissued_total", "Sends of a tile that had been sent before."),
    (
        "speculated",
        "cleave_tiles_speculated_total",
        "Copies of tiles predicted late, sent to idle workers (also counted as re-issued).",
    ),
    ("rejected", "cleave_tiles_rejected_total", "Tile results that failed verification."),
    ("refused", "cleave_tiles_refused_total", "Tiles a worker refused (e.g. bad signature)."),
    ("duplicates", "cleave_tiles_duplicate_total", "Results for tiles already done."),
    (
        "not_assigned",
        "cleave_tiles_not_assigned_total",
        "Results for tiles the sender did not hold (replays, forgeries).",
    ),
    (
        "computed_here",
        "cleave_tiles_computed_here_total",
        "Tiles no connected worker could take, computed at the coordinator.",
    ),
    (
        "kept_here",
        "cleave_tiles_kept_here_total",
        "Tiles the planner kept for the coordinator to compute itself (its share).",
    ),
)
TILE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("queued", "cleave_tiles_queued", "Tiles waiting for a worker."),
    ("pending", "cleave_tiles_pending", "Tiles submitted and not yet verified."),
)
# Training states the coordinator reports; each gets a 0/1 series so alerts can use them.
STATES = ("starting", "waiting for workers", "training", "stopping", "done", "stopped", "failed")


@dataclass
class _Family:
    name: str
    kind: str  # "counter" or "gauge"
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


class _Exposition:
    """Metric families in the order first declared; one HELP/TYPE header each."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}

    def add(
        self,
        name: str,
        kind: str,
        help_text: str,
        value: Any,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        number = _number(value)
        if number is None:
            return
        family = self._families.setdefault(name, _Family(name, kind, help_text))
        family.samples.append((dict(labels or {}), number))

    def text(self) -> str:
        lines: list[str] = []
        for family in self._families.values():
            lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
            lines.append(f"# TYPE {family.name} {family.kind}")
            for labels, value in family.samples:
                lines.append(f"{family.name}{_labels(labels)} {_format_value(value)}")
        return "\n".join(lines) + "\n"


def render_metrics(status: Mapping[str, Any]) -> str:
    """The Prometheus text exposition of one ``/api/status`` snapshot."""
    out = _Exposition()
    out.add(
        "cleave_info",
        "gauge",
        "Constant 1, labelled with the job and the coordinator's key fingerprint.",
        1,
        {
            "job": str(status.get("job", "")),
            "coordinator_key": str(status.get("coordinator_key", "")),
        },
    )
    tiles = status.get("tiles") or {}
    for key, name, help_text in TILE_COUNTERS:
        out.add(name, "counter", help_text, tiles.get(key))
    for key, name, help_text in TILE_GAUGES:
        out.add(name, "gauge", help_text, tiles.get(key))
    traffic = status.get("traffic") or {}
    out.add(
        "cleave_bytes_down_total",
        "counter",
        "Tile bundle bytes sent to workers.",
        traffic.get("bytes_down"),
    )
    out.add(
        "cleave_bytes_down_uncached_total",
        "counter",
        "What the bytes to workers would have been without their operand caches.",
        traffic.get("bytes_down_uncached"),
    )
    out.add(
        "cleave_bytes_up_total",
        "counter",
        "Verified result bytes received from workers.",
        traffic.get("bytes_up"),
    )
    out.add(
        "cleave_bytes_half_precision_total",
        "counter",
        "Bytes of bf16/fp16 tiles, both ways: fp32 would have moved twice as many.",
        traffic.get("bytes_half"),
    )
    connections = status.get("connections") or {}
    out.add(
        "cleave_handshakes_refused_total",
        "counter",
        "Connections closed before they authenticated (bad hello, token, ban, timeout).",
        connections.get("refused_handshakes"),
    )
    out.add(
        "cleave_workers_banned_run_total",
        "counter",
        "Worker keys banned by this coordinator process.",
        connections.get("banned_this_run"),
    )
    _training(out, status)
    _workers(out, status.get("workers") or [])
    banned = status.get("banned")
    if isinstance(banned, list):
        out.add("cleave_workers_banned", "gauge", "Worker keys banned from this pool.", len(banned))
    return out.text()


def _training(out: _Exposition, status: Mapping[str, Any]) -> None:
    out.add(
        "cleave_steps_total",
        "counter",
        "Training steps completed, counting steps resumed from a checkpoint.",
        status.get("step"),
    )
    out.add("cleave_step", "gauge", "The step being trained now.", status.get("step"))
    out.add(
        "cleave_steps_target", "gauge", "Steps to train in total (--steps).", status.get("steps")
    )
    history = status.get("history") or []
    last = history[-1] if history else {}
    out.add("cleave_loss", "gauge", "Loss of the last completed step.", last.get("loss"))
    out.add(
        "cleave_step_seconds",
        "gauge",
        "Wall time of the last completed step.",
        last.get("seconds"),
    )
    out.add("cleave_step_tiles", "gauge", "Tiles verified in the last step.", last.get("tiles"))
    flops = status.get("flops") or {}
    out.add(
        "cleave_step_gflop",
        "gauge",
        "GFLOP of the last step, every op counted (torch.utils.flop_counter conventions).",
        flops.get("gflop"),
    )
    out.add(
        "cleave_step_workers_flop_share",
        "gauge",
        "Share of the last step's FLOPs that workers computed (0 to 1).",
        flops.get("workers_share"),
    )
    for kept in flops.get("kept_here") or []:
        out.add(
            "cleave_step_kept_here_gflop",
            "gauge",
            "GFLOP of the last step computed at the coordinator, by op.",
            kept.get("gflop"),
            {"op": str(kept.get("op", ""))},
        )
    out.add(
        "cleave_checkpoint_step",
        "gauge",
        "Step of the last checkpoint written.",
        status.get("checkpoint_step"),
    )
    state = status.get("state")
    if isinstance(state, str):
        for known in STATES:
            out.add(
                "cleave_state",
                "gauge",
                "1 for the coordinator's current training state.",
                int(state == known),
                {"state": known},
            )


def _workers(out: _Exposition, workers: Iterable[Mapping[str, Any]]) -> None:
    connected = active = 0
    rows = []
    for worker in workers:
        connected += 1
        active += worker.get("state") != "paused"
        rows.append(worker)
    out.add("cleave_workers_connected", "gauge", "Workers connected now.", connected)
    out.add("cleave_workers_active", "gauge", "Connected workers not paused.", active)
    for worker in rows:
        # Names are chosen by volunteers: never trusted, always escaped in _labels.
        labels = {"id": str(worker.get("id", "")), "worker": str(worker.get("name", ""))}
        contribution = worker.get("contribution") or {}
        out.add(
            "cleave_worker_info",
            "gauge",
            "Constant 1 per connected worker, labelled with its state and device.",
            1,
            {
                **labels,
                "state": str(worker.get("state", "")),
                "device": str(worker.get("device", "")),
                "key": str(worker.get("key", "")),
            },
        )
        out.add(
            "cleave_worker_tiles_verified_total",
            "counter",
            "Verified tiles credited to this worker's name, all time.",
            contribution.get("tiles"),
            labels,
        )
        out.add(
            "cleave_worker_gflop_verified_total",
            "counter",
            "Verified GFLOP credited to this worker's name, all time.",
            contribution.get("gflop"),
            labels,
        )
        out.add(
            "cleave_worker_tiles_session",
            "gauge",
            "Tiles verified on this connection.",
            worker.get("tiles_session"),
            labels,
        )
        out.add(
            "cleave_worker_in_flight",
            "gauge",
            "Tiles this worker holds now.",
            worker.get("in_flight"),
            labels,
        )
        out.add(
            "cleave_worker_refused_total",
            "counter",
            "Tiles this connection refused.",
            worker.get("refused"),
            labels,
        )
        out.add(
            "cleave_worker_last_seen_seconds",
            "gauge",
            "Seconds since this worker's last frame.",
            worker.get("last_seen_s"),
            labels,
        )
        out.add(
            "cleave_worker_reputation",
            "gauge",
            "This worker's reputation, 0 to 1.",
            worker.get("reputation"),
            labels,
        )


def _number(value: Any) -> float | None:
    # bool is an int in Python, and True would pass silently as 1 where a count is meant.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def escape_label_value(value: str) -> str:
    """Escape a label value per the text format: backslash, double quote and newline.
    Other control characters are replaced, so that a hostile worker name cannot break
    line-oriented tools that read this page."""
    out = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "".join("\ufffd" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch for ch in out)


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{escape_label_value(value)}"' for key, value in labels.items())
    return "{" + inner + "}"
