"""A worker's status with a job on show: what the window tests and the window probe
(tests/support/window_probe.py) lay out."""

from __future__ import annotations

from client_app.status import WorkerStatus

JOB_STATUS = WorkerStatus(
    state="computing",
    line="Computing tile t-7",
    coordinator_url="ws://h/ws",
    coordinator_fingerprint="3f9a-c1e2-77b0-94d5-0a6e-51b8-d2f4-8c03",
    current_tile="t-7",
    tiles_done=557,
    compute_s=0.4,  # 557 tiles of under a millisecond each
    credit_tiles=550,
    credit_gflop=2.5,
    threads=1,
    cpu_percent=30,
    limits_mode="in use",
    job_name="tiny_gpt",
    job_description="A small GPT-style model learning Shakespeare's sonnets.",
    job_operator="Ada's lab",
    job_link="https://example.org/tiny",
    job_parameters=124_000_000,
    job_step=1_204,
    job_steps=5_000,
)
