//! One `vigil replay --redis` of an input at a time, and what a finished one applied.
//!
//! Two replays of one input interleaving their writes would each count what the other had not
//! yet recorded as applied, so a replay claims its input lane first (`vg:r:{<lane>}:claim`, a
//! key with a TTL its keeper thread refreshes); a second one is refused, naming the holder. A
//! replay that finishes records how many lines it applied and when (`vg:r:{<lane>}`), so the
//! next one of the same input can say it would only re-judge them (`lua/replay_lane.lua`).

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use redis::Value;

use super::counter_store::StoreError;
use super::keys::push_hex;
use super::link::{Batch, Link};
use super::redis::{open_side_link, RedisStoreConfig};
use super::scripts::REPLAY_LANE;

/// How long a claim outlives its holder's last sign of life.
const CLAIM_TTL_MS: u64 = 30_000;

/// How long the record of a finished replay is kept.
const RECORD_TTL_MS: u64 = 90 * 86_400_000;

/// What a finished replay of the input applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub lines: u64,
    /// When it finished (epoch ms).
    pub at_ms: i64,
}

impl Applied {
    /// When it finished, as messages say it.
    pub fn finished(&self) -> String {
        utc_text(self.at_ms)
    }
}

/// This process's claim on an input lane; released on drop unless [`ReplayClaim::finish`]ed.
pub struct ReplayClaim {
    link: Arc<Mutex<Link>>,
    cluster: bool,
    keys: [String; 2],
    value: String,
    keeper: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
    /// What an earlier replay of the same input applied, if one finished.
    pub previous: Option<Applied>,
}

impl ReplayClaim {
    /// Claims `lane` for this process, or says who holds it. A claim left by a process of this
    /// host that no longer runs (a replay killed with SIGKILL) is taken over at once.
    pub fn acquire(
        url: &str,
        config: &RedisStoreConfig,
        lane: u64,
    ) -> Result<ReplayClaim, StoreError> {
        let holder = holder();
        let (link, cluster) = open_side_link(url, config)?;
        let mut tag = String::new();
        push_hex(&mut tag, &lane.to_be_bytes());
        let keys = [format!("vg:r:{{{tag}}}:claim"), format!("vg:r:{{{tag}}}")];
        let mut value = String::new();
        push_hex(&mut value, &rand::random::<[u8; 12]>());
        value.push(' ');
        value.push_str(&holder);
        let mut claim = ReplayClaim {
            link: Arc::new(Mutex::new(link)),
            cluster,
            keys,
            value,
            keeper: None,
            previous: None,
        };
        let mut reply: Vec<String> = claim.call("claim", &[CLAIM_TTL_MS.to_string()])?;
        if let [state, stale] = reply.as_slice() {
            if state == "held" && holder_is_gone(stale) {
                let args = [CLAIM_TTL_MS.to_string(), stale.clone()];
                reply = claim.call("take", &args)?;
            }
        }
        match reply.as_slice() {
            [state, holder] if state == "held" => {
                // Not ours: nothing to release.
                claim.value.clear();
                Err(StoreError::Claimed(format!(
                    "another replay of this input is writing to this Redis ({}); two at once could count \
                     an event twice: wait for it to finish (a claim left by a killed replay expires within {} s)",
                    holder.split_once(' ').map_or(holder.as_str(), |(_, who)| who),
                    CLAIM_TTL_MS / 1000
                )))
            }
            [state, lines, at] if state == "ok" => {
                claim.previous = lines
                    .parse()
                    .ok()
                    .zip(at.parse().ok())
                    .map(|(lines, at_ms)| Applied { lines, at_ms });
                claim.start_keeper();
                Ok(claim)
            }
            other => Err(StoreError::Protocol(format!(
                "replay_lane: unexpected reply {other:?}"
            ))),
        }
    }

