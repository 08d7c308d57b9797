"""Layouts: how earlier plans cut the matrices later GEMMs read, and who holds which block."""

from __future__ import annotations

from coordinator.plan.layouts import Layouts, Operand
from coordinator.plan.placement import LOCAL, Placement, operand_blocks
from coordinator.plan.planner import GemmPlan, GemmShape, Grid, grid_plan

T, IN, OUT = 256, 512, 384  # tokens, a linear layer's inputs and outputs
# The layer's forward x Wᵀ, its input gradient g W and its weight gradient gᵀ x.
FORWARD = GemmShape("mm", 1, T, OUT, IN, 4)
INPUT_GRAD = GemmShape("mm", 1, T, IN, OUT, 4)
WEIGHT_GRAD = GemmShape("mm", 1, OUT, IN, T, 4)
X, W, G = Operand("x"), Operand("W", transposed=True), Operand("g")


def plan(shape: GemmShape, grid: Grid) -> GemmPlan:
    made = grid_plan(shape, grid)
    assert made is not None
    return made


def placed(made: GemmPlan, owners: list[str]) -> list[Placement]:
    """Tile i of the plan on owners[i]."""
    return [Placement(t, w, 0.0, 1.0, 0) for t, w in zip(made.tiles, owners, strict=True)]


def forward_on_two() -> tuple[Layouts, GemmPlan]:
    """The forward cut into W's two halves of outputs, one worker each."""
    layouts = Layouts()
    fwd = plan(FORWARD, (1, 1, 2, 1))
    layouts.record(FORWARD, fwd.grid, (X, W), placed(fwd, ["w1", "w2"]), {})
    return layouts, fwd


def test_a_later_gemm_may_cut_a_matrix_as_an_earlier_plan_did() -> None:
    layouts, _ = forward_on_two()
    # W (stored out x in) was cut into two row blocks: in the input gradient it is B,
    # not transposed, its rows are K. x was read whole: in the weight gradient it is B.
    found = layouts.variants(INPUT_GRAD, (G, Operand("W")), [(1, 2, 2, 1), (1, 1, 1, 1)])
    assert found == [(1, 1, 1, 2), (1, 2, 1, 2)]
    assert layouts.variants(WEIGHT_GRAD, (Operand("g", True), X), [(1, 2, 2, 1)]) == [(1, 2, 1, 1)]
    # Nothing read before: nothing to follow.
    assert layouts.variants(FORWARD, (Operand("y"), Operand("V", True)), [(1, 2, 2, 1)]) == []


def test_where_a_and_b_fix_k_differently_a_grid_follows_one_of_them() -> None:
    layouts = Layouts()
    dx = plan(INPUT_GRAD, (1, 2, 1, 1))  # g cut by tokens, W (as B) whole
    layouts.record(INPUT_GRAD, dx.grid, (G, Operand("W")), placed(dx, ["w1", "w2"]), {})
    fwd = plan(FORWARD, (1, 1, 1, 2))  # x cut along its inputs (K)
    layouts.record(FORWARD, fwd.grid, (X, W), placed(fwd, ["w1", "w2"]), {})
    # gᵀ x: A = gᵀ wants M (outputs) whole and K (tokens) in 2; B = x wants K whole.
    found = layouts.variants(WEIGHT_GRAD, (Operand("g", True), X), [(1, 1, 1, 1)])
    assert found == [(1, 1, 1, 2), (1, 1, 2, 1)]


def test_held_blocks_are_named_as_the_later_plan_names_its_tiles_blocks() -> None:
    layouts, _ = forward_on_two()
    dx = plan(INPUT_GRAD, (1, 1, 1, 2))
    held = layouts.held(INPUT_GRAD, (G, Operand("W")))
    for tile, worker in zip(dx.tiles, ["w1", "w2"], strict=True):
        (a, _), (b, _) = operand_blocks(INPUT_GRAD, tile)
        assert b in held[worker]  # its half of W, where the forward put it
        assert a not in held[worker]  # g was never sent
        other = "w2" if worker == "w1" else "w1"
        assert b not in held[other]
    # The weight gradient reads x whole, as both forward tiles did: both hold it.
    dw = plan(WEIGHT_GRAD, (1, 2, 1, 1))
    held = layouts.held(WEIGHT_GRAD, (Operand("g", True), X))
    for tile in dw.tiles:
        (_, _), (b, _) = operand_blocks(WEIGHT_GRAD, tile)
        assert b in held["w1"] and b in held["w2"]


