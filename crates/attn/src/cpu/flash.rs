//! FlashAttention-2 on the CPU: tiled forward with an online softmax, and a tiled backward that
//! recomputes probabilities from the saved logsumexp. No buffer here grows with N².
//!
//! Forward, per (head, query tile of `block_q` rows): for each key tile of `block_k` rows up to
//! the causal diagonal, `S = scale·Q_i·K_jᵀ`, update the running row max `m` and sum `l`,
//! rescale the unnormalised accumulator by `exp(m_old − m_new)` and add `P·V_j`; divide by `l`
//! once at the end and save `lse = m + ln l`.
//!
//! Backward, per (head, query segment): `D_i = rowsum(dO_i∘O_i)`; then for each key tile `j`
//! (outer) and query tile `i` of the segment (inner): `P = exp(S − lse)`, `dV_j += Pᵀ·dO_i`,
//! `dP = dO_i·V_jᵀ`, `dS = P∘(dP − D_i)`, `dK_j += scale·dSᵀ·Q_i`, `dQ_i += scale·dS·K_j`.
//! Five tile products per tile pair, the minimum; `dK`/`dV` land in the segment's private
//! partial, so no two tasks ever write the same memory.
//!
//! Document masks (packed sequences) add a lower bound per query row: scores of keys before
//! the row's document start are set to -inf before the softmax, key tiles wholly before the
//! first row's start are never visited, and the backward skips (query tile, key tile) pairs
//! no row of the query tile sees.

use headroom_tensor::Cpu;

use super::matmul::{matmul, MatRef};
use super::parallel::{self, BackwardSegment, ForwardTile, Grads};
use super::softmax_rows::{
    dot, online_softmax_row, probs_from_lse_row, scale_row, softmax_grad_row,
};
use super::{HeadBackward, Problem, SavedRows};
use crate::{AttentionConfig, AttnError, Result};

fn rows_of(data: &[f32], rows: std::ops::Range<usize>, hd: usize) -> Result<&[f32]> {
    data.get(rows.start * hd..rows.end * hd)
        .ok_or(AttnError::Internal("flash rows"))
}

/// Flash forward into `out` (`[batch·heads, q_len, head_dim]` f32) and `lse`.
pub(crate) fn forward(
    cpu: &Cpu,
    p: &Problem<'_>,
    block_q: usize,
    block_k: usize,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let scratch = block_q * block_k + 2 * block_q;
    parallel::for_each_forward_tile(cpu, p, block_q, out, lse, scratch, |tile, scratch| {
        forward_tile(p, block_k, tile, scratch)
    })
}

fn forward_tile(
    p: &Problem<'_>,
    block_k: usize,
    tile: ForwardTile<'_>,
    scratch: &mut [f32],
) -> Result<()> {
    let hd = p.dims.head_dim;
    let nq = p.dims.q_len;
    let ForwardTile { bh, rows, out, lse } = tile;
    let qb = rows.len();
    let q = rows_of(p.head(p.q, bh, nq)?, rows.clone(), hd)?;
    let kv = p.kv_head_of(bh);
    let (k, v) = (p.kv(p.k, kv)?, p.kv(p.v, kv)?);

    let (scores, stats) = scratch.split_at_mut(qb * block_k);
    let (row_max, row_sum) = stats.split_at_mut(qb);
    row_max.fill(f32::NEG_INFINITY);
    row_sum.fill(0.0);
    out.fill(0.0);

    // Causal: the last row sees the most keys; tiles past it are skipped entirely. Documents:
    // starts only grow along a row, so tiles wholly before the first row's start are seen by
    // no row here and skipped too. The key tiles stay on the `block_k` grid, so a mask of one
    // document per row runs exactly the unmasked loop.
    let key_end = p.visible(rows.end - 1);
    let starts = p.starts(bh)?;
    let key_begin = starts.of(rows.start).min(key_end) / block_k * block_k;
    for k0 in (key_begin..key_end).step_by(block_k) {
        let k1 = (k0 + block_k).min(key_end); // no row here sees keys past key_end
        let kb = k1 - k0;
        let k_tile = rows_of(k, k0..k1, hd)?;
        let v_tile = rows_of(v, k0..k1, hd)?;
        matmul(
            scores,
            block_k,
            MatRef::rows(q, qb, hd, hd),
            MatRef::rows(k_tile, kb, hd, hd).t(),
            p.scale,
            false,
            1,
        )?;
        for r in 0..qb {
            let valid = p.visible(rows.start + r).saturating_sub(k0).min(kb);
            let row = &mut scores[r * block_k..r * block_k + kb];
            // A row whose document starts past this tile gets only -inf, which the online
            // softmax treats as "nothing seen yet" (correction 1, no contribution).
            starts.mask(row, rows.start + r, k0);
            let correction = online_softmax_row(row, valid, &mut row_max[r], &mut row_sum[r]);
            if correction != 1.0 {
                scale_row(&mut out[r * hd..(r + 1) * hd], correction);
            }
        }
        matmul(
            out,
            hd,
            MatRef::rows(scores, qb, kb, block_k),
            MatRef::rows(v_tile, kb, hd, hd),
            1.0,
            true,
            1,
        )?;
    }
    for r in 0..qb {
        let o = &mut out[r * hd..(r + 1) * hd];
        if row_sum[r] > 0.0 {
            // The one division of FlashAttention-2, as a multiplication by the reciprocal.
            scale_row(o, 1.0 / row_sum[r]);
            lse[r] = row_max[r] + row_sum[r].ln();
        } else {
            o.fill(0.0);
            lse[r] = f32::NEG_INFINITY;
        }
    }
    Ok(())
}

