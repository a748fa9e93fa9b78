"""Compiled element-wise loops (numba) for the syncer's per-upload and per-merge work.

Owns: the fused fold-in (a contribution added to the merge accumulator's sums, per segment,
with the sums' new squared norms taken in the same pass), the per-segment squared norms of a
contribution, what the syncer gathers from each decoded piece of an upload (per-tensor squares,
dots with the last merge, the direction check's sample: `piece_stats`), and the fused outer step, which turns the accumulator's per-segment scaled sums
into the outer gradient and applies SGD with (Nesterov) momentum in one pass over memory.
Must not: validate inputs (callers do), allocate, or hold state.

Why compiled: the same step as numpy ufuncs is six passes per chunk (mul, add, mul, add,
mul, add), each re-reading its operands; one numpy expression cannot fuse them. Measured on
a 2-core VM (``ddiloco bench perf``): 10-17 % of memory-copy bandwidth in numpy. One loop
reads sums, params and momentum once and writes the outer gradient, params and momentum
once (24 bytes per value against memcpy's 8).

Bit-exactness: every operation is a float32 multiply or add in the order optax uses
(``trace``: b' = g + μ·b; Nesterov u = g + μ·b'; ``scale_by_learning_rate``: u·(-η);
``apply_updates``: p + u). numba compiles without fast-math, so LLVM neither reassociates
nor contracts a multiply and an add into an FMA, and the results equal the numpy ufuncs'
bit for bit (tests/unit/test_outer.py checks this).
"""

from __future__ import annotations

import numpy as np

from ddiloco._jit import COMPILED, njit


# Values per block: the block's outputs are still in L1 cache when they are summed.
BLOCK = 2048


@njit(fastmath={"reassoc"})
def _block_sums(grad: np.ndarray, params: np.ndarray) -> tuple[float, float]:
    """(Σ grad², Σ params) in float64. Reassociation lets LLVM vectorize the two sums; it
    applies to these sums only, never to the step's own arithmetic."""
    grad_sq = 0.0
    params_sum = 0.0
    for i in range(grad.size):
        g = np.float64(grad[i])
        grad_sq += g * g
        params_sum += np.float64(params[i])
    return grad_sq, params_sum


@njit(fastmath={"reassoc"})
def _finite_probe(values: np.ndarray) -> float:
    """0.0 if every value is finite, else NaN: Σ x·0 in float32 (x·0 is 0 for finite x, NaN for
    inf and NaN), reassociated so that LLVM vectorizes it. Cannot overflow, unlike a plain sum,
    and costs a fraction of a float64 sum (no conversions)."""
    total = np.float32(0)
    for i in range(values.size):
        total += values[i] * np.float32(0)
    return np.float64(total)


@njit(fastmath={"reassoc"})
def _square_sum(values: np.ndarray) -> float:
    """Σ x² in float64 (reassociated so that LLVM vectorizes it). float32 squares summed in
    float64 neither overflow nor underflow for any fragment size: no careful fallback needed."""
    total = 0.0
    for i in range(values.size):
        v = np.float64(values[i])
        total += v * v
    return total


@njit(fastmath={"reassoc"})
def _block_dot32(a: np.ndarray, b: np.ndarray) -> float:
    """Σ a·b over at most BLOCK values, accumulated in float32 (reassociated: vectorized in
    float32 lanes, as BLAS's sdot), returned as float64 for a float64 total."""
    total = np.float32(0)
    for i in range(a.size):
        total += a[i] * b[i]
    return np.float64(total)


@njit()
def _blocked_dot(a: np.ndarray, b: np.ndarray) -> float:
    """Σ a·b: float32 sums per BLOCK, float64 total. A float32 square sum overflows to inf, or
    flushes a tiny one to 0 (callers fall back to an exact pass then); float64 lanes halve the
    vector width and cost twice as much per value here."""
    total = 0.0
    for lo in range(0, a.size, BLOCK):
        total += _block_dot32(a[lo : lo + BLOCK], b[lo : lo + BLOCK])
    return total


