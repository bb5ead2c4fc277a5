//! [`QuantizedTensor`]: a 4-bit tensor in bitsandbytes' layout, its quantization, validation
//! and dequantization.

use half::bf16;
use headroom_tensor::{Backend, Cpu, CpuTensor, MemoryCategory};
use rayon::prelude::*;

use crate::codebook::{dynamic_map_signed, Encoder4, Encoder8, QuantType, FP4_DEQUANT_CODE};
use crate::dequant::{decode_segment, decode_segment_bf16, Isa};
use crate::torch_sum::torch_mean_f32;
use crate::{QuantError, Result};

/// Blocks of the second-level (double) quantization: 256 absmax values share one f32 absmax.
pub const NESTED_BLOCKSIZE: usize = 256;

/// Largest element count a quantized tensor may have: its f32 dequantization must be
/// addressable in bytes.
const MAX_ELEMENTS: u64 = (isize::MAX as u64) / 4;

/// A block size of the first-level quantization: a power of two in 32..=4096 (bitsandbytes'
/// choices). [`BlockSize::default`] is 64.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockSize(u32);

impl BlockSize {
    /// The smallest block size.
    pub const MIN: usize = 32;
    /// The largest block size.
    pub const MAX: usize = 4096;

    /// A validated block size.
    pub fn new(n: u64) -> Result<Self> {
        if n.is_power_of_two() && (Self::MIN as u64..=Self::MAX as u64).contains(&n) {
            Ok(BlockSize(n as u32))
        } else {
            Err(QuantError::InvalidBlockSize(n))
        }
    }

    /// The number of elements per block.
    pub const fn get(self) -> usize {
        self.0 as usize
    }
}

impl Default for BlockSize {
    fn default() -> Self {
        BlockSize(64)
    }
}

/// How to quantize: code book, block size and whether to double-quantize the absmax values
/// (bitsandbytes' `compress_statistics`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QuantConfig {
    /// NF4 or FP4.
    pub quant_type: QuantType,
    /// Elements per absmax block.
    pub blocksize: BlockSize,
    /// Quantize the absmax values to 8 bits in blocks of [`NESTED_BLOCKSIZE`].
    pub double_quant: bool,
}

impl QuantConfig {
    /// NF4, block 64, double quantization: QLoRA's storage.
    pub fn qlora() -> Self {
        QuantConfig {
            quant_type: QuantType::Nf4,
            blocksize: BlockSize::default(),
            double_quant: true,
        }
    }

    /// The bytes [`QuantizedTensor::stored_bytes`] reports for `numel` elements quantized with
    /// this configuration, without quantizing anything (what an estimator needs): the packed
    /// codes, then one f32 scale per block — or, double-quantized, one u8 code per block, one
    /// f32 per [`NESTED_BLOCKSIZE`] codes and the 256-entry f32 code map.
    pub fn stored_bytes(&self, numel: usize) -> usize {
        let blocks = numel.div_ceil(self.blocksize.get());
        let scales = if self.double_quant {
            blocks + blocks.div_ceil(NESTED_BLOCKSIZE) * 4 + 256 * 4
        } else {
            blocks * 4
        };
        numel.div_ceil(2) + scales
    }
}

/// The per-block scales as stored: f32, or 8-bit codes with an offset and second-level scales.
#[derive(Debug)]
pub enum AbsmaxStorage {
    /// One f32 absmax per block.
    Plain(CpuTensor),
    /// bitsandbytes' double quantization.
    Double(Box<DoubleQuant>),
}

/// Double-quantized absmax values: `absmax[b] = code2[codes[b]] · absmax2[b / 256] + offset`,
/// each operation rounded to f32.
#[derive(Debug)]
pub struct DoubleQuant {
    codes: CpuTensor,
    offset: f32,
    absmax2: CpuTensor,
    code2: CpuTensor,
}

impl DoubleQuant {
    /// One 8-bit code per first-level block.
    pub fn codes(&self) -> &[u8] {
        self.codes.as_bytes()
    }

    /// The mean that was subtracted from the absmax values before quantizing them.
    pub fn offset(&self) -> f32 {
        self.offset
    }

    /// One f32 scale per 256 codes (a short tail gets its own).
    pub fn absmax2(&self) -> &[f32] {
        self.absmax2.as_slice::<f32>().unwrap_or(&[])
    }

    /// The 256-entry code map of the codes (bitsandbytes' signed dynamic map).
    pub fn code2(&self) -> &[f32] {
        self.code2.as_slice::<f32>().unwrap_or(&[])
    }

