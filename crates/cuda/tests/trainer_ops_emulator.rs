//! The trainer-op kernels run on the CPU: their own CUDA C source (`headroom_kernels::
//! TRAINER_OPS`), compiled by a C++20 compiler against a minimal host emulation of the CUDA
//! features they use, and checked against the scalar references of `common/` with the same
//! claims as the GPU tests (bitwise where the GPU tests say bitwise).
//!
//! The emulation: every CUDA thread of a block is a `std::thread`, `__syncthreads` is a real
//! barrier (so the block reductions' synchronisation is exercised), blocks run one after
//! another (so a `static` is the block's `__shared__` memory), and the `__f*_rn` intrinsics
//! are plain IEEE binary32 operations compiled with `-ffp-contract=off` (what `--fmad=false`
//! gives on the GPU), `__fmaf_rn` the C library's `fmaf` (one rounding, as on the GPU). Kernels are called through a dispatch table generated from
//! `OP_LAUNCH_SIGNATURES`, so the recorded parameter lists are exercised too.
//!
//! This is the evidence a machine without a GPU gives that the kernels compute the ops:
//! indexing, grid-stride loops, tails, ownership in the scatters, chunked column sums, the
//! reductions' barriers and the bit-level formulas. It cannot show timing, a misunderstanding
//! of CUDA shared by the kernels and the emulation, or `logf`'s device rounding (host `logf`
//! here; cross-entropy is compared with a tolerance anyway). Skipped with a message when no
//! C++20 compiler with `<barrier>` is found (`$CXX`, `c++`, `g++`, `clang++`), unless
//! `HEADROOM_REQUIRE_CXX=1`.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use common::*;
use headroom_cuda::{
    AdamWStep, HeadLayout, ParamKind, StochasticRoundingKey, OP_LAUNCH_SIGNATURES,
};
use headroom_kernels::{
    BLOCK_REDUCE_PRELUDE, FLOAT_BITS_PRELUDE, PERMUTE_HEADS_UNITS, TRAINER_OPS,
};
use headroom_tensor::bf16;

/// The host stand-ins for the CUDA built-ins the kernels use.
const HOST_CUDA: &str = r#"
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>
#include <math.h>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__ __restrict
// Blocks run one at a time, so a function-local static is exactly the block's shared memory.
#define __shared__ static
static std::barrier<>* g_barrier;
static inline void __syncthreads() { g_barrier->arrive_and_wait(); }
static inline float __int_as_float(int v) { float f; memcpy(&f, &v, 4); return f; }
static inline float __uint_as_float(unsigned v) { float f; memcpy(&f, &v, 4); return f; }
static inline unsigned __float_as_uint(float v) { unsigned u; memcpy(&u, &v, 4); return u; }
static inline int __clz(unsigned v) { return v == 0 ? 32 : __builtin_clz(v); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
"#;

/// The script interpreter: `load ID PATH`, `launch NAME GX GY BX ARGS...` (`pID` a buffer,
/// `uN` an integer, `fHEX` float bits), `save ID PATH`.
const DRIVER: &str = r#"
struct AnyPtr {
    void* p;
    template <class T> operator T*() const { return (T*)p; }
};

template <class F> static void emu_launch(unsigned gx, unsigned gy, unsigned bx, F f) {
    gridDim = dim3{gx, gy, 1};
    blockDim = dim3{bx, 1, 1};
    for (unsigned y = 0; y < gy; ++y) {
        for (unsigned x = 0; x < gx; ++x) {
            std::barrier<> bar(bx);
            g_barrier = &bar;
            std::vector<std::thread> threads;
            for (unsigned t = 0; t < bx; ++t) {
                threads.emplace_back([&, t, x, y] {
                    threadIdx = dim3{t, 0, 0};
                    blockIdx = dim3{x, y, 0};
                    f();
                });
            }
            for (auto& th : threads) th.join();
        }
    }
}

static bool dispatch(const std::string& name, unsigned gx, unsigned gy, unsigned bx,
                     const std::vector<void*>& P, const std::vector<unsigned long long>& U,
                     const std::vector<float>& F);

int main() {
    std::map<int, std::vector<unsigned char>> bufs;
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string cmd;
        in >> cmd;
        if (cmd == "load") {
            int id; std::string path; in >> id >> path;
            std::ifstream f(path, std::ios::binary);
            bufs[id] = std::vector<unsigned char>((std::istreambuf_iterator<char>(f)), {});
            bufs[id].resize(bufs[id].size() + 64);  // slack: a stray read past the end stays in bounds of the heap
        } else if (cmd == "save") {
            int id; std::string path; size_t bytes; in >> id >> path >> bytes;
            std::ofstream f(path, std::ios::binary);
            f.write((const char*)bufs[id].data(), bytes);
        } else if (cmd == "launch") {
            std::string name; unsigned gx, gy, bx; in >> name >> gx >> gy >> bx;
            std::vector<void*> P; std::vector<unsigned long long> U; std::vector<float> F;
            std::string a;
            while (in >> a) {
                if (a[0] == 'p') P.push_back(bufs.at(std::stoi(a.substr(1))).data());
                else if (a[0] == 'u') U.push_back(std::stoull(a.substr(1)));
                else if (a[0] == 'f') { unsigned b = (unsigned)std::stoul(a.substr(1), nullptr, 16); float v; memcpy(&v, &b, 4); F.push_back(v); }
            }
            if (!dispatch(name, gx, gy, bx, P, U, F)) { fprintf(stderr, "unknown kernel %s\n", name.c_str()); return 2; }
        }
    }
    return 0;
}
"#;

/// `dispatch`: one call per entry point, its arguments converted by the recorded signature.
fn dispatch_source() -> String {
    let mut s = String::from(
        "static bool dispatch(const std::string& name, unsigned gx, unsigned gy, unsigned bx,\n\
         const std::vector<void*>& P, const std::vector<unsigned long long>& U,\n\
         const std::vector<float>& F) {\n",
    );
    for (name, kinds) in OP_LAUNCH_SIGNATURES {
        let (mut p, mut u, mut f) = (0, 0, 0);
        let args: Vec<String> = kinds
            .iter()
            .map(|k| match k {
                ParamKind::Ptr => {
                    p += 1;
                    format!("AnyPtr{{P.at({})}}", p - 1)
                }
                ParamKind::U64 => {
                    u += 1;
                    format!("(hr_u64)U.at({})", u - 1)
                }
                ParamKind::U32 => {
                    u += 1;
                    format!("(hr_u32)U.at({})", u - 1)
                }
                ParamKind::F32 => {
                    f += 1;
                    format!("F.at({})", f - 1)
                }
            })
            .collect();
        s += &format!(
            "    if (name == \"{name}\") {{ emu_launch(gx, gy, bx, [&] {{ {name}({}); }}); return true; }}\n",
            args.join(", ")
        );
    }
    s + "    return false;\n}\n"
}

