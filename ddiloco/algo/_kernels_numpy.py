"""The kernels of ``ddiloco.algo._kernels`` in numpy, for an install without the `numba` extra.

Owns: the same five names with the same arguments and outputs; ``_kernels`` swaps them in when
numba cannot be imported. Why: numba is an optional dependency (pyproject.toml), and its loops
run as plain Python without it, about a thousand times slower; numpy ufuncs over chunks are a
few times slower than the compiled pass (more passes over memory), which a run can afford.
Must not: validate inputs or hold state (as ``_kernels``).

Bit-exactness: every step value is the same float32 multiply or add in the same order as the
compiled loop (and optax), so params, momentum and Δ equal the compiled kernels' bit for bit
(tests/unit/test_kernels_numpy.py). Only the float64 sums (norms, the finiteness probe) may
differ in their last bits: the compiled sums are reassociated anyway.
"""

from __future__ import annotations

import numpy as np

# The compiled kernels' block (callers size their scratch by it; see _kernels.BLOCK).
BLOCK = 2048
# Values per numpy pass here: large enough that per-call overhead vanishes, small enough that the
# temporaries stay in cache-sized pieces rather than fragment-sized copies.
_CHUNK = 1 << 16


def _square_sum(values: np.ndarray) -> float:
    """Σ x² in float64."""
    total = 0.0
    for lo in range(0, values.size, _CHUNK):
        # Not np.dot: BLAS's threads contend with the services' on a busy machine (10-100x slower here).
        total += float(np.square(values[lo : lo + _CHUNK], dtype=np.float64).sum())
    return total


def piece_stats(values: np.ndarray, start: int, tensor_bounds: np.ndarray, reference: np.ndarray,
                reference_parts: np.ndarray, index: np.ndarray, sample: np.ndarray,
                squares: np.ndarray, dots: np.ndarray) -> int:
    """See ``_kernels.piece_stats``."""
    stop = start + values.size
    for k in range(tensor_bounds.shape[0]):
        lo, hi = max(int(tensor_bounds[k, 0]), start), min(int(tensor_bounds[k, 1]), stop)
        piece = values[lo - start : hi - start]
        squares[k] = float(np.dot(piece, piece)) if lo < hi else 0.0  # float32 sums, as the compiled blocks
    for j in range(reference_parts.shape[0]):
        lo, hi = max(int(reference_parts[j, 0]), start), min(int(reference_parts[j, 1]), stop)
        dots[j] = float(np.dot(values[lo - start : hi - start], reference[lo:hi])) if lo < hi else 0.0
    first, last = int(np.searchsorted(index, start)), int(np.searchsorted(index, stop))
    np.take(values, index[first:last] - start, out=sample[first:last])
    return last - first


def segment_square_sums(values: np.ndarray, bounds: np.ndarray, out: np.ndarray) -> None:
    """out[k] = Σ values[bounds[k]:bounds[k+1]]² in float64 (non-finite iff a value is)."""
    for k in range(out.size):
        out[k] = _square_sum(values[bounds[k] : bounds[k + 1]])


def fold_segments(
    values: np.ndarray, bounds: np.ndarray, coefs: np.ndarray, sums: np.ndarray, sum_squares: np.ndarray,
) -> None:
    """sums[seg k] += coefs[k] · values[seg k] for every segment with coefs[k] != 0 (a float32
    multiply, then a float32 add), then sum_squares[k] = Σ sums[seg k]² of the updated sums."""
    for k in range(coefs.size):
        coef = coefs[k]
        if coef == 0:
            continue
        lo, hi = bounds[k], bounds[k + 1]
        y = sums[lo:hi]
        y += coef * values[lo:hi]
        sum_squares[k] = _square_sum(y)


def scaled_sgd_step(sums: np.ndarray, bounds: np.ndarray, scales: np.ndarray, state: tuple, outs: tuple, rule: tuple,
                    nesterov: bool, want_grad_sq: bool) -> tuple[float, float]:
    """``_kernels.scaled_sgd_step``: see there for the arguments and the results. A ``grad_out``
    shorter than the fragment is scratch there; here Δ then lives in a temporary per chunk."""
    (params, buf), (grad_out, params_out, buf_out), (momentum, neg_lr, carry, into) = state, outs, rule
    scratch = grad_out.size < params.size
    whole_heavy_ball = not nesterov and carry == 1 and into == 1
    grad_sq = params_sum = 0.0
    for k in range(scales.size):
        scale = scales[k]
        for lo in range(bounds[k], bounds[k + 1], _CHUNK):
            hi = min(lo + _CHUNK, bounds[k + 1])
            g = sums[lo:hi] * scale
            if not scratch:
                grad_out[lo:hi] = g
            if whole_heavy_ball:  # bit for bit optax's heavy ball
                b = g + momentum * buf[lo:hi]
                update = b * neg_lr
            else:
                b = g * into + momentum * buf[lo:hi]
                update = ((g + carry * b) if nesterov else (g + carry * (b - g * into))) * neg_lr
            new_params = params[lo:hi] + update
            buf_out[lo:hi] = b
            params_out[lo:hi] = new_params
            if want_grad_sq:
                grad_sq += _square_sum(g)
                params_sum += float(new_params.sum(dtype=np.float64))
            elif not np.isfinite(new_params).all():
                params_sum = float("nan")
    return grad_sq, params_sum


def warm_up() -> None:
    """Nothing to compile."""
