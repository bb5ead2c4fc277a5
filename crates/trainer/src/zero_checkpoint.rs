//! Checkpoints of ZeRO runs: each rank writes the shard it owns — no rank ever holds the whole
//! training state — and [`consolidate`] turns one into an ordinary checkpoint.
//!
//! ```text
//! root/
//!   step-00000010/
//!     rank-00000-of-00002.safetensors   rank 0's pieces: parameters of record and AdamW moments
//!     rank-00001-of-00002.safetensors
//!     zero.json                         step, stage, ranks, model config, run settings
//!     manifest.json                     every file's size and xxh3-64, written last
//! ```
//!
//! A rank file holds, for each piece of a tensor the rank owns (headroom-zero's
//! [`ShardPieceRef`](headroom_zero::ShardPieceRef)), three f32 tensors named
//! `{hf name}@{first element}:param`, `…:exp_avg` and `…:exp_avg_sq` (the fp32 parameters — the
//! masters in mixed precision — and AdamW's moments, PyTorch's names). The pieces of all ranks cover every element of every tensor
//! exactly once; [`load`] checks that, and every file against the manifest, before anything
//! is used. The layout does not depend on the stage or the rank count, so a resume may use
//! other ones: each rank takes its new shard of the full tensors. The data position follows
//! from the step (each rank's loader is a pure function of seed, shard and batch index), so a
//! run resumed on M ranks reads what an M-rank run would have read.
//!
//! Crash consistency is the ordinary checkpoint's: every rank writes into one `.partial-`
//! directory, the ranks meet at a barrier, rank 0 writes `zero.json` and the manifest, fsyncs
//! and publishes the directory with one rename.

use std::fs;
use std::path::{Path, PathBuf};

use headroom_mmap_data::{LoaderState, SamplerConfig, SamplingMode, Shard};
use headroom_offload::{AdamWState, ParamSpec, StatePrecision};
use headroom_zero::ZeroEngine;
use serde::{Deserialize, Serialize};

use crate::checkpoint::{
    self, check_format_and_step, err, io, read_json_bounded, read_verified, write_synced, Manifest,
    RunSpec, TrainingState, FORMAT_VERSION, MANIFEST, PARTIAL_PREFIX,
};
use crate::companions::Companions;
use crate::hf;
use crate::model::{params, ModelConfig, Part};
use crate::{Result, TrainError};

/// The run-level file of a ZeRO checkpoint.
pub const ZERO_STATE: &str = "zero.json";

/// `zero.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ZeroState {
    /// Layout version (the ordinary checkpoint's).
    pub format_version: u32,
    /// Optimizer steps completed.
    pub step: usize,
    /// The stage the run used (informative: a resume may use another).
    pub stage: u8,
    /// Ranks that wrote the shards.
    pub ranks: usize,
    /// The model's shape.
    pub config: ModelConfig,
    /// The run's settings (checked on resume; `batch` is the global batch).
    pub run: RunSpec,
    /// The training data's fingerprint.
    pub dataset_fingerprint: u64,
}

/// A loaded ZeRO checkpoint, whole: what each rank of a resume takes its shard from.
#[derive(Debug)]
pub struct ZeroCheckpoint {
    /// The step directory.
    pub dir: PathBuf,
    /// `zero.json`.
    pub state: ZeroState,
    /// The model's tokenizer and generation config, as saved with it (checked against the
    /// manifest): what a resumed run's checkpoints and a consolidation carry on.
    pub companions: Companions,
    values: Values,
}

/// Where a [`ZeroCheckpoint`]'s parameters and moments are.
#[derive(Debug)]
enum Values {
    /// In the rank files, read a few tensors at a time ([`ZeroCheckpoint::tensors`]), so a
    /// resumed rank never holds more than one part's full state beside its shard.
    Pieces(Vec<PieceAt>),
    /// A single-process checkpoint resumed under ZeRO: its model files and its optimizer
    /// file (f32 AdamW: every first moment, then every second moment), read a range of
    /// tensors at a time, like the rank files.
    Ordinary {
        params: Vec<hf::Stored>,
        exp_avg: Vec<hf::Stored>,
        exp_avg_sq: Vec<hf::Stored>,
    },
}