/// The whole program: host built-ins, the preludes once, every module without its preludes,
/// the dispatch table and the driver.
fn program_source() -> String {
    let prelude = format!("{FLOAT_BITS_PRELUDE}\n{BLOCK_REDUCE_PRELUDE}\n");
    let mut s = format!("{HOST_CUDA}\n{prelude}");
    for module in TRAINER_OPS {
        let body = module
            .source
            .strip_prefix(prelude.as_str())
            .unwrap_or_else(|| panic!("{} does not start with the preludes", module.name));
        s += body;
        s += "\n";
    }
    s + DRIVER + &dispatch_source()
}

/// Scratch space: the build's temporary directory, or the system's when the test binary runs
/// somewhere else (a device bundle copied to another machine).
fn scratch(name: &str) -> PathBuf {
    let preferred = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("trainer_ops_emulator");
    let dir = if std::fs::create_dir_all(&preferred).is_ok() {
        preferred
    } else {
        std::env::temp_dir().join(format!(
            "headroom_trainer_ops_emulator_{}",
            std::process::id()
        ))
    };
    let dir = dir.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The compiled emulator, built once per test process; `None` (with a message) when no
/// C++20 compiler is available and none is required.
fn emulator() -> Option<&'static Path> {
    static BINARY: OnceLock<Option<PathBuf>> = OnceLock::new();
    BINARY
        .get_or_init(|| {
            let dir = scratch("build");
            let src = dir.join("trainer_ops.cpp");
            std::fs::write(&src, program_source()).unwrap();
            let binary = dir.join("trainer_ops");
            let candidates: Vec<String> = std::env::var("CXX")
                .ok()
                .into_iter()
                .chain(["c++", "g++", "clang++"].map(String::from))
                .collect();
            let mut last_error = String::new();
            for cxx in candidates {
                let Ok(out) = Command::new(&cxx)
                    .args([
                        "-std=c++20",
                        "-O2",
                        "-pthread",
                        "-ffp-contract=off",
                        "-Wall",
                    ])
                    .args(["-Wno-unused-function", "-Wno-unused-variable"])
                    .arg(&src)
                    .arg("-o")
                    .arg(&binary)
                    .output()
                else {
                    continue;
                };
                if out.status.success() {
                    return Some(binary);
                }
                last_error = format!("{cxx}: {}", String::from_utf8_lossy(&out.stderr));
            }
            let required = std::env::var("HEADROOM_REQUIRE_CXX").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "HEADROOM_REQUIRE_CXX=1 but no C++20 build: {last_error}"
            );
            // A compiler that exists but rejects the kernels is a failure, not a skip.
            assert!(
                !last_error.contains("error:") || last_error.contains("<barrier>"),
                "the kernels do not compile on the host:\n{last_error}"
            );
            eprintln!("skipped: no C++20 compiler with <barrier> ({last_error})");
            None
        })
        .as_deref()
}

/// One emulator run: buffers, launches, then every buffer read back.
struct Run {
    dir: PathBuf,
    script: String,
    sizes: Vec<usize>,
}

#[derive(Clone, Copy)]
enum Arg {
    Buf(usize),
    U(u64),
    F(f32),
}

impl Run {
    fn new(name: &str) -> Run {
        Run {
            dir: scratch(name),
            script: String::new(),
            sizes: Vec::new(),
        }
    }

    fn buf<T: bytemuck::Pod>(&mut self, data: &[T]) -> usize {
        let id = self.sizes.len();
        let path = self.dir.join(format!("in{id}.bin"));
        std::fs::write(&path, bytemuck::cast_slice::<T, u8>(data)).unwrap();
        self.script += &format!("load {id} {}\n", path.display());
        self.sizes.push(std::mem::size_of_val(data));
        id
    }

    fn launch(&mut self, name: &str, grid: (u32, u32), block: u32, args: &[Arg]) {
        self.script += &format!("launch {name} {} {} {block}", grid.0, grid.1);
        for a in args {
            self.script += &match a {
                Arg::Buf(id) => format!(" p{id}"),
                Arg::U(v) => format!(" u{v}"),
                Arg::F(v) => format!(" f{:x}", v.to_bits()),
            };
        }
        self.script += "\n";
    }

