"""Prometheus text exposition (format 0.0.4) of the coordinator's status, for ``GET /metrics``.

``render_metrics`` is a pure function of the ``/api/status`` dictionary, so the page and
the metrics can never disagree and the format is tested without a server. Fields that a
status lacks (an older server, no training yet) are simply left out. ``prometheus_client``
writes the text; ``StatusCollector`` only says which families a snapshot holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from coordinator.step.run_state import RunState

# What generate_latest writes; CONTENT_TYPE_LATEST (version=1.0.0) would also announce
# UTF-8 metric names, which this page never uses.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

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


def render_metrics(status: Mapping[str, Any]) -> str:
    """The Prometheus text exposition of one ``/api/status`` snapshot."""
    registry = CollectorRegistry()
    registry.register(StatusCollector(status))
    return generate_latest(registry).decode()


class StatusCollector(Collector):
    """The metric families of one status snapshot, built when collected."""

    def __init__(self, status: Mapping[str, Any]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        # One of several coordinator ranks: every series says which (Prometheus scrapes
        # each rank's page), and the job's size in ranks is one more family.
        rank = (self._status.get("rank") or {}).get("rank")
        out = _Families({} if rank is None else {"rank": str(rank)})
        if rank is not None:
            out.gauge(
                "cleave_ranks",
                "Coordinator ranks training this job together.",
                self._status["rank"].get("world"),
            )
        _totals(out, self._status)
        _training(out, self._status)
        _workers(out, self._status.get("workers") or [], self._status.get("pool") or {})
        banned = self._status.get("banned")
        if isinstance(banned, list):
            out.gauge("cleave_workers_banned", "Worker keys banned from this pool.", len(banned))
        yield from out.families()


class _Families:
    """Families in the order first declared; a family with no sample is left out."""

    def __init__(self, const_labels: Mapping[str, str] | None = None) -> None:
        self._families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        self._const = dict(const_labels or {})  # on every series

    def gauge(
        self, name: str, help_text: str, value: Any, labels: Mapping[str, str] | None = None
    ) -> None:
        self._add(GaugeMetricFamily, name, help_text, value, labels or {})

    def counter(
        self, name: str, help_text: str, value: Any, labels: Mapping[str, str] | None = None
    ) -> None:
        # CounterMetricFamily drops the "_total" that every name here ends in and
        # generate_latest writes it back, so the exposed name is the one given.
        self._add(CounterMetricFamily, name, help_text, value, labels or {})

    def _add(
        self,
        kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
        name: str,
        help_text: str,
        value: Any,
        labels: Mapping[str, str],
    ) -> None:
        number = _number(value)
        if number is None:
            return
        labels = {**labels, **self._const}
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = kind(name, help_text, labels=list(labels))
        family.add_metric([printable(text) for text in labels.values()], number)

    def families(self) -> Iterable[Metric]:
        return self._families.values()


def _totals(out: _Families, status: Mapping[str, Any]) -> None:
    out.gauge(
        "cleave_info",
        "Constant 1, labelled with the job and the coordinator's key fingerprint.",
        1,
        {
            "job": str(status.get("job", "")),
            "coordinator_key": str(status.get("coordinator_key", "")),
        },
    )
    tiles = status.get("tiles") or {}
    for key, name, help_text in TILE_COUNTERS:
        out.counter(name, help_text, tiles.get(key))
    for key, name, help_text in TILE_GAUGES:
        out.gauge(name, help_text, tiles.get(key))
    traffic = status.get("traffic") or {}
    out.counter(
        "cleave_bytes_down_total", "Tile bundle bytes sent to workers.", traffic.get("bytes_down")
    )
    out.counter(
        "cleave_bytes_down_uncached_total",
        "What the bytes to workers would have been without their operand caches.",
        traffic.get("bytes_down_uncached"),
    )
    out.counter(
        "cleave_bytes_up_total",
        "Verified result bytes received from workers.",
        traffic.get("bytes_up"),
    )
    out.counter(
        "cleave_bytes_half_precision_total",
        "Bytes of bf16/fp16 tiles, both ways: fp32 would have moved twice as many.",
        traffic.get("bytes_half"),
    )
    connections = status.get("connections") or {}
    out.counter(
        "cleave_handshakes_refused_total",
        "Connections closed before they authenticated (bad hello, token, ban, timeout).",
        connections.get("refused_handshakes"),
    )
    out.counter(
        "cleave_workers_banned_run_total",
        "Worker keys banned by this coordinator process.",
        connections.get("banned_this_run"),
    )


def _training(out: _Families, status: Mapping[str, Any]) -> None:
    out.counter(
        "cleave_steps_total",
        "Training steps completed, counting steps resumed from a checkpoint.",
        status.get("step"),
    )
    out.gauge("cleave_step", "The step being trained now.", status.get("step"))
    out.gauge("cleave_steps_target", "Steps to train in total (--steps).", status.get("steps"))
    history = status.get("history") or []
    last = history[-1] if history else {}
    out.gauge("cleave_loss", "Loss of the last completed step.", last.get("loss"))
    out.gauge("cleave_step_seconds", "Wall time of the last completed step.", last.get("seconds"))
    out.gauge("cleave_step_tiles", "Tiles verified in the last step.", last.get("tiles"))
    out.gauge(
        "cleave_step_orchestration_cpu_seconds",
        "CPU seconds the coordinator process spent handing the last step out (every "
        "thread, the checkpoint's write included; not the tiles it multiplied itself). "
        "Over eager torch's CPU seconds for the step: the orchestration ratio.",
        last.get("orchestration_cpu_s"),
    )
    flops = status.get("flops") or {}
    out.gauge(
        "cleave_step_gflop",
        "GFLOP of the last step, every op counted (torch.utils.flop_counter conventions).",
        flops.get("gflop"),
    )
    out.gauge(
        "cleave_step_workers_flop_share",
        "Share of the last step's FLOPs that workers computed (0 to 1).",
        flops.get("workers_share"),
    )
    for op in flops.get("uncounted") or []:
        out.gauge(
            "cleave_step_uncounted_op",
            "1 for each heavy op that ran at the coordinator in the last step with no FLOP "
            "formula: the workers' share is then an upper bound.",
            1,
            {"op": str(op)},
        )
    for kept in flops.get("kept_here") or []:
        out.gauge(
            "cleave_step_kept_here_gflop",
            "GFLOP of the last step computed at the coordinator, by op.",
            kept.get("gflop"),
            {"op": str(kept.get("op", ""))},
        )
    out.gauge(
        "cleave_checkpoint_step",
        "Step of the last checkpoint written.",
        status.get("checkpoint_step"),
    )
    state = status.get("state")
    if isinstance(state, str):
        for known in RunState:
            out.gauge(
                "cleave_state",
                "1 for the coordinator's current training state.",
                int(state == known.value),
                {"state": known.value},
            )


def _workers(out: _Families, workers: Iterable[Mapping[str, Any]], pool: Mapping[str, Any]) -> None:
    """The pool's counts, and a series of each worker the status lists (in a large pool,
    the busiest: ``coordinator.pool.status.STATUS_ROWS``)."""
    rows = list(workers)
    connected = pool.get("connected", len(rows))
    out.gauge("cleave_workers_connected", "Workers connected now.", connected)
    active = pool.get("active", sum(worker.get("state") != "paused" for worker in rows))
    out.gauge("cleave_workers_active", "Connected workers not paused.", active)
    out.gauge(
        "cleave_ledger_keys", "Worker keys with a row in the ledger.", pool.get("ledger_keys")
    )
    for worker in rows:
        # Names are chosen by volunteers: never trusted. generate_latest escapes quotes,
        # backslashes and newlines; printable() replaces the other control characters.
        labels = {"id": str(worker.get("id", "")), "worker": str(worker.get("name", ""))}
        contribution = worker.get("contribution") or {}
        out.gauge(
            "cleave_worker_info",
            "Constant 1 per connected worker, labelled with its state and device.",
            1,
            {
                **labels,
                "state": str(worker.get("state", "")),
                "device": str(worker.get("device", "")),
                "key": str(worker.get("key", "")),
            },
        )
        out.counter(
            "cleave_worker_tiles_verified_total",
            "Verified tiles credited to this worker's name, all time.",
            contribution.get("tiles"),
            labels,
        )
        out.counter(
            "cleave_worker_gflop_verified_total",
            "Verified GFLOP credited to this worker's name, all time.",
            contribution.get("gflop"),
            labels,
        )
        out.gauge(
            "cleave_worker_tiles_session",
            "Tiles verified on this connection.",
            worker.get("tiles_session"),
            labels,
        )
        out.gauge(
            "cleave_worker_in_flight",
            "Tiles this worker holds now.",
            worker.get("in_flight"),
            labels,
        )
        out.counter(
            "cleave_worker_refused_total",
            "Tiles this connection refused.",
            worker.get("refused"),
            labels,
        )
        out.gauge(
            "cleave_worker_last_seen_seconds",
            "Seconds since this worker's last frame.",
            worker.get("last_seen_s"),
            labels,
        )
        out.gauge(
            "cleave_worker_reputation",
            "This worker's reputation, 0 to 1.",
            worker.get("reputation"),
            labels,
        )


def _number(value: Any) -> float | None:
    # bool is an int in Python, and True would pass silently as 1 where a count is meant.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def printable(value: str) -> str:
    """``value`` with control characters other than newline replaced by U+FFFD.

    The text format escapes only backslash, double quote and newline (generate_latest does
    that); a carriage return or NUL would pass through raw and could break line-oriented
    tools that read this page."""
    return "".join("\ufffd" if _is_control(ch) else ch for ch in value)


def _is_control(ch: str) -> bool:
    return ch != "\n" and (ord(ch) < 0x20 or ord(ch) == 0x7F)