/// Flash backward into `grads`.
pub(crate) fn backward(
    cpu: &Cpu,
    p: &Problem<'_>,
    saved: &SavedRows<'_>,
    block_q: usize,
    block_k: usize,
    config: &AttentionConfig,
    grads: Grads<'_>,
) -> Result<()> {
    let seg_rows = parallel::segment_rows(&p.dims, block_q, config.backward_segments);
    let scratch = backward_scratch_len(block_q, block_k, seg_rows);
    parallel::for_each_backward_segment(cpu, p, seg_rows, grads, scratch, |seg, scratch| {
        backward_segment(p, saved, block_q, block_k, seg, scratch)
    })
}

/// Elements of one backward task's scratch: a score tile and its gradient, and a value per row
/// of the segment.
pub(crate) fn backward_scratch_len(block_q: usize, block_k: usize, seg_rows: usize) -> usize {
    2 * block_q * block_k + seg_rows
}

fn backward_segment(
    p: &Problem<'_>,
    saved: &SavedRows<'_>,
    block_q: usize,
    block_k: usize,
    seg: BackwardSegment<'_>,
    scratch: &mut [f32],
) -> Result<()> {
    let hd = p.dims.head_dim;
    let BackwardSegment {
        bh,
        rows,
        dq,
        dk,
        dv,
    } = seg;
    let HeadBackward {
        q,
        d_out,
        out,
        lse,
        k,
        v,
    } = HeadBackward::new(p, saved, bh)?;

    let tile = block_q * block_k;
    let (probs, rest) = scratch.split_at_mut(tile);
    let (dprobs, d_rows) = rest.split_at_mut(tile);
    // D = rowsum(dO∘O) equals rowsum(P∘dP) without ever forming a full row of P.
    for (i, di) in rows.clone().zip(d_rows.iter_mut()) {
        *di = dot(&d_out[i * hd..(i + 1) * hd], &out[i * hd..(i + 1) * hd]);
    }

    // As in the forward: key tiles from the one holding the segment's first document start.
    let key_end = p.visible(rows.end - 1);
    let starts = p.starts(bh)?;
    let key_begin = starts.of(rows.start).min(key_end) / block_k * block_k;
    for k0 in (key_begin..key_end).step_by(block_k) {
        let k1 = (k0 + block_k).min(key_end); // no row here sees keys past key_end
        let kb = k1 - k0;
        let k_tile = rows_of(k, k0..k1, hd)?;
        let v_tile = rows_of(v, k0..k1, hd)?;
        let dk_tile = dk
            .get_mut(k0 * hd..k1 * hd)
            .ok_or(AttnError::Internal("flash dk"))?;
        let dv_tile = dv
            .get_mut(k0 * hd..k1 * hd)
            .ok_or(AttnError::Internal("flash dv"))?;
        for i0 in rows.clone().step_by(block_q) {
            let i1 = (i0 + block_q).min(rows.end);
            let qb = i1 - i0;
            // Causal: skip query tiles that see none of these keys (above the diagonal).
            if p.visible(i1 - 1) <= k0 {
                continue;
            }
            // Documents: skip a query tile none of whose rows' documents reach these keys —
            // most pairs of a packed sequence, the compute packing saves. Its rows then add
            // nothing to this tile's dK/dV partial, which is what they would add anyway.
            if starts.masked() && !p.sees(starts, i0..i1, k0..k1) {
                continue;
            }
            let q_tile = rows_of(q, i0..i1, hd)?;
            let do_tile = rows_of(d_out, i0..i1, hd)?;
            matmul(
                probs,
                block_k,
                MatRef::rows(q_tile, qb, hd, hd),
                MatRef::rows(k_tile, kb, hd, hd).t(),
                p.scale,
                false,
                1,
            )?;
            for r in 0..qb {
                let valid = p.visible(i0 + r).saturating_sub(k0).min(kb);
                let row = &mut probs[r * block_k..r * block_k + kb];
                starts.mask(row, i0 + r, k0);
                probs_from_lse_row(row, valid, lse[i0 + r]);
            }
            let p_tile = MatRef::rows(probs, qb, kb, block_k);
            matmul(
                dv_tile,
                hd,
                p_tile.t(),
                MatRef::rows(do_tile, qb, hd, hd),
                1.0,
                true,
                1,
            )?;
            matmul(
                dprobs,
                block_k,
                MatRef::rows(do_tile, qb, hd, hd),
                MatRef::rows(v_tile, kb, hd, hd).t(),
                1.0,
                false,
                1,
            )?;
            for r in 0..qb {
                let span = r * block_k..r * block_k + kb;
                softmax_grad_row(
                    &probs[span.clone()],
                    &mut dprobs[span],
                    d_rows[i0 - rows.start + r],
                );
            }
            let ds_tile = MatRef::rows(dprobs, qb, kb, block_k);
            matmul(
                dk_tile,
                hd,
                ds_tile.t(),
                MatRef::rows(q_tile, qb, hd, hd),
                p.scale,
                true,
                1,
            )?;
            let dq_tile = dq
                .get_mut((i0 - rows.start) * hd..(i1 - rows.start) * hd)
                .ok_or(AttnError::Internal("flash dq"))?;
            matmul(
                dq_tile,
                hd,
                ds_tile,
                MatRef::rows(k_tile, kb, hd, hd),
                p.scale,
                true,
                1,
            )?;
        }
    }
    Ok(())
}
