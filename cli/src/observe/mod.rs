//! Seeing a node from outside: `--metrics-addr` (Prometheus text), `--dashboard` (a live HTML
//! page and its JSON), and the heartbeat every long-running command publishes so that
//! `starling status` and dashboards can list the live swarm.
//!
//! - [`http`]: the bounded, read-only HTTP serving both endpoints use;
//! - [`dashboard`]: the page and its `/api/*` JSON;
//! - [`peer`]: a peer's heartbeat with its board decoded, as `status` and the dashboard show it.
//!
//! Endpoints listen on loopback unless given another address; nothing on them changes state.

pub mod dashboard;
pub mod http;
pub mod peer;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::{ensure, Result};
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use clap::Args;
use starling_node::heartbeat::{HeartbeatConfig, HeartbeatTask};
use starling_node::Node;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// `--metrics-addr`, `--dashboard` and the heartbeat, on `node`, `train` and `experts serve`.
#[derive(Args, Clone, Debug, Default)]
pub struct ObserveArgs {
    /// Serve Prometheus metrics (text format) at http://ADDR/metrics. A bare PORT means
    /// 127.0.0.1:PORT; give 0.0.0.0:PORT to expose it beyond this machine. Off by default.
    #[arg(long, value_name = "ADDR", value_parser = parse_endpoint)]
    pub metrics_addr: Option<SocketAddr>,
    /// Serve a live dashboard (swarm peers, loss curve, averaging rounds) at http://ADDR/. A
    /// bare PORT means 127.0.0.1:PORT. Off by default.
    #[arg(long, value_name = "ADDR", value_parser = parse_endpoint)]
    pub dashboard: Option<SocketAddr>,
    /// Seconds between heartbeats in the DHT (each lives three times as long).
    #[arg(long, default_value_t = 10.0, hide = true)]
    pub heartbeat_interval: f64,
}

/// `ADDR` or a bare `PORT` (on 127.0.0.1).
pub fn parse_endpoint(s: &str) -> Result<SocketAddr, String> {
    if let Ok(port) = s.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    s.parse::<SocketAddr>()
        .map_err(|e| format!("{s:?}: expected HOST:PORT (e.g. 127.0.0.1:9100) or PORT: {e}"))
}

impl ObserveArgs {
    /// The heartbeat settings these flags give.
    pub fn heartbeat(&self) -> Result<HeartbeatConfig> {
        ensure!(
            self.heartbeat_interval.is_finite() && self.heartbeat_interval > 0.0,
            "--heartbeat-interval must be a positive number of seconds"
        );
        Ok(HeartbeatConfig::default().every(Duration::from_secs_f64(self.heartbeat_interval)))
    }
}

/// The heartbeat and the endpoints of one node; stop with [`Observer::stop`].
pub struct Observer {
    heartbeat: HeartbeatTask,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    /// Where the endpoints listen: (what, address).
    pub endpoints: Vec<(&'static str, SocketAddr)>,
}

/// `/metrics`: the node's registry in the Prometheus text format.
fn metrics_routes(node: &Node) -> Router {
    let metrics = node.metrics().clone();
    Router::new().route(
        "/metrics",
        get(move || {
            let metrics = metrics.clone();
            async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    metrics.encode(),
                )
                    .into_response()
            }
        }),
    )
}

impl Observer {
    /// Starts `node`'s heartbeat and the endpoints `args` ask for (one listener when both
    /// addresses are the same).
    pub async fn start(node: &Node, args: &ObserveArgs) -> Result<Observer> {
        let hb_cfg = args.heartbeat()?;
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        let mut endpoints = Vec::new();
        let mut listeners: Vec<(SocketAddr, Router, Vec<&'static str>)> = Vec::new();
        if let Some(addr) = args.metrics_addr {
            listeners.push((addr, metrics_routes(node), vec!["metrics"]));
        }
        if let Some(addr) = args.dashboard {
            let (routes, refresher) = dashboard::routes(node, hb_cfg.clone(), stop_rx.clone());
            tasks.push(refresher);
            match listeners
                .iter_mut()
                .find(|(a, _, _)| *a == addr && addr.port() != 0)
            {
                Some((_, router, what)) => {
                    *router = std::mem::take(router).merge(routes);
                    what.push("dashboard");
                }
                None => listeners.push((addr, routes, vec!["dashboard"])),
            }
        }
        for (addr, router, what) in listeners {
            let (bound, task) = http::bind_and_serve(addr, router, stop_rx.clone()).await?;
            tasks.push(task);
            for w in what {
                endpoints.push((w, bound));
            }
        }
        let heartbeat = HeartbeatTask::spawn(node, hb_cfg);
        Ok(Observer {
            heartbeat,
            stop,
            tasks,
            endpoints,
        })
    }

    /// Prints where the endpoints listen (`{"event": "endpoint", ...}` lines with `json`).
    pub fn print(&self, json: bool) {
        for (what, addr) in &self.endpoints {
            let url = match *what {
                "metrics" => format!("http://{addr}/metrics"),
                _ => format!("http://{addr}/"),
            };
            if json {
                println!(
                    "{}",
                    serde_json::json!({ "event": "endpoint", "what": what, "url": url })
                );
            } else {
                println!("{what} at {url}");
            }
        }
    }

    /// Stops the heartbeat and the endpoints, and waits for their tasks.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        self.heartbeat.stop().await;
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(3), t).await;
        }
    }
}