    #[inline(always)]
    fn absmax(&self, block: usize) -> f32 {
        let code2 = self.code2();
        let q = self.codes()[block] as usize;
        code2[q] * self.absmax2()[block / NESTED_BLOCKSIZE] + self.offset
    }
}

/// A tensor in bitsandbytes' blockwise 4-bit layout.
///
/// Elements are taken in row-major order and cut into blocks of `blocksize` (the last one may
/// be shorter); each block stores its absolute maximum, each element the 4-bit code of
/// `x / absmax`, two per byte, the first in the high nibble (an odd count pads the last low
/// nibble with the code of 0). Every buffer is allocated through the backend, as
/// [`MemoryCategory::Parameters`], at its exact packed size.
#[derive(Debug)]
pub struct QuantizedTensor {
    shape: Vec<usize>,
    numel: usize,
    quant_type: QuantType,
    blocksize: BlockSize,
    codes: CpuTensor,
    absmax: AbsmaxStorage,
}

/// Borrowed parts of a quantized tensor, for [`QuantizedTensor::from_parts`].
#[derive(Clone, Copy, Debug)]
pub struct QuantParts<'a> {
    /// Packed codes, `ceil(numel / 2)` bytes.
    pub codes: &'a [u8],
    /// The scales.
    pub absmax: AbsmaxParts<'a>,
    /// The tensor's shape (row-major).
    pub shape: &'a [u64],
    /// Elements per block (validated).
    pub blocksize: u64,
    /// NF4 or FP4.
    pub quant_type: QuantType,
}

/// Borrowed scales, plain or double-quantized.
#[derive(Clone, Copy, Debug)]
pub enum AbsmaxParts<'a> {
    /// One non-negative finite f32 per block.
    Plain(&'a [f32]),
    /// Double quantization.
    Double {
        /// One code per block.
        codes: &'a [u8],
        /// The subtracted mean.
        offset: f32,
        /// One scale per 256 codes.
        absmax2: &'a [f32],
        /// The 256-entry code map (bitsandbytes' signed dynamic map).
        code2: &'a [f32],
    },
}

fn checked_numel(shape: &[u64]) -> Result<usize> {
    if shape.is_empty() {
        return Err(QuantError::EmptyShape(Vec::new()));
    }
    let mut n: u64 = 1;
    for &d in shape {
        n = n
            .checked_mul(d)
            .ok_or(QuantError::SizeOverflow("element count"))?;
    }
    if n == 0 {
        return Err(QuantError::EmptyShape(shape.to_vec()));
    }
    if n > MAX_ELEMENTS {
        return Err(QuantError::SizeOverflow("element count"));
    }
    usize::try_from(n).map_err(|_| QuantError::SizeOverflow("element count"))
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected != got {
        return Err(QuantError::LengthMismatch {
            what,
            expected: expected as u64,
            got: got as u64,
        });
    }
    Ok(())
}

fn check_finite(what: &'static str, x: &[f32]) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(QuantError::NonFinite {
            what,
            index: i as u64,
            value: x[i],
        }),
        None => Ok(()),
    }
}

/// Allocate `data`'s copy as a `Parameters` tensor.
fn param_u8(cpu: &Cpu, data: &[u8]) -> Result<CpuTensor> {
    let _p = MemoryCategory::Parameters.enter();
    Ok(cpu.upload(data, [data.len()])?)
}

fn param_f32(cpu: &Cpu, data: &[f32]) -> Result<CpuTensor> {
    let _p = MemoryCategory::Parameters.enter();
    Ok(cpu.upload(data, [data.len()])?)
}

/// f32 value of torch's `clamp(min=1e-38)` bound (a subnormal).
const ABSMAX_FLOOR: f32 = 1e-38_f64 as f32;

