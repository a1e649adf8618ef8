//! Connections to Redis for the store: one server or a Redis Cluster (calls pipelined per master
//! by the slot map, MOVED/ASK followed through the cluster client), with connect and response
//! timeouts on every call, reconnects, exponential backoff within a bounded number of attempts,
//! and reloading the script on NOSCRIPT.
//!
//! A call that fails in a way that leaves the connection in an unknown state (a timeout, a reset)
//! drops the connection; the next attempt opens a new one. Which calls of a pipeline ran is then
//! unknown, so they are sent again: every call the store makes is idempotent (script calls skip
//! the deltas whose input position a key has recorded, writes check the key's version).

use std::time::Duration;

use redis::Value;

use super::scripts::{ScriptCall, SOURCES};
use super::counter_store::StoreError;

/// Most calls sent in one pipeline (one round trip) while the connection holds. The replies of a
/// pipeline cut by a lost connection are all lost (the calls ran, and are sent again and skipped
/// by their recorded offsets), so a link that keeps dropping must still let whole pipelines
/// through: after each attempt that got nothing through, the next one sends pipelines a quarter
/// the size (16, 4, 1 calls), and an attempt that got some pipelines through is not counted as
/// failed. A retried call answers with whole windows (its own first run moved the keys'
/// versions), so a retry's replies are larger than the first try's. Measured with a proxy that
/// drops every 100th reply read (`redis_faults`): 64 calls, fixed, failed a flush 3 times in a
/// row in about one run in seven once the engine got faster (bigger flushes); 64 shrinking, 2 in
/// 20; 16 shrinking, 0 in 20. `vigil bench --redis --users 1000`: 16 and 64 within the noise.
const PIPELINE_CALLS: usize = 16;

/// How long a connection attempt and a reply may take.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timeouts {
    pub(super) connect: Duration,
    pub(super) response: Duration,
}

/// One call of a batch: a script invocation (flushes, built in a flat buffer and turned into a
/// command on the thread that sends it) or a plain command.
pub(super) enum Op {
    Script(ScriptCall),
    Cmd(redis::Cmd),
}

impl Op {
    fn cmd(&self) -> redis::Cmd {
        match self {
            Op::Script(call) => call.cmd(),
            Op::Cmd(cmd) => cmd.clone(),
        }
    }
}

/// Where the store connects: one Redis, or a Redis Cluster (found from the URL's node, whose
/// client also gives the credentials and TLS settings for direct connections to each master).
#[derive(Clone)]
pub(super) enum Target {
    Single(redis::Client),
    Cluster { seed: redis::Client, cluster: Box<redis::cluster::ClusterClient> },
}

enum Conn {
    Single(redis::Connection),
    Cluster(Box<ClusterConn>),
}

/// Opens a connection to one server with the timeouts set.
fn open_single(client: &redis::Client, timeouts: Timeouts) -> redis::RedisResult<redis::Connection> {
    let conn = client.get_connection_with_timeout(timeouts.connect)?;
    conn.set_read_timeout(Some(timeouts.response))?;
    conn.set_write_timeout(Some(timeouts.response))?;
    Ok(conn)
}

/// A Redis Cluster: calls are pipelined per master on direct connections, by the slot map; a call
/// answered with MOVED/ASK (the map changed) is sent again through the cluster client, which
/// follows redirects, and the map is read anew.
struct ClusterConn {
    cluster: redis::cluster::ClusterConnection,
    seed: redis::Client,
    timeouts: Timeouts,
    /// Master index per hash slot.
    slot_owner: Vec<usize>,
    masters: Vec<(String, u16, Option<redis::Connection>)>,
}

impl ClusterConn {
    fn open(seed: &redis::Client, cluster: &redis::cluster::ClusterClient, timeouts: Timeouts) -> redis::RedisResult<ClusterConn> {
        let mut conn = ClusterConn {
            cluster: cluster.get_connection()?,
            seed: seed.clone(),
            timeouts,
            slot_owner: vec![0; 16384],
            masters: Vec::new(),
        };
        conn.read_slot_map()?;
        Ok(conn)
    }

