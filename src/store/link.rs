//! Connections to Redis for the store: one server or a Redis Cluster (calls pipelined per master
//! by the slot map, MOVED/ASK followed through the cluster client; on a lost connection,
//! CLUSTERDOWN or TRYAGAIN the slot map is read again from any node seen, so a failover is
//! followed to the promoted replica, and counted for the store's data-loss check), with connect
//! and response timeouts on every call, reconnects, exponential backoff within a bounded number
//! of attempts, and reloading the script on NOSCRIPT.
//!
//! A call that fails in a way that leaves the connection in an unknown state (a timeout, a reset)
//! drops the connection; the next attempt opens a new one. Which calls of a pipeline ran is then
//! unknown, so they are sent again: every call the store makes is idempotent (script calls skip
//! the deltas whose input position a key has recorded, writes check the key's version).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::Value;

use super::counter_store::StoreError;
use super::scripts::{push_array_header, push_bulk, ScriptCall, SOURCES};
use crate::clock::{Clock, SystemClock};

/// Most script calls sent in one pipeline (one round trip) while the connection holds (a paced
/// batch, the write-behind, sends one per round trip: [`Batch::paced`]). The replies
/// of a pipeline are read one by one and kept as they come ([`exchange`]); the calls whose
/// replies a lost connection cut off ran or not, and are sent again (skipped by their recorded
/// offsets), so a link that keeps dropping must still let calls through: after each attempt that
/// got less than a pipeline through, the next one sends pipelines a quarter the size (16, 4, 1
/// calls), and an attempt that got a pipeline's worth of replies through is not counted as failed. A retried call answers with
/// whole windows (its own first run moved the keys' versions), so a retry's replies are larger
/// than the first try's. Measured with a proxy that drops every 100th reply read
/// (`redis_faults`), when a cut pipeline lost all its replies: 64 calls, fixed, failed a flush 3
/// times in a row in about one run in seven; 64 shrinking, 2 in 20; 16 shrinking, 0 in 20.
/// `vigil bench --redis --users 1000`: 16 and 64 within the noise.
const PIPELINE_CALLS: usize = 16;

/// The same for a batch of plain commands (reads of a key each, where a script call carries up
/// to 256 keys): 16 per round trip made a batch's reads wait for Redis once per 16 keys, behind
/// other connections' script calls each time (measured: a batch's ~430 hold reads took
/// 30–50 ms). Shrinks as above after an attempt that got less than a pipeline through (256, 64,
/// 16, 4, 1).
/// A silent host costs one response timeout per attempt whatever the size: [`exchange`] stops
/// at the first reply that does not come.
const PIPELINE_COMMANDS: usize = 256;

/// Sends `pipe` (`len` commands) in one write and reads the replies one by one, handing each to
/// `reply` with its position (a server error as `Err`). Stops at the first reply that does not
/// come (a timeout, a reset) and returns that error: the connection is then in an unknown state
/// and must be dropped; the replies before it were handed over. By hand, because redis-rs's
/// `Pipeline::query` reads on after a failed reply, waiting a response timeout for each of the
/// rest: a silent host would hold a 256-command pipeline for 256 timeouts.
fn exchange(
    conn: &mut redis::Connection,
    packed: &[u8],
    len: usize,
    mut reply: impl FnMut(usize, redis::RedisResult<Value>),
) -> redis::RedisResult<()> {
    conn.send_packed_command(packed)?;
    let mut index = 0;
    while index < len {
        match conn.recv_response()? {
            // RESP3 push data may come between replies; it answers no command.
            Value::Push { .. } => continue,
            Value::ServerError(error) => reply(index, Err(error.into())),
            value => reply(index, Ok(value)),
        }
        index += 1;
    }
    Ok(())
}

/// How long a connection attempt and a reply may take, and how long a batch marked `confirm`
/// waits for a replica to acknowledge its writes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timeouts {
    pub(super) connect: Duration,
    pub(super) response: Duration,
    /// `None`: writes are not confirmed (`WAIT` is never sent).
    pub(super) replica_ack: Option<Duration>,
}

/// `WAIT 1 <timeout>`: blocks until one replica has every write this connection made, or the
/// timeout passes; answers how many replicas have them.
fn wait_for_replica(timeout: Duration) -> redis::Cmd {
    let mut wait = redis::cmd("WAIT");
    wait.arg(1).arg(timeout.as_millis().max(1) as u64);
    wait
}

/// Whether a `WAIT 1` reply says a replica has the writes.
fn confirmed(reply: &redis::RedisResult<Value>) -> bool {
    matches!(reply, Ok(Value::Int(n)) if *n >= 1)
}

/// One call of a batch: a script invocation (flushes, built in a flat buffer and turned into a
/// command on the thread that sends it) or a plain command.
pub(super) enum Op {
    Script(ScriptCall),
    Cmd(redis::Cmd),
    /// A read of one key (`HGETALL`, `GET`): a batch's prefetch holds thousands, each a name
    /// and nothing to build.
    Read {
        command: &'static str,
        key: String,
    },
}

impl Op {
    fn cmd(&self) -> redis::Cmd {
        match self {
            Op::Script(call) => call.cmd(),
            Op::Cmd(cmd) => cmd.clone(),
            Op::Read { command, key } => {
                let mut cmd = redis::cmd(command);
                cmd.arg(key);
                cmd
            }
        }
    }

    /// Appends the call as Redis reads it off the wire: a script call straight from its flat
    /// buffer, with no command built and encoded in between (a flush's thousands of arguments
    /// were copied twice that way).
    fn pack_into(&self, out: &mut Vec<u8>) {
        match self {
            Op::Script(call) => call.pack_into(out),
            Op::Cmd(cmd) => cmd.write_packed_command(out),
            Op::Read { command, key } => {
                push_array_header(out, 2);
                push_bulk(out, command.as_bytes());
                push_bulk(out, key.as_bytes());
            }
        }
    }
}

/// Where the store connects: one Redis, a master found through Redis Sentinel, or a Redis
/// Cluster (found from the URL's node, whose client also gives the credentials and TLS settings
/// for direct connections to every node).
#[derive(Clone)]
pub(super) enum Target {
    Single(redis::Client),
    Sentinel(Arc<SentinelTarget>),
    Cluster {
        seed: redis::Client,
        topology: Arc<Mutex<Topology>>,
    },
}