impl QuantizedTensor {
    /// Quantize `data` (row-major, `shape`) exactly as bitsandbytes' `quantize_4bit` does on
    /// the CPU: the same packed bytes, absmax values (and with double quantization the same
    /// 8-bit codes, offset and second-level absmax). Non-finite input is an error.
    pub fn quantize(cpu: &Cpu, data: &[f32], shape: &[usize], config: QuantConfig) -> Result<Self> {
        let shape64: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let numel = checked_numel(&shape64)?;
        check_len("input", numel, data.len())?;
        check_finite("input", data)?;
        let bs = config.blocksize.get();
        let blocks = numel.div_ceil(bs);
        let enc = Encoder4::new(config.quant_type);

        let mut packed = vec![0u8; numel.div_ceil(2)];
        let mut absmax = vec![0f32; blocks];
        // Blocks hold an even number of elements, so each one owns whole bytes.
        cpu.install(|| {
            packed
                .par_chunks_mut(bs / 2)
                .zip(absmax.par_iter_mut())
                .zip(data.par_chunks(bs))
                .for_each(|((bytes, am), x)| *am = quantize_block(&enc, x, bs, bytes));
        });

        let storage = if config.double_quant {
            let (codes, offset, absmax2) = double_quantize(&absmax);
            AbsmaxParts::Double {
                codes: &codes,
                offset,
                absmax2: &absmax2,
                code2: &dynamic_map_signed()[..],
            }
            .allocate(cpu)?
        } else {
            AbsmaxStorage::Plain(param_f32(cpu, &absmax)?)
        };
        Ok(QuantizedTensor {
            shape: shape.to_vec(),
            numel,
            quant_type: config.quant_type,
            blocksize: config.blocksize,
            codes: param_u8(cpu, &packed)?,
            absmax: storage,
        })
    }

