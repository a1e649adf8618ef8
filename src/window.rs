//! Exact sliding windows over time buckets. Pure: no I/O, no clocks.
//!
//! For a window of `k` buckets of `b` ms, an event at `t` falls in bucket `i = floor(t / b)`. Per key
//! the state keeps `head` (the largest bucket counted) and the buckets `head-k+1 ..= head`. An event
//! with `i <= head - k` is late and changes nothing. Storage is sparse: only non-empty buckets are
//! kept, so a key costs memory in proportion to its activity, not to `k`.

use hashbrown::HashMap;
use smallvec::SmallVec;

/// What a window aggregates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Aggregate {
    Count,
    Sum,
    Distinct,
    /// The largest value in the window (micro-units, as a sum's).
    Max,
    /// The smallest value in the window.
    Min,
    /// The value of the key's previous event (the one with the greatest time in the window).
    Last,
}

impl Aggregate {
    pub fn as_str(self) -> &'static str {
        match self {
            Aggregate::Count => "count",
            Aggregate::Sum => "sum",
            Aggregate::Distinct => "distinct",
            Aggregate::Max => "max",
            Aggregate::Min => "min",
            Aggregate::Last => "last",
        }
    }

    /// Whether its raw values are micro-units (an amount), as a sum's.
    pub fn is_amount(self) -> bool {
        matches!(self, Aggregate::Sum | Aggregate::Max | Aggregate::Min)
    }
}

/// A `last` window's value: a JSON scalar of the event (strings of at most 256 bytes; up to 24
/// bytes — a country, a device or account id — kept inline, so keeping one allocates nothing).
#[derive(Debug, Clone, PartialEq)]
pub enum LastValue {
    Bool(bool),
    Num(crate::decimal::Decimal),
    Str(compact_str::CompactString),
}

impl LastValue {
    /// Bytes this value owns on the heap (a string too long to keep inline).
    pub fn heap_bytes(&self) -> usize {
        match self {
            LastValue::Str(s) if s.is_heap_allocated() => s.capacity(),
            _ => 0,
        }
    }
}

/// The shape of one sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WindowSpec {
    /// Bucket width in milliseconds, > 0.
    pub bucket_ms: i64,
    /// Number of buckets `k` in the window, >= 1.
    pub buckets: i64,
    pub aggregate: Aggregate,
    /// Distinct windows: the most values recorded per key (a new value beyond it is not
    /// recorded, so no key grows without bound).
    pub max_distinct: u32,
    /// What the window counts: a digest of its counter's dimensions and field (0: unnamed). Part
    /// of the window's identity, so a counter whose dimensions or field change starts afresh
    /// instead of mixing two meanings in one window.
    pub identity: u64,
    /// Where a Redis store may keep the window: counters with the same non-zero group (the same
    /// dimensions, so the same keys) may share one hash per key, each in its own section (0: a
    /// hash of its own). Distinct windows, whose hashes grow with their values, take 0.
    pub group: u64,
}

/// Values a distinct window records per key unless the counter says otherwise.
pub const DEFAULT_MAX_DISTINCT: u32 = 10_000;

impl WindowSpec {
    pub const fn new(bucket_ms: i64, buckets: i64, aggregate: Aggregate) -> WindowSpec {
        WindowSpec {
            bucket_ms,
            buckets,
            aggregate,
            max_distinct: DEFAULT_MAX_DISTINCT,
            identity: 0,
            group: 0,
        }
    }

    pub fn window_ms(&self) -> i64 {
        self.bucket_ms * self.buckets
    }

    /// The bucket index of an event time (floor division, so it is right for any sign).
    pub fn bucket_of(&self, ts_ms: i64) -> i64 {
        ts_ms.div_euclid(self.bucket_ms)
    }

    /// Whether a key whose newest bucket is `head` is indistinguishable from a key never counted
    /// for every event at or after `horizon_ms`: such an event's bucket `i` is at least `head + k`,
    /// so counting it slides every stored bucket out (and it is never late), and reading at it
    /// sees none of them.
    pub fn can_drop(&self, head: i64, horizon_ms: i64) -> bool {
        self.bucket_of(horizon_ms) >= head.saturating_add(self.buckets)
    }
}

/// One observation to add to a window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Delta {
    Count,
    /// An amount in micro-units (10^-6), exact.
    Sum(i64),
    /// A distinct value, by the digest of its canonical encoding.
    Distinct(u128),
    /// An amount in micro-units for a max or min window.
    Extreme(i64),
    /// An event for a `last` window (its value goes with it: [`WindowState::apply_last`]).
    Last,
}

/// The result of applying one observation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Applied {
    /// The bucket had slid out of the key's window: nothing changed.
    Late,
    /// Counted; the key's window value afterwards (count, micro-unit sum or distinct count).
    Counted(i64),
    /// Counted, but the distinct value was not recorded: the window already holds
    /// `max_distinct` values. The value is the window's (`max_distinct`).
    Capped(i64),
    /// Read, or counted into a `last` window, with no value: the window holds nothing (max,
    /// min and last windows; a count reads 0 instead).
    Empty,
}

impl Applied {
    /// What a key never counted reads: 0 for count, sum and distinct; nothing for the others.
    pub fn never_counted(aggregate: Aggregate) -> Applied {
        match aggregate {
            Aggregate::Count | Aggregate::Sum | Aggregate::Distinct => Applied::Counted(0),
            Aggregate::Max | Aggregate::Min | Aggregate::Last => Applied::Empty,
        }
    }

    /// The window value, unless the observation was late.
    pub fn value(self) -> Option<i64> {
        match self {
            Applied::Late | Applied::Empty => None,
            Applied::Counted(value) | Applied::Capped(value) => Some(value),
        }
    }

    /// Whether the observation was counted (its bucket is in the window).
    pub fn is_counted(self) -> bool {
        self != Applied::Late
    }
}

