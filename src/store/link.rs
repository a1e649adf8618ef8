//! Connections to Redis for the store: one server or a Redis Cluster (calls pipelined per master
//! by the slot map, MOVED/ASK followed through the cluster client), with reconnects, exponential
//! backoff, and reloading the script on NOSCRIPT.

use std::time::Duration;

use super::redis::RedisStoreConfig;
use super::scripts::APPLY_WINDOW;
use super::StoreError;

/// One key's reply: its items (head, late, skipped, field, value, …).
pub(super) type KeyReply = Vec<Vec<u8>>;
/// One script call's reply: per key.
pub(super) type CallReply = Vec<KeyReply>;
/// A batch's replies: per call.
pub(super) type Calls = Vec<CallReply>;

/// A call a batch is made of: a script invocation (flushes) or a plain command (reads), run in a
/// pipeline or, after a redirect, through the cluster client.
pub(super) trait Call {
    type Reply: redis::FromRedisValue + Clone;
    fn add_to(&self, pipe: &mut redis::Pipeline);
    fn run_through(&self, conn: &mut redis::cluster::ClusterConnection) -> redis::RedisResult<Self::Reply>;
}

impl Call for redis::Cmd {
    type Reply = KeyReply;
    fn add_to(&self, pipe: &mut redis::Pipeline) {
        pipe.add_command(self.clone());
    }
    fn run_through(&self, conn: &mut redis::cluster::ClusterConnection) -> redis::RedisResult<KeyReply> {
        self.query(conn)
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

/// A Redis Cluster: calls are pipelined per master on direct connections, by the slot map; a call
/// answered with MOVED/ASK (the map changed) is sent again through the cluster client, which
/// follows redirects, and the map is read anew.
struct ClusterConn {
    cluster: redis::cluster::ClusterConnection,
    seed: redis::Client,
    /// Master index per hash slot.
    slot_owner: Vec<usize>,
    masters: Vec<(String, u16, Option<redis::Connection>)>,
}

impl ClusterConn {
    fn open(seed: &redis::Client, cluster: &redis::cluster::ClusterClient) -> redis::RedisResult<ClusterConn> {
        let mut conn = ClusterConn {
            cluster: cluster.get_connection()?,
            seed: seed.clone(),
            slot_owner: vec![0; 16384],
            masters: Vec::new(),
        };
        conn.read_slot_map()?;
        Ok(conn)
    }

    /// `CLUSTER SLOTS`: each range's master.
    fn read_slot_map(&mut self) -> redis::RedisResult<()> {
        let mut any = self.seed.get_connection()?;
        let ranges: Vec<(u16, u16, (String, u16))> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query::<Vec<redis::Value>>(&mut any)?
            .into_iter()
            .filter_map(|range| {
                let redis::Value::Array(items) = range else { return None };
                let start: u16 = redis::from_redis_value(items.first()?.clone()).ok()?;
                let end: u16 = redis::from_redis_value(items.get(1)?.clone()).ok()?;
                let redis::Value::Array(master) = items.get(2)? else { return None };
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
            *conn = Some(redis::Client::open(info.set_addr(addr))?.get_connection()?);
        }
        Ok(conn.as_mut().expect("opened above"))
    }

    /// Runs every call, grouped per master, keeping each call's result across attempts: only
    /// calls that have not run are sent again (after a reconnect or a fresh slot map), so no call
    /// is applied twice because another master failed.
    fn run<C: Call>(&mut self, batch: &Batch<C>, attempts: u32, backoff: Duration) -> (redis::RedisResult<Vec<C::Reply>>, u64) {
        let mut results: Vec<Option<C::Reply>> = vec![None; batch.calls.len()];
        let mut delay = backoff;
        let mut retries = 0;
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
            if retries + 1 >= u64::from(attempts) {
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
    fn run_pending<C: Call>(&mut self, batch: &Batch<C>, results: &mut [Option<C::Reply>]) -> redis::RedisResult<u64> {
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
                batch.calls[call].add_to(&mut pipe);
            }
            let replies: redis::RedisResult<Vec<redis::RedisResult<C::Reply>>> =
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
                match batch.calls[call].run_through(&mut self.cluster) {
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
    fn connect(&self) -> redis::RedisResult<Conn> {
        match self {
            Target::Single(client) => client.get_connection().map(Conn::Single),
            Target::Cluster { seed, cluster } => ClusterConn::open(seed, cluster).map(|c| Conn::Cluster(Box::new(c))),
        }
    }
}

/// Calls covering a set of keys: the calls, each call's hash slot (all its keys share it in
/// cluster mode), and for each key reply (in call order) the index of its key.
pub(super) struct Batch<C> {
    pub(super) calls: Vec<C>,
    pub(super) slots: Vec<u16>,
    pub(super) order: Vec<usize>,
}

/// A connection that reconnects, and retries with exponential backoff, when Redis goes away; and
/// loads the script and retries on NOSCRIPT (after a Redis restart or `SCRIPT FLUSH`).
pub(super) struct Link {
    target: Target,
    conn: Conn,
    attempts: u32,
    backoff: Duration,
}

impl Link {
    pub(super) fn open(target: Target, config: &RedisStoreConfig) -> Result<Link, StoreError> {
        let mut conn = target.connect().map_err(unavailable)?;
        // Loaded up front, so the first flushes do not meet NOSCRIPT.
        match &mut conn {
            Conn::Single(single) => APPLY_WINDOW.prepare_invoke().load(single).map(drop),
            Conn::Cluster(cluster) => load_on_all_masters(&mut cluster.cluster),
        }
        .map_err(unavailable)?;
        Ok(Link { target, conn, attempts: config.attempts, backoff: config.retry_backoff })
    }

    /// Runs `batch`; also returns how many failed attempts were retried. Both a cluster
    /// (`ClusterConn::run`) and a single Redis keep each call's result and retry only the calls
    /// that have none.
    pub(super) fn query<C: Call>(&mut self, batch: &Batch<C>) -> (Result<Vec<C::Reply>, StoreError>, u64) {
        if let Conn::Cluster(conn) = &mut self.conn {
            let (result, retries) = conn.run(batch, self.attempts, self.backoff);
            return (result.map_err(unavailable), retries);
        }
        // Each call's result is kept across attempts, so a call that ran is never sent again
        // because another failed (a NOSCRIPT after `SCRIPT FLUSH`, say): running a flush twice
        // would count its deltas twice.
        let mut results: Vec<Option<C::Reply>> = vec![None; batch.calls.len()];
        let mut delay = self.backoff;
        let mut retries = 0;
        loop {
            let Conn::Single(conn) = &mut self.conn else { unreachable!("handled above") };
            let waiting: Vec<usize> = (0..results.len()).filter(|&i| results[i].is_none()).collect();
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for &i in &waiting {
                batch.calls[i].add_to(&mut pipe);
            }
            let error = match pipe.query::<Vec<redis::RedisResult<C::Reply>>>(conn) {
                Ok(replies) => {
                    let (mut error, mut reload) = (None, false);
                    for (i, reply) in waiting.into_iter().zip(replies) {
                        match reply {
                            Ok(reply) => results[i] = Some(reply),
                            Err(e) if is_noscript(&e) => reload = true,
                            Err(e) => error = Some(e),
                        }
                    }
                    if reload {
                        // Once for every call that met NOSCRIPT.
                        if let Err(load) = APPLY_WINDOW.prepare_invoke().load(conn) {
                            error = Some(load);
                        }
                    }
                    if results.iter().all(Option::is_some) {
                        let replies = results.into_iter().map(|r| r.expect("checked above")).collect();
                        return (Ok(replies), retries);
                    }
                    // Only NOSCRIPT calls left, the script loaded again: retried at once, but
                    // still within the attempts.
                    if error.is_none() && retries + 1 >= u64::from(self.attempts) {
                        error = Some(redis::RedisError::from((redis::ErrorKind::Io, "NOSCRIPT on every attempt")));
                    }
                    error
                }
                // The connection failed: which calls ran is unknown; they are sent again. (A
                // flush's writes then meet their own new version and its tagged deltas their
                // recorded offsets: the worker still counts once.)
                Err(e) => Some(e),
            };
            if let Some(e) = &error {
                if retries + 1 >= u64::from(self.attempts) {
                    return (Err(unavailable(error.expect("checked above"))), retries);
                }
                std::thread::sleep(delay);
                delay *= 2;
                if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
                    if let Ok(conn) = self.target.connect() {
                        self.conn = conn;
                    }
                }
            }
            retries += 1;
        }
    }
}

/// The script cache no longer holds the script (Redis restarted, or `SCRIPT FLUSH`).
fn is_noscript(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

/// Every master needs the script: SCRIPT LOAD routed to all of them.
fn load_on_all_masters(conn: &mut redis::cluster::ClusterConnection) -> redis::RedisResult<()> {
    let mut load = redis::cmd("SCRIPT");
    load.arg("LOAD").arg(include_str!("../../lua/apply_window.lua"));
    let route = redis::cluster_routing::RoutingInfo::MultiNode((
        redis::cluster_routing::MultipleNodeRoutingInfo::AllMasters,
        None,
    ));
    conn.route_command(&load, route).map(drop)
}

/// The Redis Cluster hash slot of a key (CRC16/XMODEM mod 16384). vigil's keys never hold `{`,
/// so the whole key is hashed.
pub(super) fn slot(key: &str) -> u16 {
    let mut crc: u16 = 0;
    for &byte in key.as_bytes() {
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
    }
}
