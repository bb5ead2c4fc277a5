//! Data-parallel training under ZeRO (`headroom train --zero S --ranks N`): N ranks, each a
//! thread with its own tracked backend, its own [`ZeroEngine`] (headroom-zero) and its own
//! shard of the data, talking through a [`Collective`] — the in-process group here, MPI or
//! NCCL where those run the same code. A rank's model runs on the CPU or on a GPU
//! (`--device cuda`); its engine is always in host memory (the private `RankBackend` trait
//! says how a part's gradients get there).
//!
//! The model code is the single-process model's: every rank runs
//! [`Model::forward_backward_parts`] with the engine as its [`PartStore`]. The model holds no
//! weights of its own; each part's weights come from the engine for each use, and each part's
//! gradients go to the engine as soon as the part's backward is done (stages 2–3
//! reduce-scatter them bucket by bucket meanwhile). Stage 3 all-gathers a part just before
//! its use and frees it right after; the order of uses under the checkpoint schedule is
//! known in advance ([`Part::access_order`]), so the next part's all-gather runs while this
//! one computes, and a block recomputed just before its backward is gathered once for both.
//! After the step's micro-batches each rank updates its shard with AdamW — headroom-offload's
//! fused kernel, elementwise, so a shard's update is bitwise the update of the whole tensor.
//!
//! Batch: `--batch` is the global batch; each rank runs `batch / N` sequences per step in
//! micro-batches of `--micro-batch`, every micro-batch's loss gradient seeded with
//! `1 / (batch · seq)`, so the summed gradient is the global mean's, as in one process.
//!
//! Trade-off: a part's weights reach the model as a copy in [`MemoryCategory::Workspace`]
//! (the model's ops take one tensor per weight; the engine keeps one flat buffer per layer).
//! The copy is one part at a time, a memory copy against the part's GEMMs, and it keeps the
//! engine's parameter, gradient and optimizer bytes exactly its stage's formula.

use std::cell::{Cell, RefCell};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_ckpt::Schedule;
use headroom_mmap_data::{
    Loader, LoaderConfig, OutputType, SamplerConfig, SamplingMode, Shard, TokenDataset,
};
use headroom_offload::{fused_step, AdamWHyper, Isa, StatePrecision, StepScalars};
use headroom_profiler::{label_absolute, MemorySnapshot, MemoryTracker};
use headroom_tensor::cpu::kernels::FloatSlice;
use headroom_tensor::{Backend, BoxedError, Cpu, CpuTensor, DType, Device, MemoryCategory, Shape};

use crate::checkpoint::RunSpec;
use crate::companions::Companions;
use crate::engine::ComputeDevice;
use headroom_zero::{
    Collective, CommStats, CountingCollective, InProcessGroup, ShardOptimizer, Stage, UpdatePiece,
    ZeroConfig, ZeroEngine,
};

use crate::model::{
    counted_targets, params, Geometry, Model, ModelOps, Part, PartStore, Precision,
};
use crate::techniques::{block_schedule, CheckpointChoice, OptimizerPlacement};
use crate::train::{StepLog, TrainOptions};
use crate::zero_checkpoint::{self, ZeroCheckpoint};
use crate::{Result, TrainError};

/// How a ZeRO run is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZeroOptions {
    /// What is sharded.
    pub stage: Stage,
    /// Data-parallel ranks.
    pub ranks: usize,
    /// How long a rank waits for the others in a collective before it gives up with a typed
    /// error (a rank that died never answers).
    pub timeout: Duration,
    /// Gather every parameter to the caller at the end ([`ZeroReport::parameters`]).
    pub collect_parameters: bool,
}

impl ZeroOptions {
    /// `stage` on `ranks` in-process ranks, a 60 s time-out, no final gather.
    pub fn new(stage: Stage, ranks: usize) -> Self {
        ZeroOptions {
            stage,
            ranks,
            timeout: Duration::from_secs(60),
            collect_parameters: false,
        }
    }
}

/// One rank's figures at the end of a run.
#[derive(Debug)]
pub struct RankReport {
    /// The rank.
    pub rank: usize,
    /// Its tracker's snapshot: bytes by category, live and peak.
    pub memory: MemorySnapshot,
    /// What went through its collective, all steps together.
    pub comm: CommStats,
    /// What went through its collective in the last step alone.
    pub last_step_comm: CommStats,
    /// Its host ledger: the optimizer shard (and fp32 masters) under ZeRO-Offload, else
    /// empty.
    pub host_memory: MemorySnapshot,
}

/// The outcome of a ZeRO run.
#[derive(Debug)]
pub struct ZeroReport {
    /// Every step's log: the loss over the global batch, the slowest rank's time, the largest
    /// rank's bytes.
    pub steps: Vec<StepLog>,
    /// Every rank's memory and communication, by rank.
    pub ranks: Vec<RankReport>,
    /// The checkpoint schedule the blocks ran under.
    pub schedule: Schedule,
    /// With [`ZeroOptions::collect_parameters`]: every parameter of record (the fp32 masters
    /// in mixed precision), in [`params::param_infos`] order.
    pub parameters: Option<Vec<Vec<f32>>>,
    /// True when the run ended early because [`TrainOptions::stop`] was set (after saving a
    /// checkpoint, when it has a root).
    pub stopped: bool,
}

/// What a rank reports after each step.
struct RankStep {
    /// Each validation set's loss, when the step was evaluated (empty otherwise).
    val_losses: Vec<f32>,
    step: usize,
    loss_sum: f64,
    /// The global batch's counted targets (all of them without a loss mask).
    counted: u64,
    block_forwards: usize,
    grad_norm: f64,
    seconds: f64,
    live: u64,
    peak: u64,
}

/// What the ranks share, read-only.
struct Shared<'a> {
    opts: &'a TrainOptions,
    zero: ZeroOptions,
    dataset: Arc<TokenDataset>,
    schedule: Schedule,
    /// Per part: its tensors' shapes.
    shapes: Vec<Vec<Shape>>,
    /// Per part, per tensor: AdamW group (0 decays, 1 does not).
    groups: Vec<Vec<usize>>,
    micro: usize,
    /// Where a resumed run starts: every tensor whole, each rank keeps its shard.
    resume: Option<ZeroCheckpoint>,
    /// The tokenizer and generation config rank 0 writes into every checkpoint: the resumed
    /// checkpoint's, else `--init-from`'s (none in a process without rank 0).
    companions: Companions,
    /// The fixed validation sets (`--val-data`), batches of the global batch size.
    val: Vec<crate::train::ValidationSet>,
}