/// The state of one (window, key): a bucket series for count/sum, a latest-bucket-per-value set
/// for distinct.
#[derive(Debug, Clone, PartialEq)]
pub enum WindowState {
    Series(BucketSeries),
    /// Boxed: a distinct set is several times larger than a series, and keeping it out of line
    /// keeps every store entry small.
    Distinct(Box<DistinctSet>),
    /// Per bucket its largest (`Max`) or smallest value.
    Max(BucketSeries),
    Min(BucketSeries),
    /// The event with the greatest time (its time and value): all a `last` window needs, since
    /// the greatest time is in the newest bucket, the last to slide out. Inline: no larger than
    /// a series, and one pointer fewer to chase on every event of an account.
    Last(LastState),
}

/// A `last` window's state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LastState {
    head: Option<i64>,
    /// The counted event with the greatest time (ties: the later counted), and its value.
    best: Option<(i64, LastValue)>,
}

// A `last` state inline costs the other windows nothing.
const _: () = assert!(size_of::<LastState>() <= size_of::<BucketSeries>());
// Nor does the kept sum: a window state is one cache line.
const _: () = assert!(size_of::<WindowState>() <= 64);

impl WindowState {
    pub fn new(aggregate: Aggregate) -> WindowState {
        match aggregate {
            Aggregate::Count | Aggregate::Sum => WindowState::Series(BucketSeries::default()),
            Aggregate::Distinct => WindowState::Distinct(Box::default()),
            Aggregate::Max => WindowState::Max(BucketSeries::default()),
            Aggregate::Min => WindowState::Min(BucketSeries::default()),
            Aggregate::Last => WindowState::Last(LastState::default()),
        }
    }

    /// Counts an event at `ts_ms` (bucket `bucket`) with `value` into a `last` window; the
    /// previous event's time as the value, and its value ([`Applied::Empty`]: none in the window).
    pub fn apply_last(
        &mut self,
        spec: &WindowSpec,
        bucket: i64,
        ts_ms: i64,
        value: LastValue,
    ) -> (Applied, Option<LastValue>) {
        let WindowState::Last(state) = self else {
            unreachable!("apply_last on a {} window", spec.aggregate.as_str())
        };
        let Some(head) = advance_head(&mut state.head, spec, bucket) else {
            return (Applied::Late, None);
        };
        let oldest = head - spec.buckets + 1;
        let live = state
            .best
            .as_ref()
            .filter(|(t, _)| spec.bucket_of(*t) >= oldest);
        // The previous value moves out when this event replaces it (the usual case): cloned
        // only for an event older than it.
        let previous = if live.is_none_or(|(t, _)| *t <= ts_ms) {
            let live = live.is_some();
            let replaced = state.best.replace((ts_ms, value));
            replaced.filter(|_| live)
        } else {
            live.map(|(t, v)| (*t, v.clone()))
        };
        match previous {
            Some((t, v)) => (Applied::Counted(t), Some(v)),
            None => (Applied::Empty, None),
        }
    }

    /// A `last` window's event with the greatest time (its time and value), live or not.
    pub fn last_best(&self) -> Option<(i64, &LastValue)> {
        match self {
            WindowState::Last(state) => state.best.as_ref().map(|(t, v)| (*t, v)),
            _ => None,
        }
    }

    /// A `last` window read back from a shared store: its head and its event with the greatest
    /// time (ignored unless live for `head`).
    pub fn from_last(spec: &WindowSpec, head: i64, best: Option<(i64, LastValue)>) -> WindowState {
        let oldest_live = head - spec.buckets + 1;
        WindowState::Last(LastState {
            head: Some(head),
            best: best.filter(|(t, _)| (oldest_live..=head).contains(&spec.bucket_of(*t))),
        })
    }

    /// Reads a `last` window at `bucket` without changing it: the time and value of its event
    /// with the greatest time still in the window an event at that bucket would see.
    pub fn read_last(&self, spec: &WindowSpec, bucket: i64) -> (Applied, Option<LastValue>) {
        let WindowState::Last(state) = self else {
            return (Applied::Empty, None);
        };
        let Some(head) = state.head else {
            return (Applied::Empty, None);
        };
        if bucket <= head - spec.buckets {
            return (Applied::Late, None);
        }
        let oldest = head.max(bucket) - spec.buckets + 1;
        match &state.best {
            Some((t, v)) if spec.bucket_of(*t) >= oldest => (Applied::Counted(*t), Some(v.clone())),
            _ => (Applied::Empty, None),
        }
    }

    /// Rebuilds a key's state from a window read back from a shared store: its head, the live
    /// buckets (count/sum) or the live values with their latest bucket (distinct). Entries that
    /// are not live for `head` are ignored.
    pub fn from_window(
        spec: &WindowSpec,
        head: i64,
        buckets: impl IntoIterator<Item = (i64, i64)>,
        values: impl IntoIterator<Item = (u128, i64)>,
    ) -> WindowState {
        let oldest_live = head - spec.buckets + 1;
        match spec.aggregate {
            Aggregate::Count | Aggregate::Sum | Aggregate::Max | Aggregate::Min => {
                let mut live: SmallVec<[(i64, i64); 2]> = buckets
                    .into_iter()
                    .filter(|&(b, _)| (oldest_live..=head).contains(&b))
                    .collect();
                live.sort_by_key(|&(b, _)| b);
                let series = BucketSeries::from_live(head, Buckets(live));
                match spec.aggregate {
                    Aggregate::Max => WindowState::Max(series),
                    Aggregate::Min => WindowState::Min(series),
                    _ => WindowState::Series(series),
                }
            }
            // `last` windows are not kept in a shared store.
            Aggregate::Last => WindowState::new(spec.aggregate),
            Aggregate::Distinct => {
                let mut set = DistinctSet {
                    head: Some(head),
                    ..DistinctSet::default()
                };
                for (value, bucket) in values {
                    if (oldest_live..=head).contains(&bucket) && set.latest.get(value).is_none() {
                        set.latest.set(value, bucket);
                        set.per_bucket.add(bucket, 1);
                        set.live += 1;
                    }
                }
                WindowState::Distinct(Box::new(set))
            }
        }
    }

