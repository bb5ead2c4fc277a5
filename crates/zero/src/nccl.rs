//! [`NcclCollective`] (feature `cuda`): the [`Collective`] on NCCL, one process per GPU.
//!
//! The engine's buffers are host memory, so every operation stages its data through the GPU:
//! host → device, the NCCL call, device → host. NCCL only moves bytes here — all-gather,
//! broadcast, and an all-to-all of grouped sends and receives — and the sums of a
//! reduce-scatter or all-reduce are taken on the host in rank order, exactly as the in-process
//! group and MPI take them, so every backend gives the same bits. (NCCL's own reductions sum
//! in an order that depends on its algorithm and the topology.)
//!
//! The ranks meet through an [`NcclId`], created by rank 0 and handed to the others by MPI
//! broadcast ([`NcclId::to_f32s`] / [`NcclId::from_f32s`] through any `Collective`) or by a
//! file on a shared file system ([`NcclId::publish`] / [`NcclId::wait_for`]).
//!
//! A worker thread owns the communicator and makes every NCCL call; the caller waits at most
//! the time-out, then the communicator is failed: a dead peer makes the others return
//! [`CommError::Timeout`], never hang. Run on one H100 (a one-rank communicator, and two ranks
//! refused on one GPU); never yet on two GPUs.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaStream;
use cudarc::nccl::safe::{Comm, Id};

use crate::collective::{check_scatter_gather, Buf, BufMut, Collective, CommKind};
use crate::error::CommError;
use crate::timed_worker::TimedWorker;

fn backend(message: impl Into<String>) -> CommError {
    CommError::Backend {
        source: message.into().into(),
    }
}

/// Why libnccl did not load, and the usual fix.
const NO_LIBNCCL: &str = "libnccl could not be loaded (cudarc opens libnccl.so or \
                          libnccl.so.13; NVIDIA's nccl wheel ships only libnccl.so.2: link \
                          it as libnccl.so in a folder on LD_LIBRARY_PATH)";

/// The version of the libnccl this process loads, as `(major, minor, patch)`, or a typed
/// error saying why none loads — never a panic (cudarc panics on a missing library).
pub fn nccl_version() -> Result<(u32, u32, u32), CommError> {
    // SAFETY: only tries to open the library by its candidate names.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(backend(NO_LIBNCCL));
    }
    let code = std::panic::catch_unwind(cudarc::nccl::result::get_nccl_version)
        .map_err(|_| backend(NO_LIBNCCL))?
        .map_err(|e| backend(format!("ncclGetVersion: {e:?}")))?;
    Ok(split_version(u32::try_from(code).unwrap_or(0)))
}

/// NCCL's version code: `major·10000 + minor·100 + patch` since 2.9 (`major·1000 + minor·100 +
/// patch` before).
fn split_version(code: u32) -> (u32, u32, u32) {
    if code >= 20900 {
        (code / 10000, code / 100 % 100, code % 100)
    } else {
        (code / 1000, code / 100 % 10, code % 100)
    }
}

/// The 128 bytes that name one NCCL communicator (NCCL's `ncclUniqueId`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl NcclId {
    /// A fresh id (rank 0 makes it; it loads libnccl, so it fails with a typed error where
    /// NCCL is missing).
    pub fn new() -> Result<Self, CommError> {
        let id = std::panic::catch_unwind(Id::new)
            .map_err(|_| backend(NO_LIBNCCL))?
            .map_err(|e| backend(format!("ncclGetUniqueId: {e:?}")))?;
        let mut out = [0u8; 128];
        for (o, &c) in out.iter_mut().zip(id.internal()) {
            *o = c as u8;
        }
        Ok(NcclId(out))
    }

    /// The id as 32 f32 bit patterns, to broadcast through a [`Collective`] (MPI).
    pub fn to_f32s(&self) -> [f32; 32] {
        let mut out = [0f32; 32];
        for (o, c) in out.iter_mut().zip(self.0.chunks_exact(4)) {
            *o = f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        }
        out
    }

    /// The id from [`NcclId::to_f32s`]'s patterns.
    pub fn from_f32s(v: &[f32; 32]) -> Self {
        let mut out = [0u8; 128];
        for (o, x) in out.chunks_exact_mut(4).zip(v) {
            o.copy_from_slice(&x.to_bits().to_le_bytes());
        }
        NcclId(out)
    }

    /// Rank 0: write the id to `path` ([`crate::rendezvous::publish_id`]).
    pub fn publish(&self, path: &Path) -> Result<(), CommError> {
        crate::rendezvous::publish_id(path, &self.0)
    }

    /// The other ranks: wait at most `timeout` for `path` to appear, then read the id
    /// ([`crate::rendezvous::wait_for_id`]).
    pub fn wait_for(path: &Path, timeout: Duration) -> Result<Self, CommError> {
        crate::rendezvous::wait_for_id(path, timeout).map(NcclId)
    }
}