    /// `CLUSTER SLOTS`: each range's master.
    fn read_slot_map(&mut self) -> redis::RedisResult<()> {
        let mut any = open_single(&self.seed, self.timeouts)?;
        let ranges: Vec<(u16, u16, (String, u16))> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query::<Vec<Value>>(&mut any)?
            .into_iter()
            .filter_map(|range| {
                let Value::Array(items) = range else { return None };
                let start: u16 = redis::from_redis_value(items.first()?.clone()).ok()?;
                let end: u16 = redis::from_redis_value(items.get(1)?.clone()).ok()?;
                let Value::Array(master) = items.get(2)? else { return None };
                let host: String = redis::from_redis_value(master.first()?.clone()).ok()?;
                let port: u16 = redis::from_redis_value(master.get(1)?.clone()).ok()?;
                Some((start, end, (host, port)))
            })
            .collect();
        for (start, end, (host, port)) in ranges {
            let index = match self.masters.iter().position(|(h, p, _)| *h == host && *p == port) {
                Some(index) => index,
                None => {
                    self.masters.push((host, port, None));
                    self.masters.len() - 1
                }
            };
            for slot in start..=end.min(16383) {
                self.slot_owner[usize::from(slot)] = index;
            }
        }
        Ok(())
    }

    /// A direct connection to a master, with the seed's credentials and TLS settings.
    fn master(&mut self, index: usize) -> redis::RedisResult<&mut redis::Connection> {
        let timeouts = self.timeouts;
        let (host, port, conn) = &mut self.masters[index];
        if conn.is_none() {
            let info = self.seed.get_connection_info().clone();
            let addr = match info.addr() {
                redis::ConnectionAddr::TcpTls { insecure, tls_params, .. } => redis::ConnectionAddr::TcpTls {
                    host: host.clone(),
                    port: *port,
                    insecure: *insecure,
                    tls_params: tls_params.clone(),
                },
                _ => redis::ConnectionAddr::Tcp(host.clone(), *port),
            };
            *conn = Some(open_single(&redis::Client::open(info.set_addr(addr))?, timeouts)?);
        }
        Ok(conn.as_mut().expect("opened above"))
    }

    /// Runs every call, grouped per master, keeping each call's result across attempts: only
    /// calls that have not run are sent again (after a reconnect or a fresh slot map), so no call
    /// is applied twice because another master failed.
    fn run(&mut self, batch: &Batch, attempts: u32, backoff: Duration) -> (redis::RedisResult<Vec<Value>>, u64) {
        let mut results: Vec<Option<Value>> = vec![None; batch.calls.len()];
        let mut delay = backoff;
        let mut retries = 0;
        let mut failed_attempts = 0;
        loop {
            let (redirected, error) = match self.run_pending(batch, &mut results) {
                Ok(redirected) => (redirected, None),
                Err(e) => (0, Some(e)),
            };
            retries += redirected;
            if results.iter().all(Option::is_some) {
                let calls = results.into_iter().map(|r| r.expect("checked above")).collect();
                return (Ok(calls), retries);
            }
            let error = error.unwrap_or_else(|| redis::RedisError::from((redis::ErrorKind::Io, "calls left unanswered")));
            failed_attempts += 1;
            if failed_attempts >= attempts {
                return (Err(error), retries);
            }
            retries += 1;
            std::thread::sleep(delay);
            delay *= 2;
            let _ = self.read_slot_map();
        }
    }

