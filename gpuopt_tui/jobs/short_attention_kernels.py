"""Triton kernels of `short_attention`: one program per (sequence, head) holds the whole sequence.

Imported only where triton is installed (see short_attention.py). Every tensor is contiguous: queries, keys,
values, the output and the gradients [batch, seq, heads, DIM]; the log-sum-exp [batch, heads, seq] in float32,
in base 2; the key mask [batch, seq] (nonzero = attend).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _program(heads):
    """This program's index and the (sequence, head) it holds."""
    program = tl.program_id(0)
    return program, program // heads, program % heads


@triton.jit
def _tile(batch, head, start, heads, seq, ROWS: tl.constexpr, DIM: tl.constexpr):
    """Offsets of rows start..start+ROWS of one (sequence, head) slice, and whether each row is in the sequence."""
    rows = start + tl.arange(0, ROWS)
    offsets = ((batch * seq + rows[:, None]) * heads + head) * DIM + tl.arange(0, DIM)[None, :]
    return offsets, rows < seq


@triton.jit
def _keys_kept(KEEP, batch, seq, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
    """Which key positions take part: inside the sequence and, with a mask, not padding."""
    keys = tl.arange(0, BLOCK)
    kept = keys < seq
    if HAS_MASK:
        kept = kept & (tl.load(KEEP + batch * seq + keys, mask=kept, other=0) != 0)
    return kept


# The lengths are not specialised on (triton would otherwise compile a kernel for lengths divisible by 16 and
# another for the rest): one kernel per block size, mask and dtype covers every length.
@triton.jit(do_not_specialize=["heads", "seq"])
def attention_forward(
    Q, K, V, OUT, LSE, KEEP, heads, seq, scale_log2,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr,
):  # fmt: skip
    program, batch, head = _program(heads)
    at, inside = _tile(batch, head, 0, heads, seq, BLOCK, DIM)
    q = tl.load(Q + at, mask=inside[:, None], other=0.0)
    k = tl.load(K + at, mask=inside[:, None], other=0.0)
    v = tl.load(V + at, mask=inside[:, None], other=0.0)
    kept = _keys_kept(KEEP, batch, seq, BLOCK, HAS_MASK)

    scores = tl.dot(q, tl.trans(k)) * scale_log2
    scores = tl.where(kept[None, :], scores, float("-inf"))
    top = tl.max(scores, axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row with no key left gives zeros, not NaN
    weights = tl.exp2(scores - top[:, None])
    total = tl.sum(weights, axis=1)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.dot(weights.to(v.dtype), v) / total[:, None]

    tl.store(OUT + at, out.to(OUT.dtype.element_ty), mask=inside[:, None])
    rows = tl.arange(0, BLOCK)
    tl.store(LSE + program * seq + rows, top + tl.log2(total), mask=inside)


@triton.jit(do_not_specialize=["heads", "seq"])
def attention_backward(
    Q, K, V, GRAD, LSE, DQ, DK, DV, KEEP, heads, seq, scale, scale_log2,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, DIM: tl.constexpr,
):  # fmt: skip
    program, batch, head = _program(heads)
    key_at, key_inside = _tile(batch, head, 0, heads, seq, BLOCK, DIM)
    k = tl.load(K + key_at, mask=key_inside[:, None], other=0.0)
    v = tl.load(V + key_at, mask=key_inside[:, None], other=0.0)
    kept = _keys_kept(KEEP, batch, seq, BLOCK, HAS_MASK)
    grad_k = tl.zeros([BLOCK, DIM], dtype=tl.float32)
    grad_v = tl.zeros([BLOCK, DIM], dtype=tl.float32)

    # Every query row sees every key in this program, so dQ needs no accumulation across programs; the rows go
    # BLOCK_M at a time to bound the registers the [rows, keys] tiles take.
    for start in tl.static_range(0, BLOCK, BLOCK_M):
        at, inside = _tile(batch, head, start, heads, seq, BLOCK_M, DIM)
        q = tl.load(Q + at, mask=inside[:, None], other=0.0)
        grad = tl.load(GRAD + at, mask=inside[:, None], other=0.0)
        rows = start + tl.arange(0, BLOCK_M)
        lse = tl.load(LSE + program * seq + rows, mask=inside, other=0.0)

        weights = tl.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse[:, None])
        weights = tl.where(kept[None, :] & inside[:, None], weights, 0.0)
        grad_v += tl.dot(tl.trans(weights.to(q.dtype)), grad)
        grad_weights = tl.dot(grad, tl.trans(v))
        # rowsum(P * dP) equals rowsum(dO * O): the output need not be read back
        centre = tl.sum(weights * grad_weights, axis=1)
        grad_scores = (weights * (grad_weights - centre[:, None]) * scale).to(q.dtype)
        tl.store(DQ + at, tl.dot(grad_scores, k).to(DQ.dtype.element_ty), mask=inside[:, None])
        grad_k += tl.dot(tl.trans(grad_scores), q)

    tl.store(DK + key_at, grad_k.to(DK.dtype.element_ty), mask=key_inside[:, None])
    tl.store(DV + key_at, grad_v.to(DV.dtype.element_ty), mask=key_inside[:, None])