    /// Estimated bytes this state owns on the heap (capacities, not the allocator's overhead).
    pub fn heap_bytes(&self) -> usize {
        match self {
            WindowState::Series(s) | WindowState::Max(s) | WindowState::Min(s) => {
                s.buckets.heap_bytes()
            }
            WindowState::Last(l) => l.best.as_ref().map_or(0, |(_, value)| value.heap_bytes()),
            WindowState::Distinct(d) => {
                size_of::<DistinctSet>() + d.latest.heap_bytes() + d.per_bucket.heap_bytes()
            }
        }
    }

    pub fn head(&self) -> Option<i64> {
        match self {
            WindowState::Series(s) | WindowState::Max(s) | WindowState::Min(s) => s.head(),
            WindowState::Distinct(d) => d.head,
            WindowState::Last(l) => l.head,
        }
    }

    /// What each non-empty bucket holds, oldest first, to show a window: its count, sum or extreme
    /// (micro-units for amounts); for a distinct window, the values whose latest bucket it is;
    /// for a `last` window, the kept event's time in its bucket.
    pub fn contributions(&self, spec: &WindowSpec) -> Vec<(i64, i64)> {
        match self {
            WindowState::Series(s) | WindowState::Max(s) | WindowState::Min(s) => {
                s.buckets().collect()
            }
            WindowState::Distinct(d) => d
                .per_bucket
                .0
                .iter()
                .map(|&(b, n)| (b, i64::from(n)))
                .collect(),
            WindowState::Last(l) => l
                .best
                .iter()
                .map(|(t, _)| (spec.bucket_of(*t), *t))
                .collect(),
        }
    }

    /// The count or sum held in `bucket`, if it is live and not empty (count/sum windows).
    pub fn bucket_value(&self, bucket: i64) -> Option<i64> {
        match self {
            WindowState::Series(s) | WindowState::Max(s) | WindowState::Min(s) => s
                .buckets
                .0
                .iter()
                .find(|&&(b, _)| b == bucket)
                .map(|&(_, v)| v),
            _ => None,
        }
    }

    /// The latest bucket `value` was seen in, if it is still known (distinct windows; it may
    /// have slid out: compare with the head).
    pub fn latest_bucket(&self, value: u128) -> Option<i64> {
        match self {
            WindowState::Distinct(d) => d.latest.get(value),
            _ => None,
        }
    }

    /// Applies an observation at bucket `bucket` (steps 1–3 of the window semantics).
    pub fn apply(&mut self, spec: &WindowSpec, bucket: i64, delta: Delta) -> Applied {
        match (self, delta) {
            (WindowState::Series(s), Delta::Count) => s.add(spec, bucket, 1),
            (WindowState::Series(s), Delta::Sum(v)) => s.add(spec, bucket, v),
            (WindowState::Distinct(d), Delta::Distinct(v)) => d.add(spec, bucket, v),
            (WindowState::Max(s), Delta::Extreme(v)) => s.extreme(spec, bucket, v, i64::max),
            (WindowState::Min(s), Delta::Extreme(v)) => s.extreme(spec, bucket, v, i64::min),
            // The store opens a state per window spec, so a delta always matches its state.
            (state, delta) => unreachable!("delta {delta:?} applied to {state:?}"),
        }
    }

    /// Takes back an observation [`WindowState::apply`] counted at `bucket`, so that a window
    /// already holding it can be read as it stood before it: possible for a count or a sum
    /// (their buckets add up), not for a distinct set, an extreme or a `last` (what they held
    /// before is not kept). False, and nothing changed, where it is not possible, or where the
    /// bucket is not live: one past the head would slide the window, one slid out holds
    /// nothing of it.
    pub fn take_back(&mut self, spec: &WindowSpec, bucket: i64, delta: Delta) -> bool {
        let WindowState::Series(series) = self else {
            return false;
        };
        let amount = match delta {
            Delta::Count => 1,
            Delta::Sum(v) => v,
            _ => return false,
        };
        let Some(head) = series.head() else {
            return false;
        };
        if bucket > head || bucket <= head - spec.buckets {
            return false;
        }
        let Some(negated) = amount.checked_neg() else {
            return false;
        };
        series.buckets.add(bucket, negated);
        // Counted again in full: the kept sum stays kept when every bucket is non-negative.
        *series = BucketSeries::from_live(head, std::mem::take(&mut series.buckets));
        true
    }

    /// The current window value (what [`Applied::Counted`] reported last).
    pub fn value(&self) -> i64 {
        match self {
            WindowState::Series(s) => s.value(),
            WindowState::Distinct(d) => d.live as i64,
            WindowState::Max(s) => s.buckets().map(|(_, v)| v).max().unwrap_or(0),
            WindowState::Min(s) => s.buckets().map(|(_, v)| v).min().unwrap_or(0),
            WindowState::Last(l) => l.best.as_ref().map_or(0, |(t, _)| *t),
        }
    }

    /// Reads the window at bucket `bucket` without changing it: late if `bucket <= head - k`,
    /// else, with `h = max(head, bucket)`, the buckets `h-k+1 ..= head` (distinct: the values
    /// whose latest bucket is at least `h-k+1`).
    pub fn read(&self, spec: &WindowSpec, bucket: i64) -> Applied {
        let Some(head) = self.head() else {
            return match self {
                WindowState::Series(_) | WindowState::Distinct(_) => Applied::Counted(0),
                _ => Applied::Empty,
            };
        };
        if bucket <= head - spec.buckets {
            return Applied::Late;
        }
        let oldest = head.max(bucket) - spec.buckets + 1;
        match self {
            // At or before the head every live bucket is in the window: the kept sum.
            WindowState::Series(s) if bucket <= head => Applied::Counted(s.value()),
            WindowState::Series(s) => Applied::Counted(
                s.buckets
                    .0
                    .iter()
                    .filter(|&&(b, _)| b >= oldest)
                    .fold(0i64, |a, &(_, v)| a.saturating_add(v)),
            ),
            // At or before the head every live value is in the window: the kept count.
            WindowState::Distinct(d) if bucket <= head => Applied::Counted(d.live as i64),
            WindowState::Distinct(d) => Applied::Counted(
                d.per_bucket
                    .0
                    .iter()
                    .filter(|&&(b, _)| b >= oldest)
                    .map(|&(_, n)| i64::from(n))
                    .sum(),
            ),
            WindowState::Max(s) | WindowState::Min(s) => {
                let live = s.buckets().filter(|&(b, _)| b >= oldest).map(|(_, v)| v);
                let value = if matches!(self, WindowState::Max(_)) {
                    live.max()
                } else {
                    live.min()
                };
                value.map_or(Applied::Empty, Applied::Counted)
            }
            WindowState::Last(_) => self.read_last(spec, bucket).0,
        }
    }
}