@njit()
def piece_stats(values: np.ndarray, start: int, tensor_bounds: np.ndarray, reference: np.ndarray,
                reference_parts: np.ndarray, index: np.ndarray, sample: np.ndarray,
                squares: np.ndarray, dots: np.ndarray) -> int:
    """What the syncer gathers from one decoded piece (values[i] is element start + i of a
    contribution) while it is in cache, in one compiled call: squares[k] = Σ x² over the piece's
    part of tensor k ([tensor_bounds[k, 0], tensor_bounds[k, 1])), dots[j] = Σ x·reference over
    its part of reference part j ([reference_parts[j, 0], reference_parts[j, 1])) (`_blocked_dot`),
    and sample[j] = the element index[j] for the sorted indices inside the piece. Returns how
    many sample entries were written. One call per piece instead of a numpy call per tensor, per
    reference part and a scattered gather of the sample after the whole payload is in."""
    stop = start + values.size
    for k in range(tensor_bounds.shape[0]):
        lo, hi = max(tensor_bounds[k, 0], start), min(tensor_bounds[k, 1], stop)
        piece = values[lo - start : hi - start]
        squares[k] = _blocked_dot(piece, piece) if lo < hi else 0.0
    for j in range(reference_parts.shape[0]):
        lo, hi = max(reference_parts[j, 0], start), min(reference_parts[j, 1], stop)
        dots[j] = _blocked_dot(values[lo - start : hi - start], reference[lo:hi]) if lo < hi else 0.0
    first, last = np.searchsorted(index, start), np.searchsorted(index, stop)
    for j in range(first, last):
        sample[j] = values[index[j] - start]
    return last - first


@njit()
def segment_square_sums(values: np.ndarray, bounds: np.ndarray, out: np.ndarray) -> None:
    """out[k] = Σ values[bounds[k]:bounds[k+1]]² in float64 (non-finite iff a value is)."""
    for k in range(out.size):
        total = 0.0
        for lo in range(bounds[k], bounds[k + 1], BLOCK):
            total += _square_sum(values[lo : min(lo + BLOCK, bounds[k + 1])])
        out[k] = total


@njit()
def fold_segments(
    values: np.ndarray, bounds: np.ndarray, coefs: np.ndarray, sums: np.ndarray, sum_squares: np.ndarray,
) -> None:
    """sums[seg k] += coefs[k] · values[seg k] for every segment k with coefs[k] != 0, then
    sum_squares[k] = Σ sums[seg k]² (float64) of the updated sums; other segments untouched.

    One pass: each block of the sums is squared while it is still in L1 after the update, so
    the merge never re-reads the sums for their norms. The update is a float32 multiply, then
    a float32 add (no FMA: numba compiles without fast-math), bit for bit numpy's
    ``sums += np.float32(c) * values``.
    """
    for k in range(coefs.size):
        coef = coefs[k]
        if coef == 0:
            continue
        total = 0.0
        for lo in range(bounds[k], bounds[k + 1], BLOCK):
            hi = min(lo + BLOCK, bounds[k + 1])
            x, y = values[lo:hi], sums[lo:hi]  # views from 0: see scaled_sgd_step
            for i in range(x.size):
                y[i] = y[i] + coef * x[i]
            total += _square_sum(y)
        sum_squares[k] = total