    /// Run the script; every buffer's final bytes, by id.
    fn finish(mut self, binary: &Path) -> Vec<Vec<u8>> {
        for (id, bytes) in self.sizes.iter().enumerate() {
            let path = self.dir.join(format!("out{id}.bin"));
            self.script += &format!("save {id} {} {bytes}\n", path.display());
        }
        let mut child = Command::new(binary)
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(self.script.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "emulator failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        (0..self.sizes.len())
            .map(|id| std::fs::read(self.dir.join(format!("out{id}.bin"))).unwrap())
            .collect()
    }
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(bytes)
}

const BLOCK: u32 = headroom_kernels::BLOCK_THREADS;

#[test]
fn the_emulator_dispatches_every_trainer_op() {
    let source = dispatch_source();
    for k in TRAINER_OPS {
        for f in k.functions {
            assert!(source.contains(&format!("if (name == \"{f}\")")), "{f}");
        }
    }
}

#[test]
fn emulated_embedding_is_bitwise_equal_to_the_cpu_op() {
    let Some(emu) = emulator() else { return };
    let (b, t, c, vocab) = (3usize, 5usize, 300usize, 1100usize);
    // Repeated tokens, and tokens on both sides of every vocabulary-block boundary.
    let mut tokens: Vec<u32> = (0..b * t)
        .map(|i| ((i * i * 7 + 3) % 1031) as u32)
        .collect();
    tokens[..8].copy_from_slice(&[0, 511, 512, 1023, 1024, 1099, 512, 0]);
    let wte = values(vocab * c, 9, 1.0);
    let wpe = values((t + 1) * c, 10, 1.0);
    let dout = values(b * t * c, 11, 1.0);
    let (dwte0, dwpe0) = (values(vocab * c, 12, 0.1), values((t + 1) * c, 13, 0.1));
    let mut run = Run::new("embedding");
    let (out, tk, we, pe) = (
        run.buf(&vec![0f32; b * t * c]),
        run.buf(&tokens),
        run.buf(&wte),
        run.buf(&wpe),
    );
    let (dwte, dwpe, d) = (run.buf(&dwte0), run.buf(&dwpe0), run.buf(&dout));
    let rows = (b * t) as u64;
    use Arg::{Buf, U};
    // A small grid, so the grid-stride loops go round several times.
    run.launch(
        "embedding_forward_f32",
        (3, 1),
        BLOCK,
        &[
            Buf(out),
            Buf(tk),
            Buf(we),
            Buf(pe),
            U(rows),
            U(t as u64),
            U(c as u64),
            U(vocab as u64),
        ],
    );
    // 512 vocabulary rows per block (the wrapper's choice), channel blocks over c = 300.
    let per = 512u64;
    run.launch(
        "embedding_backward_wte_f32",
        ((vocab as u32).div_ceil(512), (c as u32).div_ceil(BLOCK)),
        BLOCK,
        &[
            Buf(dwte),
            Buf(d),
            Buf(tk),
            U(rows),
            U(c as u64),
            U(vocab as u64),
            U(per),
        ],
    );
    run.launch(
        "embedding_backward_wpe_f32",
        (2, 1),
        BLOCK,
        &[Buf(dwpe), Buf(d), U(rows), U(t as u64), U(c as u64)],
    );
    let got = run.finish(emu);
    assert_bitwise(
        "forward",
        &f32s(&got[out]),
        &ref_embedding_forward(&tokens, &wte, &wpe, t, c),
    );
    let (mut want_wte, mut want_wpe) = (dwte0.clone(), dwpe0.clone());
    ref_embedding_backward(&mut want_wte, &mut want_wpe, &dout, &tokens, t, c);
    assert_bitwise("dwte", &f32s(&got[dwte]), &want_wte);
    assert_bitwise("dwpe", &f32s(&got[dwpe]), &want_wpe);
}

#[test]
fn emulated_layernorm_and_column_sums_match_the_reference() {
    let Some(emu) = emulator() else { return };
    let (rows, c) = (37usize, 300usize);
    let inp: Vec<f32> = values(rows * c, 16, 2.0).iter().map(|v| v + 0.5).collect();
    let w: Vec<f32> = values(c, 17, 0.5).iter().map(|v| 1.0 + v).collect();
    let b = values(c, 18, 0.5);
    let dout = values(rows * c, 19, 1.0);
    let (di0, dw0, db0) = (
        values(rows * c, 20, 0.1),
        values(c, 21, 0.1),
        values(c, 22, 0.1),
    );
    // 16 rows per chunk (the wrapper's minimum): 3 chunks, the last one partial.
    let (per, chunks) = (16u64, 3u32);
    let mut run = Run::new("layernorm");
    let (out, mean, rstd) = (
        run.buf(&vec![0f32; rows * c]),
        run.buf(&vec![0f32; rows]),
        run.buf(&vec![0f32; rows]),
    );
    let (x, wb, bb, d) = (run.buf(&inp), run.buf(&w), run.buf(&b), run.buf(&dout));
    let (di, dw, db) = (run.buf(&di0), run.buf(&dw0), run.buf(&db0));
    let pw = run.buf(&vec![0f32; chunks as usize * c]);
    let pb = run.buf(&vec![0f32; chunks as usize * c]);
    let (r64, c64) = (rows as u64, c as u64);
    use Arg::{Buf, U};
    // Fewer blocks than rows: the row loop strides.
    run.launch(
        "layernorm_forward_f32",
        (16, 1),
        BLOCK,
        &[
            Buf(out),
            Buf(mean),
            Buf(rstd),
            Buf(x),
            Buf(wb),
            Buf(bb),
            U(r64),
            U(c64),
        ],
    );
    run.launch(
        "layernorm_backward_input_f32",
        (16, 1),
        BLOCK,
        &[
            Buf(di),
            Buf(d),
            Buf(x),
            Buf(wb),
            Buf(mean),
            Buf(rstd),
            U(r64),
            U(c64),
        ],
    );
    run.launch(
        "layernorm_backward_param_partials_f32",
        (chunks, (c as u32).div_ceil(BLOCK)),
        BLOCK,
        &[
            Buf(pw),
            Buf(pb),
            Buf(d),
            Buf(x),
            Buf(mean),
            Buf(rstd),
            U(r64),
            U(c64),
            U(per),
        ],
    );
    for (dst, p) in [(dw, pw), (db, pb)] {
        run.launch(
            "column_sum_finish_f32",
            (1, 1),
            BLOCK,
            &[Buf(dst), Buf(p), U(chunks as u64), U(c64)],
        );
    }
    // The bias-gradient column sum of dout through the generic pair.
    let (cs_dst0, cs_p) = (
        values(c, 23, 0.1),
        run.buf(&vec![0f32; chunks as usize * c]),
    );
    let cs_dst = run.buf(&cs_dst0);
    run.launch(
        "column_sum_partials_f32",
        (chunks, (c as u32).div_ceil(BLOCK)),
        BLOCK,
        &[Buf(cs_p), Buf(d), U(r64), U(c64), U(per)],
    );
    run.launch(
        "column_sum_finish_f32",
        (2, 1),
        BLOCK,
        &[Buf(cs_dst), Buf(cs_p), U(chunks as u64), U(c64)],
    );
    let got = run.finish(emu);
    let (want_out, want_mean, want_rstd) = ref_layernorm(&inp, &w, &b, c);
    let (m, r) = (f32s(&got[mean]), f32s(&got[rstd]));
    assert_close("mean", &m, &want_mean, 1e-5, 1e-6);
    assert_close("rstd", &r, &want_rstd, 1e-5, 1e-6);
    assert_close("out", &f32s(&got[out]), &want_out, 1e-5, 1e-5);
    let (want_di, want_dw, want_db) =
        ref_layernorm_backward(&di0, &dw0, &db0, &dout, &inp, &w, &m, &r, c);
    assert_close("dinp", &f32s(&got[di]), &want_di, 1e-4, 1e-5);
    assert_close("dweight", &f32s(&got[dw]), &want_dw, 1e-5, 1e-4);
    assert_close("dbias", &f32s(&got[db]), &want_db, 1e-5, 1e-4);
    let want_cs: Vec<f64> = (0..c)
        .map(|j| cs_dst0[j] as f64 + (0..rows).map(|i| dout[i * c + j] as f64).sum::<f64>())
        .collect();
    assert_close("column sum", &f32s(&got[cs_dst]), &want_cs, 1e-5, 1e-4);
}

#[test]
fn emulated_gelu_and_residual_are_bitwise_equal_to_the_cpu_ops() {
    let Some(emu) = emulator() else { return };
    let mut x = golden_inputs();
    x.extend(values(5000, 23, 12.0));
    x.extend([
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e-40,
        -1e-40,
        88.0,
        -88.0,
    ]);
    let n = x.len();
    let (dout, di0) = (values(n, 24, 1.0), values(n, 25, 0.5));
    let mut run = Run::new("gelu");
    let (xb, out, d, di, y) = (
        run.buf(&x),
        run.buf(&vec![0f32; n]),
        run.buf(&dout),
        run.buf(&di0),
        run.buf(&di0),
    );
    use Arg::{Buf, U};
    run.launch(
        "gelu_forward_f32",
        (3, 1),
        BLOCK,
        &[Buf(out), Buf(xb), U(n as u64)],
    );
    run.launch(
        "gelu_backward_f32",
        (5, 1),
        BLOCK,
        &[Buf(di), Buf(xb), Buf(d), U(n as u64)],
    );
    run.launch(
        "residual_add_f32",
        (1, 1),
        BLOCK,
        &[Buf(y), Buf(d), U(n as u64)],
    );
    let got = run.finish(emu);
    let want: Vec<f32> = x.iter().map(|&v| ref_gelu(v)).collect();
    assert_bitwise("gelu forward", &f32s(&got[out]), &want);
    let want: Vec<f32> = (0..n)
        .map(|i| ref_gelu_backward(di0[i], x[i], dout[i]))
        .collect();
    assert_bitwise("gelu backward", &f32s(&got[di]), &want);
    let want: Vec<f32> = di0.iter().zip(&dout).map(|(a, b)| a + b).collect();
    assert_bitwise("residual", &f32s(&got[y]), &want);
}

/// A gated MLP's kernels `<name>_forward_f32` and `<name>_backward_f32` under the emulator:
/// the forward's output, then the gate's and up's gradients accumulated onto `dg0`, `du0`.
fn run_gated(
    emu: &Path,
    name: &str,
    gate: &[f32],
    up: &[f32],
    dout: &[f32],
    dg0: &[f32],
    du0: &[f32],
) -> [Vec<f32>; 3] {
    let n = gate.len();
    let mut run = Run::new(name);
    let (g, u, d, out, dg, du) = (
        run.buf(gate),
        run.buf(up),
        run.buf(dout),
        run.buf(&vec![0f32; n]),
        run.buf(dg0),
        run.buf(du0),
    );
    use Arg::{Buf, U};
    run.launch(
        &format!("{name}_forward_f32"),
        (3, 1),
        BLOCK,
        &[Buf(out), Buf(g), Buf(u), U(n as u64)],
    );
    run.launch(
        &format!("{name}_backward_f32"),
        (5, 1),
        BLOCK,
        &[Buf(dg), Buf(du), Buf(g), Buf(u), Buf(d), U(n as u64)],
    );
    let got = run.finish(emu);
    [f32s(&got[out]), f32s(&got[dg]), f32s(&got[du])]
}

/// Gemma's GeGLU gate: the GELU's operations, so bitwise like the GELU.
#[test]
fn emulated_geglu_is_bitwise_equal_to_the_cpu_op() {
    let Some(emu) = emulator() else { return };
    let mut gate = golden_inputs();
    gate.extend(values(5000, 53, 12.0));
    gate.extend([0.0, -0.0, 88.0, -88.0, 1e-40, f32::INFINITY, f32::NAN]);
    let n = gate.len();
    let (up, dout) = (values(n, 54, 2.0), values(n, 55, 1.0));
    let (dg0, du0) = (values(n, 56, 0.5), values(n, 57, 0.5));
    let got = run_gated(emu, "geglu", &gate, &up, &dout, &dg0, &du0);
    let want: Vec<f32> = (0..n).map(|i| ref_geglu(gate[i], up[i])).collect();
    assert_bitwise("geglu forward", &got[0], &want);
    let want: Vec<(f32, f32)> = (0..n)
        .map(|i| ref_geglu_backward(dg0[i], du0[i], gate[i], up[i], dout[i]))
        .collect();
    let (dgate, dup): (Vec<f32>, Vec<f32>) = want.into_iter().unzip();
    assert_bitwise("geglu dgate", &got[1], &dgate);
    assert_bitwise("geglu dup", &got[2], &dup);
}

#[test]
fn emulated_cross_entropy_matches_the_reference() {
    let Some(emu) = emulator() else { return };
    let (rows, v) = (6usize, 1000usize);
    let logits = values(rows * v, 26, 8.0);
    let mut targets: Vec<u32> = (0..rows).map(|r| ((r * 7919) % v) as u32).collect();
    targets[rows - 1] = v as u32; // out of range: NaN, no out-of-bounds read
    let dloss: Vec<f32> = (0..rows)
        .map(|r| 1.0 / rows as f32 + r as f32 * 1e-3)
        .collect();
    let mut run = Run::new("cross_entropy");
    let (l, g, lo, t, dl, l2) = (
        run.buf(&vec![0f32; rows]),
        run.buf(&vec![f32::NAN; rows * v]),
        run.buf(&logits),
        run.buf(&targets),
        run.buf(&dloss),
        run.buf(&vec![0f32; rows]),
    );
    let (l3, in_place) = (run.buf(&vec![0f32; rows]), run.buf(&logits));
    use Arg::{Buf, U};
    run.launch(
        "cross_entropy_forward_backward_f32",
        (4, 1),
        BLOCK,
        &[
            Buf(l),
            Buf(g),
            Buf(lo),
            Buf(t),
            Buf(dl),
            U(rows as u64),
            U(v as u64),
        ],
    );
    run.launch(
        "cross_entropy_forward_f32",
        (rows as u32, 1),
        BLOCK,
        &[Buf(l2), Buf(lo), Buf(t), U(rows as u64), U(v as u64)],
    );
    // Each target's logit is read by thread 0 while the other threads overwrite their own
    // elements with the gradient, so this checks the kernel's ordering of that read.
    run.launch(
        "cross_entropy_forward_backward_in_place_f32",
        (4, 1),
        BLOCK,
        &[
            Buf(l3),
            Buf(in_place),
            Buf(t),
            Buf(dl),
            U(rows as u64),
            U(v as u64),
        ],
    );
    let got = run.finish(emu);
    let valid = rows - 1;
    let (want_l, want_g) =
        ref_cross_entropy(&logits[..valid * v], &targets[..valid], &dloss[..valid], v);
    let (losses, grads) = (f32s(&got[l]), f32s(&got[g]));
    assert_close("loss", &losses[..valid], &want_l, 1e-5, 1e-5);
    assert_close("dlogits", &grads[..valid * v], &want_g, 1e-4, 1e-7);
    assert!(losses[valid].is_nan() && grads[valid * v..].iter().all(|x| x.is_nan()));
    assert_bitwise("forward-only loss", &f32s(&got[l2]), &losses);
    assert_bitwise("in-place loss", &f32s(&got[l3]), &losses);
    assert_bitwise("in-place gradient", &f32s(&got[in_place]), &grads);
}

/// On bf16-valued logits, the bf16 entries give the f32 entries' losses bit for bit and the
/// bf16 rounding (to nearest even) of their gradients.
#[test]
fn emulated_bf16_cross_entropy_is_the_f32_one_rounded() {
    let Some(emu) = emulator() else { return };
    let (rows, v) = (5usize, 777usize);
    let bits: Vec<u16> = values(rows * v, 31, 8.0)
        .iter()
        .map(|&x| bf16::from_f32(x).to_bits())
        .collect();
    let widened: Vec<f32> = bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
    let mut targets: Vec<u32> = (0..rows).map(|r| ((r * 613) % v) as u32).collect();
    targets[2] = v as u32; // out of range: NaN loss and gradient row
    let dloss: Vec<f32> = (0..rows).map(|r| 0.2 + r as f32 * 1e-3).collect();
    let mut run = Run::new("cross_entropy_bf16");
    let (l32, g32, t, dl) = (
        run.buf(&vec![0f32; rows]),
        run.buf(&widened),
        run.buf(&targets),
        run.buf(&dloss),
    );
    let (l16, g16, lf16, lo16) = (
        run.buf(&vec![0f32; rows]),
        run.buf(&bits),
        run.buf(&vec![0f32; rows]),
        run.buf(&bits),
    );
    use Arg::{Buf, U};
    let (r, n) = (rows as u64, v as u64);
    let in_place = |run: &mut Run, f: &str, l, g| {
        run.launch(
            f,
            (3, 1),
            BLOCK,
            &[Buf(l), Buf(g), Buf(t), Buf(dl), U(r), U(n)],
        );
    };
    in_place(
        &mut run,
        "cross_entropy_forward_backward_in_place_f32",
        l32,
        g32,
    );
    in_place(
        &mut run,
        "cross_entropy_forward_backward_in_place_bf16",
        l16,
        g16,
    );
    run.launch(
        "cross_entropy_forward_bf16",
        (rows as u32, 1),
        BLOCK,
        &[Buf(lf16), Buf(lo16), Buf(t), U(r), U(n)],
    );
    let got = run.finish(emu);
    let losses = f32s(&got[l32]);
    assert!(losses[2].is_nan());
    assert_bitwise("bf16 in-place loss", &f32s(&got[l16]), &losses);
    assert_bitwise("bf16 forward-only loss", &f32s(&got[lf16]), &losses);
    let want: Vec<u16> = f32s(&got[g32])
        .iter()
        .map(|&g| bf16::from_f32(g).to_bits())
        .collect();
    let grads: Vec<u16> = bytemuck::pod_collect_to_vec(&got[g16]);
    assert_eq!(grads, want, "bf16 gradient bits");
    // The logits were overwritten: not one gradient equals its logit's bits everywhere.
    assert_ne!(grads, bits);
}

#[test]
fn emulated_adamw_is_bitwise_equal_to_the_offload_reference() {
    let Some(emu) = emulator() else { return };
    let n = 3001;
    let (p0, g32, m0) = (values(n, 27, 1.0), values(n, 28, 0.1), values(n, 29, 0.01));
    let v0: Vec<f32> = values(n, 30, 0.01).iter().map(|v| v * v).collect();
    let g16: Vec<u16> = g32.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
    let g16f: Vec<f32> = g16.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
    // β1 0.9 and 0.3: both of ATen's lerp formulas (1 - β1 below and above one half).
    let steps = [
        AdamWStep::new(6e-4, 0.9, 0.95, 1e-8, 0.1, 3),
        AdamWStep::new(6e-4, 0.3, 0.95, 1e-8, 0.1, 3),
    ];
    let mut run = Run::new("adamw");
    let mut cases = Vec::new();
    for s in steps {
        let scalars = [
            s.decay,
            s.one_minus_beta1,
            s.beta2,
            s.one_minus_beta2,
            s.step_size,
            s.bc2_sqrt,
            s.eps,
        ];
        for (function, bf16_grad, copy) in [
            ("adamw_f32", false, false),
            ("adamw_bf16", true, false),
            ("adamw_copy_bf16_f32", false, true),
            ("adamw_copy_bf16_bf16", true, true),
        ] {
            let (p, m, v) = (run.buf(&p0), run.buf(&m0), run.buf(&v0));
            let g = if bf16_grad {
                run.buf(&g16)
            } else {
                run.buf(&g32)
            };
            let c = copy.then(|| run.buf(&vec![0u16; n]));
            let mut args = vec![Arg::Buf(p), Arg::Buf(g), Arg::Buf(m), Arg::Buf(v)];
            args.extend(c.map(Arg::Buf));
            args.push(Arg::U(n as u64));
            args.extend(scalars.iter().map(|&x| Arg::F(x)));
            run.launch(function, (2, 1), BLOCK, &args);
            cases.push((s, function, bf16_grad, p, m, v, c));
        }
    }
    let got = run.finish(emu);
    for (s, function, bf16_grad, p, m, v, c) in cases {
        let (mut wp, mut wm, mut wv) = (p0.clone(), m0.clone(), v0.clone());
        ref_adamw(
            &s,
            &mut wp,
            if bf16_grad { &g16f } else { &g32 },
            &mut wm,
            &mut wv,
        );
        let what = format!("{function} (1 - β1 = {})", s.one_minus_beta1);
        assert_bitwise(&what, &f32s(&got[p]), &wp);
        assert_bitwise(&what, &f32s(&got[m]), &wm);
        assert_bitwise(&what, &f32s(&got[v]), &wv);
        if let Some(c) = c {
            let copy: Vec<u16> = bytemuck::pod_collect_to_vec(&got[c]);
            let want: Vec<u16> = wp.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
            assert_eq!(copy, want, "{what} copy");
        }
    }
}

#[test]
fn emulated_stochastic_rounding_is_bitwise_equal_to_amp() {
    let Some(emu) = emulator() else { return };
    let mut x = golden_inputs();
    x.extend(values(4099, 31, 1e4));
    x.extend([
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::INFINITY,
        f32::MAX,
        -f32::MAX,
        1e-40,
    ]);
    let key = StochasticRoundingKey {
        seed: 0xdead_beef_0123_4567,
        step: 9,
        tensor: 3,
    };
    let mut run = Run::new("stochastic_round");
    let (src, dst) = (run.buf(&x), run.buf(&vec![0u16; x.len()]));
    run.launch(
        "stochastic_round_f32_bf16",
        (3, 1),
        BLOCK,
        &[
            Arg::Buf(src),
            Arg::Buf(dst),
            Arg::U(x.len() as u64),
            Arg::U(key.seed),
            Arg::U(key.step),
            Arg::U(key.tensor as u64),
        ],
    );
    let got: Vec<u16> = bytemuck::pod_collect_to_vec(&run.finish(emu)[dst]);
    let want: Vec<u16> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| ref_stochastic_round(v, ref_random_bits(key, i as u64)))
        .collect();
    assert_eq!(got, want);
}