/// Steps 1–2 of the window semantics for the head: `None` if `bucket` is late (`<= head - k`), else the new
/// head `max(head, bucket)`, stored.
fn advance_head(head: &mut Option<i64>, spec: &WindowSpec, bucket: i64) -> Option<i64> {
    let new_head = match *head {
        Some(h) if bucket <= h - spec.buckets => return None,
        Some(h) => h.max(bucket),
        None => bucket,
    };
    *head = Some(new_head);
    Some(new_head)
}

/// Non-empty buckets `(index, value)`, oldest first. Two fit inline in the owning entry, which
/// covers most keys (a handful of events per window) without a heap allocation or the cache miss
/// of following one.
#[derive(Debug, Clone, Default, PartialEq)]
struct Buckets<V>(SmallVec<[(i64, V); 2]>);

/// How bucket values add: sums saturate at the 64-bit limit instead of wrapping.
trait Accumulate: Copy {
    fn accumulate(&mut self, amount: Self);
}

impl Accumulate for i64 {
    fn accumulate(&mut self, amount: i64) {
        *self = self.saturating_add(amount);
    }
}

impl Accumulate for u32 {
    fn accumulate(&mut self, amount: u32) {
        *self = self.saturating_add(amount);
    }
}

impl<V: Accumulate> Buckets<V> {
    /// Adds `amount` to `bucket`, creating it in order if absent. Events arrive mostly in order,
    /// so the search runs from the back.
    fn add(&mut self, bucket: i64, amount: V) {
        match self.0.iter().rposition(|&(b, _)| b <= bucket) {
            Some(pos) if self.0[pos].0 == bucket => self.0[pos].1.accumulate(amount),
            Some(pos) => self.0.insert(pos + 1, (bucket, amount)),
            None => self.0.insert(0, (bucket, amount)),
        }
    }

    /// Removes the buckets older than `oldest_live`, folding their values with `dropped`.
    fn drop_before(&mut self, oldest_live: i64, mut dropped: impl FnMut(V)) {
        let n = self.0.iter().take_while(|&&(b, _)| b < oldest_live).count();
        if n > 0 {
            self.0.iter().take(n).for_each(|&(_, v)| dropped(v));
            self.0.drain(..n);
        }
    }

    fn heap_bytes(&self) -> usize {
        if self.0.spilled() {
            self.0.capacity() * size_of::<(i64, V)>()
        } else {
            0
        }
    }

    fn position(&self, bucket: i64) -> Option<usize> {
        self.0.iter().rposition(|&(b, _)| b == bucket)
    }

    fn value_at(&self, bucket: i64) -> Option<V> {
        self.position(bucket).map(|i| self.0[i].1)
    }
}

/// Non-empty buckets of a count or sum window (or each bucket's extreme, for max and min).
#[derive(Debug, Clone)]
pub struct BucketSeries {
    /// The largest bucket counted so far; [`NO_HEAD`] before the first event (buckets are never
    /// negative: event times are). A sentinel, not an `Option`, so the sum below fits in the
    /// same 64 bytes a window state took without it.
    head: i64,
    buckets: Buckets<i64>,
    /// Count and sum windows: the sum of the live buckets while every one is non-negative (the
    /// saturating fold oldest-first then equals it, so a hot key's value costs one read instead
    /// of a pass over up to `k` buckets); [`NOT_KEPT`] once a negative amount or an overflow
    /// leaves the fold the only exact answer.
    total: i64,
}

/// [`BucketSeries::head`] before the first event.
const NO_HEAD: i64 = i64::MIN;

/// [`BucketSeries::total`] when the sum is not kept.
const NOT_KEPT: i64 = -1;

impl Default for BucketSeries {
    fn default() -> BucketSeries {
        BucketSeries {
            head: NO_HEAD,
            buckets: Buckets::default(),
            total: 0,
        }
    }
}

/// Equal when they hold the same buckets: the sum is derived from them.
impl PartialEq for BucketSeries {
    fn eq(&self, other: &BucketSeries) -> bool {
        self.head == other.head && self.buckets == other.buckets
    }
}

impl BucketSeries {
    /// A series of `buckets`, all live for `head`.
    fn from_live(head: i64, buckets: Buckets<i64>) -> BucketSeries {
        let total = buckets
            .0
            .iter()
            .try_fold(
                0i64,
                |total, &(_, v)| {
                    if v < 0 {
                        None
                    } else {
                        total.checked_add(v)
                    }
                },
            )
            .unwrap_or(NOT_KEPT);
        BucketSeries {
            head,
            buckets,
            total,
        }
    }

    fn head(&self) -> Option<i64> {
        (self.head != NO_HEAD).then_some(self.head)
    }

    /// [`advance_head`] on this series' head.
    fn advance(&mut self, spec: &WindowSpec, bucket: i64) -> Option<i64> {
        let mut head = self.head();
        let advanced = advance_head(&mut head, spec, bucket)?;
        self.head = advanced;
        Some(advanced)
    }

    fn add(&mut self, spec: &WindowSpec, bucket: i64, amount: i64) -> Applied {
        let Some(head) = self.advance(spec, bucket) else {
            return Applied::Late;
        };
        // The kept sum grows by what the bucket gains (its value saturates, so not always
        // `amount`); a negative amount ends keeping it.
        let kept_before = (self.total != NOT_KEPT && amount >= 0)
            .then(|| self.buckets.value_at(bucket).unwrap_or(0));
        self.buckets.add(bucket, amount);
        self.total = match kept_before {
            Some(before) => {
                let gained = self.buckets.value_at(bucket).unwrap_or(0) - before;
                self.total.checked_add(gained).unwrap_or(NOT_KEPT)
            }
            None => NOT_KEPT,
        };
        let total = &mut self.total;
        self.buckets
            .drop_before(head - spec.buckets + 1, |dropped| {
                if *total != NOT_KEPT {
                    *total -= dropped;
                }
            });
        Applied::Counted(self.value())
    }