/// One piece of a rank file: which values of which tensor, and where its bytes are.
#[derive(Debug)]
struct PieceAt {
    tensor: usize,
    /// First element of the tensor the piece holds.
    start: usize,
    kind: PieceKind,
    stored: hf::Stored,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
enum PieceKind {
    Param,
    ExpAvg,
    ExpAvgSq,
}

impl PieceKind {
    fn name(self) -> &'static str {
        match self {
            PieceKind::Param => "param",
            PieceKind::ExpAvg => "exp_avg",
            PieceKind::ExpAvgSq => "exp_avg_sq",
        }
    }
}

/// Full tensors of a checkpoint, in [`params::param_infos`] order (or a range of it).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorValues {
    /// Parameters of record.
    pub params: Vec<Vec<f32>>,
    /// AdamW's first moments.
    pub exp_avg: Vec<Vec<f32>>,
    /// AdamW's second moments.
    pub exp_avg_sq: Vec<Vec<f32>>,
}

impl ZeroCheckpoint {
    /// A single-process checkpoint (f32 AdamW, full training) to resume under ZeRO: its
    /// files verified by streamed checksums, its values read later a range at a time.
    pub(crate) fn ordinary(point: &checkpoint::ResumePoint) -> Result<Self> {
        let st = &point.state;
        if st.optimizer.precision != StatePrecision::F32 || st.finetune.is_some() {
            return Err(err(
                &point.dir,
                "a ZeRO run resumes f32 AdamW state of full training only",
            ));
        }
        // The ZeRO engine keeps one AdamW step count for every parameter, the global step
        // (`resume_at`); a single-process run counts per parameter and skips a step whose
        // gradient was not finite, so its counts can lag. Resumed here they would be set to
        // the step, and the bias corrections would differ from the run being continued.
        if let Some(&count) = st.optimizer.steps.iter().find(|&&c| c != st.step as u64) {
            return Err(err(
                &point.dir,
                format!(
                    "its AdamW step counts differ from its step {} (one is {count}: the run \
                     skipped an optimizer step, e.g. for a non-finite gradient); a ZeRO run \
                     keeps one count for every parameter and cannot continue it exactly: \
                     resume it without --zero",
                    st.step
                ),
            ));
        }
        let params = point.stored_tensors()?;
        let numel: Vec<u64> = params
            .iter()
            .map(|t| t.shape.iter().product::<usize>() as u64)
            .collect();
        let n: u64 = numel.iter().sum();
        let (moments, bytes) = point.verified_moments_file()?;
        if bytes != 8 * n {
            return Err(err(
                &moments,
                format!("{bytes} moment bytes for {n} parameters"),
            ));
        }
        // Each tensor's moments as a stored 1-d f32 tensor of the optimizer file.
        let planes = |first: u64| {
            let mut at = first;
            numel
                .iter()
                .map(|&k| {
                    let t = hf::Stored {
                        file: moments.clone(),
                        dtype: hf::StoredDtype::F32,
                        shape: vec![k as usize],
                        start: at,
                        end: at + 4 * k,
                    };
                    at += 4 * k;
                    t
                })
                .collect::<Vec<_>>()
        };
        Ok(ZeroCheckpoint {
            dir: point.dir.clone(),
            state: ZeroState {
                format_version: checkpoint::FORMAT_VERSION,
                step: st.step,
                stage: 0,
                ranks: 1,
                config: st.config,
                run: st.run.clone(),
                dataset_fingerprint: st.loader.dataset_fingerprint,
            },
            companions: point.companions()?,
            values: Values::Ordinary {
                params,
                exp_avg: planes(0),
                exp_avg_sq: planes(4 * n),
            },
        })
    }

    /// The full values of tensors `range` ([`params::param_infos`] order): read from the
    /// checkpoint's files piece by piece (their checksums were verified when it was opened),
    /// so only these tensors exist in memory.
    pub fn tensors(&self, range: std::ops::Range<usize>) -> Result<TensorValues> {
        let count = params::param_infos(&self.state.config).len();
        if range.start > range.end || range.end > count {
            return Err(err(&self.dir, format!("tensors {range:?} of {count}")));
        }
        let read = |kind| {
            range
                .clone()
                .map(|i| self.read(i, kind))
                .collect::<Result<Vec<_>>>()
        };
        Ok(TensorValues {
            params: read(PieceKind::Param)?,
            exp_avg: read(PieceKind::ExpAvg)?,
            exp_avg_sq: read(PieceKind::ExpAvgSq)?,
        })
    }

