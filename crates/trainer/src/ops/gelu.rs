//! GELU with the tanh approximation (GPT-2's `gelu_new`).

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const K: f32 = 0.044_715;

/// `out = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn forward(out: &mut [f32], inp: &[f32]) {
    for (o, &x) in out.iter_mut().zip(inp) {
        let u = SQRT_2_OVER_PI * (x + K * x * x * x);
        *o = 0.5 * x * (1.0 + u.tanh());
    }
}

/// Accumulate `dinp += gelu'(inp) · dout`.
pub fn backward(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
    for ((di, &x), &d) in dinp.iter_mut().zip(inp).zip(dout) {
        let u = SQRT_2_OVER_PI * (x + K * x * x * x);
        let t = u.tanh();
        let sech2 = 1.0 - t * t;
        let du = SQRT_2_OVER_PI * (1.0 + 3.0 * K * x * x);
        *di += (0.5 * (1.0 + t) + 0.5 * x * sech2 * du) * d;
    }
}
