//! Chunked attention on the CPU: `chunk_size` query rows at a time against every visible key,
//! with an exact (two-pass) softmax per chunk. Extra memory per running task is
//! `chunk_size × kv_len` scores (forward) or twice that (backward); only the logsumexp is kept.

use headroom_tensor::Cpu;

use super::matmul::{matmul, MatRef};
use super::parallel::{self, BackwardSegment, ForwardTile, Grads};
use super::softmax_rows::{dot, probs_from_lse_row, softmax_grad_row, softmax_row};
use super::{HeadBackward, Problem, SavedRows};
use crate::{AttentionConfig, AttnError, Result};

fn rows_of(data: &[f32], rows: std::ops::Range<usize>, hd: usize) -> Result<&[f32]> {
    data.get(rows.start * hd..rows.end * hd)
        .ok_or(AttnError::Internal("chunked rows"))
}

/// Chunked forward into `out` and `lse`.
pub(crate) fn forward(
    cpu: &Cpu,
    p: &Problem<'_>,
    chunk: usize,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let scratch = chunk * p.dims.kv_len;
    parallel::for_each_forward_tile(cpu, p, chunk, out, lse, scratch, |tile, scratch| {
        forward_chunk(p, tile, scratch)
    })
}

fn forward_chunk(p: &Problem<'_>, tile: ForwardTile<'_>, scores: &mut [f32]) -> Result<()> {
    let hd = p.dims.head_dim;
    let nq = p.dims.q_len;
    let ForwardTile { bh, rows, out, lse } = tile;
    let cb = rows.len();
    let q = rows_of(p.head(p.q, bh, nq)?, rows.clone(), hd)?;
    let kv = p.kv_head_of(bh);
    let (k, v) = (p.kv(p.k, kv)?, p.kv(p.v, kv)?);
    // Only keys some row of the chunk can see: causal chunks stop at the diagonal, and
    // document starts only grow along a row, so none sees a key before its first row's start.
    let ke = p.visible(rows.end - 1);
    if ke == 0 {
        out.fill(0.0);
        lse.fill(f32::NEG_INFINITY);
        return Ok(());
    }
    let starts = p.starts(bh)?;
    let ks = starts.of(rows.start).min(ke);
    let nkeys = ke - ks;
    let k_vis = rows_of(k, ks..ke, hd)?;
    matmul(
        scores,
        nkeys,
        MatRef::rows(q, cb, hd, hd),
        MatRef::rows(k_vis, nkeys, hd, hd).t(),
        p.scale,
        false,
        1,
    )?;
    for r in 0..cb {
        let row = rows.start + r;
        let scores_r = &mut scores[r * nkeys..(r + 1) * nkeys];
        starts.mask(scores_r, row, ks);
        lse[r] = softmax_row(scores_r, p.visible(row).saturating_sub(ks));
    }
    matmul(
        out,
        hd,
        MatRef::rows(scores, cb, nkeys, nkeys),
        MatRef::rows(rows_of(v, ks..ke, hd)?, nkeys, hd, hd),
        1.0,
        false,
        1,
    )
}

/// Chunked backward into `grads`.
pub(crate) fn backward(
    cpu: &Cpu,
    p: &Problem<'_>,
    saved: &SavedRows<'_>,
    chunk: usize,
    config: &AttentionConfig,
    grads: Grads<'_>,
) -> Result<()> {
    let seg_rows = parallel::segment_rows(&p.dims, chunk, config.backward_segments);
    let scratch = backward_scratch_len(chunk, p.dims.kv_len);
    parallel::for_each_backward_segment(cpu, p, seg_rows, grads, scratch, |seg, scratch| {
        backward_segment(p, saved, chunk, seg, scratch)
    })
}

/// Elements of one backward task's scratch: a chunk's scores and their gradient over every key,
/// and a value per row of the chunk.
pub(crate) fn backward_scratch_len(chunk: usize, kv_len: usize) -> usize {
    2 * chunk * kv_len + chunk
}

fn backward_segment(
    p: &Problem<'_>,
    saved: &SavedRows<'_>,
    chunk: usize,
    seg: BackwardSegment<'_>,
    scratch: &mut [f32],
) -> Result<()> {
    let hd = p.dims.head_dim;
    let nk = p.dims.kv_len;
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
    let (probs, rest) = scratch.split_at_mut(chunk * nk);
    let (dprobs, d_rows) = rest.split_at_mut(chunk * nk);

    let starts = p.starts(bh)?;
    for c0 in rows.clone().step_by(chunk) {
        let c1 = (c0 + chunk).min(rows.end);
        let cb = c1 - c0;
        let ke = p.visible(c1 - 1);
        if ke == 0 {
            continue;
        }
        // As in the forward: keys before the chunk's first document start are seen by no row
        // of it, and get no gradient from it (the segment's partial keeps its zeros there).
        let ks = starts.of(c0).min(ke);
        let nkeys = ke - ks;
        let q_c = rows_of(q, c0..c1, hd)?;
        let do_c = rows_of(d_out, c0..c1, hd)?;
        let (k_vis, v_vis) = (rows_of(k, ks..ke, hd)?, rows_of(v, ks..ke, hd)?);
        for (r, di) in d_rows.iter_mut().take(cb).enumerate() {
            let i = c0 + r;
            *di = dot(&d_out[i * hd..(i + 1) * hd], &out[i * hd..(i + 1) * hd]);
        }
        matmul(
            probs,
            nkeys,
            MatRef::rows(q_c, cb, hd, hd),
            MatRef::rows(k_vis, nkeys, hd, hd).t(),
            p.scale,
            false,
            1,
        )?;
        for r in 0..cb {
            let row = c0 + r;
            let probs_r = &mut probs[r * nkeys..(r + 1) * nkeys];
            starts.mask(probs_r, row, ks);
            probs_from_lse_row(probs_r, p.visible(row).saturating_sub(ks), lse[row]);
        }
        let dk_vis = dk
            .get_mut(ks * hd..ke * hd)
            .ok_or(AttnError::Internal("chunked dk"))?;
        let dv_vis = dv
            .get_mut(ks * hd..ke * hd)
            .ok_or(AttnError::Internal("chunked dv"))?;
        let p_c = MatRef::rows(probs, cb, nkeys, nkeys);
        matmul(
            dv_vis,
            hd,
            p_c.t(),
            MatRef::rows(do_c, cb, hd, hd),
            1.0,
            true,
            1,
        )?;
        matmul(
            dprobs,
            nkeys,
            MatRef::rows(do_c, cb, hd, hd),
            MatRef::rows(v_vis, nkeys, hd, hd).t(),
            1.0,
            false,
            1,
        )?;
        for (r, &d_row) in d_rows.iter().take(cb).enumerate() {
            let span = r * nkeys..(r + 1) * nkeys;
            softmax_grad_row(&probs[span.clone()], &mut dprobs[span], d_row);
        }
        let ds_c = MatRef::rows(dprobs, cb, nkeys, nkeys);
        matmul(
            dk_vis,
            hd,
            ds_c.t(),
            MatRef::rows(q_c, cb, hd, hd),
            p.scale,
            true,
            1,
        )?;
        let dq_c = dq
            .get_mut((c0 - rows.start) * hd..(c1 - rows.start) * hd)
            .ok_or(AttnError::Internal("chunked dq"))?;
        matmul(
            dq_c,
            hd,
            ds_c,
            MatRef::rows(k_vis, nkeys, hd, hd),
            p.scale,
            false,
            1,
        )?;
    }
    Ok(())
}
