//! Dispatching a forward: the per-sample choices regrouped into one call per expert
//! ([`group`]), and the calls made in parallel under `forward_timeout`, waiting at most
//! `timeout_after_k_min` more once every sample has `k_min` answers ([`call_forward`]).

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::Tensor;
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::time::Instant;
use tracing::debug;

use super::MoeConfig;
use crate::client::RemoteExpert;
use crate::grid::ExpertUid;
use crate::ExpertError;

/// The samples routed to one expert, and the slot (of the sample's `k_best`) each one is in.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Call<E = RemoteExpert> {
    pub(super) expert: E,
    /// Sample indices, in the order their rows are sent.
    pub(super) rows: Vec<u32>,
    /// For each row, its slot among that sample's chosen experts.
    pub(super) slots: Vec<u32>,
}

/// Per-sample choices regrouped per expert.
#[derive(Debug)]
pub(super) struct Dispatch<E = RemoteExpert> {
    /// One call per distinct expert, in order of first appearance.
    pub(super) calls: Vec<Call<E>>,
    /// Grid coordinates of every slot: `coords[level][sample * k + slot]` (0 for empty slots,
    /// which the mask hides).
    pub(super) coords: Vec<Vec<u32>>,
}

/// Groups `chosen` (per sample, up to `k` experts with their uids on a grid of `levels`
/// dimensions) into one call per distinct expert uid.
pub(super) fn group<E: Clone>(
    chosen: &[Vec<(ExpertUid, E)>],
    k: usize,
    levels: usize,
) -> Dispatch<E> {
    let mut calls: Vec<Call<E>> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut coords = vec![vec![0u32; chosen.len() * k]; levels];
    for (row, picks) in chosen.iter().enumerate() {
        for (slot, (uid, expert)) in picks.iter().enumerate() {
            let i = *index.entry(uid.to_string()).or_insert_with(|| {
                calls.push(Call {
                    expert: expert.clone(),
                    rows: Vec::new(),
                    slots: Vec::new(),
                });
                calls.len() - 1
            });
            calls[i].rows.push(row as u32);
            calls[i].slots.push(slot as u32);
            for (d, c) in uid.coords.iter().enumerate() {
                coords[d][row * k + slot] = *c;
            }
        }
    }
    Dispatch { calls, coords }
}

/// Calls every chosen expert in parallel. Returns each call's outputs (flattened) or `None`.
pub(super) async fn call_forward(
    cfg: &MoeConfig,
    calls: Vec<Call>,
    x: Arc<Vec<f32>>,
    in_len: usize,
    candidates: Vec<usize>,
) -> Vec<Option<Vec<f32>>> {
    let mut outputs: Vec<Option<Vec<f32>>> = vec![None; calls.len()];
    let mut answered = vec![0usize; candidates.len()];
    let need: Vec<usize> = candidates.iter().map(|&c| c.min(cfg.k_min)).collect();
    let deadline = Instant::now() + cfg.forward_timeout;
    let mut soft: Option<Instant> = None;
    let mut pending: FuturesUnordered<_> = calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            let x = x.clone();
            let call = call.clone();
            let mut shape = vec![call.rows.len()];
            shape.extend(&cfg.sample_shape);
            let limit = cfg.forward_timeout;
            async move {
                let mut rows = Vec::with_capacity(call.rows.len() * in_len);
                for &r in &call.rows {
                    rows.extend_from_slice(&x[r as usize * in_len..(r as usize + 1) * in_len]);
                }
                let result = async {
                    let t = Tensor::from_vec(rows, shape, &candle_core::Device::Cpu)?;
                    let y = call.expert.forward_within(&t, limit).await?;
                    Ok::<_, ExpertError>(y.flatten_all()?.to_vec1::<f32>()?)
                }
                .await;
                (i, result)
            }
        })
        .collect();
    if need.iter().all(|&n| n == 0) {
        soft = Some(Instant::now() + cfg.timeout_after_k_min);
    }
    while !pending.is_empty() {
        let wake = soft.map_or(deadline, |s| s.min(deadline));
        let next = tokio::select! {
            n = pending.next() => n,
            _ = tokio::time::sleep_until(wake) => break,
        };
        let Some((i, result)) = next else { break };
        match result {
            Ok(values) if values.len() == calls[i].rows.len() * in_len => {
                for &r in &calls[i].rows {
                    answered[r as usize] += 1;
                }
                outputs[i] = Some(values);
            }
            Ok(values) => debug!(
                uid = calls[i].expert.uid(),
                len = values.len(),
                "expert answered with the wrong size"
            ),
            Err(e) => debug!(uid = calls[i].expert.uid(), "expert call failed: {e}"),
        }
        if soft.is_none() && answered.iter().zip(&need).all(|(a, n)| a >= n) {
            soft = Some(Instant::now() + cfg.timeout_after_k_min);
        }
    }
    outputs
}