    /// One pass over the calls without a result; returns how many were redirected (MOVED/ASK or
    /// NOSCRIPT) and run again through the cluster client.
    fn run_pending(&mut self, batch: &Batch, results: &mut [Option<Value>]) -> redis::RedisResult<u64> {
        let mut per_master: Vec<Vec<usize>> = vec![Vec::new(); self.masters.len()];
        for (call, &slot) in batch.slots.iter().enumerate() {
            if results[call].is_none() {
                per_master[self.slot_owner[usize::from(slot)]].push(call);
            }
        }
        let mut first_error = None;
        let mut redirected = Vec::new();
        let mut reload = false;
        for (master, calls) in per_master.into_iter().enumerate().filter(|(_, c)| !c.is_empty()) {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for &call in &calls {
                pipe.add_command(batch.calls[call].cmd());
            }
            let replies: redis::RedisResult<Vec<redis::RedisResult<Value>>> =
                self.master(master).and_then(|conn| pipe.query(conn));
            let replies = match replies {
                Ok(replies) => replies,
                Err(e) => {
                    // This master's calls stay pending; a new connection is opened next pass.
                    self.masters[master].2 = None;
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            for (call, reply) in calls.into_iter().zip(replies) {
                match reply {
                    Ok(reply) => results[call] = Some(reply),
                    Err(e) if is_noscript(&e) => {
                        reload = true;
                        redirected.push(call);
                    }
                    // MOVED/ASK: the call did not run on this node.
                    Err(e) if e.is_cluster_error() => redirected.push(call),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        if reload {
            // Once for every call that met NOSCRIPT.
            load_on_all_masters(&mut self.cluster)?;
        }
        let redirects = redirected.len() as u64;
        if !redirected.is_empty() {
            for call in redirected {
                match batch.calls[call].cmd().query::<Value>(&mut self.cluster) {
                    Ok(reply) => results[call] = Some(reply),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
            self.read_slot_map()?;
        }
        first_error.map_or(Ok(redirects), Err)
    }
}

impl Target {
    fn connect(&self, timeouts: Timeouts) -> redis::RedisResult<Conn> {
        match self {
            Target::Single(client) => open_single(client, timeouts).map(Conn::Single),
            Target::Cluster { seed, cluster } => ClusterConn::open(seed, cluster, timeouts).map(|c| Conn::Cluster(Box::new(c))),
        }
    }
}

/// Calls covering a set of keys: the calls, each call's hash slot (all its keys share it in
/// cluster mode), and for each key reply (in call order) the index of its key.
#[derive(Default)]
pub(super) struct Batch {
    pub(super) calls: Vec<Op>,
    pub(super) slots: Vec<u16>,
    pub(super) order: Vec<usize>,
}

impl Batch {
    /// Adds a plain command on `key`.
    pub(super) fn command(&mut self, cluster: bool, key: &str, cmd: redis::Cmd) {
        self.calls.push(Op::Cmd(cmd));
        self.slots.push(if cluster { slot(key) } else { 0 });
    }

    pub(super) fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }
}

/// A connection that reconnects, and retries with exponential backoff, when Redis goes away; and
/// loads the script and retries on NOSCRIPT (after a Redis restart or `SCRIPT FLUSH`).
pub(super) struct Link {
    target: Target,
    /// `None` after a failure that left the connection unusable: opened again on the next call.
    conn: Option<Conn>,
    timeouts: Timeouts,
    backoff: Duration,
}

impl Link {
    /// Connects (within the connect timeout) and loads the script, so the first flushes do not
    /// meet NOSCRIPT.
    pub(super) fn open(target: Target, timeouts: Timeouts, backoff: Duration) -> Result<Link, StoreError> {
        let mut conn = target.connect(timeouts).map_err(unavailable)?;
        load_script(&mut conn).map_err(unavailable)?;
        Ok(Link { target, conn: Some(conn), timeouts, backoff })
    }

    /// Runs `batch` in at most `attempts` attempts; also returns how many failed attempts were
    /// retried. Both a cluster (`ClusterConn::run`) and a single Redis keep each call's result and
    /// retry only the calls that have none.
    pub(super) fn query(&mut self, batch: &Batch, attempts: u32) -> (Result<Vec<Value>, StoreError>, u64) {
        let attempts = attempts.max(1);
        if batch.is_empty() {
            return (Ok(Vec::new()), 0);
        }
        let mut results: Vec<Option<Value>> = vec![None; batch.calls.len()];
        let mut delay = self.backoff;
        let mut retries = 0;
        let mut failed_attempts = 0;
        loop {
            let answered = results.iter().filter(|r| r.is_some()).count();
            let pipeline = (PIPELINE_CALLS >> (2 * failed_attempts.min(3))).max(1);
            let error = match self.attempt(batch, &mut results, attempts, pipeline) {
                Ok(redone) => {
                    let replies = results.into_iter().map(|r| r.expect("every call answered")).collect();
                    return (Ok(replies), retries + redone);
                }
                Err(e) => e,
            };
            if results.iter().filter(|r| r.is_some()).count() > answered {
                // The connection answered part of the batch before it was lost: Redis is there.
                // Only attempts that got nothing through count (each one that did answers at
                // least one more call, so this ends).
                failed_attempts = 0;
                delay = self.backoff;
            }
            failed_attempts += 1;
            if failed_attempts >= attempts || matches!(self.conn, Some(Conn::Cluster(_))) {
                return (Err(unavailable(error)), retries);
            }
            retries += 1;
            std::thread::sleep(delay);
            delay *= 2;
        }
    }

    /// One attempt (a cluster runs its own attempts in it); on success, how many calls had to be
    /// sent again (NOSCRIPT, or a cluster's redirects and retries).
    fn attempt(&mut self, batch: &Batch, results: &mut [Option<Value>], attempts: u32, pipeline: usize) -> redis::RedisResult<u64> {
        if self.conn.is_none() {
            let mut conn = self.target.connect(self.timeouts)?;
            load_script(&mut conn)?;
            self.conn = Some(conn);
        }
        let conn = self.conn.as_mut().expect("connected above");
        let conn = match conn {
            Conn::Cluster(cluster) => {
                let (result, retries) = cluster.run(batch, attempts, self.backoff);
                let replies = result?;
                for (slot, reply) in results.iter_mut().zip(replies) {
                    *slot = Some(reply);
                }
                return Ok(retries);
            }
            Conn::Single(conn) => conn,
        };
        // Each call's result is kept across attempts, so a call that ran is never sent again
        // because another failed (a NOSCRIPT after `SCRIPT FLUSH`, say). The calls go in
        // pipelines of at most `pipeline` calls: a connection lost in the middle of a long batch
        // keeps the results of the pipelines before it (redis-rs waits a response timeout per
        // reply of a pipeline a frozen server does not answer, which the callers' deadlines bound). The calls that met NOSCRIPT are sent
        // again at once, after loading the script once for all of them.
        let mut redone = 0;
        for _pass in 0..2 {
            let waiting: Vec<usize> = (0..results.len()).filter(|&i| results[i].is_none()).collect();
            let (mut error, mut reload) = (None, false);
            for chunk in waiting.chunks(pipeline) {
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                for &i in chunk {
                    pipe.add_command(batch.calls[i].cmd());
                }
                let replies = match pipe.query::<Vec<redis::RedisResult<Value>>>(conn) {
                    Ok(replies) => replies,
                    Err(e) => {
                        // A timeout, a reset: the connection is in an unknown state. Which calls
                        // of this pipeline ran is unknown too; they are sent again on a new
                        // connection (every call the store makes is idempotent).
                        self.conn = None;
                        return Err(e);
                    }
                };
                for (&i, reply) in chunk.iter().zip(replies) {
                    match reply {
                        Ok(reply) => results[i] = Some(reply),
                        Err(e) if is_noscript(&e) => reload = true,
                        Err(e) => error = Some(e),
                    }
                }
            }
            if let Some(e) = error {
                return Err(e);
            }
            if !reload {
                return Ok(redone);
            }
            load_scripts(conn)?;
            redone += results.iter().filter(|r| r.is_none()).count() as u64;
        }
        Err(redis::RedisError::from((redis::ErrorKind::Io, "NOSCRIPT after loading the script")))
    }
}

fn load_script(conn: &mut Conn) -> redis::RedisResult<()> {
    match conn {
        Conn::Single(single) => load_scripts(single),
        Conn::Cluster(cluster) => load_on_all_masters(&mut cluster.cluster),
    }
}

/// SCRIPT LOAD of every script on one server.
fn load_scripts(conn: &mut redis::Connection) -> redis::RedisResult<()> {
    for source in SOURCES {
        redis::cmd("SCRIPT").arg("LOAD").arg(source).query::<String>(conn)?;
    }
    Ok(())
}

/// The script cache no longer holds the script (Redis restarted, or `SCRIPT FLUSH`).
fn is_noscript(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

/// Every master needs the scripts: SCRIPT LOAD routed to all of them.
fn load_on_all_masters(conn: &mut redis::cluster::ClusterConnection) -> redis::RedisResult<()> {
    for source in SOURCES {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(source);
        let route = redis::cluster_routing::RoutingInfo::MultiNode((
            redis::cluster_routing::MultipleNodeRoutingInfo::AllMasters,
            None,
        ));
        conn.route_command(&load, route)?;
    }
    Ok(())
}

/// The Redis Cluster hash slot of a key (CRC16/XMODEM mod 16384) of a key without a hash tag.
/// vigil's counter keys never hold `{`, so the whole key is hashed.
pub(super) fn slot(key: &str) -> u16 {
    let hashed = key
        .find('{')
        .and_then(|open| {
            let tag = &key[open + 1..];
            tag.find('}').filter(|&len| len > 0).map(|len| &tag[..len])
        })
        .unwrap_or(key);
    let mut crc: u16 = 0;
    for &byte in hashed.as_bytes() {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc % 16384
}

pub(super) fn unavailable(e: redis::RedisError) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::slot;

    #[test]
    fn slots_follow_the_cluster_spec() {
        // The Redis Cluster specification's CRC16 check value, and slots redis-cli reports.
        assert_eq!(slot("123456789"), 0x31C3);
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("bar"), 5061);
        // A hash tag: only what is between the first { and the next } is hashed.
        assert_eq!(slot("vg:epoch:{foo}"), 12182);
    }
}
