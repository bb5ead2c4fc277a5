//! `exp` and `tanh` in f32 that the compiler vectorises: branch-free range reduction and a
//! polynomial, within a few ulp of the correctly rounded result. The loss over a 50k vocabulary
//! and GELU spend most of their time here; libm's scalar calls were a fifth of a `small` step.

const LOG2E: f32 = std::f32::consts::LOG2_E;
// ln 2 split so that n·LN2_HI is exact for |n| < 2¹⁰.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Adding and subtracting 1.5·2²³ rounds an f32 below 2²² to the nearest integer.
const ROUND: f32 = 12_582_912.0;

/// `eˣ`, flushing to 0 below −87.3 and saturating to `f32::MAX`-ish range above 88.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.7);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let y = exp_reduced(x, n);
    // 2ⁿ from the integer `n` that `shifted` holds in its low mantissa bits (its exponent is
    // ROUND's for every clamped x), not from `n as i32`: Rust's saturating float-to-int cast
    // has no vector form on x86, so it compiled to a scalar conversion with NaN and range
    // checks per lane, most of the loss rows' time. Same bits for every input (n is an exact
    // integer in −126..=128; tested); for a NaN the scale's mantissa is zero, so it is never
    // NaN and the result is the NaN from the polynomial, as before.
    let scale = f32::from_bits(
        shifted
            .to_bits()
            .wrapping_sub(ROUND.to_bits())
            .wrapping_add(127)
            << 23,
    );
    y * scale
}

/// `e^(x − n·ln 2)` for the nearest integer `n` to `x·log₂e`: the range reduction and the
/// polynomial, shared with the tests' reference.
#[inline(always)]
fn exp_reduced(x: f32, n: f32) -> f32 {
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // Taylor/minimax degree 6 on |r| ≤ ln2/2 (Cephes expf's coefficients).
    let p = 1.987_569_1e-4f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    (p * r * r + r) + 1.0
}

/// `tanh x = 1 − 2/(e²ˣ + 1)`, odd-symmetric, exactly ±1 beyond |x| ≥ 9.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs().min(9.0);
    let e = exp(2.0 * a);
    let t = 1.0 - 2.0 / (e + 1.0);
    // Near 0 the subtraction loses relative accuracy; below 0.3 the odd Taylor series to x⁹
    // is within 1e-8 instead.
    let a2 = a * a;
    let small = a
        * (1.0
            + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))));
    let t = if a < 0.3 { small } else { t };
    // Beyond 9, 1 − tanh is below half an ulp of 1.
    let t = if a >= 9.0 { 1.0 } else { t };
    t.copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(a: f32, b: f32) -> f32 {
        ((a - b) / b.abs().max(f32::MIN_POSITIVE)).abs()
    }

    #[test]
    fn exp_matches_libm_within_a_few_ulp() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x < 88.0 {
            worst = worst.max(rel(exp(x), x.exp()));
            x += 0.001_37;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp(-200.0), 0.0f32.max(exp(-200.0)));
        assert!(exp(-200.0) < 1e-37);
        assert_eq!(exp(0.0), 1.0);
    }

    /// The formulation `exp` replaced: the same reduction and polynomial, 2ⁿ built from a
    /// float-to-int cast.
    fn exp_with_cast(x: f32) -> f32 {
        let x = x.clamp(-87.3, 88.7);
        let n = (x * LOG2E + ROUND) - ROUND;
        exp_reduced(x, n) * f32::from_bits(((n as i32 + 127) as u32) << 23)
    }

    /// Every 997th f32 bit pattern (both signs, subnormals, infinities, NaNs with assorted
    /// payloads) and the clamp bounds' neighbourhoods give the cast formulation's bits.
    /// (All 2³² patterns were checked once in a release build.)
    #[test]
    fn exp_gives_the_bits_of_the_cast_formulation() {
        let strided = (0..=u32::MAX / 997).map(|i| f32::from_bits(i * 997));
        let edges = [-87.3f32, 88.7, -87.0, 88.0, 0.0, -0.0, 1e-30, -1e-30]
            .into_iter()
            .flat_map(|e| {
                (-64i32..=64).map(move |d| f32::from_bits(e.to_bits().wrapping_add_signed(d)))
            });
        let specials = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN];
        for x in strided.chain(edges).chain(specials) {
            assert_eq!(
                exp(x).to_bits(),
                exp_with_cast(x).to_bits(),
                "x = {x:e} ({:#010x})",
                x.to_bits()
            );
        }
    }

    #[test]
    fn tanh_matches_libm() {
        let mut worst = 0f32;
        let mut x = -12.0f32;
        while x < 12.0 {
            let err = (tanh(x) - x.tanh()).abs() / x.tanh().abs().max(1e-30);
            worst = worst.max(err);
            x += 0.000_731;
        }
        assert!(worst < 2e-6, "worst relative error {worst}");
        assert_eq!(tanh(0.0), 0.0);
        assert_eq!(tanh(20.0), 1.0);
        assert_eq!(tanh(-20.0), -1.0);
    }
}