def test_a_transposed_read_names_the_same_blocks() -> None:
    layouts = Layouts()
    dx = plan(INPUT_GRAD, (1, 1, 1, 2))  # g cut into column halves (its outputs)
    layouts.record(INPUT_GRAD, dx.grid, (G, Operand("W")), placed(dx, ["w1", "w2"]), {})
    # gᵀ x reads g transposed: its M is g's columns.
    dw = plan(WEIGHT_GRAD, (1, 2, 1, 1))
    held = layouts.held(WEIGHT_GRAD, (Operand("g", True), X))
    (a0, _), _ = operand_blocks(WEIGHT_GRAD, dw.tiles[0])
    (a1, _), _ = operand_blocks(WEIGHT_GRAD, dw.tiles[1])
    assert a0 in held["w1"] and a1 in held["w2"] and a0 not in held["w2"]


def test_the_coordinator_holds_nothing_and_a_matrix_of_other_sizes_is_another() -> None:
    layouts = Layouts()
    fwd = plan(FORWARD, (1, 1, 2, 1))
    layouts.record(FORWARD, fwd.grid, (X, W), placed(fwd, [LOCAL, "w2"]), {})
    assert LOCAL not in layouts.held(INPUT_GRAD, (G, Operand("W")))
    # The same name, read as a matrix of other sizes: not the matrix that was cut.
    other = GemmShape("mm", 1, T, OUT + 1, OUT, 4)
    assert layouts.held(other, (G, Operand("W"))) == {}
    assert layouts.variants(other, (G, Operand("W")), [(1, 1, 1, 1)]) == []


def test_a_workers_blocks_past_its_cap_are_forgotten_oldest_first() -> None:
    layouts = Layouts()
    half_w = OUT // 2 * IN * 4
    x_bytes = T * IN * 4
    fwd = plan(FORWARD, (1, 1, 2, 1))
    # w1 has room for x and half of W.
    layouts.record(FORWARD, fwd.grid, (X, W), placed(fwd, ["w1", "w1"]), {"w1": x_bytes + half_w})
    held = layouts.held(INPUT_GRAD, (G, Operand("W")))
    dx = plan(INPUT_GRAD, (1, 1, 1, 2))
    blocks = [operand_blocks(INPUT_GRAD, t)[1][0] for t in dx.tiles]
    # x, W's first half, x again (the second tile reads it too), W's second half: the
    # first half, now the least recently placed, is dropped to fit the cap.
    assert blocks[1] in held["w1"] and blocks[0] not in held["w1"]
    assert layouts.held(WEIGHT_GRAD, (Operand("g", True), X)) != {}


def test_workers_that_left_are_forgotten() -> None:
    layouts, _ = forward_on_two()
    layouts.forget(["w2"])
    assert set(layouts.held(INPUT_GRAD, (G, Operand("W")))) == {"w2"}


def test_the_oldest_matrices_are_forgotten_past_the_limit() -> None:
    layouts = Layouts(matrices=2)
    fwd = plan(FORWARD, (1, 1, 2, 1))
    layouts.record(FORWARD, fwd.grid, (X, W), placed(fwd, ["w1", "w2"]), {})
    layouts.record(FORWARD, fwd.grid, (Operand("x2"), W), placed(fwd, ["w1", "w2"]), {})
    assert layouts.held(WEIGHT_GRAD, (Operand("g", True), X)) == {}  # x was the oldest
    assert layouts.held(INPUT_GRAD, (G, Operand("W"))) != {}


def test_cutting_a_fresh_matrix_along_the_dim_backprop_sums_costs_later_bytes() -> None:
    layouts = Layouts()
    # x cut by tokens (M): its weight gradient sums over tokens, so it either splits
    # its K in two (one more K x N = IN x OUT output) or sends x again (T x IN): the
    # smaller. W cut by outputs (N): the input gradient sums over them: one more
    # T x IN output, or W again (IN x OUT).
    assert layouts.later_bytes(FORWARD, (X, W), (1, 2, 1, 1)) == 4 * min(IN * OUT, T * IN)
    assert layouts.later_bytes(FORWARD, (X, W), (1, 1, 2, 1)) == 4 * min(T * IN, IN * OUT)
    # Along K (inputs) neither is cut where backprop sums.
    assert layouts.later_bytes(FORWARD, (X, W), (1, 1, 1, 2)) == 0
    # A matrix read before: this is its later read.
    fwd = plan(FORWARD, (1, 1, 2, 1))
    layouts.record(FORWARD, fwd.grid, (X, W), placed(fwd, ["w1", "w2"]), {})
    assert layouts.later_bytes(FORWARD, (X, W), (1, 2, 2, 1)) == 0