/// The state a resume starts from, checked against the run: a ZeRO checkpoint of any stage and
/// rank count, or an ordinary (single-process, f32 AdamW) checkpoint.
fn resume_point(
    opts: &TrainOptions,
    path: &std::path::Path,
    fingerprint: u64,
) -> Result<ZeroCheckpoint> {
    let dir = crate::checkpoint::resolve(path)?;
    let ck = if zero_checkpoint::is_zero_checkpoint(&dir) {
        zero_checkpoint::load(&dir)?
    } else {
        ZeroCheckpoint::ordinary(&crate::checkpoint::ResumePoint::open(&dir)?)?
    };
    let mut differences = Vec::new();
    if ck.state.config != opts.model {
        differences.push(format!(
            "model: checkpoint {:?}, this run {:?}",
            ck.state.config, opts.model
        ));
    }
    differences.extend(ck.state.run.differences(&opts.run_spec(), ck.state.step));
    if ck.state.dataset_fingerprint != fingerprint {
        differences.push("data: the checkpoint's position belongs to other training data".into());
    }
    if ck.state.step > opts.steps {
        differences.push(format!(
            "the checkpoint is at step {}, past this run's {} steps",
            ck.state.step, opts.steps
        ));
    }
    if !differences.is_empty() {
        return Err(TrainError::ResumeMismatch {
            path: ck.dir.clone(),
            differences,
        });
    }
    Ok(ck)
}

/// The parameter count of each part's tensors (headroom-zero's layer sizes).
pub fn part_sizes(cfg: &crate::model::ModelConfig) -> Vec<Vec<usize>> {
    let infos = params::param_infos(cfg);
    Part::all(cfg)
        .into_iter()
        .map(|p| {
            infos[p.params(cfg)]
                .iter()
                .map(|i| i.shape.iter().product())
                .collect()
        })
        .collect()
}

/// Check a ZeRO run's settings before any rank starts.
fn check(opts: &TrainOptions, zero: &ZeroOptions) -> Result<usize> {
    opts.validate()?;
    let refuse = |what: &str| Err(TrainError::Config(format!("--zero: {what}")));
    if zero.ranks == 0 {
        return Err(TrainError::Option {
            option: "--ranks",
            reason: "must be at least 1".into(),
        });
    }
    // Without --micro-batch each rank runs its whole share at once.
    let micro = opts
        .techniques
        .micro_batch
        .unwrap_or(opts.batch / zero.ranks)
        .max(1);
    if !opts.batch.is_multiple_of(zero.ranks) || !(opts.batch / zero.ranks).is_multiple_of(micro) {
        return Err(TrainError::Option {
            option: "--batch",
            reason: format!(
                "the global batch {} must split into {} ranks of whole micro-batches of {micro}",
                opts.batch, zero.ranks
            ),
        });
    }
    let tech = &opts.techniques;
    if let ComputeDevice::Cuda { .. } = opts.device {
        // The CUDA model's own limits (bf16, flash attention, its head dimensions).
        #[cfg(feature = "cuda")]
        crate::cuda::check_options(&opts.model, &tech.model)?;
        #[cfg(not(feature = "cuda"))]
        return Err(no_cuda_build());
    }
    if tech.finetune.is_some() {
        return refuse("LoRA / QLoRA train adapters only; shard them with plain data parallelism");
    }
    if matches!(tech.optimizer.placement, OptimizerPlacement::File(_))
        || tech.optimizer.state != StatePrecision::F32
    {
        return refuse("each rank keeps its optimizer shard as f32 AdamW, beside it or in host RAM (--offload ram); no file-backed or 8-bit state");
    }
    if tech.model.precision == Precision::Fp16 {
        return refuse("fp16 needs a loss scaler; use bf16");
    }
    if matches!(tech.checkpoint, CheckpointChoice::Optimal(None)) {
        return refuse(
            "the optimal schedule needs an explicit activation budget (--checkpoint optimal:MiB)",
        );
    }
    if opts.merge_into.is_some() {
        return refuse("--merge-into needs adapters");
    }
    Ok(micro)
}

/// Refuse, before anything is allocated, a run whose `local` ranks (the ones this process
/// runs) would need more than the machine's physical memory by the ZeRO estimate.
fn check_machine_memory(
    opts: &TrainOptions,
    zero: &ZeroOptions,
    micro: usize,
    local: usize,
) -> Result<()> {
    // A CUDA rank's estimate is mostly device memory (its activations, the gathered parts);
    // the device's allocator refuses what does not fit there.
    if !opts.check_machine_memory || opts.device != ComputeDevice::Cpu {
        return Ok(());
    }
    let e = rank_estimate(opts, zero, micro)?;
    let need = e.device_peak.saturating_mul(local as u64);
    if let Some(have) = crate::train::machine_memory_bytes() {
        if need > have {
            return Err(TrainError::MachineMemory { need, have });
        }
    }
    Ok(())
}

/// What each rank of [`train_zero`] with these options would hold, by category, before
/// anything runs (`headroom estimate --zero`): the same checks as the run (`--batch` is the
/// global batch, split over the ranks in whole micro-batches), then
/// [`zero_estimate`](crate::zero_estimate::zero_estimate) of one rank's share. Returns the
/// micro-batch too.
pub fn estimate_run(
    opts: &TrainOptions,
    zero: &ZeroOptions,
) -> Result<(crate::zero_estimate::ZeroEstimate, usize)> {
    if opts.device != ComputeDevice::Cpu {
        // The replay is of a rank whose model and shards share one memory; a CUDA rank keeps
        // its shards on the host and only the parts in use on the GPU.
        return Err(TrainError::Config(
            "the ZeRO estimate models ranks whose sharded state is on their own device (what \
             NCCL ranks keep, and CPU ranks run): leave out --device for those per-device \
             figures; headroom's CUDA ranks, which keep the shards in host memory, are not \
             modelled"
                .into(),
        ));
    }
    let micro = check(opts, zero)?;
    Ok((rank_estimate(opts, zero, micro)?, micro))
}

fn rank_estimate(
    opts: &TrainOptions,
    zero: &ZeroOptions,
    micro: usize,
) -> Result<crate::zero_estimate::ZeroEstimate> {
    let e = crate::zero_estimate::zero_estimate(
        &opts.model,
        opts.seq,
        micro,
        opts.batch / zero.ranks,
        &opts.techniques,
        zero.stage,
        zero.ranks,
    )?;
    let (rows, masked) = (
        opts.batch / zero.ranks,
        crate::train::data_has_loss_mask(opts),
    );
    let e = if masked {
        e.with_loss_mask_flags(rows, opts.seq)
    } else {
        e
    };
    Ok(if opts.documents.is_some() {
        e.with_document_positions(rows, opts.seq, masked)
    } else {
        e
    })
}

/// Train under ZeRO on `zero.ranks` in-process ranks, calling `on_step` after every step
/// with the global batch's figures.
pub fn train_zero(
    opts: &TrainOptions,
    zero: ZeroOptions,
    on_step: impl FnMut(&StepLog),
) -> Result<ZeroReport> {
    let micro = check(opts, &zero)?;
    check_machine_memory(opts, &zero, micro, zero.ranks)?;
    let comms = InProcessGroup::create(zero.ranks, zero.timeout)
        .map_err(|e| TrainError::Config(format!("ZeRO rank group: {e}")))?;
    drive(opts, zero, comms, on_step)
}

