"""The Triton kernels of :mod:`specray.models.triton_attention` (imported only where Triton is: see there)."""

import triton
import triton.language as tl


@triton.jit
def _as_read(x, KV_FP8: tl.constexpr, scale, SCALED: tl.constexpr, dtype: tl.constexpr):
    """Cached values as ``PagedAttention._read`` gives them: FP8 bytes decoded to the model's dtype, times the
    checkpoint's scale (rounded to that dtype); a cache in the model's dtype as it is."""
    if KV_FP8 == 1:  # by float32: exact (every FP8 value is one in each of the model's dtypes)
        x = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif KV_FP8 == 2:
        x = x.to(tl.float8e5, bitcast=True).to(tl.float32)
    if SCALED:
        x = x * scale
    return x.to(dtype)


@triton.jit
def paged_attention(
    q_ptr, stride_qt, stride_qh,
    tok_ptr, HAS_TOKEN_INDEX: tl.constexpr,
    k_ptr, v_ptr, stride_kh, stride_ks, stride_vh, stride_vs, V_IS_K: tl.constexpr,
    extra_dim, HAS_EXTRA: tl.constexpr, BLOCK_E: tl.constexpr,
    KV_FP8: tl.constexpr, k_scale, v_scale, SCALED: tl.constexpr,
    table_ptr, num_blocks, block_size, ctx_ptr, first_ptr, HAS_FIRST: tl.constexpr,
    mask_ptr, stride_mb, stride_mh, stride_mm, stride_ml,
    MASK_BOOL: tl.constexpr, MASK_UNFOLDED: tl.constexpr,
    POSITIONAL: tl.constexpr, q_start, window, HAS_WINDOW: tl.constexpr, chunk, HAS_CHUNK: tl.constexpr,
    sink_ptr, HAS_SINKS: tl.constexpr,
    out_ptr, stride_ot, stride_oh,
    part_ptr, stat_ptr, stride_ps, stride_pt, stride_ss, stride_st,
    split_len, SPLIT: tl.constexpr,
    scale, cap, HAS_CAP: tl.constexpr,
    q_len, groups, head_dim, rows, row_tiles,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # offsets in int64: h * stride_kh passes 2**31 in a large cache
    h = (tl.program_id(1) // row_tiles).to(tl.int64)
    split = tl.program_id(2)
    m = (tl.program_id(1) % row_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)  # folded query rows: m = g * Q + j
    dd = tl.arange(0, BLOCK_D)
    row_ok = m < rows
    d_ok = dd < head_dim
    head = h * groups + m // q_len  # query head of each row
    padded_row = b * q_len + m % q_len  # its row in the padded batch [Bs * Q]
    if MASK_UNFOLDED:  # the mask's row: its query's (one row for the G heads), or the folded row itself
        mask_row = m % q_len
    else:
        mask_row = m
    if HAS_TOKEN_INDEX:
        token = tl.load(tok_ptr + padded_row, mask=row_ok, other=0)
    else:
        token = padded_row
    q_at = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_at + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    dtype = q_ptr.dtype.element_ty
    if HAS_EXTRA:  # key columns past the values' that join q.k alone (latent attention's RoPE part)
        ee = tl.arange(0, BLOCK_E)
        e_ok = ee < extra_dim
        q_extra = tl.load(q_at + head_dim + ee[None, :], mask=row_ok[:, None] & e_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # the sink's logit joins each row's softmax once (the first split): m = sink, l = 1
        sink = tl.load(sink_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    context = tl.load(ctx_ptr + b)
    first = context * 0
    if HAS_FIRST:  # the sequence's first key any of its queries may see (a sliding window's, a local chunk's)
        first = tl.load(first_ptr + b)
    last = context
    if SPLIT:  # this program's share: slot indices [split * split_len, (split + 1) * split_len) of its context
        first = tl.maximum(first, split * split_len)
        last = tl.minimum((split + 1) * split_len, context)
    if POSITIONAL:  # query j at position q_start + j, keys at their slot indices: skip the keys no row here sees
        q_pos = q_start + m % q_len
        lowest = tl.min(tl.where(row_ok, q_pos, 2147483647), 0)
        last = tl.minimum(last, tl.max(tl.where(row_ok, q_pos, 0), 0) + 1)  # causal
        if HAS_WINDOW:
            first = tl.maximum(first, lowest - window + 1)
        if HAS_CHUNK:
            first = tl.maximum(first, lowest // chunk * chunk)
    for start in range(first, last, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)  # slot indices of this tile
        t_ok = t < last
        page = tl.load(table_ptr + b * num_blocks + t // block_size, mask=t_ok, other=0)
        slot = (page * block_size + t % block_size).to(tl.int64)
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + h * stride_kh + slot[:, None] * stride_ks + dd[None, :], mask=kv_ok, other=0)
        k = _as_read(k, KV_FP8, k_scale, SCALED, dtype)
        if FP32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if HAS_EXTRA:
            k_extra = tl.load(k_ptr + h * stride_kh + slot[:, None] * stride_ks + head_dim + ee[None, :],
                              mask=t_ok[:, None] & e_ok[None, :], other=0)
            k_extra = _as_read(k_extra, KV_FP8, k_scale, SCALED, dtype)
            if FP32_DOT:
                s += tl.dot(q_extra.to(tl.float32), tl.trans(k_extra.to(tl.float32)), input_precision="ieee")
            else:
                s += tl.dot(q_extra, tl.trans(k_extra))
        s = s * scale
        if HAS_CAP:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1)
            s = cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))
        pair_ok = row_ok[:, None] & t_ok[None, :]
        mask_at = mask_ptr + b * stride_mb + h * stride_mh + mask_row[:, None] * stride_mm + t[None, :] * stride_ml
        if POSITIONAL:  # MaskKind.allows: causal, and within the window or the chunk
            allowed = t[None, :] <= q_pos[:, None]
            if HAS_WINDOW:
                allowed = allowed & (t[None, :] > q_pos[:, None] - window)
            if HAS_CHUNK:
                allowed = allowed & (t[None, :] // chunk == q_pos[:, None] // chunk)
            s = tl.where(allowed & pair_ok, s, float("-inf"))
        elif MASK_BOOL:
            allowed = tl.load(mask_at, mask=pair_ok, other=0) != 0
            s = tl.where(allowed, s, float("-inf"))
        else:
            s = tl.where(pair_ok, s + tl.load(mask_at, mask=pair_ok, other=0.0).to(tl.float32), float("-inf"))
        # online softmax: with m the running row maximum and l the running sum of exp(s - m), a tile with a larger
        # maximum rescales l and the accumulator by exp(m_old - m_new)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing to attend yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_IS_K:  # the keys' rows are the values too (latent attention): read once
            v = k
        else:
            v = tl.load(v_ptr + h * stride_vh + slot[:, None] * stride_vs + dd[None, :], mask=kv_ok, other=0)
            v = _as_read(v, KV_FP8, v_scale, SCALED, dtype)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out_ok = row_ok[:, None] & d_ok[None, :]
    if SPLIT:  # this split's unnormalised rows and their (m, l), for combine_splits
        tl.store(part_ptr + split * stride_ps + padded_row[:, None] * stride_pt + head[:, None] * head_dim
                 + dd[None, :], acc, mask=out_ok)
        stats = stat_ptr + split * stride_ss + padded_row * stride_st + head * 2
        tl.store(stats, m_i, mask=row_ok)
        tl.store(stats + 1, l_i, mask=row_ok)
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + padded_row[:, None] * stride_ot + head[:, None] * stride_oh + dd[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def combine_splits(
    part_ptr, stat_ptr, stride_ps, stride_pt, stride_ss, stride_st,
    out_ptr, stride_ot, stride_oh, num_splits, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per (padded row, query head): o = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s, M = max_s m_s
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < head_dim
    stats = stat_ptr + row * stride_st + head * 2
    top = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        top = tl.maximum(top, tl.load(stats + s * stride_ss, mask=s < num_splits, other=float("-inf")))
    top_all = tl.max(top, 0)
    top_all = tl.where(top_all == float("-inf"), 0.0, top_all)
    denom = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < num_splits
        w = tl.exp(tl.load(stats + s * stride_ss, mask=s_ok, other=float("-inf")) - top_all)  # empty split: 0
        denom += w * tl.load(stats + s * stride_ss + 1, mask=s_ok, other=0.0)
        part = tl.load(part_ptr + s[:, None] * stride_ps + row * stride_pt + head * head_dim + dd[None, :],
                       mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
    total = tl.sum(denom, 0)
    o = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dd, o.to(out_ptr.dtype.element_ty), mask=d_ok)