    /// A quantized tensor from its parts (as bitsandbytes stores them), validated: the block
    /// size, every length against the shape, finite non-negative absmax values, the code map.
    /// Nothing is allocated before the lengths are known to agree.
    pub fn from_parts(cpu: &Cpu, parts: QuantParts<'_>) -> Result<Self> {
        let blocksize = BlockSize::new(parts.blocksize)?;
        let numel = checked_numel(parts.shape)?;
        let shape = parts
            .shape
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| QuantError::SizeOverflow("dimension")))
            .collect::<Result<Vec<_>>>()?;
        check_len("packed codes", numel.div_ceil(2), parts.codes.len())?;
        let blocks = numel.div_ceil(blocksize.get());
        parts.absmax.validate(blocks)?;
        Ok(QuantizedTensor {
            shape,
            numel,
            quant_type: parts.quant_type,
            blocksize,
            codes: param_u8(cpu, parts.codes)?,
            absmax: parts.absmax.allocate(cpu)?,
        })
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// NF4 or FP4.
    pub fn quant_type(&self) -> QuantType {
        self.quant_type
    }

    /// Elements per block.
    pub fn blocksize(&self) -> BlockSize {
        self.blocksize
    }

    /// Number of first-level blocks.
    pub fn num_blocks(&self) -> usize {
        self.numel.div_ceil(self.blocksize.get())
    }

    /// The packed codes, two per byte, first element in the high nibble.
    pub fn packed(&self) -> &[u8] {
        self.codes.as_bytes()
    }

    /// The stored scales.
    pub fn absmax_storage(&self) -> &AbsmaxStorage {
        &self.absmax
    }

    /// Whether the absmax values are double-quantized.
    pub fn is_double_quant(&self) -> bool {
        matches!(self.absmax, AbsmaxStorage::Double(_))
    }

    /// Bytes of every buffer this tensor holds (the packed codes, the scales and, with double
    /// quantization, the codes' map): what the allocation hook was told.
    pub fn stored_bytes(&self) -> usize {
        self.codes.as_bytes().len()
            + match &self.absmax {
                AbsmaxStorage::Plain(a) => a.as_bytes().len(),
                AbsmaxStorage::Double(d) => {
                    d.codes.as_bytes().len() + d.absmax2.as_bytes().len() + d.code2.as_bytes().len()
                }
            }
    }

    /// Stored bits per element: `8 · stored_bytes / numel` (≈ 4.5 at block 64, ≈ 4.127 with
    /// double quantization, plus the 1 KiB code map).
    pub fn bits_per_parameter(&self) -> f64 {
        8.0 * self.stored_bytes() as f64 / self.numel as f64
    }

    /// The f32 absmax of block `b` (dequantized, with double quantization). `b` must be below
    /// [`num_blocks`](Self::num_blocks).
    #[inline(always)]
    pub(crate) fn block_absmax(&self, b: usize) -> f32 {
        match &self.absmax {
            AbsmaxStorage::Plain(a) => a.as_slice::<f32>().map_or(0.0, |s| s[b]),
            AbsmaxStorage::Double(d) => d.absmax(b),
        }
    }

    /// The 16 values codes decode to: the code book, except FP4 with an even last dimension,
    /// where code 8 decodes to -0.0 as in bitsandbytes' CPU kernel ([`FP4_DEQUANT_CODE`]).
    pub fn dequant_table(&self) -> &'static [f32; 16] {
        let even_rows = self.shape.last().is_some_and(|d| d % 2 == 0);
        match self.quant_type {
            QuantType::Fp4 if even_rows => &FP4_DEQUANT_CODE,
            qt => qt.code(),
        }
    }

    /// Every block's f32 absmax (dequantized, with double quantization), as bitsandbytes'
    /// `dequantize_4bit` computes it.
    pub fn absmax_f32(&self) -> Vec<f32> {
        (0..self.num_blocks())
            .map(|b| self.block_absmax(b))
            .collect()
    }

    /// The whole tensor in f32, bit-identical to bitsandbytes' `dequantize_4bit`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.numel];
        self.dequantize_range_with(Isa::detect(), 0, &mut out);
        out
    }

    /// Elements `start..start + out.len()` (row-major) in f32, with the fastest supported path.
    pub fn dequantize_range(&self, start: usize, out: &mut [f32]) -> Result<()> {
        self.dequantize_range_isa(Isa::detect(), start, out)
    }

    /// [`dequantize_range`](Self::dequantize_range) on a chosen path (to compare paths).
    pub fn dequantize_range_isa(&self, isa: Isa, start: usize, out: &mut [f32]) -> Result<()> {
        self.check_range(isa, start, out.len())?;
        self.dequantize_range_with(isa, start, out);
        Ok(())
    }

    /// Elements `start..start + out.len()` (row-major) rounded to bf16 (to nearest even): the
    /// bits of [`dequantize_range`](Self::dequantize_range)'s f32 values rounded, at half the
    /// bytes — what a bf16 product reads (bitsandbytes' `compute_dtype=bfloat16`).
    pub fn dequantize_range_bf16(&self, start: usize, out: &mut [bf16]) -> Result<()> {
        self.dequantize_range_bf16_isa(Isa::detect(), start, out)
    }

    /// [`dequantize_range_bf16`](Self::dequantize_range_bf16) on a chosen path.
    pub fn dequantize_range_bf16_isa(
        &self,
        isa: Isa,
        start: usize,
        out: &mut [bf16],
    ) -> Result<()> {
        self.check_range(isa, start, out.len())?;
        let (table, codes) = (self.dequant_table(), self.codes.as_bytes());
        for (done, seg, b) in self.segments(start, out.len()) {
            let out = &mut out[done..done + seg];
            decode_segment_bf16(isa, table, codes, start + done, out, self.block_absmax(b));
        }
        Ok(())
    }

    /// Elements `start..start + len` cut at block boundaries: `(offset in the range, length,
    /// block)` for each piece, in order.
    fn segments(&self, start: usize, len: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let bs = self.blocksize.get();
        let mut done = 0usize;
        std::iter::from_fn(move || {
            (done < len).then(|| {
                let i = start + done;
                let b = i / bs;
                let seg = ((b + 1) * bs - i).min(len - done);
                done += seg;
                (done - seg, seg, b)
            })
        })
    }

    /// `isa` supported and `start..start + len` inside the tensor.
    fn check_range(&self, isa: Isa, start: usize, len: usize) -> Result<()> {
        if !isa.is_supported() {
            return Err(QuantError::UnsupportedIsa(isa.name()));
        }
        let end = start
            .checked_add(len)
            .ok_or(QuantError::SizeOverflow("range"))?;
        if end > self.numel {
            return Err(QuantError::ShapeMismatch {
                op: "dequantize_range",
                detail: format!("elements {start}..{end} of a tensor of {}", self.numel),
            });
        }
        Ok(())
    }

    /// The unchecked body: `isa` supported, the range inside the tensor.
    pub(crate) fn dequantize_range_with(&self, isa: Isa, start: usize, out: &mut [f32]) {
        let (table, codes) = (self.dequant_table(), self.codes.as_bytes());
        for (done, seg, b) in self.segments(start, out.len()) {
            let out = &mut out[done..done + seg];
            decode_segment(isa, table, codes, start + done, out, self.block_absmax(b));
        }
    }
}

/// [`QuantizedTensor::quantize`] fed a chunk at a time, so a weight streamed from a file (or
/// drawn by an initialiser) is quantized without ever existing whole in f32: the same bytes,
/// absmax values and double-quantization parts, whatever the chunks.
///
/// The packed codes and the f32 absmax values are `Parameters` tensors from the start; with
/// double quantization the f32 absmax values are compressed at [`finish`](Self::finish) and
/// freed, so the most this holds beyond the result is those `4 · blocks` bytes and one
/// partial block.
pub struct Quantizer {
    cpu: Cpu,
    shape: Vec<usize>,
    numel: usize,
    config: QuantConfig,
    enc: Encoder4,
    codes: CpuTensor,
    absmax: CpuTensor,
    /// The values of the block the last chunk began and did not end (fewer than a block).
    pending: Vec<f32>,
    /// Elements received so far.
    filled: usize,
}