/// This process's rank of a ZeRO run whose ranks are processes (`mpirun -n N headroom train
/// --zero S --dist mpi`): `comm` connects them (its world size is the rank count, which
/// replaces `zero.ranks`). Every process calls this with the same options; each runs its rank,
/// and `on_step` sees the global loss and this rank's time and bytes. The report holds this
/// rank alone.
pub fn train_zero_dist<C: Collective + 'static>(
    opts: &TrainOptions,
    mut zero: ZeroOptions,
    comm: C,
    on_step: impl FnMut(&StepLog),
) -> Result<ZeroReport> {
    zero.ranks = comm.world_size();
    let micro = check(opts, &zero)?;
    check_machine_memory(opts, &zero, micro, 1)?;
    drive(opts, zero, vec![comm], on_step)
}

/// Run the ranks of `comms` (all of them in-process, or this process's one) on threads,
/// logging each step once every local rank finished it.
fn drive<C: Collective + 'static>(
    opts: &TrainOptions,
    zero: ZeroOptions,
    comms: Vec<C>,
    mut on_step: impl FnMut(&StepLog),
) -> Result<ZeroReport> {
    let micro = check(opts, &zero)?;
    let cfg = &opts.model;
    let infos = params::param_infos(cfg);
    let parts = Part::all(cfg);
    let shapes: Vec<Vec<Shape>> = parts
        .iter()
        .map(|p| {
            infos[p.params(cfg)]
                .iter()
                .map(|i| Shape::from(i.shape.clone()))
                .collect()
        })
        .collect();
    // GPT-2 practice, as the single-process trainer: decay matrices and embeddings only.
    let groups = parts
        .iter()
        .map(|p| {
            infos[p.params(cfg)]
                .iter()
                .map(|i| if i.shape.len() >= 2 { 0 } else { 1 })
                .collect()
        })
        .collect();
    let schedule = block_schedule(opts.techniques.checkpoint, cfg, || {
        let est = crate::estimate::estimate(cfg, opts.seq, micro, opts.batch, &opts.techniques)?;
        let budget = match opts.techniques.checkpoint {
            CheckpointChoice::Optimal(Some(b)) => b,
            _ => unreachable_budget()?,
        };
        Ok((est.block_chain_cost()?, budget))
    })?;
    let (dataset, _) = crate::train::open_data(opts)?;
    // The process holding rank 0 locks the root (ranks in one process share its lock; a second
    // job's rank 0 is refused, and its other ranks stop with the group).
    let _root_lock = match &opts.save {
        Some((root, _)) if comms.iter().any(|c| c.rank() == 0) => {
            let lock = crate::checkpoint::lock_root(root)?;
            // Every rank's shard lands in the one root, as `train` checks for one process.
            let bytes = zero_checkpoint::state_bytes(&opts.model)?;
            crate::checkpoint::check_room(root, bytes, "--checkpoint-dir")?;
            lock
        }
        _ => None,
    };
    let resume = match &opts.resume_from {
        Some(path) => {
            let ck = resume_point(opts, path, dataset.fingerprint())?;
            if let Some((root, _)) = &opts.save {
                crate::checkpoint::refuse_later_checkpoints(root, ck.state.step)?;
            }
            Some(ck)
        }
        None => {
            if let Some((root, _)) = &opts.save {
                crate::checkpoint::refuse_used_root(root)?;
            }
            None
        }
    };
    // Read before the first step, so a bad file is refused then, as `train` refuses it.
    let companions = if opts.save.is_some() && comms.iter().any(|c| c.rank() == 0) {
        let saved = resume.as_ref().map(|ck| ck.companions.clone());
        Companions::of_run(saved, opts.init_from.as_deref(), &opts.tokenizer_settings())?
    } else {
        Companions::none()
    };
    let shared = Shared {
        opts,
        zero,
        dataset,
        schedule: schedule.clone(),
        shapes,
        groups,
        micro,
        resume,
        companions,
        val: crate::train::validation_sets(opts)?,
    };
    let local = comms.len();
    let (tx, rx) = mpsc::channel::<RankStep>();
    let tokens_per_step = (opts.batch * opts.seq) as u64;
    let mut logs: Vec<StepLog> = Vec::new();
    let first_step = shared.resume.as_ref().map_or(0, |ck| ck.state.step);
    let outcomes: Vec<std::thread::Result<Result<RankOutcome>>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let tx = tx.clone();
                let shared = &shared;
                s.spawn(move || run_rank(shared, comm, tx))
            })
            .collect();
        drop(tx);
        // Steps complete on every rank in order; a step is logged once every rank reported it.
        let mut pending: Vec<Vec<RankStep>> = Vec::new();
        for msg in rx {
            let at = msg.step - first_step;
            if pending.len() <= at {
                pending.resize_with(at + 1, Vec::new);
            }
            pending[at].push(msg);
            while let Some(done) = pending.get(logs.len()).filter(|p| p.len() == local) {
                let step = first_step + logs.len();
                let first = &done[0];
                // Every rank reports the same global sum.
                let loss_sum = first.loss_sum;
                let seconds = done.iter().map(|r| r.seconds).fold(0.0, f64::max);
                let log = StepLog {
                    step,
                    loss: if first.counted == 0 {
                        f32::NAN
                    } else {
                        (loss_sum / first.counted as f64) as f32
                    },
                    lr: opts.lr_at(step),
                    grad_norm: first.grad_norm,
                    applied: first.counted > 0,
                    loss_scale: 1.0,
                    block_forwards: first.block_forwards,
                    seconds,
                    tokens_per_s: tokens_per_step as f64 / seconds,
                    live_bytes: done.iter().map(|r| r.live).max().unwrap_or(0),
                    peak_bytes: done.iter().map(|r| r.peak).max().unwrap_or(0),
                    val_loss: (!first.val_losses.is_empty()).then(|| {
                        let per_set: Vec<(f32, u64)> = first
                            .val_losses
                            .iter()
                            .zip(&shared.val)
                            .map(|(&loss, set)| (loss, set.counted()))
                            .collect();
                        crate::train::overall_loss(&per_set)
                    }),
                    val_losses: first.val_losses.clone(),
                    counted_targets: first.counted,
                };
                on_step(&log);
                logs.push(log);
            }
        }
        handles.into_iter().map(|h| h.join()).collect()
    });
    let mut ranks = Vec::with_capacity(local);
    let mut parameters = None;
    let mut stopped = false;
    let mut errors = Vec::new();
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        match outcome {
            Ok(Ok(o)) => {
                stopped |= o.stopped;
                if parameters.is_none() {
                    parameters = o.parameters;
                }
                ranks.push(o.report);
            }
            Ok(Err(e)) => errors.push((rank, e)),
            Err(_) => errors.push((
                rank,
                TrainError::Config(format!("ZeRO rank {rank} panicked")),
            )),
        }
    }
    if !errors.is_empty() {
        // The rank that failed first is the cause; the others time out waiting for it.
        let pos = errors
            .iter()
            .position(|(_, e)| !is_comm_timeout(e))
            .unwrap_or(0);
        let (rank, e) = errors.swap_remove(pos);
        return Err(TrainError::Rank {
            rank,
            source: Box::new(e),
        });
    }
    Ok(ZeroReport {
        steps: logs,
        ranks,
        schedule,
        parameters,
        stopped,
    })
}

