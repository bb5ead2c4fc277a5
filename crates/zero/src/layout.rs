//! Partitioning: flat buffers over lists of tensors, shards per rank, and gradient buckets.
//!
//! A [`FlatLayout`] lays a list of tensors end to end in one flat buffer, pads it with zeros
//! to a multiple of the world size, and cuts it into `world` equal, contiguous shards; rank
//! `r` owns elements `r·s .. (r+1)·s`. Tensors need not divide evenly: a tensor may straddle
//! shards, and [`FlatLayout::shard_pieces`] / [`FlatLayout::tensor_pieces`] give the exact
//! overlaps both ways. Equal shards keep every collective a plain reduce-scatter or
//! all-gather (no `v` variants).
//!
//! A [`BucketPlan`] groups layers, in backward order, into gradient buckets of at least a
//! given byte size.

use std::ops::Range;

use crate::error::{Result, ZeroError};

/// The overlap of one tensor with one rank's shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index of the tensor in the layout's list.
    pub tensor: usize,
    /// The rank owning the piece.
    pub rank: usize,
    /// Elements of the tensor (`0..numel` of that tensor).
    pub tensor_range: Range<usize>,
    /// The same elements as offsets inside the rank's shard (`0..shard_len`).
    pub shard_range: Range<usize>,
}

/// A flat buffer over a list of tensors, padded to a multiple of `world` and sharded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatLayout {
    sizes: Vec<usize>,
    offsets: Vec<usize>,
    numel: usize,
    world: usize,
    shard_len: usize,
}

impl FlatLayout {
    /// Lay out tensors of `sizes` elements (in order) for `world` ranks.
    pub fn new(sizes: &[usize], world: usize) -> Result<Self> {
        if world == 0 {
            return Err(ZeroError::InvalidConfig(
                "world size must be at least 1".into(),
            ));
        }
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut numel = 0usize;
        for &s in sizes {
            offsets.push(numel);
            numel = numel.checked_add(s).ok_or(ZeroError::SizeOverflow {
                what: "flat buffer length",
            })?;
        }
        let shard_len = numel.div_ceil(world);
        shard_len
            .checked_mul(world)
            .ok_or(ZeroError::SizeOverflow {
                what: "padded flat buffer length",
            })?;
        Ok(FlatLayout {
            sizes: sizes.to_vec(),
            offsets,
            numel,
            world,
            shard_len,
        })
    }

    /// Number of tensors.
    pub fn num_tensors(&self) -> usize {
        self.sizes.len()
    }
    /// Element counts of the tensors.
    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }
    /// Real elements (sum of the tensor sizes).
    pub fn numel(&self) -> usize {
        self.numel
    }
    /// Flat length with padding: `world × shard_len`.
    pub fn padded_len(&self) -> usize {
        self.shard_len * self.world
    }
    /// Padding elements at the end of the flat buffer (fewer than `world`).
    pub fn padding(&self) -> usize {
        self.padded_len() - self.numel
    }
    /// Elements per shard.
    pub fn shard_len(&self) -> usize {
        self.shard_len
    }
    /// Number of shards.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Tensor `t`'s elements in the flat buffer; `None` if there is no such tensor.
    pub fn tensor_range(&self, t: usize) -> Option<Range<usize>> {
        let off = *self.offsets.get(t)?;
        Some(off..off + self.sizes[t])
    }

    /// Rank `r`'s shard in the flat buffer; `None` for a rank outside the world.
    pub fn shard_range(&self, r: usize) -> Option<Range<usize>> {
        (r < self.world).then(|| r * self.shard_len..(r + 1) * self.shard_len)
    }

    /// Which tensor and element a flat index holds; `None` for padding or out of range.
    pub fn locate(&self, flat: usize) -> Option<(usize, usize)> {
        if flat >= self.numel {
            return None;
        }
        // The last tensor starting at or before `flat` that is non-empty holds it.
        let t = self
            .offsets
            .partition_point(|&o| o <= flat)
            .checked_sub(1)?;
        let t = (0..=t).rev().find(|&i| self.sizes[i] > 0)?;
        Some((t, flat - self.offsets[t]))
    }

    /// Which rank owns a flat index and where in its shard; `None` past the padded length.
    pub fn owner(&self, flat: usize) -> Option<(usize, usize)> {
        if flat >= self.padded_len() || self.shard_len == 0 {
            return None;
        }
        Some((flat / self.shard_len, flat % self.shard_len))
    }

    /// The non-empty overlaps of rank `r`'s shard with the tensors, in flat order (padding
    /// is not part of any piece). Empty for a rank outside the world.
    pub fn shard_pieces(&self, r: usize) -> Vec<Piece> {
        let Some(shard) = self.shard_range(r) else {
            return Vec::new();
        };
        (0..self.sizes.len())
            .filter_map(|t| self.overlap(t, r, &shard))
            .collect()
    }

    /// The non-empty overlaps of tensor `t` with the shards, in rank order. Empty for a
    /// tensor that does not exist.
    pub fn tensor_pieces(&self, t: usize) -> Vec<Piece> {
        let Some(range) = self.tensor_range(t) else {
            return Vec::new();
        };
        if range.is_empty() || self.shard_len == 0 {
            return Vec::new();
        }
        let first = range.start / self.shard_len;
        let last = (range.end - 1) / self.shard_len;
        (first..=last)
            .filter_map(|r| {
                let shard = self.shard_range(r)?;
                self.overlap(t, r, &shard)
            })
            .collect()
    }

    fn overlap(&self, t: usize, r: usize, shard: &Range<usize>) -> Option<Piece> {
        let range = self.tensor_range(t)?;
        let start = range.start.max(shard.start);
        let end = range.end.min(shard.end);
        (start < end).then(|| Piece {
            tensor: t,
            rank: r,
            tensor_range: start - range.start..end - range.start,
            shard_range: start - shard.start..end - shard.start,
        })
    }
}

/// Layers grouped into gradient buckets in backward order (last layer first).
///
/// Walking the layers from the last to the first, each layer with parameters joins the
/// current bucket; a bucket closes as soon as it holds at least `bucket_bytes`. A layer larger
/// than the bucket size is a bucket on its own. The plan is fixed at construction, so every
/// rank cuts the same buckets whatever order gradients arrive in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketPlan {
    buckets: Vec<Vec<usize>>,
    of_layer: Vec<Option<usize>>,
}

impl BucketPlan {
    /// Plan buckets for layers of `layer_bytes` bytes each (gradient bytes, padded). Layers
    /// of zero bytes belong to no bucket. `bucket_bytes` of 0 puts every layer alone.
    pub fn new(layer_bytes: &[usize], bucket_bytes: usize) -> Self {
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut of_layer = vec![None; layer_bytes.len()];
        let mut current: Vec<usize> = Vec::new();
        let mut bytes = 0usize;
        for (l, &b) in layer_bytes.iter().enumerate().rev() {
            if b == 0 {
                continue;
            }
            of_layer[l] = Some(buckets.len());
            current.push(l);
            bytes = bytes.saturating_add(b);
            if bytes >= bucket_bytes {
                buckets.push(std::mem::take(&mut current));
                bytes = 0;
            }
        }
        if !current.is_empty() {
            buckets.push(current);
        }
        BucketPlan { buckets, of_layer }
    }

    /// The buckets, in the order they fill; each lists its layers in backward order.
    pub fn buckets(&self) -> &[Vec<usize>] {
        &self.buckets
    }

    /// The bucket of a layer; `None` for a layer without parameters or out of range.
    pub fn bucket_of(&self, layer: usize) -> Option<usize> {
        self.of_layer.get(layer).copied().flatten()
    }
}
