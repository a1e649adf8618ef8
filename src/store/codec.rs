//! How windows look in Redis: the arguments a flush sends for one key to
//! `lua/apply_window.lua`, the script's replies, and a key's hash read back with HGETALL.

use super::counter_store::{InputPosition, StoreError};
use super::scripts::{ScriptCall, Shape};
use std::sync::Arc;

use crate::window::{Aggregate, Applied, Delta, LastValue, WindowSpec, WindowState};

/// One key's reply: its items (head, late, skipped, version, marker, field, value, …), or the
/// version alone.
pub(super) type KeyReply = Vec<Vec<u8>>;

/// A script call's replies, one per key, from the raw reply (a key's reply that is a bare string,
/// not a table, becomes a one-item reply).
pub(super) fn key_replies(value: redis::Value) -> Result<Vec<KeyReply>, StoreError> {
    redis::from_redis_value(value)
        .map_err(|e| StoreError::Protocol(format!("apply_window reply: {e}")))
}

/// A flat list of byte strings (HGETALL) from the raw reply.
pub(super) fn flat(value: redis::Value) -> Result<Vec<Vec<u8>>, StoreError> {
    redis::from_redis_value(value)
        .map_err(|e| StoreError::Protocol(format!("unexpected reply: {e}")))
}

/// One counted observation Redis has not acknowledged.
///
/// A hot key collects thousands of these between flushes, so they are kept to 64 bytes: the
/// delta is stored without `u128`'s 16-byte alignment (which made them 80).
#[derive(Debug, Clone)]
pub(super) struct Observation {
    pub(super) bucket: i64,
    delta: StoredDelta,
    pub(super) origin: Option<InputPosition>,
    /// A `last` window's event: its time and value.
    pub(super) last: Option<Arc<(i64, LastValue)>>,
}

const _: () = assert!(std::mem::size_of::<Observation>() == 64);

/// [`Delta`] with a distinct value's digest as two words.
#[derive(Debug, Clone, Copy)]
enum StoredDelta {
    Count,
    Sum(i64),
    Distinct([u64; 2]),
    Extreme(i64),
    Last,
}

impl Observation {
    pub(super) fn new(
        bucket: i64,
        delta: Delta,
        origin: Option<InputPosition>,
        last: Option<Arc<(i64, LastValue)>>,
    ) -> Observation {
        let delta = match delta {
            Delta::Count => StoredDelta::Count,
            Delta::Sum(micros) => StoredDelta::Sum(micros),
            Delta::Distinct(digest) => {
                StoredDelta::Distinct([digest as u64, (digest >> 64) as u64])
            }
            Delta::Extreme(micros) => StoredDelta::Extreme(micros),
            Delta::Last => StoredDelta::Last,
        };
        Observation {
            bucket,
            delta,
            origin,
            last,
        }
    }

    pub(super) fn delta(&self) -> Delta {
        match self.delta {
            StoredDelta::Count => Delta::Count,
            StoredDelta::Sum(micros) => Delta::Sum(micros),
            StoredDelta::Distinct([low, high]) => {
                Delta::Distinct(u128::from(low) | (u128::from(high) << 64))
            }
            StoredDelta::Extreme(micros) => Delta::Extreme(micros),
            StoredDelta::Last => Delta::Last,
        }
    }

    /// Applies the observation to `state` (a window rebuilt from Redis and the pending deltas).
    pub(super) fn apply_to(&self, state: &mut WindowState, spec: &WindowSpec) -> Applied {
        match &self.last {
            Some(last) => {
                state
                    .apply_last(spec, self.bucket, last.0, last.1.clone())
                    .0
            }
            None => state.apply(spec, self.bucket, self.delta()),
        }
    }
}

