//! The remote experts as one candle autograd node ([`ExpertsOp`]): its forward hands back the
//! outputs gathered eagerly by the layer; its backward sends each expert that answered the
//! gradient of its outputs and sums the input gradients it returns. A failed backward call
//! contributes zero and is counted in [`MoeStats::backward_failed`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use tracing::debug;

use super::dispatch::Call;
use super::{block_on, MoeStats};
use crate::ExpertError;
use starling_node::lock::lock;

/// Everything the backward needs from the forward.
pub(super) struct Plan {
    /// The calls that answered the forward.
    pub(super) calls: Vec<Call>,
    /// Their outputs, `[b, k, ..sample_shape]` flattened (zero in empty slots).
    pub(super) y: Vec<f32>,
    pub(super) y_shape: Vec<usize>,
    pub(super) k: usize,
    /// Elements per input sample.
    pub(super) in_len: usize,
    /// Elements per output sample.
    pub(super) out_len: usize,
    pub(super) backward_timeout: Duration,
    pub(super) rt: tokio::runtime::Handle,
    pub(super) last: Arc<Mutex<MoeStats>>,
}

/// The remote experts as one autograd node: forward returns the outputs gathered eagerly,
/// backward calls the experts' backward.
pub(super) struct ExpertsOp {
    pub(super) plan: Arc<Plan>,
}

impl CustomOp1 for ExpertsOp {
    fn name(&self) -> &'static str {
        "remote-experts"
    }

    fn cpu_fwd(
        &self,
        _storage: &CpuStorage,
        _layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((
            CpuStorage::F32(self.plan.y.clone()),
            Shape::from_dims(&self.plan.y_shape),
        ))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let plan = self.plan.clone();
        let x = Arc::new(arg.detach().flatten_all()?.to_vec1::<f32>()?);
        let g = Arc::new(grad_res.detach().flatten_all()?.to_vec1::<f32>()?);
        let fut = {
            let (plan, x, g) = (plan.clone(), x.clone(), g.clone());
            async move {
                let calls = (0..plan.calls.len()).map(|i| backward_call(&plan, i, &x, &g));
                futures::future::join_all(calls).await
            }
        };
        let results =
            block_on(&plan.rt, fut).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut grad = vec![0f32; x.len()];
        let mut failed = 0;
        for (call, result) in plan.calls.iter().zip(results) {
            match result {
                Some(gx) => accumulate(&mut grad, call, &gx, plan.in_len),
                None => failed += 1,
            }
        }
        lock(&plan.last).backward_failed = failed;
        Ok(Some(Tensor::from_vec(grad, arg.shape(), arg.device())?))
    }
}

/// Sends call `i` its rows of the forward input `x` (`[b, ..]` flattened) and their slots of
/// the output gradient `g` (`[b, k, ..]` flattened); the input gradient it returns, or `None`
/// when the call failed or answered with the wrong size.
async fn backward_call(plan: &Plan, i: usize, x: &[f32], g: &[f32]) -> Option<Vec<f32>> {
    let call = &plan.calls[i];
    let n = call.rows.len();
    let mut xs = Vec::with_capacity(n * plan.in_len);
    let mut gs = Vec::with_capacity(n * plan.out_len);
    for (&r, &s) in call.rows.iter().zip(&call.slots) {
        let r = r as usize;
        xs.extend_from_slice(&x[r * plan.in_len..(r + 1) * plan.in_len]);
        let at = (r * plan.k + s as usize) * plan.out_len;
        gs.extend_from_slice(&g[at..at + plan.out_len]);
    }
    let mut shape = vec![n];
    shape.extend(&plan.y_shape[2..]);
    let result = async {
        let xt = Tensor::from_vec(xs, shape.clone(), &candle_core::Device::Cpu)?;
        let gt = Tensor::from_vec(gs, shape, &candle_core::Device::Cpu)?;
        let gx = call
            .expert
            .backward_within(&xt, &gt, plan.backward_timeout)
            .await?;
        Ok::<_, ExpertError>(gx.flatten_all()?.to_vec1::<f32>()?)
    }
    .await;
    if let Err(e) = &result {
        debug!(uid = call.expert.uid(), "backward failed: {e}");
    }
    result.ok().filter(|v| v.len() == n * plan.in_len)
}

/// Adds a call's input gradients `gx` (one row of `in_len` per routed sample) into `grad`.
fn accumulate<E>(grad: &mut [f32], call: &Call<E>, gx: &[f32], in_len: usize) {
    for (j, &r) in call.rows.iter().enumerate() {
        let r = r as usize;
        for (dst, src) in grad[r * in_len..(r + 1) * in_len]
            .iter_mut()
            .zip(&gx[j * in_len..(j + 1) * in_len])
        {
            *dst += src;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_gradients_add_up_per_sample() {
        // Two samples of 2 values; the call carried sample 1 then sample 0.
        let call = Call {
            expert: (),
            rows: vec![1, 0],
            slots: vec![0, 1],
        };
        let mut grad = vec![1.0; 4];
        accumulate(&mut grad, &call, &[10.0, 20.0, 30.0, 40.0], 2);
        assert_eq!(grad, vec![31.0, 41.0, 11.0, 21.0]);
    }
}
