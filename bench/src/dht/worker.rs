//! One worker process of `starling bench dht --procs`: hosts its share of the peers and runs
//! the operations the coordinator sends on stdin, answering on stdout.

use super::*;

/// Arguments of a `bench dht --procs` worker process.
#[derive(Args, Debug, Clone)]
pub struct DhtWorkerArgs {
    /// Peers this process hosts.
    #[arg(long)]
    pub peers: usize,
    /// Where its peers bootstrap from (each peer from two of them, in turn).
    #[arg(long, required = true)]
    pub bootstrap: Vec<Multiaddr>,
    /// Idle connection timeout of its peers, seconds.
    #[arg(long)]
    pub idle_timeout: u64,
    /// Routing-table refresh interval of its peers, seconds (0: never).
    #[arg(long)]
    pub refresh: u64,
    /// Its peers' connection high-water mark.
    #[arg(long)]
    pub high_water: usize,
    /// Its peers' connection low-water mark.
    #[arg(long)]
    pub low_water: usize,
    /// Its peers' ceiling on established connections (0: none).
    #[arg(long)]
    pub max_established: u32,
}

/// `starling bench dht-worker`: hosts peers and runs the operations its stdin asks for.
pub async fn worker(args: DhtWorkerArgs) -> Result<()> {
    let base_rss_kb = rss_kb();
    let peer = PeerSettings {
        idle: Duration::from_secs(args.idle_timeout),
        refresh: PeerSettings::refresh_from_s(args.refresh),
        connections: ConnectionLimits {
            high_water: args.high_water,
            low_water: args.low_water,
            max_established: (args.max_established > 0).then_some(args.max_established),
            ..ConnectionLimits::default()
        },
    };
    let nodes = start_peers(args.peers, args.bootstrap, peer).await?;
    let mut nodes: Vec<Option<Node>> = nodes.into_iter().map(Some).collect();
    let (tx, mut rx) = mpsc::channel::<String>(1024);
    let mut out = tokio::io::stdout();
    let ready = serde_json::to_string(&Ready {
        ready: true,
        base_rss_kb,
    })?;
    out.write_all(format!("{ready}\n").as_bytes()).await?;
    out.flush().await?;
    let writer = tokio::spawn(async move {
        while let Some(line) = rx.recv().await {
            if out.write_all(line.as_bytes()).await.is_err() || out.flush().await.is_err() {
                break;
            }
        }
    });
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let op: Op = match serde_json::from_str(&line) {
            Ok(op) => op,
            Err(e) => bail!("bad op line {line:?}: {e}"),
        };
        let answer = |id, ok, ms, rss_kb, connections, routing| {
            let a = Answer {
                id,
                ok,
                ms,
                rss_kb,
                connections,
                routing,
            };
            format!("{}\n", serde_json::to_string(&a).unwrap_or_default())
        };
        match &op {
            Op::Kill { id, peers } => {
                for &p in peers {
                    if let Some(node) = nodes.get_mut(p).and_then(Option::take) {
                        node.shutdown().await;
                    }
                }
                let _ = tx.send(answer(*id, true, 0.0, 0, 0, Vec::new())).await;
            }
            Op::Rss { id } => {
                let connections = connections_of(&nodes).await;
                let routing = routing_of(&nodes).await;
                let _ = tx
                    .send(answer(*id, true, 0.0, rss_kb(), connections, routing))
                    .await;
            }
            Op::Store { id, peer, .. }
            | Op::Get { id, peer, .. }
            | Op::GetFirst { id, peer, .. } => {
                let (id, node) = (*id, nodes.get(*peer).cloned().flatten());
                let tx = tx.clone();
                tokio::spawn(async move {
                    let (ok, ms) = match node {
                        Some(node) => run_local(&node, &op).await,
                        None => (false, 0.0),
                    };
                    let _ = tx.send(answer(id, ok, ms, 0, 0, Vec::new())).await;
                });
            }
        }
    }
    // The coordinator closed our stdin: stop.
    futures::future::join_all(nodes.iter().flatten().map(|n| n.shutdown())).await;
    drop(tx);
    let _ = writer.await;
    Ok(())
}
