//! The code books: NF4 and FP4 (16 entries, bitsandbytes' `get_4bit_type`), the signed 8-bit
//! dynamic map of the double quantization (`create_dynamic_map(signed=True)`), and the
//! encoders that choose a code exactly as bitsandbytes' CPU path does.

use std::sync::OnceLock;

use crate::QuantError;

/// Which 4-bit code book a tensor uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// NormalFloat4: quantiles of N(0, 1) normalised to [-1, 1] (QLoRA), sorted.
    Nf4,
    /// bitsandbytes' 4-bit float (1 sign, 2 exponent, 1 mantissa bit, bias 2), divided by its
    /// largest magnitude (12); entries are in bit-pattern order, not sorted.
    Fp4,
}

/// NF4 as bitsandbytes lists it: its Python (f64) literals rounded to f32, as `torch.tensor` does.
pub const NF4_CODE: [f32; 16] = [
    -1.0_f64 as f32,
    -0.6961928009986877_f64 as f32,
    -0.5250730514526367_f64 as f32,
    -0.39491748809814453_f64 as f32,
    -0.28444138169288635_f64 as f32,
    -0.18477343022823334_f64 as f32,
    -0.09105003625154495_f64 as f32,
    0.0_f64 as f32,
    0.07958029955625534_f64 as f32,
    0.16093020141124725_f64 as f32,
    0.24611230194568634_f64 as f32,
    0.33791524171829224_f64 as f32,
    0.44070982933044434_f64 as f32,
    0.5626170039176941_f64 as f32,
    0.7229568362236023_f64 as f32,
    1.0_f64 as f32,
];

/// FP4 as bitsandbytes computes it: `[0, 0.0625, 8, 12, 4, 6, 2, 3]` and their negations,
/// each divided by 12 in f32 (so `0.0625 / 12` and `8 / 12` carry f32 division's rounding).
/// Code 8 ("-0") is +0.0: bitsandbytes writes it as the Python integer `-0`, which is 0.
pub const FP4_CODE: [f32; 16] = [
    0.0,
    0.0625 / 12.0,
    8.0 / 12.0,
    1.0,
    4.0 / 12.0,
    6.0 / 12.0,
    2.0 / 12.0,
    3.0 / 12.0,
    0.0,
    -0.0625 / 12.0,
    -8.0 / 12.0,
    -1.0,
    -4.0 / 12.0,
    -6.0 / 12.0,
    -2.0 / 12.0,
    -3.0 / 12.0,
];

/// FP4 as bitsandbytes' CPU `dequantize_4bit` kernel decodes it: the same values, but code 8
/// is -0.0 (the kernel builds the value from the sign bit). bitsandbytes uses that kernel when
/// the tensor's last dimension is even and its Python fallback, with [`FP4_CODE`], otherwise;
/// [`QuantizedTensor::dequantize`](crate::QuantizedTensor::dequantize) does the same, so its
/// zeros carry bitsandbytes' signs.
pub const FP4_DEQUANT_CODE: [f32; 16] = {
    let mut c = FP4_CODE;
    c[8] = -0.0;
    c
};

/// FP4 codes in ascending order of value, as torch's `argsort` orders them (the tie between
/// the two zeros, codes 0 and 8, puts code 0 first, so a value in `(-ε, 0]` encodes as 0 and
/// one in `(0, ε]` as 8, as bitsandbytes does).
const FP4_ORDER: [u8; 16] = [11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3];

impl QuantType {
    /// The 16 code values, indexed by the 4-bit code.
    pub const fn code(self) -> &'static [f32; 16] {
        match self {
            QuantType::Nf4 => &NF4_CODE,
            QuantType::Fp4 => &FP4_CODE,
        }
    }

    /// bitsandbytes' name: `"nf4"` or `"fp4"`.
    pub const fn name(self) -> &'static str {
        match self {
            QuantType::Nf4 => "nf4",
            QuantType::Fp4 => "fp4",
        }
    }

    /// Parse bitsandbytes' name.
    pub fn from_name(name: &str) -> Result<Self, QuantError> {
        match name {
            "nf4" => Ok(QuantType::Nf4),
            "fp4" => Ok(QuantType::Fp4),
            other => Err(QuantError::UnknownQuantType(
                other.chars().take(64).collect(),
            )),
        }
    }

    fn order(self) -> [u8; 16] {
        match self {
            QuantType::Nf4 => std::array::from_fn(|i| i as u8),
            QuantType::Fp4 => FP4_ORDER,
        }
    }
}

/// Encoder for one 4-bit code book: the 15 midpoints between consecutive sorted values and the
/// code of each interval.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Encoder4 {
    bounds: [f32; 15],
    codes: [u8; 16],
}

impl Encoder4 {
    pub(crate) fn new(qt: QuantType) -> Self {
        let order = qt.order();
        let code = qt.code();
        // f32 midpoints of neighbours in value order, `(a + b) / 2`, as torch computes them.
        let bounds =
            std::array::from_fn(|i| (code[order[i] as usize] + code[order[i + 1] as usize]) / 2.0);
        Encoder4 {
            bounds,
            codes: order,
        }
    }

    /// The code of a scaled value in [-1, 1]: `torch.bucketize(x, bounds)` (the number of
    /// bounds strictly below `x`), mapped through the sort order.
    #[inline(always)]
    pub(crate) fn encode(&self, x: f32) -> u8 {
        let mut i = 0usize;
        for b in &self.bounds {
            i += (*b < x) as usize;
        }
        self.codes[i]
    }
}