// ------------------------------------------------------------------------------------------
// Llama's ops: token embedding, RMSNorm, SwiGLU, rotary embedding, in-place rounding.

#[test]
fn emulated_token_embedding_is_bitwise_equal_to_the_cpu_op() {
    let Some(emu) = emulator() else { return };
    let (rows, c, vocab) = (13usize, 300usize, 1100usize);
    let mut tokens: Vec<u32> = (0..rows).map(|i| ((i * i * 7 + 3) % 1031) as u32).collect();
    tokens[..5].copy_from_slice(&[0, 1099, 512, 0, 511]);
    let wte = values(vocab * c, 40, 1.0);
    let dout = values(rows * c, 41, 1.0);
    let dwte0 = values(vocab * c, 42, 0.1);
    let mut run = Run::new("embedding_tokens");
    let (out, tk, we, dwte, d) = (
        run.buf(&vec![0f32; rows * c]),
        run.buf(&tokens),
        run.buf(&wte),
        run.buf(&dwte0),
        run.buf(&dout),
    );
    use Arg::{Buf, U};
    run.launch(
        "embedding_forward_tokens_f32",
        (3, 1),
        BLOCK,
        &[
            Buf(out),
            Buf(tk),
            Buf(we),
            U(rows as u64),
            U(c as u64),
            U(vocab as u64),
        ],
    );
    // The backward of the token embedding alone is the wte scatter alone.
    launch_wte_backward(&mut run, (dwte, d, tk), rows, c, vocab);
    let got = run.finish(emu);
    let want: Vec<f32> = tokens
        .iter()
        .flat_map(|&t| wte[t as usize * c..][..c].to_vec())
        .collect();
    assert_bitwise("forward", &f32s(&got[out]), &want);
    let want = wte_backward_reference(&dwte0, &dout, &tokens, c, None);
    assert_bitwise("dwte", &f32s(&got[dwte]), &want);
}