fn unreachable_budget() -> Result<u64> {
    Err(TrainError::Config(
        "the optimal schedule needs an explicit activation budget".into(),
    ))
}

/// Whether an error is a rank giving up on a peer (rather than the peer's own failure).
fn is_comm_timeout(e: &TrainError) -> bool {
    matches!(
        e,
        TrainError::Zero(headroom_zero::ZeroError::Comm(_) | headroom_zero::ZeroError::Broken)
    )
}

struct RankOutcome {
    stopped: bool,
    report: RankReport,
    parameters: Option<Vec<Vec<f32>>>,
}

fn zero_err(e: headroom_zero::ZeroError) -> TrainError {
    TrainError::Zero(e)
}

/// One rank's whole run, and its memory timeline when one is asked for (`--memory-trace`,
/// `--memory-svg`, `--memory-snapshot`): each rank writes its own files, the path with
/// `.rank{r}` before the extension ([`rank_path`]), as PyTorch's per-rank snapshots are kept.
fn run_rank<C: Collective + 'static>(
    shared: &Shared<'_>,
    comm: C,
    tx: mpsc::Sender<RankStep>,
) -> Result<RankOutcome> {
    let opts = shared.opts;
    let (rank, world) = (comm.rank(), comm.world_size());
    let tracker = Arc::new(MemoryTracker::new());
    let device = compute_device(opts.device);
    tracker.set_budget(device, opts.budget);
    let outputs = &opts.memory_outputs;
    if !outputs.any() {
        return run_rank_tracked(shared, comm, tx, tracker);
    }
    tracker.start_timeline();
    let result = run_rank_tracked(shared, comm, tx, tracker.clone());
    let Some(timeline) = tracker.stop_timeline() else {
        return result;
    };
    let mine = crate::train::MemoryOutputs {
        trace: outputs.trace.as_deref().map(|p| rank_path(p, rank)),
        svg: outputs.svg.as_deref().map(|p| rank_path(p, rank)),
        svg_by_event: outputs.svg_by_event,
        snapshot: outputs.snapshot.as_deref().map(|p| rank_path(p, rank)),
    };
    let title = format!(
        "{}, {} rank {rank} of {world}",
        crate::train::timeline_title(opts),
        shared.zero.stage
    );
    let written = mine.write(&timeline, device, opts.budget, &title);
    // A failed run reports its own error; the files are best-effort then.
    if result.is_ok() {
        written?;
    }
    result
}

/// Rank `rank`'s file for `path`: `mem.json` → `mem.rank0.json`, `mem` → `mem.rank0`.
pub fn rank_path(path: &std::path::Path, rank: usize) -> std::path::PathBuf {
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let name = match path.extension() {
        Some(ext) => format!("{stem}.rank{rank}.{}", ext.to_string_lossy()),
        None => format!("{stem}.rank{rank}"),
    };
    path.with_file_name(name)
}

/// The tracker's device for a run on `d`.
fn compute_device(d: ComputeDevice) -> Device {
    match d {
        ComputeDevice::Cpu => Device::Cpu,
        ComputeDevice::Cuda { ordinal } => Device::Cuda(ordinal),
    }
}

/// [`run_rank`] with the rank's allocations reported to `tracker`, on the run's device.
fn run_rank_tracked<C: Collective + 'static>(
    shared: &Shared<'_>,
    comm: C,
    tx: mpsc::Sender<RankStep>,
    tracker: Arc<MemoryTracker>,
) -> Result<RankOutcome> {
    let host_tracker = Arc::new(MemoryTracker::new());
    match shared.opts.device {
        ComputeDevice::Cpu => {
            // The model and the engine share one tracked backend: a CPU rank's memory is all
            // "device" memory, with the optimizer shard alone on the host's ledger under
            // ZeRO-Offload.
            let cpu = Cpu::new()
                .with_alloc_hook(tracker.clone())
                .with_buffer_cache(usize::MAX);
            run_rank_on(shared, comm, tx, tracker, host_tracker, cpu.clone(), cpu)
        }
        #[cfg(feature = "cuda")]
        ComputeDevice::Cuda { ordinal } => {
            let cuda = cuda_rank_device(ordinal, comm.rank(), comm.world_size())?
                .with_alloc_hook(tracker.clone());
            let host = Cpu::new().with_alloc_hook(host_tracker.clone());
            run_rank_on(shared, comm, tx, tracker, host_tracker, cuda, host)
        }
        #[cfg(not(feature = "cuda"))]
        ComputeDevice::Cuda { .. } => Err(no_cuda_build()),
    }
}

/// The GPU of a CUDA rank.
#[cfg(feature = "cuda")]
fn cuda_rank_device(first: usize, rank: usize, world: usize) -> Result<headroom_cuda::Cuda> {
    let gpu = rank_gpu(first, rank, world, headroom_cuda::device_count(), |k| {
        std::env::var(k).ok()
    });
    headroom_cuda::Cuda::new(gpu)
        .map_err(|e| TrainError::from(crate::cuda::CudaGptError::Device(e)))
}

/// The GPU ordinal of rank `rank` of `world`: `first` plus the rank's place on its machine,
/// wrapped around the machine's `count` GPUs, so that the ranks of one machine spread over its
/// GPUs and share them round-robin when they are fewer. The place is the launcher's local rank
/// (`mpirun`, `srun`, `torchrun`; [`headroom_zero::rendezvous::launched_rank`]) when this
/// process is that rank of a launched job, and the rank itself otherwise (ranks as threads of
/// one process, even one that a launcher started).
pub fn rank_gpu(
    first: usize,
    rank: usize,
    world: usize,
    count: usize,
    env: impl Fn(&str) -> Option<String>,
) -> usize {
    let local = match headroom_zero::rendezvous::launched_rank(env) {
        Ok(me) if me.rank == rank && me.world == world => me.local.unwrap_or(rank),
        _ => rank,
    };
    (first + local) % count.max(1)
}