    /// Tensor `i`'s parameters or one of its moments (`i` in range: checked by callers).
    fn read(&self, i: usize, kind: PieceKind) -> Result<Vec<f32>> {
        let info = &params::param_infos(&self.state.config)[i];
        let n: usize = info.shape.iter().product();
        let mut out = vec![0.0; n];
        match &self.values {
            Values::Ordinary {
                params,
                exp_avg,
                exp_avg_sq,
            } => {
                let stored = match kind {
                    PieceKind::Param => &params[i],
                    PieceKind::ExpAvg => &exp_avg[i],
                    PieceKind::ExpAvgSq => &exp_avg_sq[i],
                };
                let mut reader = hf::TensorReader::open(stored, n)?;
                if kind == PieceKind::Param {
                    reader.read_param(info, 0, &mut out)?;
                } else {
                    reader.read(0, &mut out)?;
                }
            }
            Values::Pieces(pieces) => {
                for p in pieces.iter().filter(|p| p.tensor == i && p.kind == kind) {
                    let len = p.stored.shape[0];
                    // `load` checked the piece lies inside its tensor.
                    let dst = &mut out[p.start..p.start + len];
                    hf::TensorReader::open(&p.stored, len)?.read(0, dst)?;
                }
            }
        }
        Ok(out)
    }
}

/// The bytes a ZeRO checkpoint (all rank files together), or its consolidation, writes for
/// its tensors: the whole model's f32 parameters and both f32 moments. The room checks use it.
pub(crate) fn state_bytes(cfg: &ModelConfig) -> Result<u64> {
    Ok(cfg.parameter_count()?.saturating_mul(12))
}

/// Rank `r` of `n`'s file name.
pub fn rank_file(r: usize, n: usize) -> String {
    format!("rank-{r:05}-of-{n:05}.safetensors")
}

/// The directory a ZeRO save of `step` is assembled in (one name for every rank, which may be
/// separate processes).
pub(crate) fn partial_dir(root: &Path, step: usize) -> PathBuf {
    root.join(format!("{PARTIAL_PREFIX}step-{step:08}-zero"))
}

/// Rank 0, before the ranks write: a fresh, empty partial directory.
pub(crate) fn prepare(root: &Path, step: usize) -> Result<PathBuf> {
    fs::create_dir_all(root).map_err(io(root))?;
    let partial = partial_dir(root, step);
    if partial.exists() {
        fs::remove_dir_all(&partial).map_err(io(&partial))?;
    }
    fs::create_dir(&partial).map_err(io(&partial))?;
    Ok(partial)
}

fn piece_name(param: &str, start: usize, what: &str) -> String {
    format!("{param}@{start}:{what}")
}

/// Every rank, between two barriers: its pieces of every part into its file in `partial`.
pub(crate) fn write_rank(
    partial: &Path,
    cfg: &ModelConfig,
    engine: &ZeroEngine,
    rank: usize,
    ranks: usize,
) -> Result<()> {
    let infos = params::param_infos(cfg);
    let zero_err = |e: headroom_zero::ZeroError| TrainError::Config(format!("ZeRO: {e}"));
    // The file is laid out from the shard's geometry, then each piece is written from the
    // shard's own memory (`export_piece` lends it): no copy of a part beside the shard, so a
    // save needs nothing beyond the run's memory (a rank's memory is what ZeRO divides).
    let parts = Part::all(cfg);
    let mut entries: Vec<(usize, usize)> = Vec::new(); // (part, piece within it) per file piece
    let mut names = Vec::new();
    let mut shapes = Vec::new();
    for (k, part) in parts.iter().enumerate() {
        let first = part.params(cfg).start;
        for (j, (tensor, range)) in engine
            .export_geometry(part.index(cfg))
            .map_err(zero_err)?
            .into_iter()
            .enumerate()
        {
            let name = &infos[first + tensor].name;
            for kind in [PieceKind::Param, PieceKind::ExpAvg, PieceKind::ExpAvgSq] {
                entries.push((k, j));
                names.push(piece_name(name, range.start, kind.name()));
                shapes.push([range.len()]);
            }
        }
    }
    let layout: Vec<(&str, &[usize])> = names
        .iter()
        .zip(&shapes)
        .map(|(n, s)| (n.as_str(), &s[..]))
        .collect();
    checkpoint::write_ordered(
        &partial.join(rank_file(rank, ranks)),
        &layout,
        partial,
        checkpoint::WRITE_CHUNK_BYTES,
        |i, put| {
            let (k, j) = entries[i];
            let n = shapes[i][0];
            let p = engine
                .export_piece(parts[k].index(cfg), j)
                .map_err(zero_err)?;
            if p.params.len() != n || p.tensor_range.len() != n {
                return Err(TrainError::Config(
                    "ZeRO: a part exported other pieces than its geometry".into(),
                ));
            }
            let values: &[f32] = match i % 3 {
                0 => &p.params,
                // Before the first step there are no moments yet: zeros, as AdamW starts.
                _ if p.state.len() != 2 * n => return put_zeros(n, put),
                1 => &p.state[..n],
                _ => &p.state[n..],
            };
            put(bytemuck::cast_slice(values))
        },
    )?;
    Ok(())
}