/// `embedding_backward_wte_f32` on buffers `(dwte, dout, tokens)` of `rows` tokens, `c`
/// channels, a `vocab`-row table, 512 vocabulary rows per block.
fn launch_wte_backward(
    run: &mut Run,
    (dwte, d, tk): (usize, usize, usize),
    rows: usize,
    c: usize,
    vocab: usize,
) {
    use Arg::{Buf, U};
    run.launch(
        "embedding_backward_wte_f32",
        ((vocab as u32).div_ceil(512), (c as u32).div_ceil(BLOCK)),
        BLOCK,
        &[
            Buf(dwte),
            Buf(d),
            Buf(tk),
            U(rows as u64),
            U(c as u64),
            U(vocab as u64),
            U(512),
        ],
    );
}

/// The trainer's token-only backward: `dout`'s rows in token order into `dwte0`, token
/// `skip`'s rows left out.
fn wte_backward_reference(
    dwte0: &[f32],
    dout: &[f32],
    tokens: &[u32],
    c: usize,
    skip: Option<u32>,
) -> Vec<f32> {
    let mut want = dwte0.to_vec();
    for (drow, &t) in dout.chunks_exact(c).zip(tokens) {
        if Some(t) == skip {
            continue;
        }
        for j in 0..c {
            want[t as usize * c + j] += drow[j];
        }
    }
    want
}