/// This process's rank of a ZeRO job whose collectives run on NCCL (`headroom train --zero S
/// --device cuda --dist nccl --nccl-id-file FILE`, one process per GPU): its rank and the
/// job's size from the launcher's environment, its GPU as the model's ([`rank_gpu`]), and the
/// communicator's id from rank 0 through `id_file` on a file system every rank sees (removed
/// by rank 0 once every rank has joined). Waits at most `timeout` for the others.
#[cfg(feature = "cuda")]
pub fn connect_nccl(
    opts: &TrainOptions,
    id_file: &std::path::Path,
    timeout: Duration,
) -> Result<Box<dyn Collective>> {
    use headroom_zero::rendezvous;
    let ComputeDevice::Cuda { ordinal } = opts.device else {
        return Err(nccl_needs_gpus());
    };
    let comm_err = |what: &str, e: headroom_zero::CommError| {
        TrainError::Config(format!("--dist nccl: {what}: {e}"))
    };
    let env = |k: &str| std::env::var(k).ok();
    let me = rendezvous::launched_rank(env).map_err(|e| comm_err("this process's rank", e))?;
    let gpu = rank_gpu(
        ordinal,
        me.rank,
        me.world,
        headroom_cuda::device_count(),
        env,
    );
    let id = rendezvous::exchange_id(me.rank, id_file, timeout, || {
        headroom_zero::NcclId::new().map(|id| id.0)
    })
    .map_err(|e| comm_err("the NCCL id", e))?;
    let comm = headroom_zero::NcclCollective::new(
        gpu,
        me.rank,
        me.world,
        headroom_zero::NcclId(id),
        timeout,
    );
    // Rank 0 removes the id whether or not the communicator opened: every rank has read it
    // once it did (ncclCommInitRank returns when all have joined), and after a failure a new
    // job must not find this one's id.
    let retired = if me.rank == 0 {
        rendezvous::retire_id(id_file)
    } else {
        Ok(())
    };
    let comm = comm.map_err(|e| comm_err(&format!("rank {} on GPU {gpu}", me.rank), e))?;
    retired.map_err(|e| comm_err("the NCCL id", e))?;
    Ok(Box::new(comm))
}

/// [`connect_nccl`] in a build without the `cuda` feature: an error.
#[cfg(not(feature = "cuda"))]
pub fn connect_nccl(
    opts: &TrainOptions,
    _id_file: &std::path::Path,
    _timeout: Duration,
) -> Result<Box<dyn Collective>> {
    if opts.device == ComputeDevice::Cpu {
        return Err(nccl_needs_gpus());
    }
    Err(TrainError::Config(
        "--dist nccl: headroom-trainer was built without its `cuda` feature".into(),
    ))
}

fn nccl_needs_gpus() -> TrainError {
    TrainError::Config(
        "--dist nccl runs one rank per GPU: add --device cuda (CPU ranks in several processes: \
         --dist mpi)"
            .into(),
    )
}

#[cfg(not(feature = "cuda"))]
fn no_cuda_build() -> TrainError {
    TrainError::Config(
        "--zero on CUDA: headroom-trainer was built without its `cuda` feature".into(),
    )
}