    /// Refreshes the claim every third of its TTL until dropped. A claim found taken (this
    /// process stood still past its TTL and another replay of the input started) ends the
    /// process: writing on would count the other's events twice. A claim found gone (a
    /// failover to a replica that never got it) is set again.
    fn start_keeper(&mut self) {
        let (stop, stopped) = mpsc::channel::<()>();
        let link = Arc::clone(&self.link);
        let (cluster, keys, value) = (self.cluster, self.keys.clone(), self.value.clone());
        let keeper = std::thread::Builder::new()
            .name("vigil-replay-claim".into())
            .spawn(move || loop {
                match stopped.recv_timeout(Duration::from_millis(CLAIM_TTL_MS / 3)) {
                    Err(RecvTimeoutError::Timeout) => {
                        let cmd = script(&keys, "keep", &value, &[CLAIM_TTL_MS.to_string()]);
                        let mut batch = Batch::default();
                        batch.command(cluster, &keys[0], cmd);
                        let (reply, _) = link.lock().unwrap_or_else(|p| p.into_inner()).query(&batch, 2);
                        // A failed refresh is retried at the next tick (the TTL leaves two).
                        if let Ok(replies) = reply {
                            if replies.first() == Some(&Value::Int(0)) {
                                eprintln!(
                                    "replay: another replay of this input took it over while this one stood still; \
                                     stopping so that no event is counted twice"
                                );
                                std::process::exit(3);
                            }
                        }
                    }
                    _ => return,
                }
            });
        if let Ok(keeper) = keeper {
            self.keeper = Some((stop, keeper));
        }
    }

    fn call<T: redis::FromRedisValue>(&self, op: &str, args: &[String]) -> Result<T, StoreError> {
        let cmd = script(&self.keys, op, &self.value, args);
        let mut batch = Batch::default();
        batch.command(self.cluster, &self.keys[0], cmd);
        let mut link = self.link.lock().unwrap_or_else(|p| p.into_inner());
        let (reply, _) = link.query(&batch, 3);
        let value = reply?.into_iter().next().unwrap_or(Value::Nil);
        redis::from_redis_value(value)
            .map_err(|e| StoreError::Protocol(format!("replay_lane: {e}")))
    }

    /// Records that this replay applied `lines` lines, and ends the claim.
    pub fn finish(mut self, lines: u64) -> Result<(), StoreError> {
        self.stop_keeper();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let args = [
            lines.to_string(),
            now.to_string(),
            RECORD_TTL_MS.to_string(),
        ];
        let result: Result<i64, _> = self.call("finish", &args);
        self.value.clear();
        result.map(drop)
    }

    fn stop_keeper(&mut self) {
        if let Some((stop, keeper)) = self.keeper.take() {
            let _ = stop.send(());
            let _ = keeper.join();
        }
    }
}

impl Drop for ReplayClaim {
    fn drop(&mut self) {
        self.stop_keeper();
        if !self.value.is_empty() {
            let _: Result<i64, _> = self.call("release", &[]);
        }
    }
}

/// This process, as a claim names it: `process <pid> on <host> started <time>`.
fn holder() -> String {
    format!(
        "process {} on {} started {}",
        std::process::id(),
        host_name().as_deref().unwrap_or("an unknown host"),
        utc_text(now_ms())
    )
}

/// Epoch ms as people read it in messages: `2026-11-26T15:04:05Z`.
fn utc_text(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms).map_or_else(
        || "-".to_owned(),
        |t| t.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
    )
}

/// The wall clock in epoch ms (when a claim was taken or a replay finished: said to people).
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
}

/// Whether a claim's holder was a process of this host that no longer runs.
fn holder_is_gone(claim: &str) -> bool {
    let Some((_, holder)) = claim.split_once(' ') else {
        return false;
    };
    let mut words = holder.split(' ');
    let (Some("process"), Some(pid), Some("on"), Some(host)) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return false;
    };
    let ours = host_name();
    pid.parse::<u32>()
        .is_ok_and(|pid| pid != std::process::id())
        && ours.as_deref() == Some(host)
        && !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// One EVALSHA of `lua/replay_lane.lua`.
fn script(keys: &[String; 2], op: &str, value: &str, args: &[String]) -> redis::Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(REPLAY_LANE.get_hash())
        .arg(2)
        .arg(&keys[0])
        .arg(&keys[1])
        .arg(op)
        .arg(value);
    for arg in args {
        cmd.arg(arg);
    }
    cmd
}
