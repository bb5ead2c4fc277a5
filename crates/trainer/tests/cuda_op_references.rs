//! The scalar references headroom-cuda's kernel tests check the CUDA kernels against
//! (`crates/cuda/tests/common`, run on the host by its emulator and on a GPU by its parity
//! tests) are transcriptions of this crate's CPU ops: here they are pinned to the ops
//! themselves, bit for bit, so "the kernel matches the reference" means "the kernel matches
//! the CPU op the model runs".
#![cfg(feature = "cuda")]

#[path = "../../cuda/tests/common/mod.rs"]
mod common;

use common::*;
use headroom_trainer::ops::{rmsnorm, rope, swiglu};

#[test]
fn rmsnorm_references_are_the_cpu_op() {
    let (rows, c, eps) = (9usize, 300usize, 1e-6f32);
    let x: Vec<f32> = values(rows * c, 1, 2.0).iter().map(|v| v + 0.25).collect();
    let w: Vec<f32> = values(c, 2, 0.5).iter().map(|v| 1.0 + v).collect();
    let (mut out, mut rstd) = (vec![0f32; rows * c], vec![0f32; rows]);
    rmsnorm::forward(&mut out, &mut rstd, &x, &w, (eps, 0.0), c);
    let (want_out, want_rstd) = ref_rmsnorm(&x, &w, eps, c);
    assert_bitwise("out", &out, &want_out);
    assert_bitwise("rstd", &rstd, &want_rstd);
    let dout = values(rows * c, 3, 1.0);
    let (mut di, mut dw) = (values(rows * c, 4, 0.1), values(c, 5, 0.1));
    let (mut rdi, mut rdw) = (di.clone(), dw.clone());
    rmsnorm::backward(&mut di, &mut dw, &dout, &x, &w, &rstd, 0.0, c);
    ref_rmsnorm_backward(&mut rdi, &mut rdw, &dout, &x, &w, &rstd, c);
    assert_bitwise("dinp", &di, &rdi);
    assert_bitwise("dweight", &dw, &rdw);
}

#[test]
fn swiglu_references_are_the_cpu_op() {
    let n = 4099;
    let (gate, up, dout) = (values(n, 6, 12.0), values(n, 7, 2.0), values(n, 8, 1.0));
    let mut out = vec![0f32; n];
    swiglu::forward(&mut out, &gate, &up);
    let want: Vec<f32> = (0..n).map(|i| ref_swiglu(gate[i], up[i])).collect();
    assert_bitwise("forward", &out, &want);
    let (mut dg, mut du) = (values(n, 9, 0.5), values(n, 10, 0.5));
    let want: Vec<(f32, f32)> = (0..n)
        .map(|i| ref_swiglu_backward(dg[i], du[i], gate[i], up[i], dout[i]))
        .collect();
    swiglu::backward(&mut dg, &mut du, &gate, &up, &dout);
    assert_bitwise("dgate", &dg, &want.iter().map(|w| w.0).collect::<Vec<_>>());
    assert_bitwise("dup", &du, &want.iter().map(|w| w.1).collect::<Vec<_>>());
}

#[test]
fn geglu_references_are_the_cpu_op() {
    use headroom_trainer::ops::glu::{self, GeluTanh};
    let n = 4099;
    let (gate, up, dout) = (values(n, 12, 12.0), values(n, 13, 2.0), values(n, 14, 1.0));
    let mut out = vec![0f32; n];
    glu::forward::<GeluTanh, f32>(&mut out, &gate, &up);
    let want: Vec<f32> = (0..n).map(|i| ref_geglu(gate[i], up[i])).collect();
    assert_bitwise("forward", &out, &want);
    let (mut dg, mut du) = (values(n, 15, 0.5), values(n, 16, 0.5));
    let want: Vec<(f32, f32)> = (0..n)
        .map(|i| ref_geglu_backward(dg[i], du[i], gate[i], up[i], dout[i]))
        .collect();
    glu::backward::<GeluTanh, f32>(&mut dg, &mut du, &gate, &up, &dout);
    assert_bitwise("dgate", &dg, &want.iter().map(|w| w.0).collect::<Vec<_>>());
    assert_bitwise("dup", &du, &want.iter().map(|w| w.1).collect::<Vec<_>>());
}

/// Gemma's gains, stored as their offset from 1: the CPU op with offset 1 on `w` is the
/// reference (the plain gain's) on `1 + w`, bit for bit — what the CUDA backend hands its
/// kernels.
#[test]
fn an_offset_gain_is_the_plain_gain_plus_one() {
    let (rows, c, eps) = (5usize, 130usize, 1e-6f32);
    let x: Vec<f32> = values(rows * c, 17, 2.0);
    let w: Vec<f32> = values(c, 18, 0.5);
    let plus_one: Vec<f32> = w.iter().map(|v| 1.0 + v).collect();
    let (mut out, mut rstd) = (vec![0f32; rows * c], vec![0f32; rows]);
    rmsnorm::forward(&mut out, &mut rstd, &x, &w, (eps, 1.0), c);
    let (want_out, want_rstd) = ref_rmsnorm(&x, &plus_one, eps, c);
    assert_bitwise("out", &out, &want_out);
    assert_bitwise("rstd", &rstd, &want_rstd);
    let dout = values(rows * c, 19, 1.0);
    let (mut di, mut dw) = (values(rows * c, 20, 0.1), values(c, 21, 0.1));
    let (mut rdi, mut rdw) = (di.clone(), dw.clone());
    rmsnorm::backward(&mut di, &mut dw, &dout, &x, &w, &rstd, 1.0, c);
    ref_rmsnorm_backward(&mut rdi, &mut rdw, &dout, &x, &plus_one, &rstd, c);
    assert_bitwise("dinp", &di, &rdi);
    assert_bitwise("dweight", &dw, &rdw);
}

#[test]
fn rope_references_are_the_cpu_op() {
    let (heads, t, hs) = (3usize, 11usize, 64usize);
    for theta in [10_000.0f32, 500_000.0] {
        let (cos, sin) = rope::tables(t, hs, rope::Rope::plain(theta));
        let (rcos, rsin) = ref_rope_tables(t, hs, theta);
        assert_bitwise("cos", &cos, &rcos);
        assert_bitwise("sin", &sin, &rsin);
        for inverse in [false, true] {
            let mut x = values(heads * t * hs, 11, 3.0);
            let mut r = x.clone();
            rope::apply(&mut x, t, hs, &cos, &sin, inverse);
            ref_rope_apply(&mut r, t, hs, &cos, &sin, inverse);
            assert_bitwise("rotated", &x, &r);
        }
    }
}
