//! [`PerCategory`]: one value per [`MemoryCategory`], indexable by category.

use std::ops::{Index, IndexMut};

use headroom_tensor::MemoryCategory;
use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

/// Number of memory categories ([`MemoryCategory::ALL`]).
pub const CATEGORY_COUNT: usize = MemoryCategory::ALL.len();

/// Dense index of a category, in [`MemoryCategory::ALL`] order.
///
/// A `match` rather than `as usize` so that a category added to headroom-tensor fails to compile
/// here instead of indexing out of bounds.
pub(crate) const fn category_index(category: MemoryCategory) -> usize {
    match category {
        MemoryCategory::Parameters => 0,
        MemoryCategory::Gradients => 1,
        MemoryCategory::OptimizerState => 2,
        MemoryCategory::Activations => 3,
        MemoryCategory::Workspace => 4,
        MemoryCategory::Data => 5,
        MemoryCategory::Other => 6,
    }
}

/// One value per memory category (bytes, counts), in [`MemoryCategory::ALL`] order.
///
/// Serialises as a JSON object keyed by the categories' short names (`"params"`, …).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PerCategory<T>(pub [T; CATEGORY_COUNT]);

impl<T: Copy> PerCategory<T> {
    /// `(category, value)` pairs in report order.
    pub fn iter(&self) -> impl Iterator<Item = (MemoryCategory, T)> + '_ {
        MemoryCategory::ALL
            .iter()
            .zip(self.0.iter())
            .map(|(c, v)| (*c, *v))
    }
}

impl PerCategory<u64> {
    /// Sum over all categories (saturating: a sum that overflows `u64` is not a real memory size).
    pub fn total(&self) -> u64 {
        self.0.iter().fold(0u64, |acc, v| acc.saturating_add(*v))
    }
}

impl<T> Index<MemoryCategory> for PerCategory<T> {
    type Output = T;
    fn index(&self, category: MemoryCategory) -> &T {
        &self.0[category_index(category)]
    }
}

impl<T> IndexMut<MemoryCategory> for PerCategory<T> {
    fn index_mut(&mut self, category: MemoryCategory) -> &mut T {
        &mut self.0[category_index(category)]
    }
}

impl<T: Serialize> Serialize for PerCategory<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(CATEGORY_COUNT))?;
        for (category, value) in MemoryCategory::ALL.iter().zip(self.0.iter()) {
            map.serialize_entry(category.name(), value)?;
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_matches_all_order() {
        for (i, c) in MemoryCategory::ALL.iter().enumerate() {
            assert_eq!(category_index(*c), i);
        }
    }

    #[test]
    fn total_and_serialise() {
        let mut p = PerCategory::<u64>::default();
        p[MemoryCategory::Gradients] = 5;
        p[MemoryCategory::Other] = 7;
        assert_eq!(p.total(), 12);
        let json = serde_json::to_value(p).unwrap();
        assert_eq!(json["grads"], 5);
        assert_eq!(json["other"], 7);
        assert_eq!(json["params"], 0);
        p[MemoryCategory::Data] = u64::MAX;
        assert_eq!(p.total(), u64::MAX);
    }
}
