"""``--self-test``: passes on the honest path, fails on a broken one, exits 0 as a command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import client_app.self_test as self_test
from bench.tile_cases import tf32
from client_app.compute import TileComputer, pin_full_precision
from client_app.self_test import (
    FP32_UNIT_ROUNDOFF,
    FULL_FP32,
    TileCase,
    measure_precision,
    print_self_test,
    run_self_test,
)
from common.messages import check_operands

SMALL_CASES = (TileCase("mm", (32, 48), (48, 16)), TileCase("bmm", (2, 8, 24), (2, 24, 8)))


class PerturbingComputer(TileComputer):
    """An honest GEMM with one element nudged: the smallest wrong answer."""

    def __init__(self, delta: float) -> None:
        super().__init__(threads=1, use_gpu=False)
        self.delta = delta

    def compute(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        c = super().compute(op, a, b)
        c.view(-1)[0] += self.delta
        return c


def lines_of(report: self_test.SelfTestReport) -> tuple[int, list[str]]:
    printed: list[str] = []
    return print_self_test(report, printed.append), printed


def test_honest_path_passes_well_inside_the_bound() -> None:
    report = run_self_test(TileComputer(threads=1, use_gpu=False), cases=SMALL_CASES)
    status, printed = lines_of(report)
    assert status == 0 and report.ok
    assert report.tampered_refused
    assert [t.case.op for t in report.tiles] == ["mm", "bmm"]
    # fp32 kernels land orders of magnitude inside the worst-case rounding bound.
    assert all(t.worst_bound_ratio < 0.5 for t in report.tiles)
    assert report.device == "cpu" and report.threads == 1 and report.gflops > 0
    assert printed[0].startswith(f"torch {torch.__version__}, device cpu")
    assert printed[-1] == "self-test passed"


def test_default_cases_pass() -> None:
    assert run_self_test(TileComputer(threads=1, use_gpu=False)).ok


def test_a_perturbed_result_fails() -> None:
    # Entries of a 48-term product of N(0, 1) values are ~7 in size; 0.01 is a relative
    # error of ~1e-3, far above fp32 rounding and far below anything visible by eye.
    report = run_self_test(PerturbingComputer(delta=0.01), cases=SMALL_CASES)
    status, printed = lines_of(report)
    assert status == 1 and not report.ok
    assert all(t.worst_bound_ratio > 1.0 for t in report.tiles)
    assert any("WRONG" in line for line in printed)
    assert printed[-1] == "self-test FAILED"


def test_a_nan_result_fails() -> None:
    report = run_self_test(PerturbingComputer(delta=float("nan")), cases=SMALL_CASES)
    assert not report.ok
    assert report.tiles[0].worst_bound_ratio == float("inf")


def test_a_computer_that_raises_fails_with_the_reason() -> None:
    class Broken(TileComputer):
        def compute(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no kernel for this CPU")

    report = run_self_test(Broken(threads=1, use_gpu=False), cases=SMALL_CASES)
    status, printed = lines_of(report)
    assert status == 1
    assert report.failure == "RuntimeError: no kernel for this CPU"
    assert "failed: RuntimeError: no kernel for this CPU" in printed


def test_a_worker_that_skips_the_signature_check_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def unchecked(received: object, key: object) -> tuple[torch.Tensor, torch.Tensor]:
        return check_operands(received.message.op, received.tensors())  # type: ignore[attr-defined]

    monkeypatch.setattr(self_test, "verify_task", unchecked)
    report = run_self_test(TileComputer(threads=1, use_gpu=False), cases=SMALL_CASES)
    status, printed = lines_of(report)
    assert status == 1 and not report.tampered_refused
    assert "signature check: NOT REFUSED" in printed


def test_the_bound_is_the_fp32_dot_product_bound() -> None:
    assert FP32_UNIT_ROUNDOFF == torch.finfo(torch.float32).eps / 2


def cleave_app_command() -> list[str]:
    script = Path(sys.executable).with_name("cleave-app")
    if script.exists():
        return [str(script)]
    found = shutil.which("cleave-app")
    # Without the installed script, the module runs the same main().
    return [found] if found else [sys.executable, "-m", "client_app.gui"]


def test_cleave_app_self_test_command_exits_0(tmp_path: Path) -> None:
    config = tmp_path / "config"
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "CLEAVE_CONFIG_DIR": str(config)}
    proc = subprocess.run(
        [*cleave_app_command(), "--self-test"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "signature check: tampered bundle refused" in out
    assert "tile mm [256, 384] @ [384, 192]: ok" in out
    assert "fp32 precision: relative error" in out and ": full fp32" in out
    assert "platform offscreen: main window built and closed" in out
    assert out.rstrip().endswith("self-test passed")
    assert not config.exists()  # the owner's settings, pins and history are untouched


class ReducedPrecisionComputer(TileComputer):
    """Multiplies as TF32 tensor cores or bf16 AMX kernels do: operands rounded first."""

    def __init__(self, to: torch.dtype | None) -> None:
        super().__init__(threads=1, use_gpu=False)
        self.to = to

    def compute(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.to is None:  # TF32: 10 mantissa bits with fp32's range
            a, b = tf32(a), tf32(b)
        else:
            a, b = a.to(self.to).float(), b.to(self.to).float()
        return super().compute(op, a, b)


@pytest.mark.parametrize(
    ("to", "level"),
    [(None, "like TF32 or fp16"), (torch.float16, "like TF32 or fp16"), (torch.bfloat16, "bf16")],
)
def test_a_device_computing_at_reduced_precision_fails_and_says_so(
    to: torch.dtype | None, level: str
) -> None:
    report = run_self_test(ReducedPrecisionComputer(to), cases=SMALL_CASES)
    status, printed = lines_of(report)
    assert status == 1 and report.precision is not None and not report.precision.ok
    line = next(p for p in printed if p.startswith("fp32 precision:"))
    assert "REDUCED" in line and level in line and "reject every tile" in line


def test_the_honest_path_reports_full_fp32_precision() -> None:
    report = run_self_test(TileComputer(threads=1, use_gpu=False), cases=SMALL_CASES)
    assert report.precision is not None and report.precision.ok
    assert report.precision.relative_error < FULL_FP32 / 10
    assert any(line.endswith(": full fp32") for line in report.lines())


def test_the_worker_pins_full_precision_on_every_backend() -> None:
    # What a library or a user script may have switched on before the worker starts:
    # bf16 for fp32 matmuls on AMX CPUs, TF32 on GPUs.
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"  # type: ignore[attr-defined]
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        computer = TileComputer(threads=1, use_gpu=False)
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"  # type: ignore[attr-defined]
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert measure_precision(computer).ok
    finally:
        pin_full_precision()