/// Bit patterns of bitsandbytes' `create_dynamic_map(signed=True)` (7 decades of linearly
/// spaced magnitudes, both signs, 0 and 1, sorted). bitsandbytes builds it from torch's f32
/// `linspace`, whose vectorised rounding is not worth reproducing; the values are its output,
/// pinned by the fixture test and checked against the defining formula in this module's tests.
const DYNAMIC_SIGNED_BITS: [u32; 256] = [
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
];

/// The signed 8-bit dynamic code map the double quantization uses for the absmax values.
pub fn dynamic_map_signed() -> &'static [f32; 256] {
    static MAP: OnceLock<[f32; 256]> = OnceLock::new();
    MAP.get_or_init(|| std::array::from_fn(|i| f32::from_bits(DYNAMIC_SIGNED_BITS[i])))
}

/// Size of bitsandbytes' 8-bit lookup table: the range [-1, 1] in 65 536 steps.
const LUT_SIZE: usize = 65_536;

/// bitsandbytes' CPU 8-bit encoder (`quantize_blockwise` on the CPU): a scaled value in
/// [-1, 1] is snapped to one of 65 536 evenly spaced points, and each point has the code whose
/// midpoint interval holds it. It is not always the nearest code (values within about 3e-5 of
/// zero land a few codes away), which is why it is reproduced rather than replaced by a
/// nearest-value search.
pub(crate) struct Encoder8 {
    lut: Vec<u8>,
}

impl Encoder8 {
    pub(crate) fn new(code: &[f32; 256]) -> Self {
        let mut mid = [0f32; 255];
        for (i, m) in mid.iter_mut().enumerate() {
            *m = 0.5 * (code[i] + code[i + 1]);
        }
        let mut lut = Vec::with_capacity(LUT_SIZE);
        let mut idx = 0usize;
        for i in 0..LUT_SIZE {
            let v = -1.0f32 + (2.0f32 * i as f32) / (LUT_SIZE - 1) as f32;
            while idx < 255 && mid[idx] < v {
                idx += 1;
            }
            lut.push(idx as u8);
        }
        Encoder8 { lut }
    }

    /// The encoder of [`dynamic_map_signed`], built once.
    pub(crate) fn dynamic() -> &'static Encoder8 {
        static ENC: OnceLock<Encoder8> = OnceLock::new();
        ENC.get_or_init(|| Encoder8::new(dynamic_map_signed()))
    }

    #[inline(always)]
    pub(crate) fn encode(&self, x: f32) -> u8 {
        let v = x.clamp(-1.0, 1.0);
        // Truncation, as C's float → uint16 conversion; `v` in [-1, 1] keeps it in range.
        let i = ((v + 1.0) * 0.5 * (LUT_SIZE - 1) as f32 + 0.5) as usize;
        self.lut[i.min(LUT_SIZE - 1)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_map_is_sorted_and_follows_its_formula() {
        let m = dynamic_map_signed();
        assert!(m.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(m[127], 0.0);
        assert_eq!(m[255], 1.0);
        // Decade i holds 2^i midpoints of equal bins of [0.1, 1], scaled by 10^(i-6).
        let mut want = Vec::new();
        for i in 0..7i32 {
            let n = 1usize << i;
            for k in 0..n {
                let lo = 0.1 + 0.9 * k as f64 / n as f64;
                let hi = 0.1 + 0.9 * (k + 1) as f64 / n as f64;
                let v = 10f64.powi(i - 6) * (lo + hi) / 2.0;
                want.push(v);
                want.push(-v);
            }
        }
        want.push(0.0);
        want.push(1.0);
        want.sort_by(|a, b| a.partial_cmp(b).unwrap());
        for (got, want) in m.iter().zip(&want) {
            assert!(
                (*got as f64 - want).abs() <= want.abs() * 1e-6,
                "{got} {want}"
            );
        }
    }

    #[test]
    fn four_bit_encoder_picks_the_nearest_code_and_ties_go_down() {
        for qt in [QuantType::Nf4, QuantType::Fp4] {
            let e = Encoder4::new(qt);
            let code = qt.code();
            for (c, &v) in code.iter().enumerate() {
                let got = e.encode(v);
                assert_eq!(code[got as usize], v, "{qt:?} code {c}");
            }
            for i in 0..=2000 {
                let x = -1.0 + i as f32 / 1000.0;
                let got = code[e.encode(x) as usize];
                let best = code
                    .iter()
                    .map(|c| (c - x).abs())
                    .fold(f32::INFINITY, f32::min);
                assert!((got - x).abs() <= best + 1e-7, "{qt:?} {x}");
            }
        }
        let fp4 = Encoder4::new(QuantType::Fp4);
        assert_eq!(fp4.encode(0.0), 0);
        assert_eq!(fp4.encode(1e-4), 8);
    }

    #[test]
    fn eight_bit_encoder_is_close_to_nearest() {
        let e = Encoder8::dynamic();
        let m = dynamic_map_signed();
        assert_eq!(e.encode(1.0), 255);
        assert_eq!(e.encode(-1.0), 0);
        for i in 0..=4000 {
            let x = -1.0 + i as f32 / 2000.0;
            let got = m[e.encode(x) as usize];
            assert!((got - x).abs() <= 0.02, "{x} -> {got}");
        }
    }
}
