//! The dashboard: one self-contained HTML page (inline CSS, JS and SVG; nothing fetched from
//! elsewhere) that polls three JSON endpoints every two seconds:
//! - `/api/swarm`: the live swarm from heartbeats (peer, mode, bandwidth, training progress,
//!   experts), refreshed in the background, so a request never waits on the network;
//! - `/api/loss`: the loss curve this node's training reported (a bounded journal);
//! - `/api/rounds`: this node's recent averaging rounds.
//!
//! Read-only: only GETs are routed; everything else is a 404 or 405.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::header;
use axum::response::{IntoResponse, Json};
use axum::routing::get;
use axum::Router;
use serde::Serialize;
use starling_averager::RoundRecord;
use starling_node::heartbeat::{read_heartbeats, HeartbeatConfig};
use starling_node::lock::lock;
use starling_node::Node;
use starling_training::LossPoint;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::peer::PeerView;

/// The page.
const PAGE: &str = include_str!("dashboard.html");
/// Rounds `/api/rounds` returns (the most recent).
const ROUNDS_SHOWN: usize = 50;

/// What `/api/swarm` answers.
#[derive(Clone, Default, Serialize)]
struct SwarmView {
    /// This node's peer id.
    #[serde(rename = "self")]
    me: String,
    /// When the view was read (unix ms; 0: not yet).
    updated_ms: u64,
    /// Why the last read failed, if it did.
    error: Option<String>,
    peers: Vec<PeerView>,
}

#[derive(Serialize)]
struct LossView {
    points: Vec<LossPoint>,
}

#[derive(Serialize)]
struct RoundsView {
    rounds: Vec<RoundRecord>,
}

/// The dashboard's routes for `node`, and the task that keeps its swarm view fresh (stops on
/// `stop` or when the node does).
pub fn routes(
    node: &Node,
    hb: HeartbeatConfig,
    mut stop: watch::Receiver<bool>,
) -> (Router, JoinHandle<()>) {
    let view = Arc::new(Mutex::new(SwarmView {
        me: node.peer_id().to_string(),
        ..SwarmView::default()
    }));
    let refresher = {
        let (node, view) = (node.clone(), view.clone());
        let every = hb
            .interval
            .clamp(Duration::from_secs(1), Duration::from_secs(10));
        let span = node.span();
        tokio::spawn(
            async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = stop.changed() => break,
                        _ = node.closed() => break,
                    }
                    let read = tokio::select! {
                        r = read_heartbeats(&node, &hb) => r,
                        _ = stop.changed() => break,
                        _ = node.closed() => break,
                    };
                    let mut v = lock(&view);
                    v.updated_ms = starling_dht::now_ms();
                    match read {
                        Ok(peers) => {
                            v.peers = peers.iter().map(PeerView::from).collect();
                            v.error = None;
                        }
                        Err(e) => v.error = Some(e.to_string()),
                    }
                }
            }
            .instrument(span),
        )
    };
    let metrics = node.metrics().clone();
    let loss_metrics = metrics.clone();
    let router = Router::new()
        .route(
            "/",
            get(|| async {
                (
                    [
                        (header::CONTENT_TYPE, "text/html; charset=utf-8"),
                        (header::CACHE_CONTROL, "no-store"),
                    ],
                    PAGE,
                )
                    .into_response()
            }),
        )
        .route(
            "/api/swarm",
            get(move || {
                let v = lock(&view).clone();
                async move { Json(v) }
            }),
        )
        .route(
            "/api/loss",
            get(move || {
                let points = loss_metrics.journal::<LossPoint>().entries();
                async move { Json(LossView { points }) }
            }),
        )
        .route(
            "/api/rounds",
            get(move || {
                let mut rounds = metrics.journal::<RoundRecord>().entries();
                let skip = rounds.len().saturating_sub(ROUNDS_SHOWN);
                rounds.drain(..skip);
                async move { Json(RoundsView { rounds }) }
            }),
        );
    (router, refresher)
}
