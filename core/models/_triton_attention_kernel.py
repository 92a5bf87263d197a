"""The Triton kernel of :mod:`specray.models.triton_attention` (imported only where Triton is: see there)."""

import triton
import triton.language as tl


@triton.jit
def paged_short_attention(
    q_ptr, stride_qt, stride_qh,
    tok_ptr, HAS_TOKEN_INDEX: tl.constexpr,
    k_ptr, v_ptr, stride_kh, stride_ks, stride_vh, stride_vs,
    table_ptr, num_blocks, block_size, ctx_ptr,
    mask_ptr, stride_mb, stride_mh, stride_mm, stride_ml,
    MASK_BOOL: tl.constexpr,
    sink_ptr, HAS_SINKS: tl.constexpr,
    out_ptr, stride_ot,
    scale, cap, HAS_CAP: tl.constexpr,
    q_len, groups, head_dim, rows,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # offsets in int64: h * stride_kh passes 2**31 in a large cache
    h = tl.program_id(1).to(tl.int64)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # folded query rows: m = g * Q + j
    dd = tl.arange(0, BLOCK_D)
    row_ok = m < rows
    d_ok = dd < head_dim
    head = h * groups + m // q_len  # query head of each row
    padded_row = b * q_len + m % q_len  # its row in the padded batch [Bs * Q]
    if HAS_TOKEN_INDEX:
        token = tl.load(tok_ptr + padded_row, mask=row_ok, other=0)
    else:
        token = padded_row
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dd[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    if HAS_SINKS:  # the sink's logit joins each row's softmax: m = sink, l = exp(sink - m) = 1
        m_i = tl.load(sink_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    context = tl.load(ctx_ptr + b)
    for start in range(0, context, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)  # slot indices of this tile
        t_ok = t < context
        page = tl.load(table_ptr + b * num_blocks + t // block_size, mask=t_ok, other=0)
        slot = (page * block_size + t % block_size).to(tl.int64)
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + h * stride_kh + slot[:, None] * stride_ks + dd[None, :], mask=kv_ok, other=0.0)
        if FP32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if HAS_CAP:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1)
            s = cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))
        pair_ok = row_ok[:, None] & t_ok[None, :]
        mask_at = mask_ptr + b * stride_mb + h * stride_mh + m[:, None] * stride_mm + t[None, :] * stride_ml
        if MASK_BOOL:
            allowed = tl.load(mask_at, mask=pair_ok, other=0) != 0
            s = tl.where(allowed, s, float("-inf"))
        else:
            s = tl.where(pair_ok, s + tl.load(mask_at, mask=pair_ok, other=0.0).to(tl.float32), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing to attend yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + h * stride_vh + slot[:, None] * stride_vs + dd[None, :], mask=kv_ok, other=0.0)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + padded_row[:, None] * stride_ot + head[:, None] * head_dim + dd[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