impl Quantizer {
    /// A quantizer for a tensor of `shape` (row-major); nothing is allocated unless the
    /// shape's size is valid.
    pub fn new(cpu: &Cpu, shape: &[usize], config: QuantConfig) -> Result<Self> {
        let shape64: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let numel = checked_numel(&shape64)?;
        let blocks = numel.div_ceil(config.blocksize.get());
        let _p = MemoryCategory::Parameters.enter();
        let codes = cpu.zeros([numel.div_ceil(2)], headroom_tensor::DType::U8)?;
        let absmax = cpu.zeros([blocks], headroom_tensor::DType::F32)?;
        Ok(Quantizer {
            cpu: cpu.clone(),
            shape: shape.to_vec(),
            numel,
            config,
            enc: Encoder4::new(config.quant_type),
            codes,
            absmax,
            pending: Vec::new(),
            filled: 0,
        })
    }

    /// The next `values` of the tensor, in row-major order. More values than the shape holds,
    /// or a non-finite one, is an error (its index counted from the tensor's start).
    pub fn push(&mut self, values: &[f32]) -> Result<()> {
        if values.len() > self.numel - self.filled {
            return Err(QuantError::LengthMismatch {
                what: "input",
                expected: self.numel as u64,
                got: (self.filled + values.len()) as u64,
            });
        }
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(QuantError::NonFinite {
                what: "input",
                index: (self.filled + i) as u64,
                value: values[i],
            });
        }
        let bs = self.config.blocksize.get();
        // Elements before `done` are quantized; `pending` holds those from `done` on.
        let mut done = self.filled - self.pending.len();
        self.filled += values.len();
        let mut rest = values;
        if !self.pending.is_empty() {
            let take = (bs - self.pending.len()).min(rest.len());
            self.pending.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if self.pending.len() < bs {
                return Ok(());
            }
            let block = done / bs;
            let bytes = &mut self.codes.as_mut_slice::<u8>()?[done / 2..][..bs / 2];
            let am = quantize_block(&self.enc, &self.pending, bs, bytes);
            self.absmax.as_mut_slice::<f32>()?[block] = am;
            self.pending.clear();
            done += bs;
        }
        let whole = rest.len() / bs * bs;
        if whole > 0 {
            let (codes, absmax) = (&mut self.codes, &mut self.absmax);
            let bytes = &mut codes.as_mut_slice::<u8>()?[done / 2..][..whole / 2];
            let scales = &mut absmax.as_mut_slice::<f32>()?[done / bs..][..whole / bs];
            let enc = &self.enc;
            // Blocks hold an even number of elements, so each one owns whole bytes.
            self.cpu.install(|| {
                bytes
                    .par_chunks_mut(bs / 2)
                    .zip(scales.par_iter_mut())
                    .zip(rest[..whole].par_chunks(bs))
                    .for_each(|((bytes, am), x)| *am = quantize_block(enc, x, bs, bytes));
            });
        }
        self.pending.extend_from_slice(&rest[whole..]);
        Ok(())
    }

    /// The quantized tensor, once every element was pushed (fewer is an error).
    pub fn finish(mut self) -> Result<QuantizedTensor> {
        check_len("input", self.numel, self.filled)?;
        let bs = self.config.blocksize.get();
        if !self.pending.is_empty() {
            // The tail block: fewer than `bs` values, its bytes up to the end.
            let done = self.filled - self.pending.len();
            let bytes = &mut self.codes.as_mut_slice::<u8>()?[done / 2..];
            let am = quantize_block(&self.enc, &self.pending, bs, bytes);
            self.absmax.as_mut_slice::<f32>()?[done / bs] = am;
        }
        let absmax = if self.config.double_quant {
            let (codes, offset, absmax2) = double_quantize(self.absmax.as_slice::<f32>()?);
            AbsmaxParts::Double {
                codes: &codes,
                offset,
                absmax2: &absmax2,
                code2: &dynamic_map_signed()[..],
            }
            .allocate(&self.cpu)?
        } else {
            AbsmaxStorage::Plain(self.absmax)
        };
        Ok(QuantizedTensor {
            shape: self.shape,
            numel: self.numel,
            quant_type: self.config.quant_type,
            blocksize: self.config.blocksize,
            codes: self.codes,
            absmax,
        })
    }
}