/// A master/replica set managed by Redis Sentinel: every connection asks the sentinels (in turn,
/// until one answers) where the master is, and checks that it is one (`ROLE`), so a failover is
/// followed on the next reconnect.
pub(super) struct SentinelTarget {
    /// The sentinels' addresses; connected to with the TLS settings of `seed` and without its
    /// credentials (those are the data nodes').
    pub(super) sentinels: Vec<(String, u16)>,
    /// The name the sentinels monitor the master by.
    pub(super) service: String,
    /// Credentials, database and TLS settings for the master (its address is the sentinels').
    pub(super) seed: redis::Client,
    /// The master the last connection found, and how many times it changed (failovers).
    pub(super) master: Mutex<(Option<(String, u16)>, u64)>,
    /// The sentinel that answered last: asked first next time (as Redis' guide for Sentinel
    /// clients advises), so a sentinel that is down costs one timeout, not one per question.
    pub(super) answered: AtomicUsize,
}

/// The sentinels' indexes, `first` first and then the others in their order, wrapping round.
fn in_turn(sentinels: usize, first: usize) -> impl Iterator<Item = usize> {
    (0..sentinels).map(move |i| (first + i) % sentinels)
}

impl SentinelTarget {
    /// A connection to the master the sentinels name now.
    pub(super) fn connect(&self, timeouts: Timeouts) -> redis::RedisResult<SingleConn> {
        let mut first_error = None;
        for at in in_turn(self.sentinels.len(), self.answered.load(Ordering::Relaxed)) {
            let (host, port) = &self.sentinels[at];
            let mut promotable = 0;
            let address = self
                .open_sentinel(host, *port, timeouts)
                .and_then(|mut conn| {
                    let address = redis::cmd("SENTINEL")
                        .arg("GET-MASTER-ADDR-BY-NAME")
                        .arg(&self.service)
                        .query::<Option<(String, u16)>>(&mut conn)?;
                    promotable = self.promotable_replicas_on(&mut conn).unwrap_or(0);
                    Ok(address)
                });
            let (master_host, master_port) = match address {
                Ok(Some(address)) => address,
                Ok(None) => {
                    first_error.get_or_insert_with(|| {
                        redis::RedisError::from((
                            redis::ErrorKind::Io,
                            "the sentinels do not monitor this master name",
                        ))
                    });
                    continue;
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            let single = match redis::Client::open(node_info(&self.seed, &master_host, master_port))
                .and_then(|client| open_single(&client, timeouts))
                .and_then(SingleConn::new)
            {
                Ok(mut single) => {
                    single.promotable = promotable;
                    single
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            // A sentinel that has not yet seen the failover names the old master, which may be
            // back as a replica: never write there.
            if single.master != Some(true) {
                first_error.get_or_insert_with(|| {
                    redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "the node a sentinel named is not known to be a master",
                    ))
                });
                continue;
            }
            let mut master = self.master.lock().expect("sentinel lock");
            let found = Some((master_host, master_port));
            if master.0.is_some() && master.0 != found {
                master.1 += 1;
                tracing::warn!(
                    "Redis Sentinel names a new master (a failover): checking for writes it lacks"
                );
            }
            master.0 = found;
            self.answered.store(at, Ordering::Relaxed);
            return Ok(single);
        }
        Err(first_error.unwrap_or_else(|| {
            redis::RedisError::from((redis::ErrorKind::Io, "no sentinel given"))
        }))
    }

    /// How many replicas of the master the first sentinel that answers lists that a failover
    /// could still promote ([`count_promotable`]); `None` if none answers.
    fn promotable_replicas(&self, timeouts: Timeouts) -> Option<usize> {
        in_turn(self.sentinels.len(), self.answered.load(Ordering::Relaxed)).find_map(|at| {
            let (host, port) = &self.sentinels[at];
            let mut conn = self.open_sentinel(host, *port, timeouts).ok()?;
            let promotable = self.promotable_replicas_on(&mut conn)?;
            self.answered.store(at, Ordering::Relaxed);
            Some(promotable)
        })
    }

    /// A connection to one sentinel, with the seed's TLS settings and without its credentials.
    fn open_sentinel(
        &self,
        host: &str,
        port: u16,
        timeouts: Timeouts,
    ) -> redis::RedisResult<redis::Connection> {
        let sentinel = node_info(&self.seed, host, port)
            .set_redis_settings(redis::RedisConnectionInfo::default());
        redis::Client::open(sentinel).and_then(|client| open_single(&client, timeouts))
    }

    fn promotable_replicas_on(&self, sentinel: &mut redis::Connection) -> Option<usize> {
        redis::cmd("SENTINEL")
            .arg("REPLICAS")
            .arg(&self.service)
            .query::<Vec<Value>>(sentinel)
            .ok()
            .map(|replicas| count_promotable(&replicas))
    }
}

/// Of the replicas a sentinel lists (`SENTINEL REPLICAS`), those a failover could still
/// promote: not excluded by `replica-priority 0`, heard from (`INFO`) within
/// `REPLICA_FORGOTTEN_AFTER`, and with their link to the master down no longer than that. The
/// master's own `ROLE` names only the replicas connected now, so a worker that starts while one
/// is cut off would otherwise count its writes as safe although a failover may promote that
/// replica once it is back. A master that died in an earlier failover is listed too, as a
/// replica the sentinels have never heard from since (no `runid`): it is not counted.
fn count_promotable(replicas: &[Value]) -> usize {
    let bound = REPLICA_FORGOTTEN_AFTER.as_millis() as i128;
    replicas
        .iter()
        .filter(|replica| {
            let field = |name: &str| -> Option<String> {
                let Value::Array(pairs) = replica else {
                    return None;
                };
                pairs.chunks(2).find_map(|pair| match pair {
                    [Value::BulkString(key), value] if key == name.as_bytes() => {
                        redis::from_redis_value::<String>(value.clone()).ok()
                    }
                    _ => None,
                })
            };
            // Sentinel reports a link still syncing as a negative time.
            let millis = |name: &str| field(name).and_then(|v| v.parse::<i128>().ok());
            let heard_from = field("runid").is_some_and(|id| !id.is_empty())
                && millis("info-refresh").is_some_and(|ms| ms <= bound);
            let linked = millis("master-link-down-time").is_none_or(|ms| ms <= bound);
            let eligible = field("slave-priority")
                .or_else(|| field("replica-priority"))
                .is_none_or(|priority| priority != "0");
            heard_from && linked && eligible
        })
        .count()
}

/// What every link of one store has learnt of a cluster's layout, shared so that the node the
/// URL names can die without taking the store's way into the cluster with it.
#[derive(Default)]
pub(super) struct Topology {
    /// Every node any slot map named (masters and replicas), the URL's node first: slot maps are
    /// asked of them in turn, and the cluster client is seeded with them.
    nodes: Vec<(String, u16)>,
    /// The node IDs of the masters of the last slot map read.
    masters: Vec<String>,
    /// How many slot maps named a master the map before did not (a replica promoted by a
    /// failover): replication is asynchronous, so the new master may lack writes the old one
    /// acknowledged, and the store checks for that as for a restart.
    promotions: u64,
}

impl Topology {
    pub(super) fn new(host: String, port: u16) -> Topology {
        Topology {
            nodes: vec![(host, port)],
            ..Topology::default()
        }
    }
}

enum Conn {
    Single(Box<SingleConn>),
    Cluster(Box<ClusterConn>),
}

/// A connection to one server (alone or a Sentinel's master), with its replicas as `ROLE` last
/// named them.
pub(super) struct SingleConn {
    conn: redis::Connection,
    /// Whether `ROLE` said master (`None`: the user may not run it).
    master: Option<bool>,
    replicas: usize,
    /// Sentinel only: the replicas the sentinels list that a failover could promote, connected
    /// or not (`count_promotable`), as last asked.
    promotable: usize,
    role_read: Instant,
}

/// How often a single server's replicas are counted again (a replica attached later).
const ROLE_INTERVAL: Duration = Duration::from_secs(5);

/// How long a replica that dropped off its master (frozen, cut off, failed) is still counted
/// when writes are confirmed. That is exactly when the master's writes go unconfirmed, and a
/// failover may still promote it: Sentinel and Cluster pass over a replica only once it has
/// been cut off for about ten times their failure-detection time (5 and 2.5 minutes with their
/// defaults).
const REPLICA_FORGOTTEN_AFTER: Duration = Duration::from_secs(600);

/// The replicas a master is taken to have when its writes are to be confirmed: the most that
/// any look at it (`ROLE`, a slot map) named, until fewer have been named for
/// `REPLICA_FORGOTTEN_AFTER`. A look that names fewer (a slot map leaves out a failed replica,
/// `ROLE` one whose link is cut) must not make the writes after it count as safe.
#[derive(Debug, Default, Clone, Copy)]
struct Replicas {
    most: usize,
    /// Since when every look named fewer than `most`.
    fewer_since: Option<Instant>,
}

impl Replicas {
    /// A look at the master named `count` replicas at `at`.
    fn named(&mut self, count: usize, at: Instant) {
        if count >= self.most {
            self.most = count;
            self.fewer_since = None;
            return;
        }
        let since = *self.fewer_since.get_or_insert_with(|| {
            tracing::warn!(
                was = self.most,
                now = count,
                "a Redis replica dropped off its master: flushes still wait for its confirmation, and keep what it lacks for a failover, for 10 minutes"
            );
            at
        });
        if at.saturating_duration_since(since) >= REPLICA_FORGOTTEN_AFTER {
            self.most = count;
            self.fewer_since = None;
        }
    }

    /// Whether a failover could promote a replica of this master.
    fn any(&self) -> bool {
        self.most > 0
    }
}

impl SingleConn {
    fn new(mut conn: redis::Connection) -> redis::RedisResult<SingleConn> {
        let role = role(&mut conn)?;
        let (master, replicas) = (
            role.map(|(master, _)| master),
            role.map_or(0, |(_, replicas)| replicas),
        );
        Ok(SingleConn {
            conn,
            master,
            replicas,
            promotable: 0,
            role_read: Instant::now(),
        })
    }
}

/// What `ROLE` says of a server: whether it is a master, and how many replicas it lists (a
/// master lists them; anything else has none). `None` for a user the ACL does not let run
/// `ROLE`, with a warning: its writes are not confirmed.
fn role(conn: &mut redis::Connection) -> redis::RedisResult<Option<(bool, usize)>> {
    let role: Vec<Value> = match redis::cmd("ROLE").query(conn) {
        Ok(role) => role,
        Err(e) if matches!(e.kind(), redis::ErrorKind::Server(_)) => {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                tracing::warn!(error = %e, "cannot ask Redis for its replicas (grant the user +role +wait): writes are not confirmed by a replica, and a failover may lose the last ones");
            });
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    Ok(Some(match (role.first(), role.get(2)) {
        (Some(Value::BulkString(r)), Some(Value::Array(replicas))) if r == b"master" => {
            (true, replicas.len())
        }
        _ => (false, 0),
    }))
}

/// Opens a connection to one server with the timeouts set.
fn open_single(
    client: &redis::Client,
    timeouts: Timeouts,
) -> redis::RedisResult<redis::Connection> {
    let conn = client.get_connection_with_timeout(timeouts.connect)?;
    conn.set_read_timeout(Some(timeouts.response))?;
    conn.set_write_timeout(Some(timeouts.response))?;
    Ok(conn)
}

/// A Redis Cluster: calls are pipelined per master on direct connections, by the slot map; a call
/// answered with MOVED/ASK (the map changed) is sent again through the cluster client, which
/// follows redirects, and the map is read anew. A call that meets a lost connection, CLUSTERDOWN
/// or TRYAGAIN stays pending: the map is read again (from any node seen, so a dead master or a
/// dead URL node costs one refused connection) and the call goes to the slot's owner then.
struct ClusterConn {
    /// Opened when first needed (a redirect), from every node seen then; dropped when it fails
    /// other than by a server's error reply, so the next one starts from live nodes (redis-rs'
    /// sync cluster client reconnects only through the nodes it was built with, and refreshes
    /// its map only through connections it holds).
    cluster: Option<redis::cluster::ClusterConnection>,
    seed: redis::Client,
    topology: Arc<Mutex<Topology>>,
    timeouts: Timeouts,
    /// Master index per hash slot.
    slot_owner: Vec<usize>,
    masters: Vec<Master>,
    /// When the slot map was last read: it is read again every `SLOT_MAP_INTERVAL` even when
    /// nothing fails, so that replicas added (or first listed) later are asked to confirm.
    map_read: Instant,
}

/// How often a cluster's slot map is read again while every call succeeds.
const SLOT_MAP_INTERVAL: Duration = Duration::from_secs(5);

/// A master of the slot map, with a direct connection opened when first needed.
struct Master {
    host: String,
    port: u16,
    conn: Option<redis::Connection>,
    /// Its replicas, as the slot maps named them.
    replicas: Replicas,
    /// It took writes of a batch marked `confirm` that no replica has confirmed yet.
    unconfirmed: bool,
}

/// One slot range of `CLUSTER SLOTS`: first and last slot, the master (host, port, node ID) and
/// the replicas' addresses.
type SlotRange = (u16, u16, (String, u16, String), Vec<(String, u16)>);

fn parse_slots(reply: Vec<Value>) -> Vec<SlotRange> {
    let node = |value: &Value| -> Option<(String, u16, String)> {
        let Value::Array(node) = value else {
            return None;
        };
        let host: String = redis::from_redis_value(node.first()?.clone()).ok()?;
        let port: u16 = redis::from_redis_value(node.get(1)?.clone()).ok()?;
        let id: String = node
            .get(2)
            .and_then(|id| redis::from_redis_value(id.clone()).ok())
            .unwrap_or_default();
        Some((host, port, id))
    };
    reply
        .into_iter()
        .filter_map(|range| {
            let Value::Array(items) = range else {
                return None;
            };
            let start: u16 = redis::from_redis_value(items.first()?.clone()).ok()?;
            let end: u16 = redis::from_redis_value(items.get(1)?.clone()).ok()?;
            let master = node(items.get(2)?)?;
            let replicas = items[3..]
                .iter()
                .filter_map(node)
                .map(|(h, p, _)| (h, p))
                .collect();
            Some((start, end, master, replicas))
        })
        .collect()
}

/// By master node ID: its replicas `CLUSTER NODES` flags failed (the slot map leaves them out)
/// but that were heard from (their last pong) within `REPLICA_FORGOTTEN_AFTER` of `now_ms`
/// (Unix milliseconds). A replica that failed is promoted once it is back if its data is recent
/// enough, so a worker that starts meanwhile must still keep what it lacks.
fn failed_replicas_heard_from(nodes: &str, now_ms: i64) -> HashMap<String, usize> {
    let bound = REPLICA_FORGOTTEN_AFTER.as_millis() as i64;
    let mut failed = HashMap::new();
    for line in nodes.lines() {
        // <id> <address> <flags> <master id> <ping sent> <pong received> ...
        let fields: Vec<&str> = line.split(' ').collect();
        let [_, _, flags, master, _, pong, ..] = fields.as_slice() else {
            continue;
        };
        let flags: Vec<&str> = flags.split(',').collect();
        let heard_from = pong
            .parse::<i64>()
            .is_ok_and(|pong| pong > 0 && now_ms.saturating_sub(pong) <= bound);
        if flags.contains(&"slave") && flags.contains(&"fail") && *master != "-" && heard_from {
            *failed.entry((*master).to_owned()).or_insert(0) += 1;
        }
    }
    failed
}

/// The seed's connection settings (credentials, TLS) for another node.
fn node_info(seed: &redis::Client, host: &str, port: u16) -> redis::ConnectionInfo {
    let info = seed.get_connection_info().clone();
    let addr = match info.addr() {
        redis::ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => redis::ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => redis::ConnectionAddr::Tcp(host.to_owned(), port),
    };
    info.set_addr(addr)
}

impl ClusterConn {
    fn open(
        seed: &redis::Client,
        topology: &Arc<Mutex<Topology>>,
        timeouts: Timeouts,
    ) -> redis::RedisResult<ClusterConn> {
        let mut conn = ClusterConn {
            cluster: None,
            seed: seed.clone(),
            topology: topology.clone(),
            timeouts,
            slot_owner: vec![0; 16384],
            masters: Vec::new(),
            map_read: Instant::now(),
        };
        conn.read_slot_map()?;
        Ok(conn)
    }

    /// The cluster client's connection, opened from every node seen if there is none.
    fn cluster(&mut self) -> redis::RedisResult<&mut redis::cluster::ClusterConnection> {
        if self.cluster.is_none() {
            let nodes: Vec<redis::ConnectionInfo> = {
                let topology = self.topology.lock().expect("topology lock");
                topology
                    .nodes
                    .iter()
                    .map(|(host, port)| node_info(&self.seed, host, *port))
                    .collect()
            };
            // Its own retries stay few: the store's attempts, backoff and breaker are the ones
            // that bound how long a flush waits on a cluster that is down.
            let client = redis::cluster::ClusterClientBuilder::new(nodes)
                .connection_timeout(self.timeouts.connect)
                .response_timeout(self.timeouts.response)
                .retries(2)
                .build()?;
            self.cluster = Some(client.get_connection()?);
        }
        Ok(self.cluster.as_mut().expect("opened above"))
    }

    /// `CLUSTER SLOTS` from the first node seen that answers: each range's master. Every node
    /// named is remembered, and a master the last map did not name counts as a promotion.
    fn read_slot_map(&mut self) -> redis::RedisResult<()> {
        let nodes = self.topology.lock().expect("topology lock").nodes.clone();
        let mut first_error = None;
        let mut ranges = None;
        for (host, port) in nodes {
            let mut failed = HashMap::new();
            let reply = redis::Client::open(node_info(&self.seed, &host, port))
                .and_then(|client| open_single(&client, self.timeouts))
                .and_then(|mut conn| {
                    let slots = redis::cmd("CLUSTER")
                        .arg("SLOTS")
                        .query::<Vec<Value>>(&mut conn)?;
                    // A node that does not answer this leaves the replicas the map names.
                    if let Ok(nodes) = redis::cmd("CLUSTER")
                        .arg("NODES")
                        .query::<String>(&mut conn)
                    {
                        failed = failed_replicas_heard_from(&nodes, SystemClock.now_ms());
                    }
                    Ok(slots)
                });
            match reply {
                Ok(reply) if !reply.is_empty() => {
                    ranges = Some((parse_slots(reply), failed));
                    break;
                }
                Ok(_) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let Some((ranges, failed)) = ranges else {
            return Err(first_error.unwrap_or_else(|| {
                redis::RedisError::from((redis::ErrorKind::Io, "no node knows the slot map"))
            }));
        };
        self.map_read = Instant::now();
        {
            let mut topology = self.topology.lock().expect("topology lock");
            let masters: Vec<String> = ranges
                .iter()
                .map(|(_, _, (_, _, id), _)| id.clone())
                .collect();
            if !topology.masters.is_empty()
                && masters.iter().any(|id| !topology.masters.contains(id))
            {
                topology.promotions += 1;
                tracing::warn!(
                    "the Redis Cluster has a new master (a failover): checking for writes it lacks"
                );
            }
            topology.masters = masters;
            for (_, _, (host, port, _), replicas) in &ranges {
                for node in std::iter::once((host.clone(), *port)).chain(replicas.iter().cloned()) {
                    if !topology.nodes.contains(&node) {
                        topology.nodes.push(node);
                    }
                }
            }
        }
        for (start, end, (host, port, id), replicas) in ranges {
            let index = match self
                .masters
                .iter()
                .position(|m| m.host == host && m.port == port)
            {
                Some(index) => index,
                None => {
                    self.masters.push(Master {
                        host,
                        port,
                        conn: None,
                        replicas: Replicas::default(),
                        unconfirmed: false,
                    });
                    self.masters.len() - 1
                }
            };
            // The slot map leaves out replicas flagged failed, which a failover may still
            // promote once they are back.
            let failed = failed.get(&id).copied().unwrap_or(0);
            self.masters[index]
                .replicas
                .named(replicas.len() + failed, self.map_read);
            for slot in start..=end.min(16383) {
                self.slot_owner[usize::from(slot)] = index;
            }
        }
        Ok(())
    }

    /// A direct connection to a master, with the seed's credentials and TLS settings.
    fn master(&mut self, index: usize) -> redis::RedisResult<&mut redis::Connection> {
        let timeouts = self.timeouts;
        let master = &mut self.masters[index];
        if master.conn.is_none() {
            master.conn = Some(open_single(
                &redis::Client::open(node_info(&self.seed, &master.host, master.port))?,
                timeouts,
            )?);
        }
        Ok(master.conn.as_mut().expect("opened above"))
    }

    /// Whether a replica has confirmed every confirmed-batch write sent to the masters that
    /// serve slots now (a master with no replica has nothing to confirm).
    fn replicated(&self) -> bool {
        self.serving().into_iter().all(|index| {
            let master = &self.masters[index];
            !master.unconfirmed || !master.replicas.any()
        })
    }

    /// The masters that own slots in the map now (a failed-over master stays in `masters`).
    fn serving(&self) -> std::collections::BTreeSet<usize> {
        self.slot_owner.iter().copied().collect()
    }

    /// SCRIPT LOAD on every master of the slot map, on the direct connections (a master the
    /// cluster client's stale map still names may be dead).
    fn load_on_all_masters(&mut self) -> redis::RedisResult<()> {
        for index in self.serving() {
            let loaded = self.master(index).and_then(load_scripts);
            if loaded.is_err() {
                self.masters[index].conn = None;
            }
            loaded?;
        }
        Ok(())
    }

    /// Runs every call, grouped per master, keeping each call's result across attempts: only
    /// calls that have not run are sent again (after a reconnect or a fresh slot map), so no call
    /// is applied twice because another master failed.
    fn run(
        &mut self,
        batch: &Batch,
        attempts: u32,
        backoff: Duration,
    ) -> (redis::RedisResult<Vec<Value>>, u64) {
        if self.map_read.elapsed() >= SLOT_MAP_INTERVAL {
            // A failure here changes nothing: the map in hand still routes, and a call that meets
            // a moved slot reads it again.
            let _ = self.read_slot_map();
        }
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
                let calls = results
                    .into_iter()
                    .map(|r| r.expect("checked above"))
                    .collect();
                return (Ok(calls), retries);
            }
            let error = error.unwrap_or_else(|| {
                redis::RedisError::from((redis::ErrorKind::Io, "calls left unanswered"))
            });
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
    fn run_pending(
        &mut self,
        batch: &Batch,
        results: &mut [Option<Value>],
    ) -> redis::RedisResult<u64> {
        let mut per_master: Vec<Vec<usize>> = vec![Vec::new(); self.masters.len()];
        for (call, &slot) in batch.slots.iter().enumerate() {
            if results[call].is_none() {
                per_master[self.slot_owner[usize::from(slot)]].push(call);
            }
        }
        let mut first_error = None;
        let mut redirected = Vec::new();
        let mut reload = false;
        for (master, calls) in per_master
            .into_iter()
            .enumerate()
            .filter(|(_, c)| !c.is_empty())
        {
            let mut packed = Vec::new();
            for &call in &calls {
                batch.calls[call].pack_into(&mut packed);
            }
            // The replica's confirmation rides in the same round trip, after the writes.
            let confirm = match self.timeouts.replica_ack {
                Some(timeout) if batch.confirm && self.masters[master].replicas.any() => {
                    wait_for_replica(timeout).write_packed_command(&mut packed);
                    self.masters[master].unconfirmed = true;
                    true
                }
                _ => false,
            };
            let len = calls.len() + usize::from(confirm);
            let mut replies = Vec::with_capacity(len);
            let exchanged = self
                .master(master)
                .and_then(|conn| exchange(conn, &packed, len, |_, reply| replies.push(reply)));
            if let Err(e) = exchanged {
                // The calls left without a reply stay pending; a new connection is opened next
                // pass.
                self.masters[master].conn = None;
                first_error.get_or_insert(e);
            }
            if confirm && replies.len() == len {
                // Confirms this pipeline's writes and every earlier one on this master.
                let wait = replies.pop().unwrap_or(Ok(Value::Nil));
                if confirmed(&wait) {
                    self.masters[master].unconfirmed = false;
                }
            }
            for (call, reply) in calls.into_iter().zip(replies) {
                match reply {
                    Ok(reply) => results[call] = Some(reply),
                    Err(e) if is_noscript(&e) => {
                        reload = true;
                        redirected.push(call);
                    }
                    // MOVED/ASK: the call did not run on this node; the cluster client follows the
                    // redirect.
                    Err(e)
                        if matches!(
                            e.kind(),
                            redis::ErrorKind::Server(
                                redis::ServerErrorKind::Moved | redis::ServerErrorKind::Ask
                            )
                        ) =>
                    {
                        redirected.push(call)
                    }
                    // CLUSTERDOWN, TRYAGAIN: the call did not run; it waits for the next attempt,
                    // after the backoff and a fresh slot map (a failover under way).
                    Err(e) if e.is_cluster_error() => {
                        first_error.get_or_insert(e);
                    }
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        if reload {
            // Once for every call that met NOSCRIPT.
            self.load_on_all_masters()?;
        }
        let redirects = redirected.len() as u64;
        if !redirected.is_empty() && batch.confirm {
            // Run through the cluster client, on a master this connection cannot ask to confirm:
            // every master waits for a confirmation of later writes.
            for master in &mut self.masters {
                master.unconfirmed = master.replicas.any();
            }
        }
        if !redirected.is_empty() {
            for call in redirected {
                match self
                    .cluster()
                    .and_then(|cluster| batch.calls[call].cmd().query::<Value>(cluster))
                {
                    Ok(reply) => results[call] = Some(reply),
                    Err(e) => {
                        if !matches!(e.kind(), redis::ErrorKind::Server(_)) {
                            self.cluster = None;
                        }
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
    /// How many failovers the links to this target have seen (shared by all of them).
    pub(super) fn promotions(&self) -> u64 {
        match self {
            Target::Single(_) => 0,
            Target::Sentinel(sentinel) => sentinel.master.lock().expect("sentinel lock").1,
            Target::Cluster { topology, .. } => topology.lock().expect("topology lock").promotions,
        }
    }

    fn connect(&self, timeouts: Timeouts) -> redis::RedisResult<Conn> {
        match self {
            Target::Single(client) => {
                SingleConn::new(open_single(client, timeouts)?).map(|c| Conn::Single(Box::new(c)))
            }
            Target::Sentinel(sentinel) => sentinel
                .connect(timeouts)
                .map(|c| Conn::Single(Box::new(c))),
            Target::Cluster { seed, topology } => {
                ClusterConn::open(seed, topology, timeouts).map(|c| Conn::Cluster(Box::new(c)))
            }
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
    /// Ask a replica of each master written to confirm the writes (see `Link::replicated`).
    pub(super) confirm: bool,
    /// Send one call per round trip: a batch written behind while partitions judge lets Redis
    /// serve their reads between its calls, where a pipeline of calls would run back to back
    /// before them (on one server; a cluster client pipelines per node as it does).
    pub(super) paced: bool,
}

impl Batch {
    /// Adds `other`'s calls after these; `keys_before`: how many keys these calls cover (the
    /// order of `other`'s replies is shifted past them).
    pub(super) fn append(&mut self, other: Batch, keys_before: usize) {
        self.order
            .extend(other.order.into_iter().map(|index| index + keys_before));
        self.calls.extend(other.calls);
        self.slots.extend(other.slots);
    }

    /// Adds a plain command on `key`.
    pub(super) fn command(&mut self, cluster: bool, key: &str, cmd: redis::Cmd) {
        self.calls.push(Op::Cmd(cmd));
        self.slots.push(if cluster { slot(key) } else { 0 });
    }

    /// Adds a read of `key` (a command whose one argument is the key).
    pub(super) fn read(&mut self, cluster: bool, command: &'static str, key: String) {
        self.slots.push(if cluster { slot(&key) } else { 0 });
        self.calls.push(Op::Read { command, key });
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
    /// One server: it took writes of a batch marked `confirm` that no replica has confirmed yet
    /// (kept across reconnects: a confirmation covers every earlier write on the server).
    unconfirmed: bool,
    /// One server: its replicas, as `ROLE` named them since it became the master.
    replicas: Replicas,
    /// The failovers seen when that server became the master (`Target::promotions`).
    master_since: u64,
}

impl Link {
    /// Connects (within the connect timeout) and loads the script, so the first flushes do not
    /// meet NOSCRIPT.
    pub(super) fn open(
        target: Target,
        timeouts: Timeouts,
        backoff: Duration,
    ) -> Result<Link, StoreError> {
        let mut conn = target.connect(timeouts).map_err(unavailable)?;
        load_script(&mut conn).map_err(unavailable)?;
        let target_promotions = target.promotions();
        Ok(Link {
            target,
            conn: Some(conn),
            timeouts,
            backoff,
            unconfirmed: false,
            replicas: Replicas::default(),
            master_since: target_promotions,
        })
    }

    /// How many failovers (promoted replicas) this store has seen, by any of its links: new
    /// masters in a cluster's slot maps, or a new master named by the sentinels; always 0 for
    /// one Redis.
    pub(super) fn promotions(&self) -> u64 {
        self.target.promotions()
    }

    /// Whether a replica has confirmed every write of the batches marked `confirm` so far, on
    /// every master that has replicas and serves data now. Without `replica_ack`, never.
    pub(super) fn replicated(&self) -> bool {
        if self.timeouts.replica_ack.is_none() {
            return false;
        }
        match &self.conn {
            Some(Conn::Cluster(cluster)) => cluster.replicated(),
            Some(Conn::Single(_)) => !self.unconfirmed,
            None => {
                !self.unconfirmed && matches!(self.target, Target::Single(_) | Target::Sentinel(_))
            }
        }
    }

    /// Runs `batch` in at most `attempts` attempts; also returns how many failed attempts were
    /// retried. Both a cluster (`ClusterConn::run`) and a single Redis keep each call's result and
    /// retry only the calls that have none.
    pub(super) fn query(
        &mut self,
        batch: &Batch,
        attempts: u32,
    ) -> (Result<Vec<Value>, StoreError>, u64) {
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
            let reads = batch
                .calls
                .iter()
                .all(|c| matches!(c, Op::Cmd(_) | Op::Read { .. }));
            let (largest, steps) = match (reads, batch.paced) {
                (_, true) => (1, 0),
                (true, false) => (PIPELINE_COMMANDS, 4),
                (false, false) => (PIPELINE_CALLS, 3),
            };
            let pipeline = (largest >> (2 * failed_attempts.min(steps))).max(1);
            let error = match self.attempt(batch, &mut results, attempts, pipeline) {
                Ok(redone) => {
                    let replies = results
                        .into_iter()
                        .map(|r| r.expect("every call answered"))
                        .collect();
                    return (Ok(replies), retries + redone);
                }
                Err(e) => e,
            };
            if results.iter().filter(|r| r.is_some()).count() >= answered + pipeline {
                // The connection answered a pipeline's worth of the batch before it was lost:
                // Redis is there. Only attempts that got less through count (each one that did
                // answers at least one more call, so this ends; a host that answers a few
                // replies and then stalls still runs out of attempts).
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
    fn attempt(
        &mut self,
        batch: &Batch,
        results: &mut [Option<Value>],
        attempts: u32,
        pipeline: usize,
    ) -> redis::RedisResult<u64> {
        if self.conn.is_none() {
            let mut conn = self.target.connect(self.timeouts)?;
            load_script(&mut conn)?;
            self.conn = Some(conn);
        }
        let conn = self.conn.as_mut().expect("connected above");
        let single = match conn {
            Conn::Cluster(cluster) => {
                let (result, retries) = cluster.run(batch, attempts, self.backoff);
                let replies = result?;
                for (slot, reply) in results.iter_mut().zip(replies) {
                    *slot = Some(reply);
                }
                return Ok(retries);
            }
            Conn::Single(single) => single,
        };
        if single.role_read.elapsed() >= ROLE_INTERVAL {
            match role(&mut single.conn) {
                Ok(role) => {
                    single.replicas = role.map_or(0, |(_, replicas)| replicas);
                    single.role_read = Instant::now();
                }
                Err(e) => {
                    self.conn = None;
                    return Err(e);
                }
            }
            // Only a link whose writes are confirmed needs the replicas that are away; a
            // sentinel that does not answer leaves the last count.
            if let (Target::Sentinel(sentinel), true) = (&self.target, batch.confirm) {
                if let Some(promotable) = sentinel.promotable_replicas(self.timeouts) {
                    single.promotable = promotable;
                }
            }
        }
        let promotions = self.target.promotions();
        if promotions != self.master_since {
            // Another server is the master (the store follows the failover with what the
            // last one left unconfirmed): its writes and replicas are counted afresh.
            self.master_since = promotions;
            self.replicas = Replicas::default();
            self.unconfirmed = false;
        }
        self.replicas
            .named(single.replicas.max(single.promotable), Instant::now());
        if !self.replicas.any() {
            // No replica a failover could promote: nothing to confirm.
            self.unconfirmed = false;
        }
        let confirm = batch.confirm && self.timeouts.replica_ack.is_some() && self.replicas.any();
        if confirm {
            self.unconfirmed = true;
        }
        let conn = &mut single.conn;
        // Each call's result is kept across attempts, so a call that ran is never sent again
        // because another failed (a NOSCRIPT after `SCRIPT FLUSH`, say). The calls go in
        // pipelines of at most `pipeline` calls: a connection lost in the middle of a long batch
        // keeps the replies read before it. The calls that met NOSCRIPT are sent
        // again at once, after loading the script once for all of them.
        let mut redone = 0;
        for _pass in 0..2 {
            let waiting: Vec<usize> = (0..results.len())
                .filter(|&i| results[i].is_none())
                .collect();
            let (mut error, mut reload) = (None, false);
            for chunk in waiting.chunks(pipeline) {
                let mut packed = Vec::new();
                for &i in chunk {
                    batch.calls[i].pack_into(&mut packed);
                }
                let exchanged = exchange(conn, &packed, chunk.len(), |at, reply| match reply {
                    Ok(reply) => results[chunk[at]] = Some(reply),
                    Err(e) if is_noscript(&e) => reload = true,
                    Err(e) => error = Some(e),
                });
                if let Err(e) = exchanged {
                    // A timeout, a reset: the connection is in an unknown state. Whether the
                    // calls left without a reply ran is unknown too; they are sent again on a
                    // new connection (every call the store makes is idempotent).
                    self.conn = None;
                    return Err(e);
                }
            }
            if let Some(e) = error {
                return Err(e);
            }
            if !reload {
                if confirm {
                    let timeout = self.timeouts.replica_ack.expect("checked above");
                    // A lost connection here loses only the confirmation: the writes are in.
                    if confirmed(&wait_for_replica(timeout).query::<Value>(conn)) {
                        self.unconfirmed = false;
                    }
                }
                return Ok(redone);
            }
            load_scripts(conn)?;
            redone += results.iter().filter(|r| r.is_none()).count() as u64;
        }
        Err(redis::RedisError::from((
            redis::ErrorKind::Io,
            "NOSCRIPT after loading the script",
        )))
    }
}

fn load_script(conn: &mut Conn) -> redis::RedisResult<()> {
    match conn {
        Conn::Single(single) => load_scripts(&mut single.conn),
        Conn::Cluster(cluster) => cluster.load_on_all_masters(),
    }
}

/// SCRIPT LOAD of every script on one server.
fn load_scripts(conn: &mut redis::Connection) -> redis::RedisResult<()> {
    for source in SOURCES {
        redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(source)
            .query::<String>(conn)?;
    }
    Ok(())
}

/// The script cache no longer holds the script (Redis restarted, or `SCRIPT FLUSH`).
fn is_noscript(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
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
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

pub(super) fn unavailable(e: redis::RedisError) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use redis::Value;

    use super::{
        count_promotable, failed_replicas_heard_from, in_turn, parse_slots, slot, wait_for_replica,
        Op, Replicas, REPLICA_FORGOTTEN_AFTER,
    };

    #[test]
    fn reads_and_commands_are_packed_as_redis_rs_would_send_them() {
        let read = Op::Read {
            command: "HGETALL",
            key: "vg:_:0123456789abcdef0123456789abcdef".into(),
        };
        let mut expected = redis::cmd("HGETALL");
        expected.arg("vg:_:0123456789abcdef0123456789abcdef");
        let mut wait = wait_for_replica(Duration::from_millis(250)).get_packed_command();
        let mut packed = Vec::new();
        read.pack_into(&mut packed);
        Op::Cmd(wait_for_replica(Duration::from_millis(250))).pack_into(&mut packed);
        let mut both = expected.get_packed_command();
        both.append(&mut wait);
        assert_eq!(packed, both);
        assert_eq!(
            read.cmd().get_packed_command(),
            expected.get_packed_command()
        );
    }

    /// The race a failover test met: the replica's link was cut, the next `ROLE` named no
    /// replica, and the flushes after it counted as safe although the replica a failover then
    /// promoted never got them.
    #[test]
    fn a_replica_that_drops_off_is_still_waited_for_until_it_has_been_gone_long() {
        let start = std::time::Instant::now();
        let mut replicas = Replicas::default();
        assert!(!replicas.any(), "a master never seen with a replica");
        replicas.named(1, start);
        assert!(replicas.any());
        replicas.named(0, start + Duration::from_secs(5));
        assert!(replicas.any(), "cut off a moment ago");
        replicas.named(0, start + REPLICA_FORGOTTEN_AFTER);
        assert!(replicas.any(), "cut off for just under the bound");
        replicas.named(1, start + REPLICA_FORGOTTEN_AFTER + Duration::from_secs(1));
        replicas.named(0, start + REPLICA_FORGOTTEN_AFTER + Duration::from_secs(2));
        replicas.named(
            0,
            start + REPLICA_FORGOTTEN_AFTER * 2 + Duration::from_secs(1),
        );
        assert!(
            replicas.any(),
            "back in between: the time away starts again"
        );
        replicas.named(
            0,
            start + REPLICA_FORGOTTEN_AFTER * 2 + Duration::from_secs(2),
        );
        assert!(!replicas.any(), "gone for the whole bound: forgotten");
        replicas.named(2, start + REPLICA_FORGOTTEN_AFTER * 3);
        replicas.named(1, start + REPLICA_FORGOTTEN_AFTER * 3);
        assert!(replicas.any(), "one of two left");
    }

    #[test]
    fn the_sentinel_that_answered_last_is_asked_first_then_the_others_in_order() {
        assert_eq!(in_turn(3, 0).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(in_turn(3, 1).collect::<Vec<_>>(), [1, 2, 0]);
        assert_eq!(in_turn(3, 2).collect::<Vec<_>>(), [2, 0, 1]);
        assert_eq!(in_turn(0, 0).count(), 0);
    }

    #[test]
    fn sentinels_replicas_count_unless_long_unheard_of_long_cut_off_or_never_to_be_promoted() {
        let replica = |fields: &[(&str, &str)]| {
            Value::Array(
                fields
                    .iter()
                    .flat_map(|(k, v)| {
                        [
                            Value::BulkString(k.as_bytes().to_vec()),
                            Value::BulkString(v.as_bytes().to_vec()),
                        ]
                    })
                    .collect(),
            )
        };
        // Still syncing (Sentinel reports a negative link-down time then).
        let connected = replica(&[
            ("name", "127.0.0.1:7001"),
            ("runid", "30b915b1b98567bfda105629749f1d1fa0baa12a"),
            ("flags", "slave"),
            ("info-refresh", "812"),
            ("master-link-down-time", "-1000"),
            ("slave-priority", "100"),
        ]);
        // Frozen a minute ago, its link to the master cut: it may come back and be promoted.
        let away = replica(&[
            ("runid", "9f0c"),
            ("flags", "s_down,slave,disconnected"),
            ("info-refresh", "61000"),
            ("master-link-down-time", "0"),
            ("slave-priority", "100"),
        ]);
        let cut_off_long = replica(&[
            ("runid", "9f0c"),
            ("flags", "slave"),
            ("info-refresh", "900"),
            ("master-link-down-time", "600001"),
            ("slave-priority", "100"),
        ]);
        let unheard_of_long = replica(&[
            ("runid", "9f0c"),
            ("flags", "s_down,slave,disconnected"),
            ("info-refresh", "600001"),
            ("slave-priority", "100"),
        ]);
        // The master of before the last failover, listed as a replica, never heard from since.
        let old_master = replica(&[
            ("runid", ""),
            ("flags", "s_down,slave,disconnected"),
            ("info-refresh", "0"),
            ("master-link-down-time", "0"),
            ("slave-priority", "100"),
        ]);
        let never = replica(&[
            ("runid", "9f0c"),
            ("flags", "slave"),
            ("info-refresh", "100"),
            ("master-link-down-time", "0"),
            ("slave-priority", "0"),
        ]);
        assert_eq!(count_promotable(&[]), 0);
        assert_eq!(count_promotable(std::slice::from_ref(&connected)), 1);
        assert_eq!(
            count_promotable(&[connected, away.clone()]),
            2,
            "a replica away for a minute counts"
        );
        assert_eq!(
            count_promotable(&[away, cut_off_long, unheard_of_long, old_master, never]),
            1
        );
        assert_eq!(count_promotable(&[Value::Nil, Value::Int(3)]), 0);
    }

    #[test]
    fn failed_cluster_replicas_count_while_recently_heard_from() {
        let now = 1_765_000_000_000i64;
        let nodes = format!(
            "m1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-8191\n\
             m2 127.0.0.1:7001@17001 master - 0 {now} 2 connected 8192-16383\n\
             r1 127.0.0.1:7002@17002 slave m1 0 {now} 1 connected\n\
             r2 127.0.0.1:7003@17003 slave,fail m1 {a} {a} 1 disconnected\n\
             r3 127.0.0.1:7004@17004 slave,fail m2 {b} {b} 2 disconnected\n\
             r4 127.0.0.1:7005@17005 slave,fail? m2 0 {now} 2 disconnected\n\
             r5 127.0.0.1:7006@17006 slave,fail m2 0 0 2 disconnected\n\
             garbage\n",
            a = now - 5_000,
            b = now - REPLICA_FORGOTTEN_AFTER.as_millis() as i64 - 1,
        );
        let failed = failed_replicas_heard_from(&nodes, now);
        assert_eq!(failed.get("m1"), Some(&1), "failed five seconds ago");
        // Long unheard of, only suspected (the map still names it), never heard from.
        assert_eq!(failed.get("m2"), None);
    }

    #[test]
    fn slot_maps_name_masters_with_their_ids_and_replicas() {
        let node = |port: i64, id: &str| {
            Value::Array(vec![
                Value::BulkString(b"127.0.0.1".to_vec()),
                Value::Int(port),
                Value::BulkString(id.as_bytes().to_vec()),
            ])
        };
        let reply = vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                node(7000, "a"),
                node(7003, "d"),
            ]),
            Value::Array(vec![Value::Int(5461), Value::Int(16383), node(7001, "b")]),
        ];
        let ranges = parse_slots(reply);
        assert_eq!(ranges.len(), 2);
        assert_eq!(
            ranges[0],
            (
                0,
                5460,
                ("127.0.0.1".to_owned(), 7000, "a".to_owned()),
                vec![("127.0.0.1".to_owned(), 7003)]
            )
        );
        assert_eq!(ranges[1].2 .2, "b");
        assert!(ranges[1].3.is_empty());
    }

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
