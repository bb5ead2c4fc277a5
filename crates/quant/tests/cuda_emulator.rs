//! The quant4 CUDA kernels run on the CPU: their own source (`headroom_kernels::QUANT4`),
//! compiled by a C++ compiler against a minimal host emulation of what they use (thread and
//! block indices, grid-stride loops, `__fmul_rn`/`__fadd_rn` as plain IEEE operations with
//! `-ffp-contract=off`), and checked bit for bit against headroom-quant's CPU dequantization:
//! the double-quantized absmax expansion, forward panels and backward strips (ragged last
//! tiles, rows that straddle blocks, odd shapes), and the column scatter.
//!
//! Grid-stride kernels need no barrier, so the emulation runs every (block, thread) pair in
//! turn, on a grid smaller than the data so the stride loop is exercised. It cannot show
//! timing or device-specific rounding (there is none here: one multiply and one add, each
//! rounded). Skipped with a message when no C++ compiler is found (`$CXX`, `c++`, `g++`,
//! `clang++`), unless `HEADROOM_REQUIRE_CXX=1`.

#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};
use std::process::Command;

use headroom_quant::{BlockSize, MatmulOptions, QuantConfig, QuantType, QuantizedTensor};
use headroom_tensor::Cpu;

const HOST_CUDA: &str = r#"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
static dim3 threadIdx, blockIdx, blockDim, gridDim;
#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__ __restrict
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline unsigned __float_as_uint(float v) { unsigned u; memcpy(&u, &v, 4); return u; }
static inline float __uint_as_float(unsigned v) { float f; memcpy(&f, &v, 4); return f; }
static inline int __float_as_int(float v) { int u; memcpy(&u, &v, 4); return u; }
static inline float __int_as_float(int v) { float f; memcpy(&f, &v, 4); return f; }
static inline int __clz(unsigned v) { return v == 0 ? 32 : __builtin_clz(v); }
"#;

/// Reads `in.bin` (sizes and buffers written by the test), runs the kernels on a small grid and
/// writes `out.bin`.
const DRIVER: &str = r#"
template <class F> static void launch(unsigned blocks, unsigned threads, F f) {
    gridDim = dim3{blocks, 1, 1};
    blockDim = dim3{threads, 1, 1};
    for (unsigned b = 0; b < blocks; ++b)
        for (unsigned t = 0; t < threads; ++t) {
            blockIdx = dim3{b, 0, 0};
            threadIdx = dim3{t, 0, 0};
            f();
        }
}
template <class T> static std::vector<T> read_vec(FILE* f) {
    unsigned long long n; if (fread(&n, 8, 1, f) != 1) exit(2);
    std::vector<T> v(n); if (n && fread(v.data(), sizeof(T), n, f) != n) exit(3); return v;
}
static unsigned long long read_u64(FILE* f) { unsigned long long v; if (fread(&v, 8, 1, f) != 1) exit(4); return v; }
template <class T> static void write_vec(FILE* f, const std::vector<T>& v) {
    unsigned long long n = v.size(); fwrite(&n, 8, 1, f); fwrite(v.data(), sizeof(T), n, f);
}
int main(int argc, char** argv) {
    FILE* in = fopen(argv[1], "rb"); FILE* out = fopen(argv[2], "wb");
    if (!in || !out) return 1;
    auto codes = read_vec<unsigned char>(in);
    auto table = read_vec<float>(in);
    auto absmax = read_vec<float>(in);            // plain f32 absmax, or empty
    auto qabsmax = read_vec<unsigned char>(in);   // double quantization, or empty
    auto code2 = read_vec<float>(in);
    auto absmax2 = read_vec<float>(in);
    float offset; if (fread(&offset, 4, 1, in) != 1) return 5;
    unsigned long long rows = read_u64(in), cols = read_u64(in), bs = read_u64(in);
    unsigned long long pr = read_u64(in), pc = read_u64(in), n = read_u64(in);
    unsigned long long blocks = (rows * cols + bs - 1) / bs;
    if (!qabsmax.empty()) {
        absmax.assign(blocks, 0.0f);
        launch(3, 32, [&] { quant4_absmax_dq_f32(qabsmax.data(), code2.data(), absmax2.data(), offset, blocks, absmax.data()); });
    }
    write_vec(out, absmax);
    // Forward panels, each scattered into the columns of a [n, rows] output (the panel's
    // [n, rows] product is emulated by copying the panel's first n rows' worth of values).
    std::vector<float> fwd(rows * cols, -1.0f);
    for (unsigned long long r0 = 0; r0 < rows; r0 += pr) {
        unsigned long long nr = pr < rows - r0 ? pr : rows - r0;
        std::vector<float> tile(nr * cols);
        launch(2, 64, [&] { quant4_dequant_tile_f32(codes.data(), absmax.data(), table.data(), r0, nr, cols, 0, cols, bs, tile.data()); });
        std::copy(tile.begin(), tile.end(), fwd.begin() + r0 * cols);
    }
    write_vec(out, fwd);
    // Backward strips, each scattered into its columns of a [rows, cols] matrix.
    std::vector<float> bwd(rows * cols, -1.0f);
    for (unsigned long long c0 = 0; c0 < cols; c0 += pc) {
        unsigned long long w = pc < cols - c0 ? pc : cols - c0;
        std::vector<float> tile(rows * w);
        launch(2, 64, [&] { quant4_dequant_tile_f32(codes.data(), absmax.data(), table.data(), 0, rows, cols, c0, w, bs, tile.data()); });
        launch(1, 32, [&] { quant4_scatter_cols_f32(tile.data(), rows, w, bwd.data(), cols, c0); });
    }
    write_vec(out, bwd);
    (void)n;
    fclose(out);
    return 0;
}
"#;

