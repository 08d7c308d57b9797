"""What a worker is doing, as immutable snapshots a GUI (or a log line) can show."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

STATES = ("connecting", "waiting", "computing", "paused", "reconnecting", "refused", "stopped")


def refusal_line(detail: str) -> str:
    """Why the worker stopped for good, in a few words (``detail`` has the whole story)."""
    if "banned" in detail:
        return "Refused: this computer is banned by the coordinator"
    if "join token" in detail:
        return "Refused: the coordinator needs the right join token"
    return "Refused: coordinator key changed"


@dataclass(frozen=True)
class WorkerStatus:
    """One snapshot; observers get a new one whenever anything in it changes."""

    state: str  # one of STATES
    line: str  # for people: "Computing tile t-12", "Reconnecting in 8 s", ...
    coordinator_url: str = ""
    coordinator_fingerprint: str = ""  # common.signing.fingerprint of the pinned key
    # Which of the job's coordinator ranks this worker serves (coordinator_ranks 0: the
    # coordinator is alone).
    coordinator_rank: int = 0
    coordinator_ranks: int = 0
    worker_id: str = ""  # what the coordinator calls this worker (from Welcome)
    detail: str = ""  # the full explanation behind a "refused" line
    current_tile: str = ""
    tiles_done: int = 0
    tiles_refused: int = 0  # bad signature, over a limit, ...
    compute_s: float = 0.0  # time spent in GEMMs
    gflop_done: float = 0.0
    bytes_in: int = 0  # protocol frames received (tensor payloads included)
    bytes_out: int = 0
    credit_tiles: int = 0  # from the coordinator's last Ack
    credit_gflop: float = 0.0
    threads: int = 0
    device: str = ""  # "cpu" or "cuda"
    cpu_percent: int = 100  # the CPU-time limit in force
    limits_mode: str = ""  # "in use", "idle", "always", or "" before the policy has decided
    # What the volunteer helps, as the coordinator describes it (plain text, checked
    # lengths: common.messages.JobAbout) and how far its training has come.
    job_name: str = ""
    job_description: str = ""
    job_operator: str = ""
    job_link: str = ""
    job_parameters: int = 0
    job_step: int = 0  # steps completed
    job_steps: int = 0  # steps the run is to train; 0: not known
    # The coordinator's word on why it sends no tiles ("" when it has nothing to say).
    note: str = ""

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"state {self.state!r} is not one of {STATES}")


StatusObserver = Callable[[WorkerStatus], None]