/// Quantize one block into its bytes; returns the stored absmax. `bs` is the full block size,
/// so a shorter `x` is the tail block (bitsandbytes treats it differently: its absmax is
/// clamped to 1e-38 when stored, and it divides instead of multiplying by a reciprocal).
fn quantize_block(enc: &Encoder4, x: &[f32], bs: usize, bytes: &mut [u8]) -> f32 {
    let am = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if x.len() == bs {
        let recip = 1.0f32 / am.max(ABSMAX_FLOOR);
        pack(enc, x, bytes, |v| v * recip);
        am
    } else {
        let am = am.max(ABSMAX_FLOOR);
        pack(enc, x, bytes, |v| v / am);
        am
    }
}

/// Encode `scale(v)` (clamped to [-1, 1]) for each value, two per byte, high nibble first; a
/// missing last value is encoded as 0 (bitsandbytes pads the scaled values with 0).
#[inline(always)]
fn pack(enc: &Encoder4, x: &[f32], bytes: &mut [u8], scale: impl Fn(f32) -> f32) {
    let code = |v: Option<&f32>| enc.encode(v.map_or(0.0, |&v| scale(v).clamp(-1.0, 1.0)));
    for (k, byte) in bytes.iter_mut().enumerate() {
        *byte = (code(x.get(2 * k)) << 4) | code(x.get(2 * k + 1));
    }
}

/// bitsandbytes' `compress_statistics`: subtract torch's mean, then 8-bit blockwise
/// quantization in blocks of 256 (its CPU kernel). Returns (codes, offset, absmax2).
fn double_quantize(absmax: &[f32]) -> (Vec<u8>, f32, Vec<f32>) {
    let offset = torch_mean_f32(absmax);
    let enc = Encoder8::dynamic();
    let mut codes = vec![0u8; absmax.len()];
    let mut absmax2 = Vec::with_capacity(absmax.len().div_ceil(NESTED_BLOCKSIZE));
    for (src, dst) in absmax
        .chunks(NESTED_BLOCKSIZE)
        .zip(codes.chunks_mut(NESTED_BLOCKSIZE))
    {
        let am = src.iter().fold(0f32, |m, &v| m.max((v - offset).abs()));
        absmax2.push(am);
        if am == 0.0 {
            continue; // bitsandbytes writes code 0 for an all-zero block
        }
        let inv = 1.0f32 / am;
        for (c, &v) in dst.iter_mut().zip(src) {
            *c = enc.encode((v - offset) * inv);
        }
    }
    (codes, offset, absmax2)
}

impl AbsmaxParts<'_> {
    fn validate(&self, blocks: usize) -> Result<()> {
        match *self {
            AbsmaxParts::Plain(a) => {
                check_len("absmax", blocks, a.len())?;
                check_finite("absmax", a)?;
                if let Some(i) = a.iter().position(|v| *v < 0.0) {
                    return Err(QuantError::NegativeAbsmax {
                        index: i as u64,
                        value: a[i],
                    });
                }
            }
            AbsmaxParts::Double {
                codes,
                offset,
                absmax2,
                code2,
            } => {
                check_len("quantized absmax", blocks, codes.len())?;
                check_len(
                    "nested absmax",
                    blocks.div_ceil(NESTED_BLOCKSIZE),
                    absmax2.len(),
                )?;
                check_len("nested code map", 256, code2.len())?;
                check_finite("nested absmax", absmax2)?;
                check_finite("nested offset", &[offset])?;
                check_finite("nested code map", code2)?;
                if let Some(i) = absmax2.iter().position(|v| *v < 0.0) {
                    return Err(QuantError::NegativeAbsmax {
                        index: i as u64,
                        value: absmax2[i],
                    });
                }
            }
        }
        Ok(())
    }

    fn allocate(&self, cpu: &Cpu) -> Result<AbsmaxStorage> {
        Ok(match *self {
            AbsmaxParts::Plain(a) => AbsmaxStorage::Plain(param_f32(cpu, a)?),
            AbsmaxParts::Double {
                codes,
                offset,
                absmax2,
                code2,
            } => AbsmaxStorage::Double(Box::new(DoubleQuant {
                codes: param_u8(cpu, codes)?,
                offset,
                absmax2: param_f32(cpu, absmax2)?,
                code2: param_f32(cpu, code2)?,
            })),
        })
    }
}