/// A `last` value as the script keeps it: a tag (`s` string, `n` number, `b` boolean) and its
/// text.
fn push_last_value(out: &mut Vec<u8>, value: &LastValue) {
    match value {
        LastValue::Str(s) => {
            out.push(b's');
            out.extend_from_slice(s.as_bytes());
        }
        LastValue::Num(d) => {
            out.push(b'n');
            out.extend_from_slice(d.to_string().as_bytes());
        }
        LastValue::Bool(b) => out.extend_from_slice(if *b { b"b1" } else { b"b0" }),
    }
}

/// A `last` delta's value for the script: `<ts>:<tag><text>`.
pub(super) fn last_delta(ts: i64, value: &LastValue) -> Vec<u8> {
    let mut out = ts.to_string().into_bytes();
    out.push(b':');
    push_last_value(&mut out, value);
    out
}

/// The `l` field of a `last` window: `<bucket>:<ts>:<tag><text>`.
pub(super) fn last_field(bucket: i64, ts: i64, value: &LastValue) -> Vec<u8> {
    let mut out = bucket.to_string().into_bytes();
    out.push(b':');
    out.extend_from_slice(&last_delta(ts, value));
    out
}

/// Parses an `l` field: (bucket, time, value); `None` if malformed.
pub(super) fn parse_last_field(bytes: &[u8]) -> Option<(i64, i64, LastValue)> {
    let text = std::str::from_utf8(bytes).ok()?;
    let (bucket, rest) = text.split_once(':')?;
    let (ts, value) = rest.split_once(':')?;
    let value = match value.as_bytes().first()? {
        b's' => LastValue::Str(value[1..].into()),
        b'n' => LastValue::Num(crate::decimal::Decimal::parse(&value[1..])?),
        b'b' => LastValue::Bool(&value[1..] == "1"),
        _ => return None,
    };
    Some((bucket.parse().ok()?, ts.parse().ok()?, value))
}

/// Highest applied offset per lane (`o:<lane>` in Redis).
pub(super) type Offsets = smallvec::SmallVec<[(u64, i64); 1]>;

pub(super) fn offset_of(offsets: &Offsets, lane: u64) -> Option<i64> {
    offsets.iter().find(|(l, _)| *l == lane).map(|&(_, o)| o)
}

pub(super) fn raise(offsets: &mut Offsets, lane: u64, offset: i64) {
    match offsets.iter_mut().find(|(l, _)| *l == lane) {
        Some(entry) => entry.1 = entry.1.max(offset),
        None => offsets.push((lane, offset)),
    }
}

/// A recorded offset field (`o:<lane>` → offset). Lanes vigil does not write (not a number)
/// are someone else's business: `None`.
fn recorded_offset(field: &[u8], value: &[u8]) -> Option<(u64, i64)> {
    let lane = std::str::from_utf8(field.strip_prefix(b"o:")?)
        .ok()?
        .parse()
        .ok()?;
    let offset = std::str::from_utf8(value).ok()?.parse().ok()?;
    Some((lane, offset))
}

/// Whether an observation from `origin` was applied before (its input is being replayed).
pub(super) fn replayed(offsets: &Offsets, origin: Option<InputPosition>) -> bool {
    origin.is_some_and(|o| offset_of(offsets, o.lane).is_some_and(|applied| o.offset <= applied))
}

/// A window as Redis holds it: its state, its version (0: Redis holds nothing) and the offsets
/// it recorded.
pub(super) struct Stored {
    pub(super) state: WindowState,
    pub(super) version: u64,
    pub(super) offsets: Offsets,
}

/// A parsed script reply for one key.
pub(super) enum Reply {
    /// The key holds nothing.
    Empty,
    /// The caller's view was current (`=`): it holds what Redis holds now.
    Current { version: u64 },
    /// Redis' window (`*`), other writers' deltas included.
    Window(Stored),
    /// Counting ahead (`<`): the window and offsets as they were before the deltas, with the
    /// version after them.
    Before(Stored),
    /// Writes for a stale version, not made (`!`): the deltas are sent again.
    Stale,
    /// The caller knew the key at a version and it is gone (`?`): nothing was written; the caller
    /// writes its whole view again.
    Missing,
}