    /// Keeps the larger (or smaller, by `keep`) of a bucket's value and `amount`; the window's
    /// extreme afterwards.
    fn extreme(
        &mut self,
        spec: &WindowSpec,
        bucket: i64,
        amount: i64,
        keep: fn(i64, i64) -> i64,
    ) -> Applied {
        let Some(head) = self.advance(spec, bucket) else {
            return Applied::Late;
        };
        match self.buckets.0.iter().rposition(|&(b, _)| b <= bucket) {
            Some(pos) if self.buckets.0[pos].0 == bucket => {
                self.buckets.0[pos].1 = keep(self.buckets.0[pos].1, amount)
            }
            Some(pos) => self.buckets.0.insert(pos + 1, (bucket, amount)),
            None => self.buckets.0.insert(0, (bucket, amount)),
        }
        self.buckets.drop_before(head - spec.buckets + 1, |_| {});
        Applied::Counted(self.buckets().map(|(_, v)| v).fold(amount, keep))
    }

    /// Sum over the live buckets, oldest first: one fixed order, so the result does not depend
    /// on how the buckets were filled.
    fn value(&self) -> i64 {
        if self.total != NOT_KEPT {
            return self.total;
        }
        self.buckets
            .0
            .iter()
            .fold(0i64, |a, &(_, v)| a.saturating_add(v))
    }

    /// Live buckets, oldest first.
    pub fn buckets(&self) -> impl Iterator<Item = (i64, i64)> + '_ {
        self.buckets.0.iter().copied()
    }
}

/// Values up to this many are kept in a small inline list scanned linearly; beyond, a hash map.
const SMALL_DISTINCT: usize = 16;

/// Each distinct value's latest bucket.
#[derive(Debug, Clone, PartialEq)]
enum Latest {
    Small(SmallVec<[(u128, i64); 2]>),
    Large(HashMap<u128, i64, foldhash::fast::FixedState>),
}

impl Default for Latest {
    fn default() -> Self {
        Latest::Small(SmallVec::new())
    }
}

impl Latest {
    fn get(&self, value: u128) -> Option<i64> {
        match self {
            Latest::Small(v) => v.iter().find(|(k, _)| *k == value).map(|&(_, b)| b),
            Latest::Large(m) => m.get(&value).copied(),
        }
    }

    fn set(&mut self, value: u128, bucket: i64) {
        match self {
            Latest::Small(v) => match v.iter().position(|(k, _)| *k == value) {
                Some(pos) => v[pos].1 = bucket,
                None if v.len() < SMALL_DISTINCT => v.push((value, bucket)),
                None => {
                    let mut map: HashMap<_, _, _> = v.drain(..).collect();
                    map.insert(value, bucket);
                    *self = Latest::Large(map);
                }
            },
            Latest::Large(m) => {
                m.insert(value, bucket);
            }
        }
    }

    fn heap_bytes(&self) -> usize {
        match self {
            Latest::Small(v) if v.spilled() => v.capacity() * size_of::<(u128, i64)>(),
            Latest::Small(_) => 0,
            // hashbrown: one control byte per bucket besides the entry.
            Latest::Large(m) => m.capacity() * (size_of::<(u128, i64)>() + 1),
        }
    }

    fn len(&self) -> usize {
        match self {
            Latest::Small(v) => v.len(),
            Latest::Large(m) => m.len(),
        }
    }

    fn retain_from(&mut self, oldest_live: i64) {
        match self {
            Latest::Small(v) => v.retain(|(_, b)| *b >= oldest_live),
            Latest::Large(m) => m.retain(|_, b| *b >= oldest_live),
        }
    }

    fn iter(&self) -> Box<dyn Iterator<Item = (u128, i64)> + '_> {
        match self {
            Latest::Small(v) => Box::new(v.iter().copied()),
            Latest::Large(m) => Box::new(m.iter().map(|(&k, &b)| (k, b))),
        }
    }
}

/// For a distinct window: each value's latest bucket, and per bucket how many values have it as
/// their latest, so the live count follows the window without scanning the values.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DistinctSet {
    head: Option<i64>,
    latest: Latest,
    /// Per live bucket, the number of values whose latest bucket it is.
    per_bucket: Buckets<u32>,
    live: u64,
}

impl DistinctSet {
    fn add(&mut self, spec: &WindowSpec, bucket: i64, value: u128) -> Applied {
        let Some(head) = advance_head(&mut self.head, spec, bucket) else {
            return Applied::Late;
        };
        let oldest_live = head - spec.buckets + 1;
        // Slide first, so values that fell out make room.
        let live = &mut self.live;
        self.per_bucket
            .drop_before(oldest_live, |n| *live -= u64::from(n));
        let mut capped = false;
        match self.latest.get(value) {
            Some(prev) if prev >= bucket => {}
            // A value not recorded in the window while it is full is not recorded.
            previous
                if previous.is_none_or(|prev| prev < oldest_live)
                    && self.live >= u64::from(spec.max_distinct) =>
            {
                capped = true;
            }
            previous => {
                // A value moving from `prev` to `bucket` stays live, unless `prev` already slid
                // out, in which case its count went with it and the value comes back to life.
                let still_live = previous.is_some_and(|prev| self.decrement(prev));
                if !still_live {
                    self.live += 1;
                }
                self.latest.set(value, bucket);
                self.per_bucket.add(bucket, 1);
            }
        }
        let live = &mut self.live;
        self.per_bucket
            .drop_before(oldest_live, |n| *live -= u64::from(n));
        // Forget values that slid out once they outnumber the live ones.
        if self.latest.len() > 2 * self.live as usize + 8 {
            self.latest.retain_from(oldest_live);
        }
        if capped {
            Applied::Capped(self.live as i64)
        } else {
            Applied::Counted(self.live as i64)
        }
    }