/// `n` f32 zeros through `put`, a few KiB at a time.
fn put_zeros(n: usize, put: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
    const CHUNK: usize = 1024;
    for done in (0..n).step_by(CHUNK) {
        put(&[0u8; 4 * CHUNK][..4 * CHUNK.min(n - done)])?;
    }
    Ok(())
}

/// Rank 0, after every rank wrote its file: `zero.json`, the model's companion files, the
/// manifest (every rank file's size and checksum, read back), then publish as `root/step-N`.
pub(crate) fn publish(
    root: &Path,
    partial: &Path,
    state: &ZeroState,
    keep: usize,
    companions: &Companions,
) -> Result<PathBuf> {
    // Every rank has written (a barrier came before): the partial directory is ours to remove
    // if this fails.
    checkpoint::saving_step(root, partial, state.step, || {
        let mut files = Vec::with_capacity(state.ranks + 1);
        for r in 0..state.ranks {
            // Another rank (perhaps another process) wrote it: read back a piece at a time.
            files.push(checkpoint::file_entry(
                &partial.join(rank_file(r, state.ranks)),
            )?);
        }
        let json = serde_json::to_vec_pretty(state).map_err(|e| err(root, e.to_string()))?;
        files.push(write_synced(&partial.join(ZERO_STATE), &json)?);
        // transformers' config.json (the weights are in the rank files): where the token ids
        // the run carries are kept for a resume and for consolidation.
        files.push(write_synced(
            &partial.join("config.json"),
            &checkpoint::hf_config(&state.config, companions.token_ids(), root)?,
        )?);
        files.extend(companions.write_into(partial)?);
        let manifest = Manifest {
            format_version: FORMAT_VERSION,
            step: state.step,
            files,
        };
        let json = serde_json::to_vec_pretty(&manifest).map_err(|e| err(root, e.to_string()))?;
        write_synced(&partial.join(MANIFEST), &json)?;
        checkpoint::publish(root, partial, state.step, Some(keep))
    })
}

/// Whether `dir` (a step directory) is a ZeRO checkpoint.
pub fn is_zero_checkpoint(dir: &Path) -> bool {
    dir.join(ZERO_STATE).is_file()
}