/// What a reply said beyond the window: deltas refused as late and deltas skipped as applied
/// before.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct ReplyCounts {
    pub(super) late: u64,
    pub(super) skipped: u64,
}

/// Whether `head` is a bucket some event time (`0..=MAX_TS_MS`) falls in: anything else in Redis
/// was not written by vigil, and would make the window arithmetic overflow.
fn valid_head(spec: &WindowSpec, head: i64) -> bool {
    (0..=spec.bucket_of(crate::event::MAX_TS_MS)).contains(&head)
}

/// Parses the script's reply for one key.
pub(super) fn parse_reply(
    spec: &WindowSpec,
    reply: &KeyReply,
) -> Result<(Reply, ReplyCounts), StoreError> {
    let counts = ReplyCounts::default();
    if reply.is_empty() {
        return Ok((Reply::Empty, counts));
    }
    let bad = |what: &str| StoreError::Protocol(format!("apply_window reply: {what}"));
    let number = |bytes: &[u8]| -> Result<i64, StoreError> {
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|s| s.parse::<i64>().ok())
            .ok_or_else(|| bad("not an integer"))
    };
    if reply.len() == 1 {
        return match reply[0].as_slice() {
            b"!" => Ok((Reply::Stale, counts)),
            b"?" => Ok((Reply::Missing, counts)),
            // The writes were taken as they are: the reply is the version they left alone (a
            // bare string, read as a one-item reply).
            version => {
                let version =
                    u64::try_from(number(version)?).map_err(|_| bad("a negative version"))?;
                Ok((Reply::Current { version }, counts))
            }
        };
    }
    if reply.len() < 5 || reply.len() % 2 == 0 {
        return Err(bad("wrong length"));
    }
    let before = reply[4].as_slice() == b"<";
    // Before a key's first deltas there is no head.
    let head = if before && reply[0].is_empty() {
        None
    } else {
        Some(number(&reply[0])?)
    };
    if head.is_some_and(|head| !valid_head(spec, head)) {
        return Err(bad("a head no event time can have"));
    }
    let counts = ReplyCounts {
        late: number(&reply[1])? as u64,
        skipped: number(&reply[2])? as u64,
    };
    let version = number(&reply[3])? as u64;
    match reply[4].as_slice() {
        b"=" => return Ok((Reply::Current { version }, counts)),
        b"*" | b"<" => {}
        _ => return Err(bad("unknown marker")),
    }
    let (mut buckets, mut values, mut offsets) = (Vec::new(), Vec::new(), Offsets::new());
    let mut last = None;
    for pair in reply[5..].chunks_exact(2) {
        let (field, value) = (&pair[0], &pair[1]);
        if field.starts_with(b"o:") {
            if let Some((lane, offset)) = recorded_offset(field, value) {
                raise(&mut offsets, lane, offset);
            }
            continue;
        }
        if field.as_slice() == b"l" {
            let (_, ts, value) = parse_last_field(value).ok_or_else(|| bad("bad last value"))?;
            last = Some((ts, value));
            continue;
        }
        match field.first() {
            Some(b'b') => buckets.push((number(&field[1..])?, number(value)?)),
            Some(b'd') if field.len() == 17 => {
                let mut digest = [0u8; 16];
                digest.copy_from_slice(&field[1..]);
                values.push((u128::from_le_bytes(digest), number(value)?));
            }
            _ => return Err(bad("unknown field")),
        }
    }
    let state = match head {
        Some(head) if spec.aggregate == Aggregate::Last => WindowState::from_last(spec, head, last),
        Some(head) => WindowState::from_window(spec, head, buckets, values),
        None if buckets.is_empty() && values.is_empty() && last.is_none() => {
            WindowState::new(spec.aggregate)
        }
        None => return Err(bad("a window without a head")),
    };
    let stored = Stored {
        state,
        version,
        offsets,
    };
    Ok((
        if before {
            Reply::Before(stored)
        } else {
            Reply::Window(stored)
        },
        counts,
    ))
}

