//! The progress board: where each partition of a consumer group stands in event time, shared by
//! the group's workers through one Redis hash (`vg:align:<digest of the group>`, a field per
//! lane: `<event ms>:<wall ms it last moved>`), so that partitions owned by different workers
//! stay in step (the worker's alignment reads it; see `worker::alignment`).

use std::time::Duration;

use redis::Value;

use super::keys::push_hex;
use super::link::{Batch, Link};
use super::redis::{open_side_link, RedisStoreConfig};
use super::StoreError;

/// One lane's entry: its position in event time, and when it last moved (wall-clock ms since
/// the Unix epoch: other workers compare it with their own clocks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LanePosition {
    pub lane: u64,
    pub event_ms: i64,
    pub moved_wall_ms: i64,
}

/// A worker's connection to its group's board.
pub struct ProgressBoard {
    link: Link,
    cluster: bool,
    key: String,
    attempts: u32,
}

impl ProgressBoard {
    /// Connects to the Redis at `url`; `namespace` (the consumer group) names the board.
    pub fn connect(
        url: &str,
        config: &RedisStoreConfig,
        namespace: &str,
    ) -> Result<ProgressBoard, StoreError> {
        let (link, cluster) = open_side_link(url, config)?;
        let mut key = String::from("vg:align:");
        push_hex(
            &mut key,
            &blake3::hash(namespace.as_bytes()).as_bytes()[..16],
        );
        Ok(ProgressBoard {
            link,
            cluster,
            key,
            attempts: 1,
        })
    }

    /// Writes this worker's lanes and reads every lane of the group, in one round trip. The
    /// board expires `ttl` after the last exchange of any worker.
    pub fn exchange(
        &mut self,
        mine: &[LanePosition],
        ttl: Duration,
    ) -> Result<Vec<LanePosition>, StoreError> {
        let mut batch = Batch::default();
        if !mine.is_empty() {
            let mut set = redis::cmd("HSET");
            set.arg(&self.key);
            for entry in mine {
                set.arg(entry.lane)
                    .arg(format!("{}:{}", entry.event_ms, entry.moved_wall_ms));
            }
            batch.command(self.cluster, &self.key, set);
        }
        let mut expire = redis::cmd("PEXPIRE");
        expire.arg(&self.key).arg(ttl.as_millis().max(1) as u64);
        batch.command(self.cluster, &self.key, expire);
        let mut read = redis::cmd("HGETALL");
        read.arg(&self.key);
        batch.command(self.cluster, &self.key, read);
        let (replies, _) = self.link.query(&batch, self.attempts);
        let all = replies?.pop().unwrap_or(Value::Nil);
        Ok(parse_board(all))
    }
}

/// The entries of an `HGETALL` of the board; entries that do not parse are left out (the board
/// is advisory: a lane missing from it only holds nobody back).
fn parse_board(reply: Value) -> Vec<LanePosition> {
    let pairs: Vec<(String, String)> = match reply {
        Value::Map(pairs) => pairs
            .into_iter()
            .filter_map(|(k, v)| {
                Some((
                    redis::from_redis_value(k).ok()?,
                    redis::from_redis_value(v).ok()?,
                ))
            })
            .collect(),
        Value::Array(items) => items
            .chunks_exact(2)
            .filter_map(|kv| {
                Some((
                    redis::from_redis_value(kv[0].clone()).ok()?,
                    redis::from_redis_value(kv[1].clone()).ok()?,
                ))
            })
            .collect(),
        _ => Vec::new(),
    };
    pairs
        .into_iter()
        .filter_map(|(lane, entry)| {
            let (event_ms, moved_wall_ms) = entry.split_once(':')?;
            Some(LanePosition {
                lane: lane.parse().ok()?,
                event_ms: event_ms.parse().ok()?,
                moved_wall_ms: moved_wall_ms.parse().ok()?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn board_entries_parse_and_malformed_ones_are_left_out() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let reply = Value::Array(vec![
            bulk("3"),
            bulk("1700000000000:1800000000000"),
            bulk("x"),
            bulk("1:2"),
            bulk("4"),
            bulk("12"),
        ]);
        assert_eq!(
            parse_board(reply),
            vec![LanePosition {
                lane: 3,
                event_ms: 1_700_000_000_000,
                moved_wall_ms: 1_800_000_000_000
            }]
        );
    }
}