/// What the worker thread owns: the communicator and the stream it runs on.
struct NcclContext {
    comm: Comm,
    stream: Arc<CudaStream>,
}

/// One rank's NCCL communicator on GPU `ordinal`, as a [`Collective`].
pub struct NcclCollective {
    rank: usize,
    world: usize,
    worker: TimedWorker<NcclContext>,
}

impl std::fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("timeout", &self.worker.timeout())
            .finish_non_exhaustive()
    }
}

impl NcclCollective {
    /// Rank `rank` of `world` on GPU `ordinal`, joining the communicator `id` names; waits at
    /// most `timeout` for the others there and in every operation. A machine without a GPU,
    /// without libcuda or without libnccl gets a typed error.
    pub fn new(
        ordinal: usize,
        rank: usize,
        world: usize,
        id: NcclId,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        if world == 0 || rank >= world {
            return Err(CommError::EmptyGroup);
        }
        let cuda = headroom_cuda::Cuda::new(ordinal).map_err(|e| CommError::Backend {
            source: Box::new(e),
        })?;
        let stream = cuda.stream().clone();
        let (worker, ()) = TimedWorker::spawn("headroom-zero-nccl", "NCCL", timeout, move || {
            let mut internal = [0 as std::ffi::c_char; 128];
            for (i, &b) in internal.iter_mut().zip(&id.0) {
                *i = b as std::ffi::c_char;
            }
            let comm = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                Comm::from_rank(stream.clone(), rank, world, Id::uninit(internal))
            }));
            match comm {
                Ok(Ok(comm)) => Ok((NcclContext { comm, stream }, ())),
                Ok(Err(e)) => Err(format!("ncclCommInitRank: {e:?}")),
                Err(_) => Err(NO_LIBNCCL.to_string()),
            }
        })?;
        Ok(NcclCollective {
            rank,
            world,
            worker,
        })
    }

    /// Run `f` on the worker and wait at most the time-out.
    fn call<R, F>(&mut self, op: CommKind, f: F) -> Result<R, CommError>
    where
        R: Send + 'static,
        F: FnOnce(&Comm, &Arc<CudaStream>) -> Result<R, String> + Send + 'static,
    {
        self.worker
            .call(op, move |ctx: &NcclContext| f(&ctx.comm, &ctx.stream))
    }
}

