"""Worker statuses for the history and statistics tests."""

from __future__ import annotations

from client_app.status import WorkerStatus


def st(
    tiles: int = 0,
    gflop: float = 0.0,
    compute_s: float = 0.0,
    b_in: int = 0,
    b_out: int = 0,
    credit_tiles: int = 0,
    credit_gflop: float = 0.0,
    worker_id: str = "w-1",
    url: str = "wss://coord.example:8765",
) -> WorkerStatus:
    return WorkerStatus(
        state="computing",
        line="",
        coordinator_url=url,
        worker_id=worker_id,
        tiles_done=tiles,
        gflop_done=gflop,
        compute_s=compute_s,
        bytes_in=b_in,
        bytes_out=b_out,
        credit_tiles=credit_tiles,
        credit_gflop=credit_gflop,
    )
