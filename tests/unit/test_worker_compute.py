"""Tile arithmetic against plain torch, the thread cap, device choice, and the profile."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from client_app.compute import TileComputer, cpu_model_name
from client_app.profile import GIB, MIB, build_profile, default_mem_cap_bytes, measure_gflops
from client_app.result_buffers import ResultBuffers
from common.limits import DEFAULT_LIMITS
from common.messages import (
    DeviceProfile,
    Hello,
    encode_message,
    encode_task,
    parse_message,
    verify_task,
)
from common.signing import generate_private_key

# (rtol, atol) per dtype: the worker and the reference may block the sum differently.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}
SHAPES = {"mm": ((33, 65), (65, 17)), "bmm": ((3, 33, 65), (3, 65, 17))}


def operands_from_the_wire(
    op: str, dtype: torch.dtype, transposed_b: bool = False
) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    """Operands exactly as the worker gets them: read-only views of a received frame
    (with ``transposed_b``, b arrives as its transpose's bytes, as a weight does)."""
    gen = torch.Generator().manual_seed(5)
    a_shape, b_shape = SHAPES[op]
    a = torch.randn(a_shape, generator=gen).to(dtype)
    b = torch.randn(b_shape, generator=gen).to(dtype)
    if transposed_b:
        b = b.mT.contiguous().mT
    key = generate_private_key()
    frame = encode_task("t", op, a, b, key)
    a_got, b_got = verify_task(parse_message(frame), key.public_key())
    assert b_got.is_contiguous() is not transposed_b
    return frame, a_got, b_got


@pytest.mark.parametrize("transposed_b", [False, True], ids=["b", "bT"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", ["mm", "bmm"])
def test_compute_matches_plain_torch(op: str, dtype: torch.dtype, transposed_b: bool) -> None:
    frame, a, b = operands_from_the_wire(op, dtype, transposed_b)
    before = bytes(frame)
    c = TileComputer(threads=1, use_gpu=False).compute(op, a, b)
    a_ref, b_ref = a.clone(), b.clone()
    reference = torch.matmul(a_ref, b_ref) if op == "mm" else torch.bmm(a_ref, b_ref)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(c, reference, rtol=rtol, atol=atol)
    assert c.dtype == dtype and c.device.type == "cpu" and c.is_contiguous()
    assert c.shape == reference.shape
    assert frame == before  # the received frame (read-only by contract) was not written


def test_fp32_against_fp64_reference_within_explicit_tolerance() -> None:
    _, a, b = operands_from_the_wire("mm", torch.float32)
    c = TileComputer(threads=1, use_gpu=False).compute("mm", a, b)
    torch.testing.assert_close(c.double(), a.double() @ b.double(), rtol=1e-5, atol=1e-5)


def test_rank_and_op_are_checked() -> None:
    computer = TileComputer(threads=1, use_gpu=False)
    with pytest.raises(ValueError, match="2-D"):
        computer.compute("mm", torch.ones(2, 2, 2), torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="not one of"):
        computer.compute("conv", torch.ones(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError):
        TileComputer(threads=0, use_gpu=False)


def test_thread_cap_is_applied_on_the_compute_thread_and_can_change() -> None:
    computer = TileComputer(threads=1, use_gpu=False)
    a, b = torch.ones(8, 8), torch.ones(8, 8)

    def compute_then_read_cap() -> int:
        computer.compute("mm", a, b)
        return torch.get_num_threads()

    with ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(compute_then_read_cap).result() == 1
        computer.threads = 2  # what a GUI's thread slider does, mid-run
        assert pool.submit(compute_then_read_cap).result() == 2


def test_gpu_is_used_only_when_allowed_and_present() -> None:
    assert TileComputer(1, use_gpu=True, cuda_available=lambda: False).device.type == "cpu"
    assert TileComputer(1, use_gpu=False, cuda_available=lambda: True).device.type == "cpu"
    assert TileComputer(1, use_gpu=True, cuda_available=lambda: True).device.type == "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compute_matches_cpu() -> None:  # pragma: no cover - no GPU in CI
    _, a, b = operands_from_the_wire("bmm", torch.float32)
    c = TileComputer(1, use_gpu=True).compute("bmm", a, b)
    assert c.device.type == "cpu"
    torch.testing.assert_close(c, torch.bmm(a, b), rtol=1e-3, atol=1e-3)


def test_cpu_model_name_reads_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Test CPU @ 3.0GHz\n")
    assert cpu_model_name(cpuinfo) == "Test CPU @ 3.0GHz"
    assert cpu_model_name(tmp_path / "missing")  # falls back to the platform's answer


def test_default_memory_cap_is_a_quarter_of_ram_up_to_one_gib() -> None:
    assert default_mem_cap_bytes(64 * GIB) == GIB
    assert default_mem_cap_bytes(2 * GIB) == GIB // 2


def test_profile_is_measured_and_valid_on_the_wire() -> None:
    computer = TileComputer(threads=1, use_gpu=False)
    with ThreadPoolExecutor(max_workers=1) as pool:
        profile = pool.submit(build_profile, computer, ram_bytes=8 * GIB).result()
    assert profile.device == "cpu" and profile.threads == 1
    assert profile.ram_bytes == 8 * GIB and profile.mem_cap_bytes == GIB
    assert profile.gflops > 0.1 and profile.device_name
    # The coordinator validates it with common's rules: it must pass them.
    hello = parse_message(encode_message(Hello("w", profile, 2)), DEFAULT_LIMITS).message
    assert isinstance(hello, Hello) and hello.profile == profile
    capped = build_profile(computer, memory_mb=300, gflops=5.0, ram_bytes=8 * GIB)
    assert capped == DeviceProfile("cpu", profile.device_name, 1, 8 * GIB, 300 * MIB, 5.0)


def test_gflops_measurement_uses_the_injected_clock() -> None:
    # start, then (before, after) per run: runs of 4, 6 and 12 ms; the third ends the window.
    ticks = iter([0.0, 0.0, 0.004, 0.004, 0.010, 0.010, 0.022])
    gflops = measure_gflops(
        TileComputer(1, use_gpu=False), target_s=0.02, n=64, clock=lambda: next(ticks)
    )
    assert gflops == pytest.approx(2 * 64**3 / 0.006 / 1e9)  # the median run


def test_misaligned_half_precision_operands_in_turn_reuse_the_copies_correctly() -> None:
    """bf16 operands off the 64-byte grid are copied into buffers the computer reuses:
    tiles of several shapes in turn, each against plain torch on its own operands."""
    computer = TileComputer(threads=1, use_gpu=False)
    gen = torch.Generator().manual_seed(3)
    for m, k, n in ((8, 16, 8), (32, 64, 48), (4, 8, 4), (32, 64, 48)):
        flat = torch.randn(1 + m * k + k * n, generator=gen).to(torch.bfloat16)
        a, b = flat[1 : 1 + m * k].view(m, k), flat[1 + m * k :].view(k, n)
        assert a.data_ptr() % 64 != 0  # one element past the allocator's alignment
        c = computer.compute("mm", a, b)
        torch.testing.assert_close(c, a.clone() @ b.clone(), rtol=1.6e-2, atol=1e-2)


def test_a_product_given_back_holds_the_next_one_and_a_held_one_is_never_reused() -> None:
    """Products go into memory reused from tile to tile, but only once given back: a
    product still held (its result not sent yet) keeps its values while others are
    computed, and one given back twice is handed out once."""
    computer = TileComputer(threads=1, use_gpu=False)
    gen = torch.Generator().manual_seed(4)

    def operands(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)

    a1, b1 = operands(32, 16, 24)
    first = computer.compute("mm", a1, b1)
    computer.give_back(first)
    a2, b2 = operands(32, 16, 24)
    second = computer.compute("mm", a2, b2)
    assert second.data_ptr() == first.data_ptr()  # the given-back memory, reused
    a3, b3 = operands(32, 16, 24)
    third = computer.compute("mm", a3, b3)  # `second` is still held: fresh memory
    assert third.data_ptr() != second.data_ptr()
    torch.testing.assert_close(second, a2 @ b2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(third, a3 @ b3, rtol=1e-5, atol=1e-5)

    computer.give_back(second)
    computer.give_back(second)  # twice: still one buffer
    tiny = computer.compute("mm", torch.ones(2, 3), torch.ones(3, 2))
    assert tiny.data_ptr() != second.data_ptr()  # would hold a buffer 100x its size
    smaller = computer.compute("bmm", torch.ones(2, 16, 3), torch.ones(2, 3, 20))
    other = computer.compute("mm", *operands(32, 16, 24))
    assert smaller.data_ptr() == second.data_ptr()  # a product a bit smaller fits it
    assert other.data_ptr() != smaller.data_ptr()
    torch.testing.assert_close(smaller, torch.full((2, 16, 20), 3.0))
    assert smaller.shape == (2, 16, 20) and smaller.is_contiguous()


def test_operands_that_do_not_multiply_get_torchs_own_error() -> None:
    computer = TileComputer(threads=1, use_gpu=False)
    with pytest.raises(RuntimeError):
        computer.compute("mm", torch.ones(2, 3), torch.ones(4, 2))
    with pytest.raises(RuntimeError):
        computer.compute("bmm", torch.ones(2, 2, 3), torch.ones(3, 3, 2))
    with pytest.raises(RuntimeError):
        computer.compute("mm", torch.ones(2, 3), torch.ones(3, 2, dtype=torch.float64))


def test_result_buffers_keep_the_latest_few_within_their_bytes() -> None:
    buffers = ResultBuffers(kept=2, kept_bytes=4096)
    products = [buffers.take((16, 16), torch.float32) for _ in range(3)]  # 1 KiB each
    for product in products:
        buffers.give_back(product)
    again = {buffers.take((16, 16), torch.float32).data_ptr() for _ in range(3)}
    kept = {p.data_ptr() for p in products[1:]}  # the latest two; the oldest was let go
    assert kept < again and products[0].data_ptr() not in again
    large = buffers.take((64, 32), torch.float32)  # 8 KiB: over the bytes kept
    buffers.give_back(large)
    assert buffers.take((64, 32), torch.float32).data_ptr() != large.data_ptr()