/// Read a ZeRO checkpoint (a step directory, or a root: its newest), every file checked
/// against the manifest and every element of every tensor covered exactly once.
pub fn load(path: &Path) -> Result<ZeroCheckpoint> {
    let dir = checkpoint::resolve(path)?;
    let manifest = checkpoint::parse_manifest(&dir)?;
    let entry = |name: &str| manifest.entry(&dir, name);
    let state_path = dir.join(ZERO_STATE);
    let state_entry = entry(ZERO_STATE).map_err(|_| {
        err(
            &dir,
            "not a ZeRO checkpoint (no zero.json): resume it without --zero",
        )
    })?;
    // Bounded like every JSON file, then checked against the manifest.
    read_json_bounded(&state_path)?;
    let json = read_verified(&dir, state_entry)?;
    let state: ZeroState =
        serde_json::from_slice(&json).map_err(|e| err(&state_path, e.to_string()))?;
    check_format_and_step(&state_path, state.format_version, state.step, manifest.step)?;
    state.config.validate()?;
    if state.ranks == 0 || state.ranks > 1 << 20 {
        return Err(err(&state_path, format!("{} ranks", state.ranks)));
    }
    let infos = params::param_infos(&state.config);
    let numel: Vec<usize> = infos.iter().map(|i| i.shape.iter().product()).collect();
    let total = state.config.parameter_count()?;
    // 12 bytes per parameter plus headers: anything much larger is not this model's.
    let max_bytes = total
        .checked_mul(12)
        .and_then(|b| b.checked_add(1 << 24))
        .ok_or_else(|| err(&dir, "parameter bytes overflow"))?;
    // (tensor, first element, kind) → length, for the tiling check below.
    let mut pieces: std::collections::HashMap<(usize, usize, PieceKind), usize> =
        std::collections::HashMap::new();
    let mut located = Vec::new();
    let index: std::collections::HashMap<&str, usize> = infos
        .iter()
        .enumerate()
        .map(|(i, info)| (info.name.as_str(), i))
        .collect();
    for r in 0..state.ranks {
        let name = rank_file(r, state.ranks);
        let e = entry(&name)?;
        if e.bytes > max_bytes {
            return Err(err(&dir.join(&name), "implausibly large for this model"));
        }
        // Verified a piece at a time: the values are read later, a part at a time.
        checkpoint::verify_streamed(&dir, e)?;
        let path = dir.join(&name);
        for (tname, stored) in hf::read_header(&path)? {
            let bad = |why: &str| err(&path, format!("tensor {tname}: {why}"));
            let (head, what) = tname.rsplit_once(':').ok_or_else(|| bad("no kind"))?;
            let (param, start) = head.rsplit_once('@').ok_or_else(|| bad("no offset"))?;
            let start: usize = start.parse().map_err(|_| bad("offset"))?;
            let &i = index
                .get(param)
                .ok_or_else(|| bad("not a parameter of this model"))?;
            if stored.dtype != hf::StoredDtype::F32 || stored.shape.len() != 1 {
                return Err(bad("not a 1-d f32 tensor"));
            }
            let len = stored.shape[0];
            start
                .checked_add(len)
                .filter(|&e| e <= numel[i])
                .ok_or_else(|| bad("past the tensor's end"))?;
            let kind = match what {
                "param" => PieceKind::Param,
                "exp_avg" => PieceKind::ExpAvg,
                "exp_avg_sq" => PieceKind::ExpAvgSq,
                _ => return Err(bad("unknown kind")),
            };
            if pieces.insert((i, start, kind), len).is_some() {
                return Err(bad("written twice"));
            }
            located.push(PieceAt {
                tensor: i,
                start,
                kind,
                stored,
            });
        }
    }
    // Every piece has its parameters and both moments, and each tensor's pieces, sorted by
    // their first element, tile it: no gap, no overlap, nothing past the end.
    let mut tiles: Vec<(usize, usize, usize)> = Vec::new();
    for (&(i, start, kind), &len) in &pieces {
        if kind == PieceKind::Param {
            for other in [PieceKind::ExpAvg, PieceKind::ExpAvgSq] {
                if pieces.get(&(i, start, other)) != Some(&len) {
                    return Err(err(
                        &dir,
                        format!(
                            "{}@{start}: its {} is missing or of another length",
                            infos[i].name,
                            other.name()
                        ),
                    ));
                }
            }
            tiles.push((i, start, len));
        }
    }
    if pieces.len() != 3 * tiles.len() {
        return Err(err(&dir, "a moment without its parameters"));
    }
    tiles.sort_unstable();
    let mut next = vec![0usize; infos.len()];
    for (i, start, len) in tiles {
        if start != next[i] {
            return Err(err(
                &dir,
                format!(
                    "{}: the shards overlap or leave a gap at element {}",
                    infos[i].name, next[i]
                ),
            ));
        }
        next[i] = start + len;
    }
    for (i, (&got, &n)) in next.iter().zip(&numel).enumerate() {
        if got != n {
            return Err(err(
                &dir,
                format!(
                    "{}: the shards hold {got} of its {n} elements",
                    infos[i].name
                ),
            ));
        }
    }
    let companions = Companions::listed_in(&dir, &manifest)?;
    Ok(ZeroCheckpoint {
        dir,
        state,
        companions,
        values: Values::Pieces(located),
    })
}