/// A rank's run: the model on `compute`, the sharded engine (masters, gradients, optimizer
/// state, collectives) on `host`. On the CPU the two are one backend; on a GPU the engine
/// stays in host memory and each part crosses the bus once per use, up as weights and down as
/// gradients (ZeRO-Offload's arrangement), with the collectives on host buffers.
fn run_rank_on<C: Collective + 'static, B: RankBackend>(
    shared: &Shared<'_>,
    comm: C,
    tx: mpsc::Sender<RankStep>,
    tracker: Arc<MemoryTracker>,
    host_tracker: Arc<MemoryTracker>,
    compute: B,
    host: Cpu,
) -> Result<RankOutcome> {
    let opts = shared.opts;
    let cfg = &opts.model;
    let (rank, world) = (comm.rank(), comm.world_size());
    let comm = CountingCollective::new(comm);
    let counters = comm.counters();
    let device = compute.device();
    let precision = opts.techniques.model.precision;
    let zcfg = ZeroConfig::new(shared.zero.stage).with_precision(match precision {
        Precision::Fp32 => headroom_zero::Precision::Fp32,
        _ => headroom_zero::Precision::MixedBf16,
    });
    let sizes = part_sizes(cfg);
    // ZeRO-Offload: the optimizer shard (and bf16 runs' fp32 masters) on the host's ledger,
    // from the start.
    let state_on = if opts.techniques.optimizer.placement == OptimizerPlacement::HostRam {
        Cpu::new().with_alloc_hook(host_tracker.clone())
    } else {
        host.clone()
    };
    let engine =
        ZeroEngine::with_state_on(host.clone(), state_on, comm, &sizes, zcfg).map_err(zero_err)?;
    let store = EngineStore {
        engine: RefCell::new(engine),
        compute: compute.clone(),
        host: host.clone(),
        shapes: &shared.shapes,
        cfg: *cfg,
        dtype: precision.storage(),
        plan: Part::access_order(cfg, &shared.schedule)
            .into_iter()
            .map(|p| p.index(cfg))
            .collect(),
        cursor: Cell::new(0),
    };
    let start = match &shared.resume {
        Some(ck) => {
            store.load_checkpoint(ck)?;
            ck.state.step
        }
        None => {
            store.load_initial(opts)?;
            0
        }
    };

    let mut model_opts = opts.techniques.model;
    if opts.techniques.checkpoint == CheckpointChoice::Selective {
        model_opts.selective = true;
    }
    model_opts.offload_grads = false;
    let model = Model::parts_only(&compute, *cfg, model_opts)?;

    let sampler = SamplerConfig {
        mode: SamplingMode::EpochWindows,
        seq_len: opts.seq as u64,
        seed: opts.seed,
        shard: Shard::new(rank as u32, world as u32)?,
    };
    let per_rank = opts.batch / world;
    let data_label = crate::train::data_name(&opts.data);
    let mut loader_cfg = LoaderConfig::new(per_rank);
    loader_cfg.output = OutputType::U32;
    loader_cfg.documents = opts.documents;
    let mut loader = {
        let _g = MemoryCategory::Data.enter();
        let _l = label_absolute("data.batch");
        let hook = host.alloc_hook().cloned();
        if start > 0 {
            // Where an uninterrupted run of this many ranks would be.
            let at = zero_checkpoint::loader_state(
                &opts.run_spec(),
                rank,
                world,
                start,
                shared.dataset.fingerprint(),
            )?;
            Loader::resume(shared.dataset.clone(), &at, loader_cfg, hook)?
        } else {
            Loader::new(shared.dataset.clone(), sampler, loader_cfg, hook)?
        }
    };
    let mut adamw = ShardAdamW::new(opts, shared.groups.clone());
    let micro = shared.micro;
    let g = Geometry::new(micro, opts.seq);
    let rows = micro * opts.seq;
    let end = opts.stop_after.map_or(opts.steps, |k| k.min(opts.steps));
    let mut before_last = counters.snapshot();
    let mut stopped = false;
    for step in start..end {
        if tracker.is_recording() {
            tracker.mark(&format!("step {step}"));
        }
        let t0 = Instant::now();
        before_last = counters.snapshot();
        let crate::train::TokenBatch {
            tokens,
            targets,
            positions,
        } = crate::train::batch_tokens(&*loader.next_batch()?, opts.model.vocab, &data_label)?;
        // The global batch's counted targets (every target without a loss mask): each rank's
        // count, gathered (exact in f64), so every rank seeds its loss gradient with the
        // weight one process gives the whole batch.
        // (Packed documents leave out the targets that start one, so they count too.)
        let counted = if shared.dataset.has_loss_mask() || opts.documents.is_some() {
            let mine = counted_targets(&targets) as f64;
            let all = store
                .engine
                .borrow_mut()
                .gather_scalars(mine)
                .map_err(zero_err)?;
            all.iter().sum::<f64>() as u64
        } else {
            (opts.batch * opts.seq) as u64
        };
        let dloss = (1.0 / counted.max(1) as f64) as f32;
        let mut loss_sum = 0.0f64;
        let mut block_forwards = 0;
        let phase = tracker.phase("forward+backward");
        // A global batch of prompts only: no loss, no gradient, no step on any rank (they
        // all know the count), as a single process skips it.
        let batches = if counted == 0 { 0 } else { tokens.len() };
        for (i, (tok, tgt)) in tokens[..batches]
            .chunks(rows)
            .zip(targets[..batches].chunks(rows))
            .enumerate()
        {
            let documents =
                crate::train::micro_documents(positions.as_deref(), i, micro, opts.seq)?;
            let g = g.packed(documents.as_ref())?;
            let out = model.forward_backward_parts(&store, tok, tgt, g, dloss, &shared.schedule);
            // Whatever happened, nothing gathered may outlive the micro-batch: a prefetch
            // the pass did not consume would be stale after the step.
            store.release_all()?;
            let (mb_loss, stats) = out?;
            block_forwards += stats.forward_count;
            loss_sum += mb_loss as f64 * counted_targets(tgt) as f64;
        }
        drop(phase);
        adamw.lr = opts.lr_at(step);
        let grad_norm = {
            let _phase = tracker.phase("optimizer");
            let mut e = store.engine.borrow_mut();
            if counted == 0 {
                f64::NAN
            } else if opts.grad_clip.is_finite() {
                e.step_clipped(&mut adamw, opts.grad_clip as f32)
                    .map_err(zero_err)?
                    .grad_norm
            } else {
                e.step(&mut adamw).map_err(zero_err)?;
                f64::NAN
            }
        };
        // The global batch's loss: every rank's sum, added in rank order on every rank.
        let loss_sum: f64 = store
            .engine
            .borrow_mut()
            .gather_scalars(loss_sum)
            .map_err(zero_err)?
            .iter()
            .sum();
        let val_losses = match &opts.eval {
            Some(e) if (e.every > 0 && (step + 1) % e.every == 0) || step + 1 == end => {
                let _phase = tracker.phase("eval");
                shared
                    .val
                    .iter()
                    .map(|set| {
                        validation_loss(&model, &store, &set.batches, micro, opts.seq, rank, world)
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            _ => Vec::new(),
        };
        let report = RankStep {
            val_losses,
            step,
            loss_sum,
            counted,
            block_forwards,
            grad_norm,
            seconds: t0.elapsed().as_secs_f64(),
            live: tracker.live_bytes(device),
            peak: tracker.peak_bytes(device),
        };
        // The receiver only goes away when the caller is gone.
        let _ = tx.send(report);
        // A stop request (SIGINT/SIGTERM) seen by any rank stops every rank after the same
        // step: they agree through a collective, so none waits for a peer that stopped.
        let stop = match &opts.stop {
            Some(flag) => {
                let mine = if flag.load(std::sync::atomic::Ordering::SeqCst) {
                    1.0
                } else {
                    0.0
                };
                store
                    .engine
                    .borrow_mut()
                    .gather_scalars(mine)
                    .map_err(zero_err)?
                    .iter()
                    .any(|&x| x > 0.0)
            }
            None => false,
        };
        if let Some((root, every)) = &opts.save {
            let done = step + 1;
            if (*every > 0 && done % every == 0) || done == opts.steps || stop {
                save(&store, shared, root, done, rank, world)?;
                if rank == 0 && !stop && done < opts.steps {
                    let bytes = zero_checkpoint::state_bytes(&opts.model)?;
                    crate::checkpoint::warn_if_no_room(root, bytes);
                }
            }
        }
        if stop {
            stopped = true;
            break;
        }
    }
    let parameters = if shared.zero.collect_parameters {
        let layers = store
            .engine
            .borrow_mut()
            .full_parameters()
            .map_err(zero_err)?;
        let mut out = Vec::new();
        for (flat, sizes) in layers.iter().zip(&sizes) {
            let mut at = 0;
            for &n in sizes {
                out.push(flat[at..at + n].to_vec());
                at += n;
            }
        }
        Some(out)
    } else {
        None
    };
    let comm = counters.snapshot();
    Ok(RankOutcome {
        stopped,
        report: RankReport {
            rank,
            memory: tracker.snapshot(),
            comm,
            last_step_comm: comm.since(&before_last),
            host_memory: host_tracker.snapshot(),
        },
        parameters,
    })
}

/// The engine as the model's [`PartStore`], for a model on `B`.
struct EngineStore<'a, B: RankBackend> {
    engine: RefCell<ZeroEngine>,
    /// The model's backend: part weights are made here for each use.
    compute: B,
    /// The engine's: gradients come back through here when `compute` is not the host.
    host: Cpu,
    shapes: &'a [Vec<Shape>],
    cfg: crate::model::ModelConfig,
    /// The working weights' dtype (f32, or bf16 in mixed precision).
    dtype: DType,
    /// The parts a micro-batch asks for, in order ([`Part::access_order`]), by index.
    plan: Vec<usize>,
    /// Where in `plan` the next request should be (`usize::MAX` once off the plan).
    cursor: Cell<usize>,
}

/// The mean loss over the validation batches, `micro` sequences at a time, forward only with
/// the engine's weights. The chunks are dealt out in rounds of one per rank (every batch is a
/// global batch, so the chunk count is a multiple of the rank count); each round's losses are
/// gathered and added in chunk order, so every rank reports the value one process gets by
/// summing the chunks in order. Each rank computes 1/N of the forwards; under stage 3 the ranks
/// still gather every part together, each for its own chunk.
fn validation_loss<B: RankBackend>(
    model: &Model<B>,
    store: &EngineStore<'_, B>,
    batches: &[crate::train::TokenBatch],
    micro: usize,
    seq: usize,
    rank: usize,
    ranks: usize,
) -> Result<f32> {
    let rows = micro * seq;
    let g = Geometry::new(micro, seq);
    // Each chunk: tokens, targets, and position ids when the rows are packed documents.
    type Chunk<'a> = (&'a [u32], &'a [u32], Option<&'a [u32]>);
    let chunks: Vec<Chunk<'_>> = batches
        .iter()
        .flat_map(|b| {
            let positions = b.positions.as_deref();
            b.tokens
                .chunks(rows)
                .zip(b.targets.chunks(rows))
                .enumerate()
                .map(move |(i, (tok, tgt))| {
                    (tok, tgt, positions.and_then(|p| p.chunks(rows).nth(i)))
                })
        })
        .collect();
    if !chunks.len().is_multiple_of(ranks) {
        // Every rank sees the same batches, so every rank refuses alike: none is left waiting.
        return Err(TrainError::Config(format!(
            "{} validation chunks do not deal out evenly to {ranks} ranks",
            chunks.len()
        )));
    }
    let mut mean = crate::train::ValidationMean::default();
    for round in chunks.chunks(ranks) {
        let (tok, tgt, positions) = round[rank];
        let documents = crate::train::packed_documents(positions, micro, seq)?;
        let l = model.loss_parts(store, tok, tgt, g.packed(documents.as_ref())?);
        store.release_all()?;
        // f32 losses pass through gather_scalars exactly.
        let losses = store
            .engine
            .borrow_mut()
            .gather_scalars(f64::from(l?))
            .map_err(zero_err)?;
        // One at a time, in chunk order: what a single process forms.
        for (l, (_, tgt, _)) in losses.into_iter().zip(round) {
            mean.add(l as f32, counted_targets(tgt) as u64, tgt.len());
        }
    }
    Ok(mean.mean())
}

/// Every rank: its shard into one partial directory, then rank 0 publishes it.
fn save<B: RankBackend>(
    store: &EngineStore<'_, B>,
    shared: &Shared<'_>,
    root: &std::path::Path,
    step: usize,
    rank: usize,
    ranks: usize,
) -> Result<()> {
    let opts = shared.opts;
    let mut e = store.engine.borrow_mut();
    // Rank 0 makes the directory; nobody writes before it exists, nobody publishes before
    // everyone wrote. A rank that fails here stops; the others time out at the barrier.
    let partial = if rank == 0 {
        zero_checkpoint::prepare(root, step)?
    } else {
        zero_checkpoint::partial_dir(root, step)
    };
    let mut write = || -> Result<()> {
        e.barrier().map_err(zero_err)?;
        zero_checkpoint::write_rank(&partial, &opts.model, &e, rank, ranks)?;
        e.barrier().map_err(zero_err)?;
        if rank == 0 {
            let state = zero_checkpoint::ZeroState {
                format_version: crate::checkpoint::FORMAT_VERSION,
                step,
                stage: shared.zero.stage.index(),
                ranks,
                config: opts.model,
                run: opts.run_spec(),
                dataset_fingerprint: shared.dataset.fingerprint(),
            };
            zero_checkpoint::publish(
                root,
                &partial,
                &state,
                opts.keep_checkpoints,
                &shared.companions,
            )?;
        }
        Ok(())
    };
    if rank == 0 {
        // The directory is rank 0's: a failed save (its own write, or another rank's, seen
        // at the barrier) removes it, as a one-process save does. A rank still writing then
        // fails too, and the job, which is ending anyway, ends.
        crate::checkpoint::saving_step(root, &partial, step, write)?;
    } else {
        write()?;
    }
    e.barrier().map_err(zero_err)?;
    Ok(())
}

impl<B: RankBackend> EngineStore<'_, B> {
    /// Every rank takes its shard of a checkpoint's full tensors, part by part.
    fn load_checkpoint(&self, ck: &ZeroCheckpoint) -> Result<()> {
        let mut e = self.engine.borrow_mut();
        for part in Part::all(&self.cfg) {
            let range = part.params(&self.cfg);
            let l = part.index(&self.cfg);
            // This part's full tensors only: a rank never holds the whole model's state.
            let part_values = ck.tensors(range)?;
            let values: Vec<&[f32]> = part_values.params.iter().map(Vec::as_slice).collect();
            e.load_layer(l, &values).map_err(zero_err)?;
            // The engine's optimizer state is in planes per tensor: moments m, then v.
            let planes: Vec<Vec<f32>> = part_values
                .exp_avg
                .iter()
                .zip(&part_values.exp_avg_sq)
                .map(|(m, v)| [&m[..], &v[..]].concat())
                .collect();
            let planes: Vec<&[f32]> = planes.iter().map(Vec::as_slice).collect();
            e.load_optimizer_state(l, 2, &planes).map_err(zero_err)?;
        }
        e.resume_at(ck.state.step as u64);
        Ok(())
    }

    /// Every rank builds the same initial parameters (the seed's, or `--init-from`'s) one
    /// tensor at a time on an untracked staging backend, and keeps its shard of each part.
    fn load_initial(&self, opts: &TrainOptions) -> Result<()> {
        let staging = Cpu::new();
        let parts = Part::all(&self.cfg);
        let mut part = 0usize;
        let mut held: Vec<CpuTensor> = Vec::new();
        let mut take = |_: usize, t: CpuTensor| -> Result<()> {
            held.push(t);
            while part < parts.len() && held.len() == self.shapes[part].len() {
                let slices = held
                    .iter()
                    .map(|t| t.as_slice::<f32>())
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                self.engine
                    .borrow_mut()
                    .load_layer(part, &slices)
                    .map_err(zero_err)?;
                held.clear();
                part += 1;
            }
            Ok(())
        };
        match &opts.init_from {
            Some(dir) => {
                let cfg = crate::hf::load_each(dir, &staging, &mut take)?;
                if cfg != self.cfg {
                    return Err(TrainError::Option {
                        option: "--init-from",
                        reason: format!(
                            "{} holds {cfg:?}, the run's model is {:?}",
                            dir.display(),
                            self.cfg
                        ),
                    });
                }
            }
            None => params::init_params_each(&staging, &self.cfg, opts.seed, &mut take)?,
        }
        Ok(())
    }

    /// Free whatever is gathered or in flight and start the plan over: between micro-batches.
    fn release_all(&self) -> Result<()> {
        self.cursor.set(0);
        let mut e = self.engine.borrow_mut();
        for l in 0..e.num_layers() {
            e.release(l).map_err(zero_err)?;
        }
        Ok(())
    }
}