/// A key's window from its raw hash (HGETALL): fields by slot relative to the head `h`,
/// distinct values as `d<digest>`; `v` the version (an empty hash: version 0, nothing counted).
pub(super) fn decode_hash(spec: &WindowSpec, flat: &[Vec<u8>]) -> Result<Stored, StoreError> {
    decode_section(spec, b"", flat)
}

/// A window from its raw hash (HGETALL), as [`decode_hash`], reading only the fields of the
/// section `prefix` (empty: every field: the hash is the window's own).
pub(super) fn decode_section(
    spec: &WindowSpec,
    prefix: &[u8],
    flat: &[Vec<u8>],
) -> Result<Stored, StoreError> {
    let section: Vec<Vec<u8>>;
    let flat = if prefix.is_empty() {
        flat
    } else {
        if flat.len() % 2 != 0 {
            return Err(StoreError::Protocol(
                "stored window: odd field count".into(),
            ));
        }
        section = flat
            .chunks_exact(2)
            .filter_map(|pair| {
                pair[0]
                    .strip_prefix(prefix)
                    .map(|field| [field.to_vec(), pair[1].clone()])
            })
            .flatten()
            .collect();
        &section
    };
    if flat.is_empty() {
        return Ok(Stored {
            state: WindowState::new(spec.aggregate),
            version: 0,
            offsets: Offsets::new(),
        });
    }
    let bad = |what: &str| StoreError::Protocol(format!("stored window: {what}"));
    fn text(bytes: &[u8]) -> Result<&str, StoreError> {
        std::str::from_utf8(bytes)
            .map_err(|_| StoreError::Protocol("stored window: not text".into()))
    }
    if flat.len() % 2 != 0 {
        return Err(bad("odd field count"));
    }
    let (mut head, mut version) = (None, None);
    for pair in flat.chunks_exact(2) {
        match pair[0].as_slice() {
            b"h" => {
                head = Some(
                    text(&pair[1])?
                        .parse::<i64>()
                        .map_err(|_| bad("bad head"))?,
                )
            }
            b"v" => {
                version = Some(
                    text(&pair[1])?
                        .parse::<u64>()
                        .map_err(|_| bad("bad version"))?,
                )
            }
            _ => {}
        }
    }
    let head = head
        .filter(|&h| valid_head(spec, h))
        .ok_or_else(|| bad("no head, or one no event time can have"))?;
    let k = spec.buckets;
    // Checked: the hash is outside this process's control (anything may have written it).
    let unslot = |slot: i64| {
        head.checked_sub(slot)
            .map(|d| head - d.rem_euclid(k))
            .ok_or_else(|| bad("bad slot"))
    };
    let mut last = None;
    let (mut buckets, mut values, mut offsets) = (Vec::new(), Vec::new(), Offsets::new());
    for pair in flat.chunks_exact(2) {
        let (field, value) = (&pair[0], &pair[1]);
        if field.starts_with(b"o:") {
            if let Some((lane, offset)) = recorded_offset(field, value) {
                raise(&mut offsets, lane, offset);
            }
        } else if !field.is_empty() && field.iter().all(u8::is_ascii_digit) {
            let slot = text(field)?.parse::<i64>().map_err(|_| bad("bad slot"))?;
            let value = text(value)?;
            // Versions before exact sums stored units as doubles: read them as micro-units.
            let amount = match value.parse::<i64>() {
                Ok(amount) => amount,
                Err(_) => value
                    .parse::<f64>()
                    .map(|units| (units * 1e6).round() as i64)
                    .map_err(|_| bad("bad amount"))?,
            };
            buckets.push((unslot(slot)?, amount));
        } else if field.len() == 17 && field[0] == b'd' {
            let mut digest = [0u8; 16];
            digest.copy_from_slice(&field[1..]);
            let slot = text(value)?.parse::<i64>().map_err(|_| bad("bad slot"))?;
            values.push((u128::from_le_bytes(digest), unslot(slot)?));
        } else if field.as_slice() == b"l" {
            let (_, ts, value) = parse_last_field(value).ok_or_else(|| bad("bad last value"))?;
            last = Some((ts, value));
        }
    }
    let state = if spec.aggregate == Aggregate::Last {
        WindowState::from_last(spec, head, last)
    } else {
        WindowState::from_window(spec, head, buckets, values)
    };
    Ok(Stored {
        state,
        version: version.unwrap_or(0),
        offsets,
    })
}