/// The padding index on the device: headroom-trainer's CUDA `embed_backward` renames the
/// padding token to `u32::MAX` before upload, and the wte scatter skips a token past the
/// vocabulary, so its rows add nothing — the CPU op's `skip`, bit for bit.
#[test]
fn emulated_token_embedding_backward_skips_the_padding_index() {
    let Some(emu) = emulator() else { return };
    let (rows, c, vocab, pad) = (13usize, 300usize, 1100usize, 7u32);
    let mut tokens: Vec<u32> = (0..rows).map(|i| ((i * i * 7 + 3) % 1031) as u32).collect();
    tokens[..5].copy_from_slice(&[pad, 1099, pad, 0, pad]);
    let renamed: Vec<u32> = tokens
        .iter()
        .map(|&t| if t == pad { u32::MAX } else { t })
        .collect();
    let dout = values(rows * c, 43, 1.0);
    let dwte0 = values(vocab * c, 44, 0.1);
    let mut run = Run::new("embedding_padding");
    let (dwte, d, tk) = (run.buf(&dwte0), run.buf(&dout), run.buf(&renamed));
    launch_wte_backward(&mut run, (dwte, d, tk), rows, c, vocab);
    let got = run.finish(emu);
    let want = wte_backward_reference(&dwte0, &dout, &tokens, c, Some(pad));
    let got = f32s(&got[dwte]);
    assert_bitwise("dwte", &got, &want);
    let row = pad as usize * c;
    assert_eq!(
        &got[row..row + c],
        &dwte0[row..row + c],
        "the padding row moved"
    );
}

#[test]
fn emulated_rmsnorm_matches_the_cpu_op() {
    let Some(emu) = emulator() else { return };
    let (rows, c, eps) = (37usize, 300usize, 1e-6f32);
    let inp: Vec<f32> = values(rows * c, 43, 2.0).iter().map(|v| v + 0.25).collect();
    let w: Vec<f32> = values(c, 44, 0.5).iter().map(|v| 1.0 + v).collect();
    let dout = values(rows * c, 45, 1.0);
    let (di0, dw0) = (values(rows * c, 46, 0.1), values(c, 47, 0.1));
    let (per, chunks) = (16u64, 3u32);
    let mut run = Run::new("rmsnorm");
    let (out, rstd) = (run.buf(&vec![0f32; rows * c]), run.buf(&vec![0f32; rows]));
    let (x, wb, d) = (run.buf(&inp), run.buf(&w), run.buf(&dout));
    let (di, dw) = (run.buf(&di0), run.buf(&dw0));
    let pw = run.buf(&vec![0f32; chunks as usize * c]);
    let (r64, c64) = (rows as u64, c as u64);
    use Arg::{Buf, F, U};
    // Fewer blocks than rows: the row loop strides.
    run.launch(
        "rmsnorm_forward_f32",
        (16, 1),
        BLOCK,
        &[Buf(out), Buf(rstd), Buf(x), Buf(wb), U(r64), U(c64), F(eps)],
    );
    run.launch(
        "rmsnorm_backward_input_f32",
        (16, 1),
        BLOCK,
        &[Buf(di), Buf(d), Buf(x), Buf(wb), Buf(rstd), U(r64), U(c64)],
    );
    run.launch(
        "rmsnorm_backward_weight_partials_f32",
        (chunks, (c as u32).div_ceil(BLOCK)),
        BLOCK,
        &[Buf(pw), Buf(d), Buf(x), Buf(rstd), U(r64), U(c64), U(per)],
    );
    run.launch(
        "column_sum_finish_f32",
        (1, 1),
        BLOCK,
        &[Buf(dw), Buf(pw), U(chunks as u64), U(c64)],
    );
    let got = run.finish(emu);
    let (want_out, want_rstd) = ref_rmsnorm(&inp, &w, eps, c);
    let widen = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let r = f32s(&got[rstd]);
    // The f64 sums differ from the CPU's only in order: one f32 ulp at most.
    assert_close("rstd", &r, &widen(&want_rstd), 2e-7, 0.0);
    assert_close("out", &f32s(&got[out]), &widen(&want_out), 4e-7, 1e-7);
    let (mut want_di, mut want_dw) = (di0.clone(), dw0.clone());
    ref_rmsnorm_backward(&mut want_di, &mut want_dw, &dout, &inp, &w, &r, c);
    assert_close("dinp", &f32s(&got[di]), &widen(&want_di), 1e-5, 1e-6);
    // dweight sums rows in chunks, the CPU in sequence.
    assert_close("dweight", &f32s(&got[dw]), &widen(&want_dw), 1e-5, 1e-4);
}