@njit()
def scaled_sgd_step(
    sums: np.ndarray,
    bounds: np.ndarray,
    scales: np.ndarray,
    state: tuple[np.ndarray, np.ndarray],
    outs: tuple[np.ndarray, np.ndarray, np.ndarray],
    rule: tuple[np.float32, np.float32, np.float32, np.float32],
    nesterov: bool,
    want_grad_sq: bool,
) -> tuple[float, float]:
    """One outer step with Δ given as scaled sums: Δ[bounds[k]:bounds[k+1]] = sums · scales[k].

    ``state`` is (params, momentum buffer) before the step, ``outs`` is (grad_out, params_out,
    buf_out) and ``rule`` is (momentum, neg_lr, carry, into), all float32. ``momentum`` decays the buffer and ``into`` is the share of Δ it takes in
    (b' ← into·Δ + momentum·b); ``carry`` weighs what the step takes of it beyond Δ: Nesterov
    moves by Δ + carry·b', heavy ball by Δ + carry·(b' − into·Δ). A whole step passes into = 1 and
    carry = μ (Nesterov) or 1 (heavy ball); see ``OuterStepper.step_scaled`` for other fractions.

    Writes Δ to ``grad_out``, the new params to ``params_out`` and the new momentum to
    ``buf_out`` (all float32, caller-allocated). Returns (Σ Δ², Σ new params) in float64:
    the first gives ‖Δ‖, the second is non-finite iff a new parameter is (float32 values
    summed in float64 cannot overflow for any realistic fragment size).

    A ``grad_out`` of ``BLOCK`` values (shorter than the fragment) is scratch: each block's Δ
    goes there, stays in L1 for its sum of squares and is overwritten by the next block, so a
    caller that keeps Δ in factored form saves one of the step's six streams over memory.

    ``want_grad_sq`` False (the caller knows ‖Δ‖ already, e.g. from the merge's sums): the first
    result is 0 and the second is 0 or NaN (NaN iff a new parameter is not finite), from a float32
    probe instead of float64 sums; the float64 sums were a quarter of the step's time.
    """
    params, buf = state
    grad_out, params_out, buf_out = outs
    momentum, neg_lr, carry, into = rule
    grad_sq = 0.0
    params_sum = 0.0
    scratch = grad_out.size < params.size
    for k in range(scales.size):
        scale = scales[k]
        for lo in range(bounds[k], bounds[k + 1], BLOCK):
            hi = min(lo + BLOCK, bounds[k + 1])
            # Loops over block views indexed from 0: an index numba cannot prove >= 0 gets a
            # negative-index wrap-around check, which keeps LLVM from vectorizing the loop.
            s, p0, b0 = sums[lo:hi], params[lo:hi], buf[lo:hi]
            g1 = grad_out[: hi - lo] if scratch else grad_out[lo:hi]
            p1, b1 = params_out[lo:hi], buf_out[lo:hi]
            if nesterov:
                for i in range(s.size):
                    g = s[i] * scale
                    b = g * into + momentum * b0[i]
                    g1[i] = g
                    b1[i] = b
                    p1[i] = p0[i] + (g + carry * b) * neg_lr
            elif carry == 1 and into == 1:  # a whole heavy-ball step, bit for bit optax's
                for i in range(s.size):
                    g = s[i] * scale
                    b = g + momentum * b0[i]
                    g1[i] = g
                    b1[i] = b
                    p1[i] = p0[i] + b * neg_lr
            else:
                for i in range(s.size):
                    g = s[i] * scale
                    b = g * into + momentum * b0[i]
                    g1[i] = g
                    b1[i] = b
                    p1[i] = p0[i] + (g + carry * (b - g * into)) * neg_lr
            if want_grad_sq:
                block_sq, block_sum = _block_sums(g1, p1)
                grad_sq += block_sq
                params_sum += block_sum
            else:
                params_sum += _finite_probe(p1)
    return grad_sq, params_sum


def warm_up() -> None:
    """Compiles the kernels for the argument types callers use (numba compiles on first
    call; later calls in the process reuse the machine code)."""
    one = np.zeros(1, np.float32)
    whole = np.array([0, 1], np.int64)
    segment_square_sums(one, whole, np.empty(1, np.float64))
    pairs = np.array([[0, 1]], np.int64)
    piece_stats(one, 0, pairs, one, pairs, np.zeros(1, np.int64), np.empty(1, np.float32), np.empty(1), np.empty(1))
    fold_segments(one, whole, np.ones(1, np.float32), np.zeros(1, np.float32), np.empty(1, np.float64))
    rule = (np.float32(0.9), np.float32(-0.7), np.float32(0.9), np.float32(1.0))
    outs = (np.empty_like(one), np.empty_like(one), np.empty_like(one))
    scaled_sgd_step(one, whole, np.ones(1, np.float32), (one, one), outs, rule, True, True)


if not COMPILED:  # no numba (its extra is not installed): the same kernels in numpy, bit for bit
    from ddiloco.algo._kernels_numpy import (  # noqa: F401, F811 (re-exported in place of the loops above)
        fold_segments, piece_stats, scaled_sgd_step, segment_square_sums, warm_up,
    )
