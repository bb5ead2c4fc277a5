//! The loss of a model on a token file, on windows anyone can recompute: `headroom eval`, and
//! the other side of `benches/torch/check_hf_export.py`'s comparison with transformers.
//!
//! Window `w` holds tokens `w·T ..= w·T + T` of the file (its segments read as one stream):
//! the first `T` are the input, the last `T` the targets. Batch `k` is windows `k·B .. k·B + B`.
//! The result is the mean over batches of each batch's mean cross-entropy per token. With a
//! loss mask beside the file, only the targets it keeps are scored, each batch weighted by
//! its counted targets (the mean per counted token, whatever the batch size).
//!
//! With `documents` the windows are packed documents (see [`crate::model::Documents`]): the
//! file's Megatron index says where each document starts (or each ends with a separator token:
//! [`DocumentBoundaries::EndsWith`]), positions restart there, attention
//! stays inside each document, and a target that starts a document is not scored — the loss
//! of the same examples padded one per row.

use headroom_mmap_data::{DocumentBoundaries, TokenDataset};

use crate::model::{counted_targets, Documents, Geometry, Model, ModelOps, IGNORE_TARGET};
use crate::{Result, TrainError};

/// Mean loss (nats per token) of `model` over the first `batches` batches of `batch` windows
/// of `seq` tokens of `data`, and the number of targets scored (those its loss mask keeps);
/// with `documents`, as packed documents begun by those boundaries.
pub fn evaluate<B: ModelOps>(
    model: &Model<B>,
    data: &TokenDataset,
    batch: usize,
    seq: usize,
    batches: usize,
    documents: Option<DocumentBoundaries>,
) -> Result<(f64, u64)> {
    let bad = |what: String| TrainError::Input(format!("eval: {what}"));
    if batch == 0 || seq == 0 || batches == 0 {
        return Err(bad(
            "batch, sequence and batch count must be at least 1".into()
        ));
    }
    if seq > model.cfg.max_seq {
        return Err(bad(format!(
            "windows of {seq} tokens are longer than the model's context of {} tokens",
            model.cfg.max_seq
        )));
    }
    if let Some(DocumentBoundaries::EndsWith(separator)) = documents {
        if separator as usize >= model.cfg.vocab {
            return Err(bad(format!(
                "documents ending with token {separator}: the model's vocabulary has {} ids",
                model.cfg.vocab
            )));
        }
    }
    let rows = batch
        .checked_mul(batches)
        .and_then(|w| w.checked_mul(seq))
        .ok_or_else(|| bad("the windows' token count overflows".into()))?;
    let needed = rows as u64 + 1;
    if data.total_tokens() < needed {
        return Err(bad(format!(
            "{batches} batches of {batch}×{seq} tokens need {needed} tokens; the file has {}",
            data.total_tokens()
        )));
    }
    // Only the tokens the windows read are copied (at most the file, checked above).
    let mut stream = Vec::with_capacity(rows + 1);
    // Whether each token counts as a target (loss-masked data only).
    let mut flags = Vec::with_capacity(if data.has_loss_mask() { rows + 1 } else { 0 });
    // Whether each token starts a document (with `documents` only).
    let mut starts = Vec::with_capacity(if documents.is_some() { rows + 1 } else { 0 });
    'segments: for (s, segment) in data.segments().iter().enumerate() {
        let positions = if let Some(boundaries) = documents {
            // Only the tokens the windows read (at most the file, checked above).
            let len = (needed - stream.len() as u64).min(segment.len() as u64) as usize;
            let mut p = vec![0u32; len];
            segment
                .document_positions(boundaries, 0, &mut p)
                .ok_or_else(|| match boundaries {
                    DocumentBoundaries::Index if segment.sequence_index().is_none() => {
                        bad(format!(
                            "{}: packed documents need the file's document boundaries, and it has \
                         none: a Megatron .bin/.idx pair has them (`headroom data build \
                         --format megatron`), and a file whose documents each end with a \
                         separator token can name it (--document-separator)",
                            segment.name()
                        ))
                    }
                    _ => bad(format!("{}: its documents ({boundaries})", segment.name())),
                })?;
            p
        } else {
            Vec::new()
        };
        for i in 0..segment.len() as u64 {
            if stream.len() as u64 == needed {
                break 'segments;
            }
            if let Some(mask) = segment.loss_mask() {
                flags.push(mask.get(i as usize).unwrap_or(true));
            } else if data.has_loss_mask() {
                flags.push(true);
            }
            let t = data
                .token(s, i)
                .ok_or_else(|| bad(format!("token {i} of segment {s} is unreadable")))?;
            let id = u32::try_from(t).map_err(|_| bad(format!("token id {t}")))?;
            if id as usize >= model.cfg.vocab {
                return Err(bad(format!(
                    "token {i} of segment {s} is id {id}, outside the model's vocabulary of {} \
                     ids: was the file tokenised for another model?",
                    model.cfg.vocab
                )));
            }
            stream.push(id);
            if documents.is_some() {
                starts.push(positions.get(i as usize) == Some(&0));
            }
        }
    }
    let g = Geometry::new(batch, seq);
    let mut mean = crate::train::ValidationMean::default();
    for k in 0..batches {
        let (mut x, mut y) = (
            Vec::with_capacity(batch * seq),
            Vec::with_capacity(batch * seq),
        );
        for w in k * batch..(k + 1) * batch {
            x.extend_from_slice(&stream[w * seq..w * seq + seq]);
            y.extend_from_slice(&stream[w * seq + 1..w * seq + seq + 1]);
            if let Some(f) = flags.get(w * seq + 1..w * seq + seq + 1) {
                let row = y.len() - seq;
                for (t, &counts) in y[row..].iter_mut().zip(f) {
                    if !counts {
                        *t = IGNORE_TARGET;
                    }
                }
            }
        }
        let packed = if documents.is_some() {
            let mut positions = Vec::with_capacity(batch * seq);
            for w in k * batch..(k + 1) * batch {
                let mut p = 0u32;
                for i in 0..seq {
                    p = if i == 0 || starts[w * seq + i] {
                        0
                    } else {
                        p + 1
                    };
                    positions.push(p);
                }
                // A target that starts a document has nothing of it to be predicted from.
                for (i, t) in y[(w - k * batch) * seq..][..seq].iter_mut().enumerate() {
                    if starts[w * seq + i + 1] {
                        *t = IGNORE_TARGET;
                    }
                }
            }
            Some(Documents::from_positions(batch, seq, &positions)?)
        } else {
            None
        };
        let counted = counted_targets(&y) as u64;
        let loss = if counted > 0 {
            model.loss(&x, &y, g.packed(packed.as_ref())?)?
        } else {
            0.0
        };
        mean.add(loss, counted, y.len());
    }
    let scored = mean.counted();
    if scored == 0 {
        return Err(bad(format!(
            "the loss mask beside the file keeps none of the {rows} targets scored"
        )));
    }
    Ok((mean.mean_f64(), scored))
}