impl<B: RankBackend> PartStore<B> for EngineStore<'_, B> {
    fn weights(&self, part: Part) -> Result<Vec<B::Tensor>> {
        let l = part.index(&self.cfg);
        // The next request, if this one is where the plan said it would be; a caller off the
        // plan gets no prefetching from then on (correct, only slower).
        let at = self.cursor.get();
        let next = if self.plan.get(at) == Some(&l) {
            self.cursor.set(at + 1);
            self.plan.get(at + 1).copied()
        } else {
            self.cursor.set(usize::MAX);
            None
        };
        let mut e = self.engine.borrow_mut();
        e.gather(l).map_err(zero_err)?;
        let out = {
            let _g = MemoryCategory::Workspace.enter();
            let _l = label_absolute("zero.part_weights");
            let mut out = Vec::with_capacity(self.shapes[l].len());
            for (t, shape) in self.shapes[l].iter().enumerate() {
                let w = match self.dtype {
                    DType::F32 => self
                        .compute
                        .upload(e.tensor(l, t).map_err(zero_err)?, shape.clone())?,
                    _ => {
                        let bits = e.tensor_bf16(l, t).map_err(zero_err)?;
                        self.compute
                            .upload::<half::bf16>(bytemuck::cast_slice(bits), shape.clone())?
                    }
                };
                out.push(w);
            }
            out
        };
        // A part used twice in a row (a block's last recomputation and its backward) stays
        // gathered; otherwise it goes, and the next part is fetched while this one computes:
        // at most two parts are gathered at any time.
        if next != Some(l) {
            e.release(l).map_err(zero_err)?;
            if let Some(n) = next {
                e.prefetch(n).map_err(zero_err)?;
            }
        }
        Ok(out)
    }

    fn grad_buffers(&self, part: Part) -> Result<Vec<B::Tensor>> {
        let l = part.index(&self.cfg);
        let _g = MemoryCategory::Gradients.enter();
        let _l = label_absolute("zero.part_grads");
        self.shapes[l]
            .iter()
            .map(|s| Ok(self.compute.zeros(s.clone(), DType::F32)?))
            .collect()
    }

    fn push_grads(&self, part: Part, grads: Vec<B::Tensor>) -> Result<()> {
        let l = part.index(&self.cfg);
        self.compute
            .push_part_grads(&mut self.engine.borrow_mut(), l, &grads, &self.host)
    }
}

