"""``--self-test``: one tile through the real worker path, checked against bare torch.

An installed bundle can be complete enough to start yet miss what a worker needs at
its first tile (a native library of cryptography or blake3, a torch kernel). So the
check runs the code a coordinator's tile meets, in the worker's order: a signed
bundle is parsed, its signature checked (``verify_task``) and its operands decoded,
``TileComputer`` multiplies, the ``Result`` is framed and parsed back the way the
coordinator parses it. A tampered copy of the bundle must be refused on the way.
No network, no config files: the signing key is thrown away afterwards.

It also measures the precision the device computes fp32 tiles at: the coordinator's
check accepts full fp32 rounding only, so a device that multiplies at TF32 or bf16
precision (some GPU and AMX defaults, which ``TileComputer`` switches off) would have
every tile rejected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from client_app.compute import TileComputer
from client_app.config import default_threads
from client_app.profile import measure_gflops
from common.errors import SignatureError
from common.messages import Result, Task, encode_message, encode_task, parse_message, verify_task
from common.signing import generate_private_key

# Summation order differs between torch's blocked kernels, so results are compared
# with the classical bound for a k-term fp32 dot product: |c - c_exact| <= k*u*(|a|@|b|)
# with u = 2^-24. Any honest kernel stays well inside it; a wrong element, a
# transposed or truncated operand does not.
FP32_UNIT_ROUNDOFF = 2.0**-24

# The precision tile: a 1024-term sum, deep enough that the rounding of its operands
# (TF32, fp16 or bf16 arithmetic) shows far above fp32's accumulated rounding.
PRECISION_SHAPES = ((64, 1024), (1024, 64))
# Relative (Frobenius) error of the precision tile at full fp32 is ~4e-7; with operands
# rounded to 10 mantissa bits (TF32, fp16) it is ~3e-4, to 7 bits (bf16) ~2e-3.
FULL_FP32 = 1e-5


@dataclass(frozen=True)
class TileCase:
    """One self-test tile: ``op`` on operands of shapes ``a_shape`` @ ``b_shape``."""

    op: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]


# Both ops a worker computes; sizes large enough to use the blocked kernels, small
# enough that the whole check takes a fraction of a second on a laptop.
DEFAULT_CASES = (
    TileCase("mm", (256, 384), (384, 192)),
    TileCase("bmm", (4, 96, 128), (4, 128, 80)),
)


@dataclass(frozen=True)
class TileCheck:
    """How one tile came out: its error relative to the fp32 error bound."""

    case: TileCase
    max_abs_error: float
    worst_bound_ratio: float  # max over elements of |error| / bound; must be <= 1
    compute_ms: float

    @property
    def ok(self) -> bool:
        return self.worst_bound_ratio <= 1.0


@dataclass(frozen=True)
class PrecisionCheck:
    """The relative error of an fp32 product the device computed, against float64."""

    relative_error: float

    @property
    def ok(self) -> bool:
        return self.relative_error <= FULL_FP32  # NaN fails too

    def line(self) -> str:
        depth = PRECISION_SHAPES[0][1]
        if self.ok:
            level = "full fp32"
        elif self.relative_error < 1e-3:
            level = "REDUCED, like TF32 or fp16 arithmetic (10 mantissa bits)"
        else:
            level = "REDUCED, like bf16 arithmetic or worse"
        return (
            f"fp32 precision: relative error {self.relative_error:.1e} on a {depth}-term "
            f"sum: {level}" + ("" if self.ok else "; the coordinator would reject every tile")
        )


@dataclass(frozen=True)
class SelfTestReport:
    torch_version: str
    device: str
    device_name: str
    threads: int
    gflops: float = 0.0
    tampered_refused: bool = False
    tiles: tuple[TileCheck, ...] = ()
    precision: PrecisionCheck | None = None
    failure: str = ""  # why the path broke before a comparison could be made

    @property
    def ok(self) -> bool:
        return (
            not self.failure
            and self.tampered_refused
            and bool(self.tiles)
            and all(t.ok for t in self.tiles)
            and self.precision is not None
            and self.precision.ok
        )

    def lines(self) -> list[str]:
        """The report as printed by ``cleave-app --self-test``, before its verdict."""
        out = [
            f"torch {self.torch_version}, device {self.device} ({self.device_name}), "
            f"{self.threads} threads, {self.gflops:.1f} GFLOP/s (fp32 GEMM)",
            "signature check: "
            + ("tampered bundle refused" if self.tampered_refused else "NOT REFUSED"),
        ]
        for t in self.tiles:
            shapes = f"{list(t.case.a_shape)} @ {list(t.case.b_shape)}"
            verdict = "ok" if t.ok else "WRONG"
            out.append(
                f"tile {t.case.op} {shapes}: {verdict}, max |error| {t.max_abs_error:.2e} "
                f"= {t.worst_bound_ratio:.3f} x fp32 bound, {t.compute_ms:.1f} ms"
            )
        if self.precision is not None:
            out.append(self.precision.line())
        if self.failure:
            out.append(f"failed: {self.failure}")
        return out


def run_self_test(
    computer: TileComputer | None = None,
    *,
    cases: tuple[TileCase, ...] = DEFAULT_CASES,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> SelfTestReport:
    """Compute ``cases`` through the worker path; never raises for a broken path."""
    computer = computer or TileComputer(default_threads(), use_gpu=True)
    base = SelfTestReport(
        torch_version=torch.__version__,
        device=computer.device.type,
        device_name=computer.device_name,
        threads=computer.threads,
    )
    try:
        gflops = measure_gflops(computer, target_s=0.1)
        tampered_refused, tiles = _run_tiles(computer, cases, seed, clock)
        precision = measure_precision(computer, seed)
    except Exception as exc:  # the report, not a traceback, is what a volunteer sees
        return replace(base, failure=f"{type(exc).__name__}: {exc}")
    return replace(
        base, gflops=gflops, tampered_refused=tampered_refused, tiles=tiles, precision=precision
    )


def measure_precision(computer: TileComputer, seed: int = 0) -> PrecisionCheck:
    """The relative error of one fp32 product of Gaussian operands, as computed."""
    generator = torch.Generator().manual_seed(seed + 1)
    a = torch.randn(PRECISION_SHAPES[0], generator=generator)
    b = torch.randn(PRECISION_SHAPES[1], generator=generator)
    c = computer.compute("mm", a, b).double()
    exact = a.double() @ b.double()
    error = torch.linalg.matrix_norm(c - exact) / torch.linalg.matrix_norm(exact)
    return PrecisionCheck(float(error))


def _run_tiles(
    computer: TileComputer,
    cases: tuple[TileCase, ...],
    seed: int,
    clock: Callable[[], float],
) -> tuple[bool, tuple[TileCheck, ...]]:
    key = generate_private_key()  # throwaway: it signs these tiles and nothing else
    generator = torch.Generator().manual_seed(seed)
    tampered_refused = True
    checks: list[TileCheck] = []
    for index, case in enumerate(cases):
        a = torch.randn(case.a_shape, generator=generator)
        b = torch.randn(case.b_shape, generator=generator)
        tile_id = f"self-test-{index}"
        bundle = encode_task(tile_id, case.op, a, b, key)
        tampered_refused &= _tampered_is_refused(bundle, key.public_key())
        checks.append(_compute_tile(computer, bundle, key.public_key(), a, b, clock))
    return tampered_refused, tuple(checks)


def _tampered_is_refused(bundle: bytes, key: Ed25519PublicKey) -> bool:
    """Flip one operand bit: signature checking must refuse the bundle."""
    tampered = bytearray(bundle)
    tampered[-1] ^= 0x01  # the last byte is operand b's: inside the signed payload
    try:
        verify_task(parse_message(tampered), key)
    except SignatureError:
        return True
    return False


def _compute_tile(
    computer: TileComputer,
    bundle: bytes,
    key: Ed25519PublicKey,
    a: torch.Tensor,
    b: torch.Tensor,
    clock: Callable[[], float],
) -> TileCheck:
    # The worker's order (client_app.session): parse, check the signature, and only
    # then decode the operands, compute, and frame the Result.
    received = parse_message(bundle)
    task = received.message
    if not isinstance(task, Task):
        raise RuntimeError(f"expected a task, parsed a {task.TYPE!r} message")
    op_a, op_b = verify_task(received, key)
    start = clock()
    c = computer.compute(task.op, op_a, op_b)
    computer.synchronize()
    seconds = clock() - start
    frame = encode_message(Result(tile_id=task.tile_id, compute_s=seconds), [("c", c)])
    answer = parse_message(frame)  # as the coordinator reads it
    if not isinstance(answer.message, Result) or answer.message.tile_id != task.tile_id:
        raise RuntimeError(f"expected the result of {task.tile_id}, got {answer.message}")
    returned = answer.tensors()["c"]
    # Exact product up to fp64 rounding, far below the fp32 bound it is judged by.
    exact = torch.matmul(a.double(), b.double())
    if returned.shape != exact.shape or returned.dtype != a.dtype:
        raise RuntimeError(
            f"result is {returned.dtype} {list(returned.shape)}, "
            f"expected {a.dtype} {list(exact.shape)}"
        )
    k = a.shape[-1]
    bound = k * FP32_UNIT_ROUNDOFF * torch.matmul(a.double().abs(), b.double().abs())
    error = (returned.double() - exact).abs()
    return TileCheck(
        case=TileCase(task.op, tuple(a.shape), tuple(b.shape)),
        max_abs_error=float(error.max()),
        # NaN (a garbage result) must fail: nan_to_num turns it into an infinite ratio.
        worst_bound_ratio=float(torch.nan_to_num(error / bound, nan=float("inf")).max()),
        compute_ms=seconds * 1e3,
    )


def verdict(ok: bool) -> str:
    return "self-test " + ("passed" if ok else "FAILED")


def print_self_test(report: SelfTestReport, write: Callable[[str], object] = print) -> int:
    """Print ``report`` and its verdict; the exit status for it (0 passed, 1 failed)."""
    for line in [*report.lines(), verdict(report.ok)]:
        write(line)
    return 0 if report.ok else 1