    /// Decrements `bucket`'s count; false if the bucket is no longer held (it slid out).
    fn decrement(&mut self, bucket: i64) -> bool {
        match self.per_bucket.position(bucket) {
            Some(pos) => {
                self.per_bucket.0[pos].1 -= 1;
                if self.per_bucket.0[pos].1 == 0 {
                    self.per_bucket.0.remove(pos);
                }
                true
            }
            None => false,
        }
    }

    /// Values still in the window, with their latest bucket.
    pub fn live_values<'s>(&'s self, spec: &WindowSpec) -> impl Iterator<Item = (u128, i64)> + 's {
        let oldest_live = self.head.map_or(i64::MAX, |h| h - spec.buckets + 1);
        self.latest.iter().filter(move |&(_, b)| b >= oldest_live)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(aggregate: Aggregate, bucket_ms: i64, buckets: i64) -> WindowSpec {
        WindowSpec::new(bucket_ms, buckets, aggregate)
    }

    #[test]
    fn reading_changes_nothing_and_follows_the_event_time() {
        let s = spec(Aggregate::Count, 10, 3);
        let mut w = WindowState::new(Aggregate::Count);
        assert_eq!(w.read(&s, 5), Applied::Counted(0));
        w.apply(&s, 4, Delta::Count);
        w.apply(&s, 5, Delta::Count);
        let before = w.clone();
        assert_eq!(w.read(&s, 5), Applied::Counted(2));
        // At bucket 7 the window would be 5..=7: bucket 4 is not seen, but not dropped either.
        assert_eq!(w.read(&s, 7), Applied::Counted(1));
        assert_eq!(w.read(&s, 2), Applied::Late);
        assert_eq!(w.read(&s, 3), Applied::Counted(2));
        assert_eq!(w, before);
    }

    #[test]
    fn a_count_or_a_sum_takes_an_observation_back_and_counts_it_again_to_the_same_window() {
        let s = spec(Aggregate::Count, 10, 3);
        let mut w = WindowState::new(Aggregate::Count);
        for bucket in [3, 4, 4, 5] {
            w.apply(&s, bucket, Delta::Count);
        }
        let whole = w.clone();
        assert!(w.take_back(&s, 4, Delta::Count));
        assert_eq!(w.read(&s, 5), Applied::Counted(3));
        assert_eq!(w.apply(&s, 4, Delta::Count), Applied::Counted(4));
        assert_eq!(w, whole, "the kept sum is kept again");
        // Past the head (it would slide the window) or slid out: nothing changes.
        assert!(!w.take_back(&s, 6, Delta::Count));
        assert!(!w.take_back(&s, 2, Delta::Count));
        assert_eq!(w, whole);

        let s = spec(Aggregate::Sum, 10, 3);
        let mut w = WindowState::new(Aggregate::Sum);
        w.apply(&s, 1, Delta::Sum(-2_500_000));
        w.apply(&s, 2, Delta::Sum(7_000_000));
        let whole = w.clone();
        assert!(w.take_back(&s, 2, Delta::Sum(7_000_000)));
        assert_eq!(w.read(&s, 2), Applied::Counted(-2_500_000));
        assert!(!w.take_back(&s, 2, Delta::Sum(i64::MIN)), "not negatable");
        w.apply(&s, 2, Delta::Sum(7_000_000));
        assert_eq!(w.read(&s, 2), whole.read(&s, 2));

        // What a distinct set or an extreme held before is not kept.
        let s = spec(Aggregate::Distinct, 10, 3);
        let mut w = WindowState::new(Aggregate::Distinct);
        w.apply(&s, 1, Delta::Distinct(9));
        assert!(!w.take_back(&s, 1, Delta::Distinct(9)));
        let s = spec(Aggregate::Max, 10, 3);
        let mut w = WindowState::new(Aggregate::Max);
        w.apply(&s, 1, Delta::Extreme(9));
        assert!(!w.take_back(&s, 1, Delta::Extreme(9)));
    }

    #[test]
    fn distinct_saturates_at_max_distinct() {
        let s = WindowSpec {
            max_distinct: 3,
            ..spec(Aggregate::Distinct, 60_000, 5)
        };
        let mut w = WindowState::new(Aggregate::Distinct);
        let at = |w: &mut WindowState, b: i64, v: u128| counted(w.apply(&s, b, Delta::Distinct(v)));
        assert_eq!(at(&mut w, 0, 1), 1);
        assert_eq!(at(&mut w, 1, 2), 2);
        assert_eq!(at(&mut w, 1, 2), 2);
        assert_eq!(at(&mut w, 1, 3), 3);
        assert_eq!(
            w.apply(&s, 2, Delta::Distinct(4)),
            Applied::Capped(3),
            "a fourth value is not recorded"
        );
        assert_eq!(at(&mut w, 3, 1), 3);
        assert_eq!(w.apply(&s, 5, Delta::Distinct(5)), Applied::Capped(3));
        assert_eq!(at(&mut w, 6, 5), 2);
        assert_eq!(at(&mut w, 6, 4), 3);
    }

    fn counted(a: Applied) -> i64 {
        match a {
            Applied::Counted(v) | Applied::Capped(v) => v,
            Applied::Late | Applied::Empty => panic!("unexpected {a:?}"),
        }
    }

    #[test]
    fn bucket_index_is_floor_division() {
        let s = spec(Aggregate::Count, 1000, 10);
        assert_eq!(s.bucket_of(0), 0);
        assert_eq!(s.bucket_of(999), 0);
        assert_eq!(s.bucket_of(1000), 1);
        assert_eq!(s.bucket_of(-1), -1);
        assert_eq!(s.window_ms(), 10_000);
    }

    #[test]
    fn count_slides_and_drops_old_buckets() {
        let s = spec(Aggregate::Count, 1000, 3);
        let mut w = WindowState::new(Aggregate::Count);
        assert_eq!(counted(w.apply(&s, 0, Delta::Count)), 1);
        assert_eq!(counted(w.apply(&s, 1, Delta::Count)), 2);
        assert_eq!(counted(w.apply(&s, 2, Delta::Count)), 3);
        // Bucket 3 pushes bucket 0 out: window is 1..=3.
        assert_eq!(counted(w.apply(&s, 3, Delta::Count)), 3);
        // A jump far ahead empties the window.
        assert_eq!(counted(w.apply(&s, 100, Delta::Count)), 1);
    }

    #[test]
    fn late_is_exactly_head_minus_k_or_older() {
        let s = spec(Aggregate::Count, 10, 3);
        let mut w = WindowState::new(Aggregate::Count);
        w.apply(&s, 10, Delta::Count);
        assert_eq!(w.apply(&s, 7, Delta::Count), Applied::Late);
        // Bucket 8 = head - k + 1 is still in the window.
        assert_eq!(counted(w.apply(&s, 8, Delta::Count)), 2);
        assert_eq!(w.head(), Some(10));
    }

    #[test]
    fn out_of_order_within_window_is_counted_in_its_bucket() {
        let s = spec(Aggregate::Sum, 10, 4);
        let mut w = WindowState::new(Aggregate::Sum);
        w.apply(&s, 5, Delta::Sum(1));
        w.apply(&s, 3, Delta::Sum(2));
        w.apply(&s, 4, Delta::Sum(4));
        assert_eq!(counted(w.apply(&s, 5, Delta::Sum(8))), 15);
        // Head 6 drops bucket 2 (none) and keeps 3..=6.
        assert_eq!(counted(w.apply(&s, 6, Delta::Sum(16))), 31);
        // Head 7 drops bucket 3 (2).
        assert_eq!(counted(w.apply(&s, 7, Delta::Sum(1))), 30);
        if let WindowState::Series(series) = &w {
            let buckets: Vec<_> = series.buckets().collect();
            assert_eq!(buckets, [(4, 4), (5, 9), (6, 16), (7, 1)]);
        }
    }

    #[test]
    fn the_kept_sum_equals_the_saturating_fold_whatever_the_amounts() {
        // Pseudo-random amounts, mostly small and positive, sometimes negative or near the
        // limits, with out-of-order buckets and reads before and after the head: the value
        // counted or read is always the fold over the live buckets, oldest first.
        let s = spec(Aggregate::Sum, 10, 5);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..200 {
            let mut w = WindowState::new(Aggregate::Sum);
            let mut head = 0i64;
            for _ in 0..60 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let amount = match x % 16 {
                    0 => -((x >> 8) as i64 % 1000),
                    1 => i64::MAX - (x >> 40) as i64,
                    _ => (x >> 8) as i64 % 1000,
                };
                let bucket = (head + (x >> 4) as i64 % 4 - 2).max(0);
                let fold = |w: &WindowState, from: i64| match w {
                    WindowState::Series(series) => series
                        .buckets()
                        .filter(|&(b, _)| b >= from)
                        .fold(0i64, |a, (_, v)| a.saturating_add(v)),
                    _ => unreachable!(),
                };
                if let Applied::Counted(value) = w.apply(&s, bucket, Delta::Sum(amount)) {
                    head = head.max(bucket);
                    assert_eq!(value, fold(&w, i64::MIN));
                }
                for at in [head - 1, head, head + 2] {
                    if let Applied::Counted(read) = w.read(&s, at) {
                        assert_eq!(read, fold(&w, head.max(at) - s.buckets + 1), "read at {at}");
                    }
                }
            }
        }
    }

    #[test]
    fn distinct_counts_values_by_latest_bucket() {
        let s = spec(Aggregate::Distinct, 10, 3);
        let mut w = WindowState::new(Aggregate::Distinct);
        assert_eq!(counted(w.apply(&s, 0, Delta::Distinct(1))), 1);
        assert_eq!(counted(w.apply(&s, 0, Delta::Distinct(1))), 1);
        assert_eq!(counted(w.apply(&s, 1, Delta::Distinct(2))), 2);
        // Value 1 seen again in bucket 2: its latest moves, so it survives bucket 0 sliding out.
        assert_eq!(counted(w.apply(&s, 2, Delta::Distinct(1))), 2);
        assert_eq!(counted(w.apply(&s, 3, Delta::Distinct(3))), 3);
        // Head 4: window 2..=4; value 2 (latest 1) is gone.
        assert_eq!(counted(w.apply(&s, 4, Delta::Distinct(3))), 2);
        // An older sighting (bucket 2) of value 3 does not move its latest back.
        assert_eq!(counted(w.apply(&s, 2, Delta::Distinct(3))), 2);
        // Value 2 returns after sliding out: counted afresh.
        assert_eq!(counted(w.apply(&s, 4, Delta::Distinct(2))), 3);
        assert_eq!(w.apply(&s, 1, Delta::Distinct(9)), Applied::Late);
    }

    #[test]
    fn distinct_forgets_expired_values() {
        let s = spec(Aggregate::Distinct, 1, 2);
        let mut w = WindowState::new(Aggregate::Distinct);
        for i in 0..10_000u128 {
            w.apply(&s, i as i64, Delta::Distinct(i));
        }
        if let WindowState::Distinct(d) = &w {
            assert!(
                d.latest.len() <= 2 * d.live as usize + 8,
                "{} retained",
                d.latest.len()
            );
            assert_eq!(d.live_values(&s).count(), 2);
        }
    }

    #[test]
    fn distinct_large_sets_match_a_naive_count() {
        // Hundreds of values per window, out of order: exercises the switch to a hash map.
        let s = spec(Aggregate::Distinct, 10, 5);
        let mut w = WindowState::new(Aggregate::Distinct);
        let mut naive: std::collections::HashMap<u128, i64> = Default::default();
        let mut head = i64::MIN;
        let mut x: u64 = 1;
        for step in 0..20_000i64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let value = u128::from((x >> 33) % 300);
            let bucket = step / 50 - ((x >> 20) % 4) as i64;
            let applied = w.apply(&s, bucket, Delta::Distinct(value));
            if head != i64::MIN && bucket <= head - s.buckets {
                assert_eq!(applied, Applied::Late);
                continue;
            }
            head = head.max(bucket);
            let latest = naive.entry(value).or_insert(bucket);
            *latest = (*latest).max(bucket);
            let live = naive.values().filter(|&&b| b > head - s.buckets).count();
            assert_eq!(applied, Applied::Counted(live as i64), "step {step}");
        }
        assert!(matches!(&w, WindowState::Distinct(d) if matches!(d.latest, Latest::Large(_))));
    }

    #[test]
    fn from_window_rebuilds_the_same_state() {
        let s = spec(Aggregate::Sum, 10, 3);
        let mut built = WindowState::new(Aggregate::Sum);
        for (b, v) in [(4, 15), (5, 2), (6, 25), (6, 1)] {
            built.apply(&s, b, Delta::Sum(v));
        }
        let WindowState::Series(series) = &built else {
            panic!()
        };
        let buckets: Vec<_> = series.buckets().collect();
        // Out of order and with a bucket that is no longer live: both handled.
        let mut shuffled = buckets.clone();
        shuffled.reverse();
        shuffled.push((3, 99));
        let rebuilt = WindowState::from_window(&s, 6, shuffled, []);
        assert_eq!(rebuilt, built);

        let d = spec(Aggregate::Distinct, 10, 3);
        let mut built = WindowState::new(Aggregate::Distinct);
        for (b, v) in [(1, 7u128), (2, 8), (3, 7), (3, 9)] {
            built.apply(&d, b, Delta::Distinct(v));
        }
        let WindowState::Distinct(set) = &built else {
            panic!()
        };
        let values: Vec<_> = set.live_values(&d).collect();
        let mut rebuilt = WindowState::from_window(&d, 3, [], values);
        assert_eq!(rebuilt.value(), built.value());
        // Both continue identically.
        assert_eq!(
            rebuilt.apply(&d, 4, Delta::Distinct(8)),
            built.apply(&d, 4, Delta::Distinct(8))
        );
        assert_eq!(
            rebuilt.apply(&d, 5, Delta::Distinct(1)),
            built.apply(&d, 5, Delta::Distinct(1))
        );
    }

    #[test]
    fn a_key_can_be_dropped_once_no_event_at_the_horizon_can_see_it() {
        let s = spec(Aggregate::Count, 1000, 10);
        // Head bucket 9: an event in bucket 18 (t = 18_999) still sees it (window 9..=18).
        assert!(!s.can_drop(9, 18_999));
        assert!(s.can_drop(9, 19_000));
        let mut w = WindowState::new(Aggregate::Count);
        w.apply(&s, 9, Delta::Count);
        assert_eq!(w.apply(&s, 18, Delta::Count), Applied::Counted(2));
        let mut w = WindowState::new(Aggregate::Count);
        w.apply(&s, 9, Delta::Count);
        assert_eq!(
            w.apply(&s, 19, Delta::Count),
            Applied::Counted(1),
            "as if it had been dropped"
        );
    }

    /// Max and min are exact over the live buckets; a key never counted, or whose buckets all
    /// slid out of what a read sees, has no value.
    #[test]
    fn max_and_min_follow_the_window() {
        let s = spec(Aggregate::Max, 10, 3);
        let mut max = WindowState::new(Aggregate::Max);
        let mut min = WindowState::new(Aggregate::Min);
        assert_eq!(max.read(&s, 0), Applied::Empty);
        for (bucket, v, want_max, want_min) in [
            (0, 50, 50, 50),
            (0, 70, 70, 50),
            (1, 10, 70, 10),
            (2, 30, 70, 10),
            // Bucket 0 slides out: 70 and 50 go.
            (3, 20, 30, 10),
            // Late: bucket 0 is behind head - k.
            (0, 999, -1, -1),
        ] {
            let got_max = max.apply(&s, bucket, Delta::Extreme(v));
            let got_min = min.apply(&s, bucket, Delta::Extreme(v));
            if want_max < 0 {
                assert_eq!((got_max, got_min), (Applied::Late, Applied::Late));
            } else {
                assert_eq!(got_max, Applied::Counted(want_max), "max at {bucket}");
                assert_eq!(got_min, Applied::Counted(want_min), "min at {bucket}");
            }
        }
        // A read at bucket 5 sees buckets 3..=3 only; at 7, nothing.
        assert_eq!(max.read(&s, 5), Applied::Counted(20));
        assert_eq!(min.read(&s, 7), Applied::Empty);
        assert_eq!(Applied::Empty.value(), None);
    }

    /// `last`: the previous event of the key, the one with the greatest time (ties: the later
    /// counted), while it is in the window; reading changes nothing.
    #[test]
    fn last_is_the_previous_event_by_time() {
        let s = spec(Aggregate::Last, 1_000, 60);
        let mut w = WindowState::new(Aggregate::Last);
        let v = |x: &str| LastValue::Str(x.into());
        let count =
            |w: &mut WindowState, ts: i64, x: &str| w.apply_last(&s, s.bucket_of(ts), ts, v(x));
        assert_eq!(count(&mut w, 10_000, "US"), (Applied::Empty, None));
        assert_eq!(
            count(&mut w, 20_000, "FR"),
            (Applied::Counted(10_000), Some(v("US")))
        );
        // Out of order: the previous is still the greatest time, and it stays the greatest.
        assert_eq!(
            count(&mut w, 15_000, "DE"),
            (Applied::Counted(20_000), Some(v("FR")))
        );
        // A tie goes to the later counted.
        assert_eq!(
            count(&mut w, 20_000, "GB"),
            (Applied::Counted(20_000), Some(v("FR")))
        );
        assert_eq!(
            count(&mut w, 21_000, "IT"),
            (Applied::Counted(20_000), Some(v("GB")))
        );
        assert_eq!(
            w.read_last(&s, s.bucket_of(30_000)),
            (Applied::Counted(21_000), Some(v("IT")))
        );
        // 60 s later the window no longer holds 21 000: nothing before.
        assert_eq!(w.read_last(&s, s.bucket_of(81_000)), (Applied::Empty, None));
        assert_eq!(count(&mut w, 81_500, "ES"), (Applied::Empty, None));
        // Late for the window (bucket 20 <= head 81 - 60).
        assert_eq!(count(&mut w, 20_000, "XX"), (Applied::Late, None));
        assert_eq!(
            w.read_last(&s, s.bucket_of(82_000)),
            (Applied::Counted(81_500), Some(v("ES")))
        );
    }
}