/// A version for a key created by this process: random, so that a key that expired and was
/// created again does not come back to a version someone's cached view was based on.
fn fresh_version() -> u64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEED: std::sync::LazyLock<foldhash::fast::RandomState> =
        std::sync::LazyLock::new(Default::default);
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    // Below 2^52: Lua's doubles then count up from it exactly.
    SEED.hash_one(COUNTER.fetch_add(1, Ordering::Relaxed)) % (1 << 52) + 1
}

/// Most slots one write may delete: a head that moved further is merged by the script instead.
const MAX_WRITE_DELETES: i64 = 64;

/// What a flush sends for one key.
pub(super) struct KeyFlush<'a> {
    pub(super) spec: &'a WindowSpec,
    /// The window's section of a shared hash: the prefix of its fields (empty: its own hash).
    pub(super) prefix: &'a [u8],
    pub(super) ttl_ms: i64,
    /// The Redis version the view is based on (0: Redis held nothing); `None` if unknown.
    pub(super) version: Option<u64>,
    /// Whether the writes should refresh the TTL.
    pub(super) refresh: bool,
    /// The view with the deltas applied.
    pub(super) state: &'a WindowState,
    /// The head Redis holds at `version`.
    pub(super) base_head: Option<i64>,
    /// The offsets the view knows Redis recorded.
    pub(super) offsets: &'a Offsets,
    pub(super) deltas: &'a [Observation],
    /// Write the whole view, not only what the deltas touched (the key was lost).
    pub(super) full: bool,
    /// Counting ahead: no view, no writes; the deltas are merged and the window as it was
    /// before them comes back (`Reply::Before`).
    pub(super) before: bool,
}

/// Appends one key to a script call: the key, its header, and either the writes to make if
/// Redis still holds the version the view is based on (see `add_writes`), or the deltas for the
/// script to merge. A full write (the key was lost) sends both: the writes if the key is still
/// absent, the deltas to merge if someone created it meanwhile.
pub(super) fn add_key(call: &mut ScriptCall, name: &str, key: &KeyFlush<'_>) {
    let deltas = key.deltas;
    // With every delta tagged, the script skips those it applied before (stride 4).
    let tagged = deltas.iter().all(|o| o.origin.is_some());
    call.key(name.as_bytes());
    // The aggregate's letter, then the section's field prefix (none for a hash of its own).
    let mut head = smallvec::SmallVec::new();
    head.push(match key.spec.aggregate {
        Aggregate::Count => b'c',
        Aggregate::Sum => b's',
        Aggregate::Distinct => b'd',
        Aggregate::Max => b'x',
        Aggregate::Min => b'n',
        Aggregate::Last => b'l',
    });
    head.extend_from_slice(key.prefix);
    let shape = call.shape(Shape {
        head,
        buckets: key.spec.buckets,
        // The script records at most this many distinct values per key, as the view does.
        max_distinct: if key.spec.aggregate == Aggregate::Distinct {
            i64::from(key.spec.max_distinct)
        } else {
            0
        },
        ttl_ms: key.ttl_ms,
        stride: if tagged { 4 } else { 2 },
    });
    call.uint(shape as u64);
    match key.version {
        _ if key.before => call.arg(b"<"),
        Some(version) => call.int(version as i64),
        None => call.arg(b""),
    }
    let deltas_count = call.placeholder();
    let writes_count = call.placeholder();
    if !key.full && !key.before {
        if let Some(version) = key.version {
            let mark = call.mark();
            if add_writes(call, key, version) {
                call.fill(writes_count, call.args() - mark.1);
                return;
            }
            call.truncate(mark);
        }
    }
    let deltas_start = call.args();
    if !tagged && key.spec.aggregate == Aggregate::Count {
        // Untagged increments commute: one per bucket.
        let mut per_bucket: smallvec::SmallVec<[(i64, i64); 4]> = Default::default();
        for o in deltas {
            match per_bucket.iter_mut().find(|(b, _)| *b == o.bucket) {
                Some(entry) => entry.1 += 1,
                None => per_bucket.push((o.bucket, 1)),
            }
        }
        for (bucket, n) in per_bucket {
            call.int(bucket);
            call.int(n);
        }
    } else {
        for o in deltas {
            call.int(o.bucket);
            match o.delta() {
                Delta::Count => call.int(1),
                Delta::Sum(micros) => call.int(micros),
                Delta::Distinct(value) => call.arg(&value.to_le_bytes()),
                Delta::Extreme(v) => call.int(v),
                Delta::Last => match &o.last {
                    Some(last) => call.arg(&last_delta(last.0, &last.1)),
                    // Built only with its value (`Observation::last`).
                    None => call.arg(b""),
                },
            }
            if let (true, Some(origin)) = (tagged, o.origin) {
                call.uint(origin.lane);
                call.int(origin.offset);
            }
        }
    }
    call.fill(deltas_count, call.args() - deltas_start);
    if key.full {
        let mark = call.mark();
        if add_writes(call, key, 0) {
            call.fill(writes_count, call.args() - mark.1);
        } else {
            call.truncate(mark);
        }
    }
}