#[test]
fn emulated_swiglu_matches_the_cpu_op() {
    let Some(emu) = emulator() else { return };
    let mut gate = values(5000, 48, 12.0);
    gate.extend([
        0.0,
        -0.0,
        88.0,
        -88.0,
        1e-40,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ]);
    let n = gate.len();
    let (up, dout) = (values(n, 49, 2.0), values(n, 50, 1.0));
    let (dg0, du0) = (values(n, 51, 0.5), values(n, 52, 0.5));
    let got = run_gated(emu, "swiglu", &gate, &up, &dout, &dg0, &du0);
    let fwd: Vec<f64> = (0..n).map(|i| ref_swiglu(gate[i], up[i]) as f64).collect();
    let bwd: Vec<(f32, f32)> = (0..n)
        .map(|i| ref_swiglu_backward(dg0[i], du0[i], gate[i], up[i], dout[i]))
        .collect();
    // e^x is the fast_math port in the kernel and libm's in the CPU op: a few ulp, not bits.
    let [out, dg, du] = got;
    let finite = |v: &[f32], w: &[f64]| -> (Vec<f32>, Vec<f64>) {
        v.iter()
            .zip(w)
            .filter(|(_, w)| w.is_finite())
            .map(|(&v, &w)| (v, w))
            .unzip()
    };
    let (o, w) = finite(&out, &fwd);
    assert!(o.len() + 2 >= n, "only the infinite gates are left out");
    assert_close("swiglu forward", &o, &w, 1e-6, 1e-30);
    let (o, w) = finite(&dg, &bwd.iter().map(|b| b.0 as f64).collect::<Vec<_>>());
    assert_close("swiglu dgate", &o, &w, 1e-6, 1e-6);
    let (o, w) = finite(&du, &bwd.iter().map(|b| b.1 as f64).collect::<Vec<_>>());
    assert_close("swiglu dup", &o, &w, 1e-6, 1e-6);
}

#[test]
fn emulated_rope_is_bitwise_equal_to_the_cpu_op_both_ways() {
    let Some(emu) = emulator() else { return };
    // B·H = 6 heads of 7 positions, head dimension 64 (half 32): tables from the CPU's code.
    let (heads, t, hs, theta) = (6usize, 7usize, 64usize, 10_000.0f32);
    let x0 = values(heads * t * hs, 53, 3.0);
    let (cos, sin) = ref_rope_tables(t, hs, theta);
    let mut run = Run::new("rope");
    let (fwd, inv, cb, sb) = (run.buf(&x0), run.buf(&x0), run.buf(&cos), run.buf(&sin));
    use Arg::{Buf, U};
    let rows = (heads * t) as u64;
    for (b, inverse) in [(fwd, 0u64), (inv, 1)] {
        run.launch(
            "rope_f32",
            (2, 1),
            BLOCK,
            &[
                Buf(b),
                Buf(cb),
                Buf(sb),
                U(rows),
                U(t as u64),
                U(hs as u64 / 2),
                U(inverse),
            ],
        );
    }
    let got = run.finish(emu);
    for (b, inverse) in [(fwd, false), (inv, true)] {
        let mut want = x0.clone();
        ref_rope_apply(&mut want, t, hs, &cos, &sin, inverse);
        assert_bitwise(&format!("rope inverse={inverse}"), &f32s(&got[b]), &want);
    }
}

#[test]
fn emulated_in_place_rounding_is_bitwise_the_conversion() {
    let Some(emu) = emulator() else { return };
    let mut x = golden_inputs();
    x.extend(values(3001, 54, 1e4));
    x.extend([
        f32::NAN,
        f32::INFINITY,
        f32::MAX,
        -f32::MAX,
        1e-40,
        65520.0,
        -65519.0,
    ]);
    let n = x.len() as u64;
    let mut run = Run::new("round");
    let (b, h) = (run.buf(&x), run.buf(&x));
    run.launch("round_bf16_f32", (3, 1), BLOCK, &[Arg::Buf(b), Arg::U(n)]);
    run.launch("round_f16_f32", (2, 1), BLOCK, &[Arg::Buf(h), Arg::U(n)]);
    let got = run.finish(emu);
    assert_bitwise(
        "bf16",
        &f32s(&got[b]),
        &round_to(headroom_tensor::DType::BF16, &x),
    );
    assert_bitwise(
        "f16",
        &f32s(&got[h]),
        &round_to(headroom_tensor::DType::F16, &x),
    );
}

// ------------------------------------------------------------------------------------------
// Attention-head permutes.

/// Bytes past the end of every permute destination, which must stay as they were.
const GUARD: usize = 64;
const SENTINEL: u8 = 0xA5;

/// Deterministic pseudo-random bytes.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (s >> 56) as u8
        })
        .collect()
}

/// Elements of `elem` bytes as opaque fixed-size values, so the CPU loops move whole elements.
fn elements(bytes: &[u8], elem: usize) -> Vec<Vec<u8>> {
    bytes.chunks_exact(elem).map(<[u8]>::to_vec).collect()
}

fn flat(elems: &[Vec<u8>]) -> Vec<u8> {
    elems.concat()
}

/// One permute case: a layout, an element size and a launch shape.
#[derive(Clone, Copy, Debug)]
struct PermuteCase {
    layout: HeadLayout,
    elem: usize,
    grid: u32,
    block: u32,
}

/// Every unit that divides a head row of `case`, with its entry point.
fn units_for(case: &PermuteCase) -> Vec<(usize, &'static str)> {
    let row_bytes = case.layout.head_dim * case.elem;
    PERMUTE_HEADS_UNITS
        .iter()
        .copied()
        .filter(|(unit, _)| row_bytes.is_multiple_of(*unit))
        .collect()
}

fn permute_args(dst: usize, src: usize, l: HeadLayout, head_units: usize, merge: bool) -> Vec<Arg> {
    use Arg::{Buf, U};
    vec![
        Buf(dst),
        Buf(src),
        U(l.batch as u64),
        U(l.seq as u64),
        U(l.heads as u64),
        U(head_units as u64),
        U(l.parts as u64),
        U(l.part as u64),
        U(merge as u64),
    ]
}