fn compiler() -> Option<String> {
    let mut candidates = std::env::var("CXX")
        .ok()
        .into_iter()
        .chain(["c++", "g++", "clang++"].map(String::from));
    candidates.find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("headroom-quant-emu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn build(dir: &Path) -> Option<PathBuf> {
    let Some(cxx) = compiler() else {
        let required = std::env::var("HEADROOM_REQUIRE_CXX").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "HEADROOM_REQUIRE_CXX=1 but no C++ compiler was found"
        );
        eprintln!("cuda_emulator: skipped: no C++ compiler");
        return None;
    };
    let src = dir.join("quant4_emu.cpp");
    let source = format!("{HOST_CUDA}\n{}\n{DRIVER}", headroom_kernels::QUANT4.source);
    std::fs::write(&src, source).unwrap();
    let exe = dir.join("quant4_emu");
    let out = Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-ffp-contract=off", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "compiling the emulated kernels failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(exe)
}

fn put<T: Copy>(buf: &mut Vec<u8>, v: &[T], to_bytes: impl Fn(T) -> Vec<u8>) {
    buf.extend((v.len() as u64).to_le_bytes());
    for &x in v {
        buf.extend(to_bytes(x));
    }
}

fn take_f32(bytes: &[u8], pos: &mut usize) -> Vec<f32> {
    let n = u64::from_le_bytes(bytes[*pos..*pos + 8].try_into().unwrap()) as usize;
    *pos += 8;
    let v = bytes[*pos..*pos + 4 * n]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    *pos += 4 * n;
    v
}

#[test]
fn quant4_kernels_dequantize_bit_for_bit_like_the_cpu() {
    let dir = scratch();
    let Some(exe) = build(&dir) else { return };
    let cpu = Cpu::new();
    let mut cases = 0;
    for (qt, bs, double, rows, cols) in [
        (QuantType::Nf4, 64, true, 37, 70),
        (QuantType::Fp4, 32, false, 9, 33),
        (QuantType::Fp4, 128, true, 20, 300),
        (QuantType::Nf4, 4096, false, 3, 5),
        (QuantType::Nf4, 32, true, 300, 40),
    ] {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1999) as f32 / 400.0 - 2.5)
            .collect();
        let config = QuantConfig {
            quant_type: qt,
            blocksize: BlockSize::new(bs).unwrap(),
            double_quant: double,
        };
        let q = QuantizedTensor::quantize(&cpu, &w, &[rows, cols], config).unwrap();
        let opts = MatmulOptions {
            panel_elements: 7 * cols, // several forward panels, a ragged last one
            ..MatmulOptions::default()
        };
        let (pr, pc) = (
            opts.forward_panel_rows(rows, cols),
            opts.backward_panel_cols(rows, cols).min(cols),
        );
        let mut input = Vec::new();
        put(&mut input, q.packed(), |b| vec![b]);
        put(&mut input, &q.dequant_table()[..], |x: f32| {
            x.to_le_bytes().to_vec()
        });
        let f32b = |x: f32| x.to_le_bytes().to_vec();
        match q.absmax_storage() {
            headroom_quant::AbsmaxStorage::Double(d) => {
                put(&mut input, &[] as &[f32], f32b);
                put(&mut input, d.codes(), |b| vec![b]);
                put(&mut input, d.code2(), f32b);
                put(&mut input, d.absmax2(), f32b);
                input.extend(d.offset().to_le_bytes());
            }
            _ => {
                put(&mut input, &q.absmax_f32(), f32b);
                put(&mut input, &[] as &[u8], |b| vec![b]);
                put(&mut input, &[] as &[f32], f32b);
                put(&mut input, &[] as &[f32], f32b);
                input.extend(0f32.to_le_bytes());
            }
        }
        for v in [rows, cols, bs as usize, pr, pc, 1] {
            input.extend((v as u64).to_le_bytes());
        }
        let (inp, outp) = (dir.join("in.bin"), dir.join("out.bin"));
        std::fs::write(&inp, &input).unwrap();
        let status = Command::new(&exe).arg(&inp).arg(&outp).status().unwrap();
        assert!(status.success(), "emulator exited with {status}");
        let out = std::fs::read(&outp).unwrap();
        let mut pos = 0;
        let absmax = take_f32(&out, &mut pos);
        let fwd = take_f32(&out, &mut pos);
        let bwd = take_f32(&out, &mut pos);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&absmax),
            bits(&q.absmax_f32()),
            "{qt:?} b{bs} dq={double}: absmax"
        );
        let want = bits(&q.dequantize());
        assert_eq!(bits(&fwd), want, "{qt:?} b{bs} dq={double}: forward panels");
        assert_eq!(
            bits(&bwd),
            want,
            "{qt:?} b{bs} dq={double}: backward strips"
        );
        cases += 1;
    }
    assert_eq!(cases, 5);
    let _ = std::fs::remove_dir_all(&dir);
}