/// Appends what a flush writes if Redis still holds `version` (the fast path of
/// `lua/apply_window.lua`): whether to refresh the TTL, the count of field/value entries, the
/// next version (`v`) and the head (`h`), the entries — each bucket the deltas touched with its
/// value in the view, or each distinct value with its latest bucket, by slot (every live one for
/// a full write) — then the slots that slid out since `base_head`. False when that is not known
/// here (a distinct window whose head moved: the values that slid out are not kept): the script
/// merges the deltas instead.
fn add_writes(call: &mut ScriptCall, key: &KeyFlush<'_>, version: u64) -> bool {
    let (spec, state, deltas, prefix) = (key.spec, key.state, key.deltas, key.prefix);
    let Some(head) = state.head() else {
        return false;
    };
    let k = spec.buckets;
    let oldest_live = head - k + 1;
    let base_head = if key.full { None } else { key.base_head };
    let moved = base_head.map_or(0, |base| head - base);
    call.arg(if key.refresh || key.full { b"1" } else { b"0" });
    let sets_count = call.placeholder();
    // The next version and the head, then the field/value entries counted by `sets_count`.
    call.int(if version == 0 {
        fresh_version()
    } else {
        version + 1
    } as i64);
    call.int(head);
    let sets_start = call.args();
    match state {
        WindowState::Last(_) => {
            if let Some((ts, value)) = state.last_best() {
                call.field(prefix, b"l");
                call.arg(&last_field(spec.bucket_of(ts), ts, value));
            }
            add_offsets(call, key);
            call.fill(sets_count, call.args() - sets_start);
        }
        WindowState::Series(series) | WindowState::Max(series) | WindowState::Min(series) => {
            let mut touched: smallvec::SmallVec<[(i64, i64); 4]> = if key.full {
                series.buckets().collect()
            } else {
                let mut buckets: smallvec::SmallVec<[i64; 4]> = deltas
                    .iter()
                    .map(|o| o.bucket)
                    .filter(|&b| b >= oldest_live)
                    .collect();
                buckets.sort_unstable();
                buckets.dedup();
                let mut touched = smallvec::SmallVec::new();
                for bucket in buckets {
                    let Some(value) = state.bucket_value(bucket) else {
                        return false;
                    };
                    touched.push((bucket, value));
                }
                touched
            };
            touched.retain(|(b, _)| *b >= oldest_live);
            for &(bucket, value) in &touched {
                call.field_int(prefix, bucket.rem_euclid(k));
                call.int(value);
            }
            add_offsets(call, key);
            call.fill(sets_count, call.args() - sets_start);
            if let Some(base) = base_head {
                if moved.min(k) > MAX_WRITE_DELETES {
                    return false;
                }
                for bucket in (base - k + 1)..=base.min(head - k) {
                    let slot = bucket.rem_euclid(k);
                    if !touched.iter().any(|&(b, _)| b.rem_euclid(k) == slot) {
                        call.field_int(prefix, slot);
                    }
                }
            }
        }
        WindowState::Distinct(set) => {
            if moved > 0 {
                return false;
            }
            let mut values: smallvec::SmallVec<[(u128, i64); 4]> = if key.full {
                set.live_values(spec).collect()
            } else {
                let mut digests: smallvec::SmallVec<[u128; 4]> = deltas
                    .iter()
                    .filter_map(|o| {
                        if let Delta::Distinct(v) = o.delta() {
                            Some(v)
                        } else {
                            None
                        }
                    })
                    .collect();
                digests.sort_unstable();
                digests.dedup();
                let mut values = smallvec::SmallVec::new();
                for value in digests {
                    let Some(latest) = state.latest_bucket(value) else {
                        return false;
                    };
                    values.push((value, latest));
                }
                values
            };
            values.retain(|(_, latest)| *latest >= oldest_live);
            for (value, latest) in values {
                let mut field = [0u8; 17];
                field[0] = b'd';
                field[1..].copy_from_slice(&value.to_le_bytes());
                call.field(prefix, &field);
                call.int(latest.rem_euclid(k));
            }
            add_offsets(call, key);
            call.fill(sets_count, call.args() - sets_start);
        }
    }
    true
}