/// The bytes of a buffer (f32 or bf16 bit patterns, little-endian).
fn bytes_of(b: Buf<'_>) -> Vec<u8> {
    match b {
        Buf::F32(s) => s.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Buf::Bf16(s) => s.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// Write `bytes` back into `out` (same element type the bytes came from).
fn write_bytes(bytes: &[u8], out: BufMut<'_>) {
    match out {
        BufMut::F32(d) => d
            .iter_mut()
            .zip(bytes.chunks_exact(4))
            .for_each(|(d, c)| *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        BufMut::Bf16(d) => d
            .iter_mut()
            .zip(bytes.chunks_exact(2))
            .for_each(|(d, c)| *d = u16::from_le_bytes([c[0], c[1]])),
    }
}

fn nccl_err(what: &str) -> impl Fn(cudarc::nccl::result::NcclError) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

fn driver_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// All-gather of `send` (the same length on every rank) on the device: every rank's bytes in
/// rank order.
fn gather_bytes(
    comm: &Comm,
    stream: &Arc<CudaStream>,
    send: &[u8],
    world: usize,
) -> Result<Vec<u8>, String> {
    let src = stream
        .clone_htod(send)
        .map_err(driver_err("host to device"))?;
    let mut dst = stream
        .alloc_zeros::<u8>(send.len() * world)
        .map_err(driver_err("device allocation"))?;
    comm.all_gather(&src, &mut dst)
        .map_err(nccl_err("ncclAllGather"))?;
    stream.synchronize().map_err(driver_err("synchronize"))?;
    stream
        .clone_dtoh(&dst)
        .map_err(driver_err("device to host"))
}

/// All-to-all on the device: block `j` of `send` (of `world` equal blocks) goes to rank `j`;
/// block `j` of the result came from rank `j`.
fn all_to_all_bytes(
    comm: &Comm,
    stream: &Arc<CudaStream>,
    send: &[u8],
    world: usize,
) -> Result<Vec<u8>, String> {
    let k = send.len() / world.max(1);
    let src = stream
        .clone_htod(send)
        .map_err(driver_err("host to device"))?;
    let mut dst = stream
        .alloc_zeros::<u8>(send.len())
        .map_err(driver_err("device allocation"))?;
    cudarc::nccl::result::group_start().map_err(nccl_err("ncclGroupStart"))?;
    let mut sent = Ok(());
    for peer in 0..world {
        let s = src.slice(peer * k..(peer + 1) * k);
        let mut r = dst.slice_mut(peer * k..(peer + 1) * k);
        let p = i32::try_from(peer).map_err(|_| "rank out of range".to_string())?;
        if let Err(e) = comm.send(&s, p) {
            sent = Err(nccl_err("ncclSend")(e));
        }
        if let Err(e) = comm.recv(&mut r, p) {
            sent = Err(nccl_err("ncclRecv")(e));
        }
    }
    cudarc::nccl::result::group_end().map_err(nccl_err("ncclGroupEnd"))?;
    sent?;
    stream.synchronize().map_err(driver_err("synchronize"))?;
    stream
        .clone_dtoh(&dst)
        .map_err(driver_err("device to host"))
}

/// Sum the `world` blocks of `recv` (block `r` from rank `r`) in rank order, as the in-process
/// group does: f32 adds for f32; for bf16, f32 accumulation and one rounding.
fn sum_blocks(recv: &[u8], world: usize, bf16: bool) -> Vec<u8> {
    if bf16 {
        let v: Vec<u16> = recv
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        let k = v.len() / world.max(1);
        let mut acc = vec![0f32; k];
        for block in v.chunks_exact(k.max(1)).take(world) {
            acc.iter_mut()
                .zip(block)
                .for_each(|(a, &x)| *a += half::bf16::from_bits(x).to_f32());
        }
        acc.into_iter()
            .flat_map(|a| half::bf16::from_f32(a).to_bits().to_le_bytes())
            .collect()
    } else {
        let v: Vec<f32> = recv
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let k = v.len() / world.max(1);
        let mut out = v.get(..k).unwrap_or(&[]).to_vec();
        for block in v
            .chunks_exact(k.max(1))
            .skip(1)
            .take(world.saturating_sub(1))
        {
            out.iter_mut().zip(block).for_each(|(o, &x)| *o += x);
        }
        out.into_iter().flat_map(|x| x.to_le_bytes()).collect()
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce(&mut self, buf: BufMut<'_>) -> Result<(), CommError> {
        let world = self.world;
        let n = buf.len();
        let bf16 = matches!(buf, BufMut::Bf16(_));
        let width = if bf16 { 2 } else { 4 };
        let q = n.div_ceil(world);
        // Padded so every rank owns an equal chunk: the all-to-all sends chunk r to rank r.
        let mut send = bytes_of(buf.as_buf());
        send.resize(q * world * width, 0);
        let full = self.call(CommKind::AllReduce, move |comm, stream| {
            let mine = sum_blocks(&all_to_all_bytes(comm, stream, &send, world)?, world, bf16);
            gather_bytes(comm, stream, &mine, world)
        })?;
        write_bytes(&full, buf);
        Ok(())
    }

    fn reduce_scatter(&mut self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        let op = CommKind::ReduceScatter;
        let world = self.world;
        check_scatter_gather(op, world, &input, &output)?;
        let bf16 = matches!(input, Buf::Bf16(_));
        let send = bytes_of(input);
        let mine = self.call(op, move |comm, stream| {
            Ok(sum_blocks(
                &all_to_all_bytes(comm, stream, &send, world)?,
                world,
                bf16,
            ))
        })?;
        write_bytes(&mine, output);
        Ok(())
    }

    fn all_gather(&mut self, input: Buf<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        let op = CommKind::AllGather;
        let world = self.world;
        check_scatter_gather(op, world, &input, &output)?;
        let send = bytes_of(input);
        let full = self.call(op, move |comm, stream| {
            gather_bytes(comm, stream, &send, world)
        })?;
        write_bytes(&full, output);
        Ok(())
    }

    fn broadcast(&mut self, buf: BufMut<'_>, root: usize) -> Result<(), CommError> {
        let op = CommKind::Broadcast;
        let world = self.world;
        if root >= world {
            return Err(CommError::InvalidRoot { op, root, world });
        }
        let root = i32::try_from(root).map_err(|_| CommError::InvalidRoot { op, root, world })?;
        let mut data = bytes_of(buf.as_buf());
        let data = self.call(op, move |comm, stream| {
            let mut dev = stream
                .clone_htod(&data)
                .map_err(driver_err("host to device"))?;
            comm.broadcast_in_place(&mut dev, root)
                .map_err(nccl_err("ncclBroadcast"))?;
            stream.synchronize().map_err(driver_err("synchronize"))?;
            data = stream
                .clone_dtoh(&dev)
                .map_err(driver_err("device to host"))?;
            Ok(data)
        })?;
        write_bytes(&data, buf);
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let world = self.world;
        self.call(CommKind::Barrier, move |comm, stream| {
            gather_bytes(comm, stream, &[0u8], world).map(|_| ())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_of_both_eras_split() {
        assert_eq!(split_version(22803), (2, 28, 3));
        assert_eq!(split_version(20900), (2, 9, 0));
        assert_eq!(split_version(2708), (2, 7, 8));
    }
}
