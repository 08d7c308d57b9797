"""The owner's limits, measured in real time: how close a worker comes to them.

The test suite asserts only that a worker never exceeds its CPU-time or bandwidth limit
(a loaded machine can only slow it down). How close it gets from below is measured here,
each figure as a ratio to its target, with a real ``WorkerCore`` on the loopback fake
coordinator (the same scenarios as tests/test_worker_duty.py and tests/test_bandwidth.py).
Run on a quiet machine: ``python bench/bench_limits.py``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_bandwidth import measure_receive_rate  # noqa: E402
from test_worker_duty import measure_cpu  # noqa: E402

from client_app.bandwidth import BYTES_PER_KB  # noqa: E402


def main() -> None:
    print(f"{'limit':>24} {'target':>10} {'measured':>10} {'ratio':>6}")
    for percent in (25, 50, 100):
        with tempfile.TemporaryDirectory() as tmp:
            figures = measure_cpu(percent, Path(tmp))
        target = percent / 100
        print(
            f"{f'CPU time {percent}%':>24} {target:>10.3f} {figures['worker']:>10.3f} "
            f"{figures['worker'] / target:>6.2f}"
        )
    for kbps in (128, 256, 1024):
        with tempfile.TemporaryDirectory() as tmp:
            rate = measure_receive_rate(kbps, Path(tmp), n_frames=10 if kbps < 1024 else 30)
        target = kbps * BYTES_PER_KB
        print(
            f"{f'download {kbps} KiB/s':>24} {target / 1e3:>9.0f}k {rate / 1e3:>9.0f}k "
            f"{rate / target:>6.2f}"
        )
    print("(CPU time: the worker's compute and event-loop threads over the window, one thread)")


if __name__ == "__main__":
    main()