/// Run every unit's kernel on `case`: each part split out of random wide rows, every part merged
/// back into a sentinel-filled wide tensor, and one part merged alone; all compared bitwise with
/// the CPU loops, guard bytes included.
fn check_permute_case(emu: &Path, name: &str, case: PermuteCase, seed: u64) {
    let PermuteCase {
        layout,
        elem,
        grid,
        block,
    } = case;
    let wide_n = layout.wide_numel().unwrap();
    let heads_n = layout.heads_numel().unwrap();
    let wide = noise(wide_n * elem, seed);
    let heads_in: Vec<Vec<u8>> = (0..layout.parts)
        .map(|p| noise(heads_n * elem, seed ^ ((p as u64 + 1) << 32)))
        .collect();
    let guarded = |len: usize| vec![SENTINEL; len + GUARD];
    let units = units_for(&case);
    assert!(!units.is_empty());
    let mut run = Run::new(name);
    let wide_b = run.buf(&wide);
    let heads_b: Vec<usize> = heads_in.iter().map(|h| run.buf(h)).collect();
    let mut checks = Vec::new();
    for &(unit, function) in &units {
        let head_units = layout.head_dim * elem / unit;
        let splits: Vec<usize> = (0..layout.parts)
            .map(|part| {
                let dst = run.buf(&guarded(heads_n * elem));
                let l = layout.part_of(layout.parts, part);
                run.launch(
                    function,
                    (grid, 1),
                    block,
                    &permute_args(dst, wide_b, l, head_units, false),
                );
                dst
            })
            .collect();
        let merged_all = run.buf(&guarded(wide_n * elem));
        for (part, &src) in heads_b.iter().enumerate() {
            let l = layout.part_of(layout.parts, part);
            run.launch(
                function,
                (grid, 1),
                block,
                &permute_args(merged_all, src, l, head_units, true),
            );
        }
        let last = layout.parts - 1;
        let merged_one = run.buf(&guarded(wide_n * elem));
        let l = layout.part_of(layout.parts, last);
        run.launch(
            function,
            (grid, 1),
            block,
            &permute_args(merged_one, heads_b[last], l, head_units, true),
        );
        checks.push((function, splits, merged_all, merged_one));
    }
    let got = run.finish(emu);
    let wide_e = elements(&wide, elem);
    let guard = [SENTINEL; GUARD];
    for (function, splits, merged_all, merged_one) in checks {
        let what = format!("{function} {case:?}");
        for (part, &dst) in splits.iter().enumerate() {
            let l = layout.part_of(layout.parts, part);
            let want = flat(&ref_split_heads(&wide_e, l));
            assert!(
                got[dst][..heads_n * elem] == want[..],
                "split part {part}: {what}"
            );
            assert_eq!(
                &got[dst][heads_n * elem..],
                &guard[..],
                "split wrote past the end: {what}"
            );
        }
        let mut want_all = elements(&guarded(wide_n * elem)[..wide_n * elem], elem);
        for (part, h) in heads_in.iter().enumerate() {
            ref_merge_heads(
                &mut want_all,
                &elements(h, elem),
                layout.part_of(layout.parts, part),
            );
        }
        assert!(
            got[merged_all][..wide_n * elem] == flat(&want_all)[..],
            "merge all: {what}"
        );
        assert_eq!(
            &got[merged_all][wide_n * elem..],
            &guard[..],
            "merge wrote past the end: {what}"
        );
        let mut want_one = elements(&guarded(wide_n * elem)[..wide_n * elem], elem);
        let last = layout.parts - 1;
        ref_merge_heads(
            &mut want_one,
            &elements(&heads_in[last], elem),
            layout.part_of(layout.parts, last),
        );
        // Only the merged part changed: every other part still holds the sentinel.
        assert!(
            got[merged_one][..wide_n * elem] == flat(&want_one)[..],
            "merge one part: {what}"
        );
        assert_eq!(
            &got[merged_one][wide_n * elem..],
            &guard[..],
            "merge wrote past the end: {what}"
        );
    }
}

#[test]
fn head_permute_references_are_inverse_permutations() {
    let l = HeadLayout::single(2, 3, 4, 5).part_of(3, 1);
    let wide: Vec<u32> = (0..l.wide_numel().unwrap() as u32).collect();
    let heads = ref_split_heads(&wide, l);
    // A permutation of one part's elements: each exactly once.
    let mut sorted = heads.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), l.heads_numel().unwrap());
    // Element (b=1, h=2, t=0, d=3) comes from row (b=1, t=0), part 1, head 2, position 3.
    let c = l.heads * l.head_dim;
    assert_eq!(
        heads[((l.heads + 2) * l.seq) * l.head_dim + 3],
        (l.seq * 3 * c + c + 2 * l.head_dim + 3) as u32
    );
    let mut back = vec![u32::MAX; wide.len()];
    for part in 0..3 {
        let lp = l.part_of(3, part);
        ref_merge_heads(&mut back, &ref_split_heads(&wide, lp), lp);
    }
    assert_eq!(back, wide);
}

#[test]
fn emulated_head_permutes_are_the_cpu_permutation_for_every_unit() {
    let Some(emu) = emulator() else { return };
    let case = |b, t, nh, hs, parts, elem, grid, block| PermuteCase {
        layout: HeadLayout::single(b, t, nh, hs).part_of(parts, 0),
        elem,
        grid,
        block,
    };
    let cases = [
        // GPT-2's bf16 qkv split (hs = 64, 16-byte units), odd T, a one-block grid-stride.
        case(2, 7, 3, 64, 3, 2, 1, 256),
        // hs = 128, more heads than positions.
        case(1, 2, 5, 128, 1, 2, 2, 256),
        // A single position, more heads than positions, a tiny block: rows loop.
        case(3, 1, 4, 8, 3, 2, 2, 32),
        // Odd head sizes in bf16: 6 bytes (2-byte units), 12 bytes (4-byte units).
        case(2, 5, 3, 3, 3, 2, 3, 64),
        case(1, 9, 2, 6, 1, 2, 1, 64),
        // f32 (4-byte elements), 20-byte head rows; u8 with 7-byte rows (1-byte units).
        case(2, 3, 2, 5, 3, 4, 2, 128),
        case(2, 3, 3, 7, 2, 1, 2, 64),
        // A head row longer than the block (37 units of 4 bytes, 32 threads): the unit loop.
        case(1, 3, 2, 74, 1, 2, 2, 32),
        // A block that is not a power of two: threads past its last whole row stay idle.
        case(2, 3, 2, 64, 3, 2, 2, 96),
    ];
    for (i, c) in cases.into_iter().enumerate() {
        check_permute_case(emu, "permute_heads", c, i as u64 + 1);
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(12))]

    /// Random shapes (odd T, NH > T, every element size and unit), random small launches.
    #[test]
    fn emulated_head_permutes_match_the_cpu_for_random_shapes(
        b in 1usize..4, t in 1usize..10, nh in 1usize..7, hs in 1usize..40, parts in 1usize..4,
        elem in proptest::sample::select(vec![1usize, 2, 4, 8]),
        grid in 1u32..4, block in proptest::sample::select(vec![32u32, 64, 96, 256]),
        seed in 0u64..1 << 40,
    ) {
        let Some(emu) = emulator() else { return Ok(()) };
        let layout = HeadLayout::single(b, t, nh, hs).part_of(parts, 0);
        check_permute_case(emu, "permute_heads_random", PermuteCase { layout, elem, grid, block }, seed);
    }
}
