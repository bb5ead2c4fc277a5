//! Naive (standard) attention on the CPU: the whole `[batch, heads, q_len, kv_len]` score
//! matrix is materialised, softmaxed and multiplied by `V`; the probabilities are kept for
//! backward, which materialises `dP` of the same size. This is what PyTorch's math path does,
//! and the memory baseline the other algorithms are measured against.
//!
//! Matrix products are threaded inside `gemm`; heads run one after another so that `dK`/`dV`
//! of a shared key/value head (GQA) accumulate in a fixed order.

use headroom_tensor::{Backend, Cpu, CpuTensor, DType, MemoryCategory};
use rayon::prelude::*;

use super::matmul::{matmul, MatRef};
use super::parallel::{workspace, Grads};
use super::softmax_rows::{dot, softmax_grad_row, softmax_row};
use super::Problem;
use crate::Result;

/// Naive forward into `out` and `lse`; returns the probabilities (`Activations`).
pub(crate) fn forward(
    cpu: &Cpu,
    p: &Problem<'_>,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<CpuTensor> {
    let d = p.dims;
    let (nq, nk, hd) = (d.q_len, d.kv_len, d.head_dim);
    let heads = d.batch * d.q_heads;
    let mut probs = {
        let _saved = MemoryCategory::Activations.enter();
        cpu.zeros(d.probs_shape(), DType::F32)?
    };
    if nk == 0 {
        out.fill(0.0);
        lse.fill(f32::NEG_INFINITY);
        return Ok(probs);
    }
    if nq == 0 || heads == 0 {
        return Ok(probs);
    }
    let threads = cpu.num_threads();
    let all = probs.as_mut_slice::<f32>()?;
    cpu.install(|| -> Result<()> {
        for (bh, scores) in all.chunks_mut(nq * nk).enumerate() {
            let kv = p.kv_head_of(bh);
            matmul(
                scores,
                nk,
                MatRef::rows(p.head(p.q, bh, nq)?, nq, hd, hd),
                MatRef::rows(p.kv(p.k, kv)?, nk, hd, hd).t(),
                p.scale,
                false,
                threads,
            )?;
        }
        all.par_chunks_mut(nk)
            .zip(lse.par_iter_mut())
            .enumerate()
            .try_for_each(|(row, (scores, l))| -> Result<()> {
                let i = row % nq;
                p.starts(row / nq)?.mask(scores, i, 0);
                *l = softmax_row(scores, p.visible(i));
                Ok(())
            })?;
        for (bh, (probs_h, out_h)) in all.chunks(nq * nk).zip(out.chunks_mut(nq * hd)).enumerate() {
            let kv = p.kv_head_of(bh);
            matmul(
                out_h,
                hd,
                MatRef::rows(probs_h, nq, nk, nk),
                MatRef::rows(p.kv(p.v, kv)?, nk, hd, hd),
                1.0,
                false,
                threads,
            )?;
        }
        Ok(())
    })?;
    Ok(probs)
}

/// Naive backward from the saved probabilities, with the textbook `D = rowsum(P∘dP)` (flash
/// uses the equal `rowsum(dO∘O)`; the two are checked against each other by the tests).
/// A document mask needs nothing here: its hidden keys have probability 0, so `dS = P∘(…)`
/// is 0 there too.
pub(crate) fn backward(
    cpu: &Cpu,
    p: &Problem<'_>,
    probs: &[f32],
    d_out: &[f32],
    grads: Grads<'_>,
) -> Result<()> {
    let d = p.dims;
    let (nq, nk, hd) = (d.q_len, d.kv_len, d.head_dim);
    let heads = d.batch * d.q_heads;
    if nq == 0 || nk == 0 || heads == 0 {
        return Ok(());
    }
    let threads = cpu.num_threads();
    let mut dprobs_t = workspace(cpu, heads * nq * nk)?;
    let dprobs = dprobs_t.as_mut_slice::<f32>()?;
    let Grads { dq, dk, dv } = grads;
    let kv_len = nk * hd;
    cpu.install(|| -> Result<()> {
        for (bh, dp_h) in dprobs.chunks_mut(nq * nk).enumerate() {
            let kv = p.kv_head_of(bh);
            let probs_h = MatRef::rows(p.head_rows(probs, bh, nq * nk)?, nq, nk, nk);
            let do_h = MatRef::rows(p.head(d_out, bh, nq)?, nq, hd, hd);
            let dv_kv = &mut dv[kv * kv_len..(kv + 1) * kv_len];
            matmul(dv_kv, hd, probs_h.t(), do_h, 1.0, true, threads)?;
            let v_kv = MatRef::rows(p.kv(p.v, kv)?, nk, hd, hd);
            matmul(dp_h, nk, do_h, v_kv.t(), 1.0, false, threads)?;
        }
        dprobs
            .par_chunks_mut(nk)
            .zip(probs.par_chunks(nk))
            .for_each(|(dp_row, p_row)| {
                let d_row = dot(p_row, dp_row);
                softmax_grad_row(p_row, dp_row, d_row);
            });
        for (bh, (ds_h, dq_h)) in dprobs
            .chunks(nq * nk)
            .zip(dq.chunks_mut(nq * hd))
            .enumerate()
        {
            let kv = p.kv_head_of(bh);
            let ds = MatRef::rows(ds_h, nq, nk, nk);
            let k_kv = MatRef::rows(p.kv(p.k, kv)?, nk, hd, hd);
            matmul(dq_h, hd, ds, k_kv, p.scale, false, threads)?;
            let q_h = MatRef::rows(p.head(p.q, bh, nq)?, nq, hd, hd);
            let dk_kv = &mut dk[kv * kv_len..(kv + 1) * kv_len];
            matmul(dk_kv, hd, ds.t(), q_h, p.scale, true, threads)?;
        }
        Ok(())
    })
}