/// The loader position of rank `rank` of `ranks` after `step` steps of a run with `run`'s
/// settings: what an uninterrupted run of that many ranks would hold.
pub(crate) fn loader_state(
    run: &RunSpec,
    rank: usize,
    ranks: usize,
    step: usize,
    dataset_fingerprint: u64,
) -> Result<LoaderState> {
    Ok(LoaderState {
        sampler: SamplerConfig {
            mode: SamplingMode::EpochWindows,
            seq_len: run.seq as u64,
            seed: run.seed,
            shard: Shard::new(rank as u32, ranks as u32)?,
        },
        batch_size: (run.batch / ranks) as u64,
        next_batch: step as u64,
        epoch: 0,
        dataset_fingerprint,
    })
}

/// Write the ZeRO checkpoint at `src` as one ordinary checkpoint under `dst_root`: the same
/// parameters and moments, a single-process optimizer and data position at the same step. It
/// loads in `sample`, `eval` and transformers, and resumes without `--zero`.
///
/// Nothing under `dst_root` is removed: it may hold the run's other checkpoints (it may be
/// the source's own root). A `dst_root` already holding a checkpoint of the same step — the
/// source itself, when it is the source's root — is refused, as writing would replace it.
pub fn consolidate(src: &Path, dst_root: &Path) -> Result<PathBuf> {
    // Not into a root a run is saving into.
    let _root_lock = checkpoint::lock_root(dst_root)?;
    let ck = load(src)?;
    if let Some((_, existing)) = checkpoint::list(dst_root)?
        .into_iter()
        .find(|&(step, _)| step == ck.state.step)
    {
        return Err(err(
            dst_root,
            format!(
                "already holds a checkpoint of step {} ({}), which consolidating here would \
                 replace: choose another output directory",
                ck.state.step,
                existing.display()
            ),
        ));
    }
    let cfg = ck.state.config;
    // Refused now rather than by a full disk half-way through the files.
    checkpoint::check_room(
        dst_root,
        state_bytes(&cfg)? + ck.companions.bytes(),
        "consolidate's <OUT>",
    )?;
    let infos = params::param_infos(&cfg);
    let run = &ck.state.run;
    let lr = run.lr_at(ck.state.step.saturating_sub(1));
    let specs: Vec<ParamSpec> = infos
        .iter()
        .map(|i| ParamSpec {
            numel: i.shape.iter().product(),
            group: if i.shape.len() >= 2 { 0 } else { 1 },
        })
        .collect();
    let optimizer = AdamWState {
        precision: StatePrecision::F32,
        groups: vec![run.adamw_hyper(lr, 0), run.adamw_hyper(lr, 1)],
        steps: vec![ck.state.step as u64; specs.len()],
        params: specs,
    };
    let loader = loader_state(
        &ck.state.run,
        0,
        1,
        ck.state.step,
        ck.state.dataset_fingerprint,
    )?;
    let state = TrainingState::new(ck.state.step, cfg, ck.state.run.clone(), optimizer, loader);
    // One tensor at a time from the rank files into the files written; headroom-offload's
    // f32 moment layout: every first moment, then every second moment.
    let n = infos.len();
    checkpoint::save_streamed(
        dst_root,
        &state,
        None,
        checkpoint::MAX_SHARD_BYTES,
        &ck.companions,
        |i| ck.read(i, PieceKind::Param),
        |put| {
            for kind in [PieceKind::ExpAvg, PieceKind::ExpAvgSq] {
                for i in 0..n {
                    put(bytemuck::cast_slice(&ck.read(i, kind)?))?;
                }
            }
            Ok(())
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The moments of a shard saved before its first step: exactly `4n` zero bytes, for
    /// lengths around the write chunk.
    #[test]
    fn zeros_are_exactly_the_moments_length() {
        for n in [0, 1, 1023, 1024, 1025, 5000] {
            let mut got = Vec::new();
            put_zeros(n, &mut |b| {
                got.extend_from_slice(b);
                Ok(())
            })
            .unwrap();
            assert_eq!(got.len(), 4 * n);
            assert!(got.iter().all(|&b| b == 0));
        }
    }
}
