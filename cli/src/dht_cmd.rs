use anyhow::{bail, Result};
use clap::Subcommand;
use starling_dht::{decode_value, now_ms};
use starling_node::Node;

use crate::JoinArgs;

#[derive(Subcommand, Debug)]
pub enum DhtCommand {
    /// Store VALUE (a UTF-8 string) under KEY.
    Put {
        key: String,
        value: String,
        /// Sub-key to write (default: empty). Include `[owner:me]` to make it writable by this
        /// identity only (the entry is then signed).
        #[arg(long, default_value = "")]
        subkey: String,
        /// Time to live in seconds.
        #[arg(long, default_value_t = 3600)]
        ttl: u64,
        #[command(flatten)]
        join: JoinArgs,
    },
    /// Print every live entry under KEY.
    Get {
        key: String,
        /// Print a JSON object instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        join: JoinArgs,
    },
}

async fn join(args: &JoinArgs) -> Result<Node> {
    if args.bootstrap.is_empty() {
        bail!("--bootstrap is required: give the address of a running node (it prints its addresses at start)");
    }
    let cfg = args.config()?.client(true);
    Ok(Node::start(cfg).await?)
}

fn render(value: &[u8]) -> String {
    match decode_value::<String>(value) {
        Ok(s) if postcard_len_matches(&s, value) => s,
        _ => format!("0x{}", hex_encode(value)),
    }
}

fn postcard_len_matches(s: &str, raw: &[u8]) -> bool {
    starling_dht::encode_value(&s.to_string()).is_ok_and(|b| b == raw)
}

fn hex_encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub async fn run(cmd: DhtCommand) -> Result<()> {
    match cmd {
        DhtCommand::Put {
            key,
            value,
            subkey,
            ttl,
            join: args,
        } => {
            let node = join(&args).await?;
            let subkey = subkey.replace("[owner:me]", &node.owner_marker());
            let key = key.replace("[owner:me]", &node.owner_marker());
            let expiration = now_ms() + ttl.saturating_mul(1000);
            let result = node.store(&key, &subkey, &value, expiration).await;
            node.shutdown().await;
            let report = result?;
            println!(
                "stored {key:?} sub-key {subkey:?} (expires in {ttl} s; acknowledged by {} peer(s))",
                report.acknowledged
            );
            Ok(())
        }
        DhtCommand::Get {
            key,
            json,
            join: args,
        } => {
            let node = join(&args).await?;
            let result = node.get_record(&key).await;
            node.shutdown().await;
            let Some(record) = result? else {
                bail!("no live entries under {key:?}");
            };
            let now = now_ms();
            if json {
                let entries: Vec<_> = record
                    .live_entries(now)
                    .map(|e| {
                        serde_json::json!({
                            "subkey": e.subkey,
                            "value": render(&e.value),
                            "expires_in_s": (e.expiration.saturating_sub(now)) as f64 / 1000.0,
                            "signed": e.signature.is_some(),
                        })
                    })
                    .collect();
                println!("{}", serde_json::json!({ "key": key, "entries": entries }));
            } else {
                for e in record.live_entries(now) {
                    println!(
                        "{}\t{}\t(expires in {} s{})",
                        if e.subkey.is_empty() { "-" } else { &e.subkey },
                        render(&e.value),
                        e.expiration.saturating_sub(now) / 1000,
                        if e.signature.is_some() {
                            ", signed"
                        } else {
                            ""
                        }
                    );
                }
            }
            Ok(())
        }
    }
}
