//! Layers of different types in one chain, through type erasure.
//!
//! [`Chain`](crate::Chain) is generic over one layer type, so a homogeneous chain costs no
//! dispatch. A chain of mixed layers (embedding, blocks, head) either uses an enum of them or
//! wraps each in a [`BoxedLayer`]: one virtual call per forward or backward and one box per
//! saved state, negligible beside a layer's kernels.

use std::any::Any;

use headroom_tensor::{Backend, Error, Result};

use crate::{Layer, SavedState};

/// A saved state of any layer type.
pub trait AnySaved: SavedState + Send {
    /// The state as `Any`, to recover its concrete type.
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

impl<S: SavedState + Send + 'static> AnySaved for S {
    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

impl SavedState for Box<dyn AnySaved> {
    fn size_in_bytes(&self) -> usize {
        (**self).size_in_bytes()
    }
}

/// The object-safe form of [`Layer`].
trait ErasedLayer<B: Backend>: Send {
    fn forward_save(
        &self,
        backend: &B,
        input: &B::Tensor,
    ) -> Result<(B::Tensor, Box<dyn AnySaved>)>;
    fn forward_discard(&self, backend: &B, input: &B::Tensor) -> Result<B::Tensor>;
    fn backward(
        &mut self,
        backend: &B,
        input: &B::Tensor,
        saved: Box<dyn AnySaved>,
        grad_output: &B::Tensor,
    ) -> Result<B::Tensor>;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A saved state handed to the backward of another layer type.
#[derive(Debug, thiserror::Error)]
#[error("saved state does not belong to this layer type")]
struct ForeignSavedState;

impl<B, L> ErasedLayer<B> for L
where
    B: Backend,
    L: Layer<B> + Send + 'static,
    L::Saved: Send + 'static,
{
    fn forward_save(
        &self,
        backend: &B,
        input: &B::Tensor,
    ) -> Result<(B::Tensor, Box<dyn AnySaved>)> {
        let (out, saved) = Layer::forward_save(self, backend, input)?;
        Ok((out, Box::new(saved)))
    }

    fn forward_discard(&self, backend: &B, input: &B::Tensor) -> Result<B::Tensor> {
        Layer::forward_discard(self, backend, input)
    }

    fn backward(
        &mut self,
        backend: &B,
        input: &B::Tensor,
        saved: Box<dyn AnySaved>,
        grad_output: &B::Tensor,
    ) -> Result<B::Tensor> {
        let saved = saved
            .into_any()
            .downcast::<L::Saved>()
            .map_err(|_| Error::Backend {
                device: backend.device(),
                op: "BoxedLayer::backward",
                source: Box::new(ForeignSavedState),
            })?;
        Layer::backward(self, backend, input, *saved, grad_output)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// Any layer for backend `B`, boxed so layers of different types share one chain.
pub struct BoxedLayer<B: Backend>(Box<dyn ErasedLayer<B>>);

impl<B: Backend> std::fmt::Debug for BoxedLayer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BoxedLayer")
    }
}

impl<B: Backend + 'static> BoxedLayer<B> {
    /// Box `layer`.
    pub fn new<L>(layer: L) -> Self
    where
        L: Layer<B> + Send + 'static,
        L::Saved: Send + 'static,
    {
        BoxedLayer(Box::new(layer))
    }

    /// The layer inside, if it is an `L`.
    pub fn downcast_ref<L: 'static>(&self) -> Option<&L> {
        self.0.as_any().downcast_ref()
    }

    /// The layer inside, mutably, if it is an `L`.
    pub fn downcast_mut<L: 'static>(&mut self) -> Option<&mut L> {
        self.0.as_any_mut().downcast_mut()
    }
}

impl<B: Backend> Layer<B> for BoxedLayer<B> {
    type Saved = Box<dyn AnySaved>;

    fn forward_save(&self, backend: &B, input: &B::Tensor) -> Result<(B::Tensor, Self::Saved)> {
        self.0.forward_save(backend, input)
    }

    fn forward_discard(&self, backend: &B, input: &B::Tensor) -> Result<B::Tensor> {
        self.0.forward_discard(backend, input)
    }

    fn backward(
        &mut self,
        backend: &B,
        input: &B::Tensor,
        saved: Self::Saved,
        grad_output: &B::Tensor,
    ) -> Result<B::Tensor> {
        self.0.backward(backend, input, saved, grad_output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_layers::{Dense, MlpBlock};
    use crate::{Chain, KeepMatmuls, Schedule};
    use headroom_tensor::{Cpu, CpuTensor};

    fn mixed() -> Chain<BoxedLayer<Cpu>> {
        Chain::new(vec![
            BoxedLayer::new(Dense::new(5, 8, 1)),
            BoxedLayer::new(MlpBlock::with_policy(8, 16, 2, KeepMatmuls)),
            BoxedLayer::new(MlpBlock::new(8, 24, 3)),
            BoxedLayer::new(Dense::new(8, 3, 4)),
        ])
    }

    fn grads(chain: &Chain<BoxedLayer<Cpu>>) -> Vec<Vec<u32>> {
        let mut out = Vec::new();
        for l in chain.layers() {
            let gs: Vec<&[f32]> = if let Some(d) = l.downcast_ref::<Dense>() {
                d.grads().to_vec()
            } else if let Some(m) = l.downcast_ref::<MlpBlock<KeepMatmuls>>() {
                m.grads().to_vec()
            } else {
                l.downcast_ref::<MlpBlock>().unwrap().grads().to_vec()
            };
            out.extend(gs.iter().map(|g| g.iter().map(|v| v.to_bits()).collect()));
        }
        out
    }

    #[test]
    fn mixed_chain_gives_identical_gradients_under_every_schedule() {
        let cpu = Cpu::new();
        let x = cpu
            .upload(&crate::cpu_layers::seeded_values(15, 9, 1.0), [3, 5])
            .unwrap();
        let dy = crate::cpu_layers::seeded_values(9, 10, 1.0);
        let run = |schedule: &Schedule| {
            let mut chain = mixed();
            let out = chain
                .step(&cpu, schedule, &x, |_y: &CpuTensor| cpu.upload(&dy, [3, 3]))
                .unwrap();
            (
                grads(&chain),
                out.input_grad.as_slice::<f32>().unwrap().to_vec(),
            )
        };
        let reference = run(&Schedule::store_all(4).unwrap());
        assert!(
            reference.0.iter().flatten().any(|&b| b != 0),
            "gradients are not all zero"
        );
        for schedule in [
            Schedule::sqrt_n(4).unwrap(),
            Schedule::revolve(4, 0).unwrap(),
            Schedule::every_k(4, 3).unwrap(),
        ] {
            assert_eq!(run(&schedule), reference);
        }
    }

    #[test]
    fn foreign_saved_state_is_an_error() {
        let cpu = Cpu::new();
        let a = BoxedLayer::new(Dense::new(2, 2, 1));
        let mut b = BoxedLayer::new(MlpBlock::new(2, 4, 2));
        let x = cpu.upload(&[0.5f32; 4], [2, 2]).unwrap();
        let (y, saved) = Layer::forward_save(&a, &cpu, &x).unwrap();
        assert!(matches!(
            Layer::backward(&mut b, &cpu, &x, saved, &y),
            Err(Error::Backend { .. })
        ));
        assert!(b.downcast_mut::<MlpBlock>().is_some());
        assert!(b.downcast_ref::<Dense>().is_none());
    }
}
