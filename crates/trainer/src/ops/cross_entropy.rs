//! Softmax cross-entropy over the vocabulary, fused: forward returns per-row losses, backward
//! writes `dlogits = (softmax − onehot) · dloss` in place of nothing extra (no stored probs).

/// Per-row loss `-log softmax(logits)[target]`, computed stably; `losses[n]`.
pub fn forward(losses: &mut [f32], logits: &[f32], targets: &[u32], v: usize) {
    for ((l, row), &t) in losses.iter_mut().zip(logits.chunks_exact(v)).zip(targets) {
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let sum: f32 = row.iter().map(|x| (x - max).exp()).sum();
        *l = (sum.ln() + max) - row[t as usize];
    }
}

/// `dlogits[row] = (softmax(row) − onehot(target)) · dloss[row]` (overwrites `dlogits`).
pub fn backward(dlogits: &mut [f32], logits: &[f32], targets: &[u32], dloss: &[f32], v: usize) {
    for (((d, row), &t), &dl) in dlogits
        .chunks_exact_mut(v)
        .zip(logits.chunks_exact(v))
        .zip(targets)
        .zip(dloss)
    {
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let sum: f32 = row.iter().map(|x| (x - max).exp()).sum();
        let inv = 1.0 / sum;
        for (j, (dj, x)) in d.iter_mut().zip(row).enumerate() {
            let p = (x - max).exp() * inv;
            let onehot = if j == t as usize { 1.0 } else { 0.0 };
            *dj = (p - onehot) * dl;
        }
    }
}