/// What a rank's compute backend adds to the model's ops: handing a part's finished
/// gradients to the engine, which lives in host memory.
trait RankBackend: ModelOps + Clone {
    /// `engine.push_grads(l, …)` with `grads`, f32 tensors on this backend; `host` is the
    /// engine's backend, for staging copies.
    fn push_part_grads(
        &self,
        engine: &mut ZeroEngine,
        l: usize,
        grads: &[Self::Tensor],
        host: &Cpu,
    ) -> Result<()>;
}

/// `engine.push_grads` with f32 host tensors.
fn push_host_grads(engine: &mut ZeroEngine, l: usize, grads: &[CpuTensor]) -> Result<()> {
    let slices = grads
        .iter()
        .map(|t| t.as_slice::<f32>())
        .collect::<std::result::Result<Vec<_>, _>>()?;
    engine.push_grads(l, &slices).map_err(zero_err)
}

impl RankBackend for Cpu {
    /// The engine reads the gradients where they are.
    fn push_part_grads(
        &self,
        engine: &mut ZeroEngine,
        l: usize,
        grads: &[CpuTensor],
        _: &Cpu,
    ) -> Result<()> {
        push_host_grads(engine, l, grads)
    }
}

#[cfg(feature = "cuda")]
impl RankBackend for headroom_cuda::Cuda {
    /// Downloaded into host staging (one part's gradients, counted as the host's
    /// `Gradients`), then pushed: the collectives run on host buffers.
    fn push_part_grads(
        &self,
        engine: &mut ZeroEngine,
        l: usize,
        grads: &[headroom_cuda::CudaTensor],
        host: &Cpu,
    ) -> Result<()> {
        let staged = {
            let _g = MemoryCategory::Gradients.enter();
            let _l = label_absolute("zero.part_grads_staging");
            grads
                .iter()
                .map(|g| {
                    let mut h =
                        host.uninit(headroom_tensor::Tensor::shape(g).clone(), DType::F32)?;
                    self.download_into(g, h.as_mut_slice::<f32>()?)?;
                    Ok(h)
                })
                .collect::<Result<Vec<CpuTensor>>>()?
        };
        push_host_grads(engine, l, &staged)
    }
}

/// AdamW on a rank's shard: the trainer's two groups (decay for matrices and embeddings, none
/// for biases and norms) and the run's β1, β2 and ε, through headroom-offload's fused kernel —
/// the same operations as the single-process `CpuAdamW`, piece by piece.
pub struct ShardAdamW {
    /// Learning rate of the next step.
    pub lr: f64,
    /// The run's settings (β1, β2, ε, weight decay).
    run: RunSpec,
    /// Per part, per tensor: 0 decays, 1 does not.
    groups: Vec<Vec<usize>>,
    isa: Isa,
}

impl ShardAdamW {
    /// The optimizer of `opts`'s run over parts whose tensors fall in `groups`.
    pub fn new(opts: &TrainOptions, groups: Vec<Vec<usize>>) -> Self {
        ShardAdamW {
            lr: opts.lr,
            run: opts.run_spec(),
            groups,
            isa: Isa::detect(),
        }
    }

    /// Group `g`'s hyper-parameters (the single-process trainer's).
    pub fn hyper(&self, g: usize) -> AdamWHyper {
        self.run.adamw_hyper(self.lr, g)
    }
}

impl ShardOptimizer for ShardAdamW {
    fn state_per_param(&self) -> usize {
        2
    }

    fn update(
        &mut self,
        piece: &UpdatePiece,
        params: &mut [f32],
        grads: &[f32],
        state: &mut [f32],
    ) -> std::result::Result<(), BoxedError> {
        let g = *self
            .groups
            .get(piece.layer)
            .and_then(|l| l.get(piece.tensor))
            .ok_or("update of a tensor the optimizer does not know")?;
        let h = self.hyper(g);
        let s = StepScalars::new(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, piece.step);
        let (m, v) = state.split_at_mut(params.len());
        fused_step(self.isa, &s, params, FloatSlice::F32(grads), m, v, None)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::rank_gpu;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn a_launched_rank_takes_its_local_gpu_and_threads_their_rank() {
        // Rank 5 of 8, the second process on its machine: GPU first + 1, wrapped.
        let launched = [
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ];
        assert_eq!(rank_gpu(0, 5, 8, 4, env(&launched)), 1);
        assert_eq!(rank_gpu(3, 5, 8, 4, env(&launched)), 0);
        // No local rank from the launcher: the rank, wrapped.
        assert_eq!(
            rank_gpu(0, 5, 8, 4, env(&[("RANK", "5"), ("WORLD_SIZE", "8")])),
            1
        );
        // Thread ranks of one launched process (world 1 there, 3 here): their own rank.
        let one = [("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")];
        assert_eq!(
            (0..3)
                .map(|r| rank_gpu(0, r, 3, 4, env(&one)))
                .collect::<Vec<_>>(),
            [0, 1, 2]
        );
        // No launcher, no GPU count: never a division by zero.
        assert_eq!(rank_gpu(2, 1, 2, 0, env(&[])), 0);
    }
}