/// The highest offset per lane of the deltas (and, for a full write, of the whole view), as
/// `o:<lane>` fields — never below what the view knows Redis recorded for that lane: the deltas
/// may be ones another writer of the lane applied first (sent again, and skipped), and a write
/// must not take the key's record back.
fn add_offsets(call: &mut ScriptCall, key: &KeyFlush<'_>) {
    let mut offsets = if key.full {
        key.offsets.clone()
    } else {
        Offsets::new()
    };
    for origin in key.deltas.iter().filter_map(|o| o.origin) {
        raise(&mut offsets, origin.lane, origin.offset);
    }
    for (lane, offset) in offsets.iter_mut() {
        if let Some(recorded) = offset_of(key.offsets, *lane) {
            *offset = (*offset).max(recorded);
        }
    }
    for (lane, offset) in offsets {
        let mut field = Vec::with_capacity(24);
        field.extend_from_slice(b"o:");
        field.extend_from_slice(itoa::Buffer::new().format(lane).as_bytes());
        call.field(key.prefix, &field);
        call.int(offset);
    }
}

/// Decoding of replies from a Redis this process does not control, for fuzz targets and their
/// bounded variants in the test suite: RESP bytes → the script's per-key replies and a stored
/// hash, for every aggregate. Never panics; errors are fine.
pub fn decode_untrusted(resp: &[u8]) -> usize {
    let Ok(value) = redis::parse_redis_value(resp) else {
        return 0;
    };
    let specs = [
        WindowSpec::new(1_000, 60, Aggregate::Count),
        WindowSpec::new(60_000, 7, Aggregate::Sum),
        WindowSpec::new(1, 3_600, Aggregate::Distinct),
    ];
    let mut decoded = 0;
    if let Ok(replies) = key_replies(value.clone()) {
        for reply in &replies {
            for spec in &specs {
                decoded += usize::from(parse_reply(spec, reply).is_ok());
            }
        }
    }
    if let Ok(fields) = flat(value) {
        for spec in &specs {
            decoded += usize::from(decode_hash(spec, &fields).is_ok());
            decoded += usize::from(decode_section(spec, b"0a1b2c3d.", &fields).is_ok());
        }
    }
    decoded
}
