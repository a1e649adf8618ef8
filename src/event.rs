//! Events: one JSON object → the few values the rules read. Pure: no I/O.
//!
//! Decoding is driven by a [`Projection`], the set of field paths the compiled rules use. Only those
//! values are materialised (strings borrowed from the input where they carry no escapes); every other
//! part of the document is skipped without being built. A scanner of its own (`fast`) takes the
//! usual line in one pass; whatever it does not handle (escapes, a duplicate key, any error) goes
//! through `serde_json`, which decides and explains. This keeps decoding at a few hundred
//! nanoseconds per event instead of building a whole `serde_json::Value` tree.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::value::RawValue;

pub use crate::decimal::Decimal;

mod fast;

/// Slot of the event's `ts` field in every projection.
pub const TS_SLOT: usize = 0;
/// Slot of the event's `event_id` field in every projection.
pub const EVENT_ID_SLOT: usize = 1;

/// Why an input line is not an event. Each is dead-lettered / reported with this reason.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BadEvent {
    #[error("invalid JSON: {0}")]
    InvalidJson(String),
    #[error("not a JSON object (found {0})")]
    NotAnObject(&'static str),
    #[error("missing ts")]
    MissingTs,
    #[error("unusable ts: {0}")]
    BadTs(String),
    /// The event's time is taken from elsewhere (`--time FIELD`, a Kafka record) and is missing
    /// or unusable there.
    #[error("{0}")]
    BadTime(String),
    /// More than `max_future_skew` ahead of the wall clock: it could poison future buckets.
    #[error("ts {ts} is more than {skew_ms} ms ahead of the wall clock ({now})")]
    FutureTs { ts: i64, now: i64, skew_ms: i64 },
    /// An object names one key twice: a validator upstream that keeps the first value and one
    /// that keeps the last would judge different events.
    #[error("{0}")]
    DuplicateKey(String),
}

impl BadEvent {
    /// Low-cardinality reason code, used as a metric label and a dead-letter header.
    pub fn code(&self) -> &'static str {
        match self {
            BadEvent::InvalidJson(_) => "invalid_json",
            BadEvent::NotAnObject(_) => "not_an_object",
            BadEvent::MissingTs => "missing_ts",
            BadEvent::BadTs(_) => "bad_ts",
            BadEvent::BadTime(_) => "bad_ts",
            BadEvent::FutureTs { .. } => "future_ts",
            BadEvent::DuplicateKey(_) => "duplicate_key",
        }
    }
}

/// A JSON number: the exact decimal its text writes (compared and keyed by that value, so `1`,
/// `1.0` and `100e-2` are one number and `1.0000000000000001` another).
#[derive(Debug, Clone, PartialEq)]
pub struct Number {
    pub exact: Decimal,
    /// Written without a fraction or an exponent (`ts` must be).
    pub integer_text: bool,
}

impl Number {
    /// Parses JSON number text.
    pub fn parse(text: &str) -> Option<Number> {
        let exact = Decimal::parse(text)?;
        // Parsed already: the text is a valid number, so a fraction or exponent is one of these.
        let integer_text = !text.bytes().any(|b| matches!(b, b'.' | b'e' | b'E'));
        Some(Number {
            exact,
            integer_text,
        })
    }

    pub fn from_i64(v: i64) -> Number {
        Number {
            exact: Decimal::from_i64(v),
            integer_text: true,
        }
    }

    /// The nearest double (arithmetic is IEEE-754).
    pub fn as_f64(&self) -> f64 {
        self.exact.to_f64()
    }
}

/// What an event holds at one projected path.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum FieldValue<'a> {
    #[default]
    Missing,
    Null,
    Bool(bool),
    Number(Number),
    Str(Cow<'a, str>),
    /// An object, with its JSON text (for deep `==`): present, but not a scalar, so never a
    /// key or a match.
    Object(&'a str),
    /// An array, with its elements (for `in`) and its JSON text (for deep `==`); never a key
    /// or a match.
    Array(Vec<FieldValue<'a>>, &'a str),
}

impl FieldValue<'_> {
    pub fn kind(&self) -> &'static str {
        match self {
            FieldValue::Missing => "missing",
            FieldValue::Null => "null",
            FieldValue::Bool(_) => "boolean",
            FieldValue::Number(_) => "number",
            FieldValue::Str(_) => "string",
            FieldValue::Object(_) => "object",
            FieldValue::Array(..) => "array",
        }
    }

    /// The value as a scalar, or `None` for missing, null, object and array.
    pub fn scalar(&self) -> Option<Scalar<'_>> {
        match self {
            FieldValue::Bool(b) => Some(Scalar::Bool(*b)),
            FieldValue::Number(n) => Some(Scalar::Number(&n.exact)),
            FieldValue::Str(s) => Some(Scalar::Str(s)),
            _ => None,
        }
    }
}

/// A JSON scalar compared by type and value (`"17"` ≠ `17`, `1` = `1.0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scalar<'a> {
    Bool(bool),
    Number(&'a Decimal),
    Str(&'a str),
}

impl Scalar<'_> {
    /// Appends an unambiguous encoding: a type tag, then fixed-width bytes or a length-prefixed
    /// string, so a concatenation of encodings identifies the tuple of values exactly.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match *self {
            Scalar::Bool(b) => out.extend_from_slice(&[b'b', b as u8]),
            Scalar::Number(n) => match n.as_i128() {
                // Integers keep the encoding they always had (keys in Redis stay the same).
                Some(i) => match i64::try_from(i) {
                    Ok(small) => {
                        out.push(b'i');
                        out.extend_from_slice(&small.to_le_bytes());
                    }
                    Err(_) => {
                        out.push(b'I');
                        out.extend_from_slice(&i.to_le_bytes());
                    }
                },
                None => {
                    // Any other number by its exact decimal text (unambiguous: length-prefixed).
                    let text = n.to_string();
                    out.push(b'd');
                    push_length(out, text.len());
                    out.extend_from_slice(text.as_bytes());
                }
            },
            Scalar::Str(s) => {
                out.push(b's');
                push_length(out, s.len());
                out.extend_from_slice(s.as_bytes());
            }
        }
    }
}

/// A LEB128 length: one byte under 128 keeps keys short.
fn push_length(out: &mut Vec<u8>, len: usize) {
    let mut len = len as u64;
    while len >= 0x80 {
        out.push((len as u8) | 0x80);
        len >>= 7;
    }
    out.push(len as u8);
}

impl serde::Serialize for Scalar<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Scalar::Bool(b) => s.serialize_bool(*b),
            Scalar::Number(n) => n.serialize(s),
            Scalar::Str(v) => s.serialize_str(v),
        }
    }
}

/// A field path: a top-level name or a dotted path into nested objects (`device.id`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FieldPath {
    dotted: String,
}

impl FieldPath {
    /// Parses `a.b.c`; every segment must be non-empty.
    pub fn parse(dotted: &str) -> Option<FieldPath> {
        if dotted.is_empty() || dotted.split('.').any(str::is_empty) {
            return None;
        }
        Some(FieldPath {
            dotted: dotted.to_owned(),
        })
    }

    pub fn as_str(&self) -> &str {
        &self.dotted
    }

    pub fn segments(&self) -> impl Iterator<Item = &str> {
        self.dotted.split('.')
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.dotted)
    }
}

/// Where an event's time comes from. Whoever sets it can hide an event from every counter
/// (backdated past the lateness bound) or blind a key for a while (stamped ahead), so it must be a
/// clock the operator trusts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TimeSource {
    /// The event's `ts` field, stamped by the producing service.
    #[default]
    Ts,
    /// Another field of the event, read like `ts` (e.g. an export that kept the Kafka record time).
    Field(FieldPath),
    /// The Kafka record's timestamp (set by the producer, or by the broker with `LogAppendTime`).
    Record,
}

/// The set of paths to extract, as a trie over path segments. `ts` and `event_id` always have
/// slots [`TS_SLOT`] and [`EVENT_ID_SLOT`].
#[derive(Debug, Clone)]
pub struct Projection {
    root: Node,
    slots: usize,
    time: TimeSlot,
}

/// Where [`decode`] finds the event's time.
#[derive(Debug, Clone, PartialEq, Eq)]
enum TimeSlot {
    Field(usize),
    /// A field other than `ts`, by slot and path (to name it in errors).
    Other(usize, String),
    Record,
}

#[derive(Debug, Clone, Default)]
struct Node {
    slot: Option<usize>,
    children: Vec<(String, Node)>,
    /// Per child, its name's [`name_tag`]: an event's key is compared with a projected name only
    /// when their tags agree (every key of every event is looked up here).
    tags: Vec<u64>,
}

impl Node {
    #[inline]
    fn child(&self, name: &str) -> Option<&Node> {
        let tag = name_tag(name);
        self.tags
            .iter()
            .zip(&self.children)
            .find(|(t, (n, _))| **t == tag && n == name)
            .map(|(_, (_, c))| c)
    }
}

/// A word from a name's length and a few of its bytes, read whole (bytes stored one by one and
/// read back as a word would stall on every key): equal names have equal tags, and the names of
/// an event almost never share one.
#[inline]
fn name_tag(name: &str) -> u64 {
    let b = name.as_bytes();
    let n = b.len();
    let word = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    let half = |at: usize| {
        u64::from(u32::from_le_bytes(
            b[at..at + 4].try_into().expect("4 bytes"),
        ))
    };
    let bytes = if n >= 8 {
        word(0) ^ word(n - 8).rotate_left(29)
    } else if n >= 4 {
        half(0) | half(n - 4) << 32
    } else if n > 0 {
        u64::from(b[0]) | u64::from(b[n / 2]) << 8 | u64::from(b[n - 1]) << 16
    } else {
        0
    };
    bytes ^ (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

impl Default for Projection {
    fn default() -> Self {
        Self::new()
    }
}

impl Projection {
    pub fn new() -> Projection {
        let mut p = Projection {
            root: Node::default(),
            slots: 0,
            time: TimeSlot::Field(TS_SLOT),
        };
        let ts = p.slot(&FieldPath::parse("ts").expect("valid path"));
        let id = p.slot(&FieldPath::parse("event_id").expect("valid path"));
        debug_assert_eq!((ts, id), (TS_SLOT, EVENT_ID_SLOT));
        p
    }

    /// The slot for `path`, assigning a new one the first time a path is seen.
    pub fn slot(&mut self, path: &FieldPath) -> usize {
        let mut node = &mut self.root;
        for seg in path.segments() {
            let pos = match node.children.iter().position(|(n, _)| n == seg) {
                Some(pos) => pos,
                None => {
                    node.children.push((seg.to_owned(), Node::default()));
                    node.tags.push(name_tag(seg));
                    node.children.len() - 1
                }
            };
            node = &mut node.children[pos].1;
        }
        *node.slot.get_or_insert_with(|| {
            self.slots += 1;
            self.slots - 1
        })
    }

    pub fn slot_count(&self) -> usize {
        self.slots
    }

    /// Takes event time from `source` (the `ts` field unless told otherwise).
    pub fn set_time(&mut self, source: &TimeSource) {
        self.time = match source {
            TimeSource::Ts => TimeSlot::Field(TS_SLOT),
            TimeSource::Field(path) => TimeSlot::Other(self.slot(path), path.as_str().to_owned()),
            TimeSource::Record => TimeSlot::Record,
        };
    }

    /// Whether event time is the Kafka record's timestamp.
    pub fn time_from_record(&self) -> bool {
        matches!(self.time, TimeSlot::Record)
    }
}

/// A decoded event: its time, and the projected values by slot.
#[derive(Debug, Clone, PartialEq)]
pub struct Event<'a> {
    /// Event time, epoch milliseconds.
    pub ts: i64,
    fields: Vec<FieldValue<'a>>,
}

impl<'a> Event<'a> {
    pub fn field(&self, slot: usize) -> &FieldValue<'a> {
        &self.fields[slot]
    }

    pub fn event_id(&self) -> &FieldValue<'a> {
        &self.fields[EVENT_ID_SLOT]
    }

    /// A numeric `event_id`'s JSON text as the event wrote it.
    pub fn event_id_text(&self) -> Option<&str> {
        match self.fields.last() {
            Some(FieldValue::Str(text)) if matches!(self.event_id(), FieldValue::Number(_)) => {
                Some(text)
            }
            _ => None,
        }
    }

    /// The time its `ts` field states, if usable (whatever the event's time was taken from).
    pub fn stamped_ts(&self) -> Option<i64> {
        event_time(&self.fields[TS_SLOT]).ok()
    }
}

/// Decodes one JSON document into an [`Event`] holding the projected values, its time from the
/// projection's time field.
pub fn decode<'a>(input: &'a [u8], projection: &Projection) -> Result<Event<'a>, BadEvent> {
    decode_at(input, projection, None)
}

/// [`decode`] of a Kafka record whose timestamp is `record_time` (epoch ms): the event's time when
/// the projection takes time from the record (an event without one is `missing_ts`).
pub fn decode_at<'a>(
    input: &'a [u8],
    projection: &Projection,
    record_time: Option<i64>,
) -> Result<Event<'a>, BadEvent> {
    decode_line(input, projection, record_time, true)
}

/// [`decode`] through `serde_json` alone, without the scanner that takes the usual line first:
/// for the benchmark that shows what the scanner saves and the test that holds the two equal.
#[doc(hidden)]
pub fn decode_by_parser<'a>(
    input: &'a [u8],
    projection: &Projection,
) -> Result<Event<'a>, BadEvent> {
    decode_line(input, projection, None, false)
}

fn decode_line<'a>(
    input: &'a [u8],
    projection: &Projection,
    record_time: Option<i64>,
    scan_first: bool,
) -> Result<Event<'a>, BadEvent> {
    // JSON text is UTF-8 (RFC 8259). The parser checks only the strings it materialises, so
    // check the whole line once.
    let text = std::str::from_utf8(input).map_err(|e| {
        BadEvent::InvalidJson(format!("not valid UTF-8 at byte {}", e.valid_up_to()))
    })?;
    // One slot past the projection's: the text of a numeric `event_id` (see `ValueSeed`).
    let mut fields = Vec::with_capacity(projection.slot_count() + 1);
    fields.resize_with(projection.slot_count() + 1, || FieldValue::Missing);
    if !(scan_first && fast::decode(text, &projection.root, &mut fields)) {
        fields.fill(FieldValue::Missing);
        decode_with_parser(text, projection, &mut fields)?;
    }
    let ts = match &projection.time {
        TimeSlot::Field(slot) => event_time(&fields[*slot])?,
        TimeSlot::Other(slot, path) => event_time(&fields[*slot]).map_err(|e| match e {
            BadEvent::MissingTs => BadEvent::BadTime(format!("missing {path} (the event's time)")),
            BadEvent::BadTs(why) => {
                BadEvent::BadTime(format!("unusable {path} (the event's time): {why}"))
            }
            other => other,
        })?,
        TimeSlot::Record => record_time_ms(record_time)?,
    };
    Ok(Event { ts, fields })
}

/// The projected values of `text` through `serde_json`: what decides every line the scanner in
/// [`fast`] gives up on, with the parser's own explanation when the line is refused.
fn decode_with_parser<'a>(
    text: &'a str,
    projection: &Projection,
    fields: &mut [FieldValue<'a>],
) -> Result<(), BadEvent> {
    let mut de = serde_json::Deserializer::from_str(text);
    let top = de
        .deserialize_any(TopVisitor {
            node: &projection.root,
            out: fields,
        })
        .map_err(bad_json)?;
    de.end().map_err(bad_json)?;
    match top {
        Some(kind) => Err(BadEvent::NotAnObject(kind)),
        None => Ok(()),
    }
}

/// What the parser refused: a duplicate key (raised by the visitors below), or invalid JSON.
fn bad_json(e: serde_json::Error) -> BadEvent {
    let message = e.to_string();
    if message.starts_with(DUPLICATE_KEY) {
        BadEvent::DuplicateKey(message)
    } else {
        BadEvent::InvalidJson(message)
    }
}

/// How the visitors' duplicate-key error starts (it reaches `decode` as the parser's error).
const DUPLICATE_KEY: &str = "duplicate key ";

fn duplicate_key<E: de::Error>(key: &str) -> E {
    E::custom(format!("{DUPLICATE_KEY}{}", quote_prefix(key)))
}

/// The keys of one object seen so far: scanned while few, hashed past that (an object of a
/// hundred thousand keys costs no more than linear time).
struct SeenKeys<K> {
    /// Inline: most events' objects have a few keys, and an allocation per object would cost
    /// more than the check.
    few: smallvec::SmallVec<[K; 16]>,
    /// A bit per key of `few`, from its length and end bytes: a key whose bit is clear is new
    /// without a single comparison (the usual case).
    sketch: u64,
    many: Option<hashbrown::HashSet<K, foldhash::fast::RandomState>>,
}

impl<K> Default for SeenKeys<K> {
    fn default() -> Self {
        SeenKeys {
            few: smallvec::SmallVec::new(),
            sketch: 0,
            many: None,
        }
    }
}

impl<K: AsRef<str> + Eq + std::hash::Hash> SeenKeys<K> {
    const FEW: usize = 16;

    /// Records `key`; false if the object named it already. Inlined into the object visitor (it
    /// runs for every key of every event); objects of many keys take the cold path.
    #[inline]
    fn insert(&mut self, key: K) -> bool {
        if let Some(many) = &mut self.many {
            return many.insert(key);
        }
        let bytes = key.as_ref().as_bytes();
        let mix = bytes.len() as u32 * 7
            + u32::from(bytes.first().copied().unwrap_or(0)) * 3
            + u32::from(bytes.last().copied().unwrap_or(0));
        let bit = 1u64 << (mix % 64);
        if self.sketch & bit != 0 && self.few.contains(&key) {
            return false;
        }
        self.sketch |= bit;
        if self.few.len() < Self::FEW {
            self.few.push(key);
        } else {
            self.spill(key);
        }
        true
    }

    /// An object of more keys than fit inline: from now on, a hash set.
    #[cold]
    #[inline(never)]
    fn spill(&mut self, key: K) {
        let mut many: hashbrown::HashSet<_, _> = self.few.drain(..).collect();
        many.insert(key);
        self.many = Some(many);
    }
}

/// The first key some object of `text` (a JSON value the parser validated) names twice, found
/// without recursion: a value nested a hundred thousand deep costs no stack.
fn duplicate_key_in(text: &str) -> Option<Cow<'_, str>> {
    if !matches!(text.as_bytes().first(), Some(b'{' | b'[')) {
        return None;
    }
    // Per open object its keys so far (the first inline, a set from the second on: a frame of a
    // deeply nested chain stays a few words) and whether a key comes next; `None` for an array.
    struct Frame<'a> {
        key_next: bool,
        first: Option<Cow<'a, str>>,
        rest: Option<Box<SeenKeys<Cow<'a, str>>>>,
    }
    impl<'a> Frame<'a> {
        fn insert(&mut self, key: Cow<'a, str>) -> bool {
            match &self.first {
                None => {
                    self.first = Some(key);
                    true
                }
                Some(first) if *first == key => false,
                Some(_) => self.rest.get_or_insert_with(Default::default).insert(key),
            }
        }
    }
    let mut open: Vec<Option<Frame<'_>>> = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'{' => open.push(Some(Frame {
                key_next: true,
                first: None,
                rest: None,
            })),
            b'[' => open.push(None),
            b'}' | b']' => {
                open.pop();
            }
            b',' => {
                if let Some(Some(frame)) = open.last_mut() {
                    frame.key_next = true;
                }
            }
            b'"' => {
                let start = i + 1;
                let mut escaped = false;
                i = start;
                while bytes[i] != b'"' {
                    if bytes[i] == b'\\' {
                        escaped = true;
                        i += 1;
                    }
                    i += 1;
                }
                if let Some(Some(frame)) = open
                    .last_mut()
                    .filter(|f| f.as_ref().is_some_and(|f| f.key_next))
                {
                    frame.key_next = false;
                    let key = match escaped {
                        false => Cow::Borrowed(&text[start..i]),
                        // Validated already: only the escapes are read here.
                        true => Cow::Owned(
                            serde_json::from_str::<String>(&text[start - 1..=i])
                                .unwrap_or_default(),
                        ),
                    };
                    if !frame.insert(key.clone()) {
                        return Some(key);
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Checks a value the parser took whole (`&RawValue`) for a key named twice in its objects.
fn check_keys<E: de::Error>(raw: &RawValue) -> Result<(), E> {
    match duplicate_key_in(raw.get()) {
        Some(key) => Err(duplicate_key(&key)),
        None => Ok(()),
    }
}

/// The latest usable event time: the last millisecond of year 9999.
pub const MAX_TS_MS: i64 = 253_402_300_799_999;

/// Longest prefix of an input value quoted in a diagnostic: a hostile event cannot make the error
/// text (a log line, a dead-letter header) as large as itself.
const QUOTED_PREFIX: usize = 64;

/// `s` for a message: whole if short, else its first characters and how long it was.
pub fn quote_prefix(s: &str) -> String {
    match s.char_indices().nth(QUOTED_PREFIX) {
        None => format!("{s:?}"),
        Some((cut, _)) => format!("{:?}… ({} bytes)", &s[..cut], s.len()),
    }
}

/// `s` for a message, unquoted: whole if short, else its first characters and how long it was.
pub fn shorten(s: &str) -> std::borrow::Cow<'_, str> {
    match s.char_indices().nth(QUOTED_PREFIX) {
        None => std::borrow::Cow::Borrowed(s),
        Some((cut, _)) => std::borrow::Cow::Owned(format!("{}… ({} bytes)", &s[..cut], s.len())),
    }
}

/// A Kafka record's timestamp as event time, in the same range as `ts`.
fn record_time_ms(record_time: Option<i64>) -> Result<i64, BadEvent> {
    match record_time {
        None => Err(BadEvent::BadTime(
            "the Kafka record has no timestamp (input.time = \"kafka\")".into(),
        )),
        Some(ms) if (0..=MAX_TS_MS).contains(&ms) => Ok(ms),
        Some(ms) => Err(BadEvent::BadTime(format!(
            "the record timestamp {ms} is outside 0..={MAX_TS_MS} (1970 to the end of 9999)"
        ))),
    }
}

/// `ts` as a JSON integer of epoch milliseconds in `0..=MAX_TS_MS`, or an RFC 3339 string in that
/// range (fractions finer than a millisecond are truncated).
pub fn event_time(value: &FieldValue<'_>) -> Result<i64, BadEvent> {
    let out_of_range = |what: String| {
        BadEvent::BadTs(format!(
            "{what} is outside 0..={MAX_TS_MS} (1970 to the end of 9999)"
        ))
    };
    match value {
        FieldValue::Missing => Err(BadEvent::MissingTs),
        FieldValue::Number(n) if !n.integer_text => Err(BadEvent::BadTs(format!(
            "{} is not an integer number of milliseconds",
            shorten(&n.exact.to_string())
        ))),
        FieldValue::Number(n) => match n.exact.as_i64() {
            Some(ms) if (0..=MAX_TS_MS).contains(&ms) => Ok(ms),
            _ => Err(out_of_range(shorten(&n.exact.to_string()).into_owned())),
        },
        FieldValue::Str(s) => {
            let parsed = chrono::DateTime::parse_from_rfc3339(s).map_err(|e| {
                BadEvent::BadTs(format!("{} is not RFC 3339 ({e})", quote_prefix(s)))
            })?;
            // chrono reads second 60 as a leap second, on any day and at any minute, and its
            // milliseconds are those of the next second: one instant, two texts. Refused.
            if chrono::Timelike::nanosecond(&parsed) >= 1_000_000_000 {
                return Err(BadEvent::BadTs(format!(
                    "{} is a leap second (second 60), which is not a usable time",
                    quote_prefix(s)
                )));
            }
            let ms = parsed.timestamp_millis();
            if (0..=MAX_TS_MS).contains(&ms) {
                Ok(ms)
            } else {
                Err(out_of_range(quote_prefix(s)))
            }
        }
        other => Err(BadEvent::BadTs(format!(
            "expected an integer or an RFC 3339 string, found {}",
            other.kind()
        ))),
    }
}

/// Bounds on event time relative to the wall clock and to the newest event of an input (the
/// `[input]` section of the worker's config). `None` disables a bound (`off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeBounds {
    /// An event more than this far ahead of the wall clock is a bad event (`future_ts`).
    pub max_future_skew_ms: Option<i64>,
    /// An event older than its input's newest accepted event minus this is late for every counter.
    pub max_lateness_ms: Option<i64>,
}

impl Default for TimeBounds {
    fn default() -> Self {
        TimeBounds {
            max_future_skew_ms: Some(5 * 60_000),
            max_lateness_ms: Some(3_600_000),
        }
    }
}

impl TimeBounds {
    /// No bound at all.
    pub const OFF: TimeBounds = TimeBounds {
        max_future_skew_ms: None,
        max_lateness_ms: None,
    };

    /// Refuses an event too far ahead of `now_ms` (wall clock, epoch ms).
    pub fn check_future(&self, ts: i64, now_ms: i64) -> Result<(), BadEvent> {
        match self.max_future_skew_ms {
            Some(skew_ms) if ts > now_ms.saturating_add(skew_ms) => Err(BadEvent::FutureTs {
                ts,
                now: now_ms,
                skew_ms,
            }),
            _ => Ok(()),
        }
    }

    /// The watermark of an input whose newest accepted event time is `newest`: events before it
    /// are late for every counter. `None` without a lateness bound.
    pub fn watermark(&self, newest: i64) -> Option<i64> {
        self.max_lateness_ms
            .map(|lateness| newest.saturating_sub(lateness))
    }
}

/// Visits the top-level document. `Ok(Some(kind))` means valid JSON that is not an object.
struct TopVisitor<'p, 'o, 'a> {
    node: &'p Node,
    out: &'o mut [FieldValue<'a>],
}

macro_rules! not_an_object {
    ($($method:ident($($arg:ty)?) => $kind:literal;)*) => {
        $(fn $method<E: de::Error>(self $(, _: $arg)?) -> Result<Self::Value, E> { Ok(Some($kind)) })*
    };
}

impl<'de: 'a, 'a> Visitor<'de> for TopVisitor<'_, '_, 'a> {
    type Value = Option<&'static str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    not_an_object! {
        visit_bool(bool) => "boolean";
        visit_i64(i64) => "number";
        visit_u64(u64) => "number";
        visit_f64(f64) => "number";
        visit_str(&str) => "string";
        visit_unit() => "null";
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Some("array"))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        visit_object(self.node, self.out, map)?;
        Ok(None)
    }
}

fn visit_object<'de: 'a, 'a, A: MapAccess<'de>>(
    node: &Node,
    out: &mut [FieldValue<'a>],
    mut map: A,
) -> Result<(), A::Error> {
    let mut seen = SeenKeys::default();
    while let Some(key) = map.next_key::<KeyStr<'de>>()? {
        match node.child(key.as_str()) {
            Some(child) => map.next_value_seed(ValueSeed {
                node: child,
                out: &mut *out,
            })?,
            None => check_keys(map.next_value::<&'de RawValue>()?)?,
        }
        let key = key.into_cow();
        if !seen.insert(key.clone()) {
            return Err(duplicate_key(&key));
        }
    }
    Ok(())
}

/// An object key, borrowed from the input unless it had escapes.
enum KeyStr<'de> {
    Borrowed(&'de str),
    Owned(String),
}

impl<'de> KeyStr<'de> {
    fn as_str(&self) -> &str {
        match self {
            KeyStr::Borrowed(s) => s,
            KeyStr::Owned(s) => s,
        }
    }

    fn into_cow(self) -> Cow<'de, str> {
        match self {
            KeyStr::Borrowed(s) => Cow::Borrowed(s),
            KeyStr::Owned(s) => Cow::Owned(s),
        }
    }
}

impl<'de> de::Deserialize<'de> for KeyStr<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeyStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(KeyStr::Borrowed(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(KeyStr::Owned(v.to_owned()))
            }
        }
        d.deserialize_str(V)
    }
}

/// The value under a projected name: recorded if the node has a slot, descended into if nested
/// paths continue below it.
struct ValueSeed<'p, 'o, 'a> {
    node: &'p Node,
    out: &'o mut [FieldValue<'a>],
}

impl<'de: 'a, 'a> DeserializeSeed<'de> for ValueSeed<'_, '_, 'a> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        let ValueSeed { node, out } = self;
        if node.children.is_empty() || node.slot.is_some() {
            // A leaf: the value's own text, so numbers keep the exact decimal they write (the
            // parser's f64 would lose it).
            let raw = <&'de RawValue>::deserialize(d)?;
            let text = raw.get();
            if !node.children.is_empty() && text.starts_with('{') {
                // Both projected and a parent (`device` and `device.id`): descend into the
                // object's text (rare, so reading it twice costs nothing that matters).
                let mut inner = serde_json::Deserializer::from_str(text);
                de::Deserializer::deserialize_any(
                    &mut inner,
                    Inner {
                        node,
                        out: &mut *out,
                    },
                )
                .map_err(de::Error::custom)?;
                if let Some(slot) = node.slot {
                    out[slot] = FieldValue::Object(text);
                }
                return Ok(());
            }
            check_keys(raw)?;
            if let Some(slot) = node.slot {
                out[slot] = interpret(text).map_err(de::Error::custom)?;
                if slot == EVENT_ID_SLOT && matches!(out[slot], FieldValue::Number(_)) {
                    // Records echo a numeric id as written (`1.50`, `1E3`): its text goes in
                    // the slot after the projection's, so numbers elsewhere stay 24 bytes.
                    let last = out.len() - 1;
                    out[last] = FieldValue::Str(Cow::Borrowed(text));
                }
            }
            Ok(())
        } else {
            d.deserialize_any(Inner { node, out })
        }
    }
}

/// A value under a path that continues below it (`device` when `device.id` is projected):
/// descended into if it is an object; recorded as it is if the path itself is projected too.
struct Inner<'p, 'o, 'a> {
    node: &'p Node,
    out: &'o mut [FieldValue<'a>],
}

impl<'a> Inner<'_, '_, 'a> {
    fn set(self, value: FieldValue<'a>) {
        if let Some(slot) = self.node.slot {
            self.out[slot] = value;
        }
    }
}

impl<'de: 'a, 'a> Visitor<'de> for Inner<'_, '_, 'a> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.set(FieldValue::Bool(v));
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.set(FieldValue::Number(Number::from_i64(v)));
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.set(FieldValue::Number(Number {
            exact: Decimal::small_int(v),
            integer_text: true,
        }));
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        // Only under a path that is not itself projected (see `ValueSeed`): never recorded.
        if let Some(exact) = Decimal::from_f64(v) {
            self.set(FieldValue::Number(Number {
                exact,
                integer_text: false,
            }));
        }
        Ok(())
    }
    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<(), E> {
        self.set(FieldValue::Str(Cow::Borrowed(v)));
        Ok(())
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.set(FieldValue::Str(Cow::Owned(v.to_owned())));
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.set(FieldValue::Null);
        Ok(())
    }
    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(element) = seq.next_element::<&'de RawValue>()? {
            check_keys(element)?;
        }
        // Only under a path that is not itself projected (see `ValueSeed`): never recorded.
        self.set(FieldValue::Array(Vec::new(), "[]"));
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        let Inner { node, out } = self;
        visit_object(node, out, map)
    }
}

/// An array's element: a nested array is kept without its elements (only scalars can equal
/// what `in` looks for), so no depth of nesting recurses here.
fn interpret_element(text: &str) -> Result<FieldValue<'_>, serde_json::Error> {
    match text.as_bytes().first() {
        Some(b'[') => Ok(FieldValue::Array(Vec::new(), text)),
        _ => interpret(text),
    }
}

/// A JSON value's text (already validated by the parser) as a [`FieldValue`].
fn interpret(text: &str) -> Result<FieldValue<'_>, serde_json::Error> {
    Ok(match text.as_bytes().first() {
        Some(b'"') => {
            let inner = &text[1..text.len() - 1];
            if inner.contains('\\') {
                FieldValue::Str(Cow::Owned(serde_json::from_str::<String>(text)?))
            } else {
                FieldValue::Str(Cow::Borrowed(inner))
            }
        }
        Some(b't') => FieldValue::Bool(true),
        Some(b'f') => FieldValue::Bool(false),
        Some(b'n') => FieldValue::Null,
        Some(b'{') => FieldValue::Object(text),
        Some(b'[') => {
            let elements: Vec<&RawValue> = serde_json::from_str(text)?;
            FieldValue::Array(
                elements
                    .into_iter()
                    .map(|e| interpret_element(e.get()))
                    .collect::<Result<_, _>>()?,
                text,
            )
        }
        _ => match Number::parse(text) {
            Some(n) => FieldValue::Number(n),
            None => {
                return Err(de::Error::custom(format!(
                    "bad number {}",
                    quote_prefix(text)
                )))
            }
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn projection(paths: &[&str]) -> (Projection, Vec<usize>) {
        let mut p = Projection::new();
        let slots = paths
            .iter()
            .map(|s| p.slot(&FieldPath::parse(s).unwrap()))
            .collect();
        (p, slots)
    }

    #[test]
    fn event_time_comes_from_ts_another_field_or_the_record() {
        let line = br#"{"ts":1700000000000,"meta":{"received":"2023-11-14T22:13:21Z"}}"#;
        let mut p = Projection::new();
        let at = |p: &Projection, record: Option<i64>, line: &[u8]| {
            decode_at(line, p, record).map(|e| (e.ts, e.stamped_ts()))
        };
        assert_eq!(
            at(&p, Some(5), line),
            Ok((1_700_000_000_000, Some(1_700_000_000_000)))
        );

        p.set_time(&TimeSource::Field(
            FieldPath::parse("meta.received").unwrap(),
        ));
        assert_eq!(
            at(&p, None, line),
            Ok((1_700_000_001_000, Some(1_700_000_000_000)))
        );
        assert_eq!(
            at(&p, None, br#"{"ts":1}"#).unwrap_err(),
            BadEvent::BadTime("missing meta.received (the event's time)".into())
        );
        let bad = at(&p, None, br#"{"meta":{"received":"soon"}}"#).unwrap_err();
        assert_eq!(bad.code(), "bad_ts");
        assert!(
            bad.to_string()
                .starts_with("unusable meta.received (the event's time): "),
            "{bad}"
        );

        // From the record: `ts` may be absent, ahead or behind; only the record counts.
        p.set_time(&TimeSource::Record);
        assert!(p.time_from_record());
        assert_eq!(at(&p, Some(42), line), Ok((42, Some(1_700_000_000_000))));
        assert_eq!(at(&p, Some(42), br#"{"ts":"later"}"#), Ok((42, None)));
        assert_eq!(at(&p, Some(42), b"{}"), Ok((42, None)));
        let none = at(&p, None, b"{}").unwrap_err();
        assert_eq!(
            (none.code(), none.to_string().as_str()),
            (
                "bad_ts",
                "the Kafka record has no timestamp (input.time = \"kafka\")"
            )
        );
        assert_eq!(at(&p, Some(-1), b"{}").unwrap_err().code(), "bad_ts");

        p.set_time(&TimeSource::Ts);
        assert_eq!(at(&p, Some(42), b"{}").unwrap_err(), BadEvent::MissingTs);
    }

    #[test]
    fn extracts_top_level_and_nested_paths() {
        let (p, s) = projection(&["user_id", "device.id", "device.os.name", "amount"]);
        let line = br#"{"ts":1700000000000,"user_id":"u-1","device":{"id":7,"os":{"name":"ios"}},"amount":12.5,"x":[1,{"a":2}]}"#;
        let e = decode(line, &p).unwrap();
        assert_eq!(e.ts, 1_700_000_000_000);
        assert_eq!(e.field(s[0]), &FieldValue::Str("u-1".into()));
        assert_eq!(e.field(s[1]), &FieldValue::Number(Number::from_i64(7)));
        assert_eq!(e.field(s[2]), &FieldValue::Str("ios".into()));
        assert_eq!(
            e.field(s[3]),
            &FieldValue::Number(Number::parse("12.5").unwrap())
        );
        assert_eq!(e.event_id(), &FieldValue::Missing);
    }

    #[test]
    fn distinguishes_missing_null_object_array() {
        let (p, s) = projection(&["a", "b", "c", "d", "e.f"]);
        let e = decode(br#"{"ts":1,"b":null,"c":{"x":1},"d":[1],"e":"flat"}"#, &p).unwrap();
        let kinds: Vec<_> = s.iter().map(|&i| e.field(i).kind()).collect();
        assert_eq!(kinds, ["missing", "null", "object", "array", "missing"]);
    }

    #[test]
    fn unescapes_strings_and_keys() {
        let (p, s) = projection(&["name"]);
        let e = decode(br#"{"ts":1,"n\u0061me":"a\"b\u00e9"}"#, &p).unwrap();
        assert_eq!(e.field(s[0]), &FieldValue::Str("a\"b\u{e9}".into()));
    }

    /// A key named twice in any object of the event — projected or not, nested, in an array,
    /// spelled with escapes — makes it a bad event: whoever keeps the first value and whoever
    /// keeps the last would judge different events.
    /// (The column is where the parser stood when it saw the second key's value, or the end of
    /// the value holding the object.)
    #[test]
    fn a_key_named_twice_in_any_object_makes_a_bad_event() {
        let (p, _) = projection(&["a", "device.id", "tags"]);
        for (line, message) in [
            (
                r#"{"ts":1,"a":1,"a":0.5}"#,
                r#"duplicate key "a" at line 1 column 22"#,
            ),
            (
                r#"{"ts":1,"a":1,"\u0061":2}"#,
                r#"duplicate key "a" at line 1 column 25"#,
            ),
            (
                r#"{"ts":1,"ts":2}"#,
                r#"duplicate key "ts" at line 1 column 15"#,
            ),
            (
                r#"{"ts":1,"other":3,"other":3}"#,
                r#"duplicate key "other" at line 1 column 28"#,
            ),
            (
                r#"{"ts":1,"device":{"id":"d","id":"e"}}"#,
                r#"duplicate key "id" at line 1 column 36"#,
            ),
            (
                r#"{"ts":1,"x":{"y":[{"z":1,"z":2}]}}"#,
                r#"duplicate key "z" at line 1 column 34"#,
            ),
            (
                r#"{"ts":1,"tags":[{"k":1,"k":1}]}"#,
                r#"duplicate key "k" at line 1 column 31"#,
            ),
        ] {
            match decode(line.as_bytes(), &p) {
                Err(e @ BadEvent::DuplicateKey(_)) => {
                    assert_eq!(e.code(), "duplicate_key");
                    assert_eq!(e.to_string(), message, "{line}");
                }
                other => panic!("{line}: {other:?}"),
            }
        }
        // The same key in different objects, and many distinct keys, are fine.
        assert!(decode(br#"{"ts":1,"a":{"a":{"a":1}},"b":[{"a":1},{"a":2}]}"#, &p).is_ok());
        let wide: String = (0..10_000).map(|i| format!(",\"k{i}\":{i}")).collect();
        assert!(decode(format!("{{\"ts\":1{wide}}}").as_bytes(), &p).is_ok());
        let twice = format!("{{\"ts\":1{wide},\"k9999\":0}}");
        assert!(matches!(
            decode(twice.as_bytes(), &p),
            Err(BadEvent::DuplicateKey(_))
        ));
    }

    #[test]
    fn ts_forms() {
        let p = Projection::new();
        assert_eq!(
            decode(br#"{"ts":"2023-11-14T22:13:20Z"}"#, &p).unwrap().ts,
            1_700_000_000_000
        );
        assert_eq!(
            decode(br#"{"ts":"2023-11-15T00:13:20.123+02:00"}"#, &p)
                .unwrap()
                .ts,
            1_700_000_000_123
        );
        assert_eq!(decode(br#"{"ts":0}"#, &p).unwrap().ts, 0);
        let err = |line: &[u8]| decode(line, &p).unwrap_err().code();
        assert_eq!(err(br#"{"a":1}"#), "missing_ts");
        assert_eq!(err(br#"{"ts":-5}"#), "bad_ts");
        assert_eq!(err(br#"{"ts":1.5}"#), "bad_ts");
        assert_eq!(err(br#"{"ts":"yesterday"}"#), "bad_ts");
        assert_eq!(err(br#"{"ts":null}"#), "bad_ts");
        assert_eq!(err(br#"{"ts":"1969-12-31T23:59:59Z"}"#), "bad_ts");
        // Second 60 is a leap second, on a leap-second day or not: never a usable time.
        for leap in [
            "2016-12-31T23:59:60Z",
            "2023-06-01T23:59:60Z",
            "2023-06-01T12:30:60.5+02:00",
        ] {
            let line = format!(r#"{{"ts":"{leap}"}}"#);
            match decode(line.as_bytes(), &p) {
                Err(BadEvent::BadTs(why)) => assert!(why.contains("leap second"), "{why}"),
                other => panic!("{leap}: {other:?}"),
            }
        }
        assert!(decode(br#"{"ts":"2016-12-31T23:59:59.999Z"}"#, &p).is_ok());
        // The range ends with year 9999; sub-millisecond fractions are truncated.
        assert_eq!(
            decode(br#"{"ts":253402300799999}"#, &p).unwrap().ts,
            MAX_TS_MS
        );
        assert_eq!(
            decode(br#"{"ts":"9999-12-31T23:59:59.9999999Z"}"#, &p)
                .unwrap()
                .ts,
            MAX_TS_MS
        );
        assert_eq!(
            decode(br#"{"ts":"2023-06-01T00:00:00.0019Z"}"#, &p)
                .unwrap()
                .ts,
            1_685_577_600_001
        );
        assert_eq!(err(br#"{"ts":253402300800000}"#), "bad_ts");
        assert_eq!(err(br#"{"ts":9223372036854775807}"#), "bad_ts");
        assert_eq!(err(br#"{"ts":18446744073709551615}"#), "bad_ts");
        assert_eq!(err(br#"{"ts":"1685577601000"}"#), "bad_ts");
    }

    /// Found by feeding hostile lines: a projected field holding 100 000 nested arrays overflowed
    /// the stack (each element was interpreted recursively). Nesting of any depth, projected or
    /// not, now decodes or fails with a reason, never deeper than the projection.
    #[test]
    fn deep_nesting_never_overflows_the_stack() {
        let (p, s) = projection(&["tags", "device.id"]);
        let deep =
            |open: &str, close: &str| format!("{}{}", open.repeat(100_000), close.repeat(100_000));
        let arrays = deep("[", "]");
        let line = format!(r#"{{"ts":1,"tags":[1,{arrays},"a"],"device":{arrays}}}"#);
        let e = decode(line.as_bytes(), &p).unwrap();
        let FieldValue::Array(items, _) = e.field(s[0]) else {
            panic!("tags is an array")
        };
        assert_eq!(items.len(), 3);
        assert_eq!(items[1], FieldValue::Array(Vec::new(), &arrays));
        assert_eq!(items[2], FieldValue::Str("a".into()));
        for line in [
            format!(r#"{{"ts":{arrays}}}"#),
            format!(r#"{{"ts":1,"other":{arrays}}}"#),
            format!(r#"{{"ts":1,"other":{}}}"#, deep(r#"{"a":"#, "}")),
            format!(r#"{{"ts":1,"device":{}}}"#, deep(r#"{"device":"#, "}")),
            format!(r#"{{"ts":1,"tags":{}}}"#, deep(r#"[{"a":"#, "}]")),
            arrays.clone(),
        ] {
            // Decoded or refused; either way the stack holds.
            let _ = decode(line.as_bytes(), &p);
        }
    }

    #[test]
    fn a_long_ts_string_is_quoted_by_a_bounded_prefix() {
        let p = Projection::new();
        let line = format!(r#"{{"ts":"{}"}}"#, "9".repeat(1 << 20));
        let message = decode(line.as_bytes(), &p).unwrap_err().to_string();
        assert!(message.len() < 300, "{} bytes", message.len());
        assert!(message.contains("(1048576 bytes)"), "{message}");
    }

    #[test]
    fn time_bounds_refuse_the_future_and_place_the_watermark() {
        let bounds = TimeBounds::default();
        let now = 1_700_000_000_000;
        assert_eq!(bounds.check_future(now + 300_000, now), Ok(()));
        assert_eq!(
            bounds.check_future(now + 300_001, now).unwrap_err().code(),
            "future_ts"
        );
        assert_eq!(TimeBounds::OFF.check_future(MAX_TS_MS, now), Ok(()));
        assert_eq!(bounds.watermark(now), Some(now - 3_600_000));
        assert_eq!(TimeBounds::OFF.watermark(now), None);
    }

    #[test]
    fn rejects_non_objects_and_invalid_json() {
        let p = Projection::new();
        assert_eq!(
            decode(b"[1,2]", &p).unwrap_err(),
            BadEvent::NotAnObject("array")
        );
        assert_eq!(
            decode(b"\"x\"", &p).unwrap_err(),
            BadEvent::NotAnObject("string")
        );
        assert_eq!(decode(b"{\"ts\":1", &p).unwrap_err().code(), "invalid_json");
        assert_eq!(
            decode(b"{\"ts\":1} x", &p).unwrap_err().code(),
            "invalid_json"
        );
        assert_eq!(
            decode(b"{\"ts\":1,\"s\":\"\xff\"}", &p).unwrap_err().code(),
            "invalid_json"
        );
    }

    #[test]
    fn numbers_are_keyed_by_exact_decimal_value() {
        let n = |t: &str| Number::parse(t).unwrap().exact;
        assert_eq!(n("1"), n("1.0"));
        assert_eq!(n("-0.0"), n("0"));
        assert_ne!(n("1.5"), n("1"));
        assert_ne!(n("1.0000000000000001"), n("1"));
        let enc = |s: Scalar| {
            let mut v = Vec::new();
            s.encode_into(&mut v);
            v
        };
        let num = |t: &str| enc(Scalar::Number(&Number::parse(t).unwrap().exact));
        assert_ne!(enc(Scalar::Str("17")), num("17"));
        assert_eq!(num("17.0"), enc(Scalar::Number(&Decimal::from_i64(17))));
        assert_ne!(num("1.0000000000000001"), num("1"));
        // Every digit counts, at any length: 64-bit ids, 128-bit ids, and longer.
        assert_ne!(num("18446744073709551611"), num("18446744073709551612"));
        let long = "1".repeat(300);
        assert_ne!(num(&format!("{long}1")), num(&format!("{long}2")));
        assert_eq!(num(&format!("{long}1")), num(&format!("{long}1.000")));
        // A long number's text can be as long as a tag and a length byte: still distinct.
        assert_ne!(num(&format!("{long}1")), num(&format!("{long}1e1")));
        // Length prefixes keep ("ab","c") and ("a","bc") apart.
        let mut ab_c = enc(Scalar::Str("ab"));
        ab_c.extend(enc(Scalar::Str("c")));
        let mut a_bc = enc(Scalar::Str("a"));
        a_bc.extend(enc(Scalar::Str("bc")));
        assert_ne!(ab_c, a_bc);
    }

    /// The scanner that takes the usual line first decides exactly what the parser decides, on
    /// every line: the same fields when both accept, the same refusal (the parser's) otherwise.
    mod scanner_and_parser_agree {
        use super::*;
        use proptest::prelude::*;

        fn projection() -> Projection {
            let mut p = Projection::new();
            for path in [
                "user_id",
                "amount",
                "device.id",
                "geo",
                "geo.country",
                "tags",
                "a.b.c",
                "a.long_projected_name",
                "obj",
            ] {
                p.slot(&FieldPath::parse(path).unwrap());
            }
            p
        }

        fn scalar() -> impl Strategy<Value = String> {
            prop_oneof![
                1 => prop::sample::select(vec![
                    "0",
                    "-0",
                    "1",
                    "-12.50",
                    "1e3",
                    "1E+3",
                    "2.5e-3",
                    "01",
                    "1.",
                    ".5",
                    "-",
                    "1e",
                    "+1",
                    "1e999999999",
                    "123456789012345678901234567890.123",
                    "1700000000000",
                    "true",
                    "false",
                    "null",
                    "tru",
                    "nul",
                    "\"\"",
                    "\"u-1\"",
                    "\"a\\\"b\"",
                    "\"\\u00e9\"",
                    "\"\\ud800\"",
                    "\"\u{e9}t\u{e9}\"",
                    "\"tab\there\"",
                    "\"2023-06-01T00:00:00Z\"",
                    "\"x\\q\"",
                ])
                .prop_map(str::to_owned),
                // Mostly plain values, so that larger structures are often valid as a whole.
                3 => "[a-z0-9-]{0,8}".prop_map(|s| format!("\"{s}\"")),
                // Longer strings (the scanner looks at eight bytes at a time), with what ends a
                // string or sends it to the parser anywhere in them: escapes (the parser's), a
                // raw control character or quote (refused), a multi-byte character.
                1 => prop::collection::vec(
                    prop::sample::select(vec![
                        "a", "b", "c", "0", "9", "-", ".", " ", "\u{e9}", "\u{2603}", "\\\"",
                        "\\\\", "\\n", "\t", "\u{1}", "\"",
                    ]),
                    0..20,
                )
                .prop_map(|pieces| format!("\"{}\"", pieces.concat())),
                3 => (0u64..2_000_000_000_000).prop_map(|n| n.to_string()),
            ]
        }

        fn key() -> impl Strategy<Value = String> {
            prop::sample::select(vec![
                "ts",
                "event_id",
                "user_id",
                "amount",
                "device",
                "id",
                "geo",
                "country",
                "tags",
                "obj",
                "x",
                "",
                "us\\u0065r_id",
                "a",
                "b",
                "c",
                "long_projected_name",
                "long_projected_namf",
                "t\\s",
            ])
            .prop_map(|k| format!("\"{k}\""))
        }

        fn value() -> impl Strategy<Value = String> {
            // Whitespace inside nested values too; now and then an object of more keys than
            // the duplicate check keeps inline.
            let ws = || prop::sample::select(vec!["", "", " ", "\r\n "]);
            scalar().prop_recursive(4, 64, 20, move |inner| {
                prop_oneof![
                    4 => prop::collection::vec((inner.clone(), ws()), 0..4).prop_map(|v| {
                        let items: Vec<_> =
                            v.iter().map(|(v, ws)| format!("{ws}{v}{ws}")).collect();
                        format!("[{}]", items.join(","))
                    }),
                    4 => prop::collection::vec((key(), inner.clone(), ws()), 0..4).prop_map(|v| {
                        let entries: Vec<_> = v
                            .iter()
                            .map(|(k, v, ws)| format!("{ws}{k}{ws}:{ws}{v}"))
                            .collect();
                        format!("{{{}}}", entries.join(","))
                    }),
                    1 => (prop::collection::vec(inner, 17..20), any::<bool>()).prop_map(|(v, twice)| {
                        let mut entries: Vec<_> = v
                            .iter()
                            .enumerate()
                            .map(|(i, v)| format!("\"k{i}\":{v}"))
                            .collect();
                        if twice {
                            entries.push(format!("\"k3\":{}", v[0]));
                        }
                        format!("{{{}}}", entries.join(","))
                    }),
                ]
            })
        }

        /// An event-like object, then a few bytes replaced, inserted or dropped.
        fn line() -> impl Strategy<Value = Vec<u8>> {
            let entries = prop::collection::vec(
                (key(), value(), prop::sample::select(vec!["", " ", "\n\t"])),
                0..8,
            );
            let edits = prop::collection::vec(
                (
                    any::<prop::sample::Index>(),
                    0u8..3,
                    prop::sample::select(b"{}[]\":,\\ 0e-.ntf\x01\x7f".to_vec()),
                ),
                0..3,
            );
            (
                entries,
                prop::sample::select(vec!["", " ", "\r\n"]),
                edits,
                any::<u8>(),
            )
                .prop_map(|(entries, pad, edits, dice)| {
                    // Most lines keep their time and half keep their bytes as built.
                    let (with_ts, edits) =
                        (dice % 8 != 0, if dice < 128 { edits } else { Vec::new() });
                    let mut parts: Vec<String> = entries
                        .iter()
                        .map(|(k, v, ws)| format!("{ws}{k}{ws}:{ws}{v}{ws}"))
                        .collect();
                    if with_ts {
                        parts.insert(0, "\"ts\":1700000000000".into());
                    }
                    let mut bytes = format!("{pad}{{{}}}{pad}", parts.join(",")).into_bytes();
                    for (at, how, byte) in edits {
                        let i = at.index(bytes.len() + 1);
                        match how {
                            0 if i < bytes.len() => bytes[i] = byte,
                            1 => bytes.insert(i, byte),
                            _ if i < bytes.len() => {
                                bytes.remove(i);
                            }
                            _ => {}
                        }
                    }
                    bytes
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 4000, failure_persistence: None, ..ProptestConfig::default() })]
            #[test]
            fn on_any_line(line in line()) {
                let p = projection();
                prop_assert_eq!(decode(&line, &p), decode_by_parser(&line, &p), "{}", String::from_utf8_lossy(&line));
            }
        }

        /// The lines above reach every outcome: the scanner's, the parser's accepting what the
        /// scanner left, and refusals.
        #[test]
        fn the_generated_lines_reach_every_outcome() {
            use proptest::strategy::ValueTree;
            let p = projection();
            let mut runner = proptest::test_runner::TestRunner::deterministic();
            let (mut scanned, mut parsed, mut refused) = (0, 0, 0);
            for _ in 0..2000 {
                let line = line().new_tree(&mut runner).unwrap().current();
                let mut fields = vec![FieldValue::Missing; p.slot_count() + 1];
                let text = std::str::from_utf8(&line).unwrap_or("");
                match (fast::decode(text, &p.root, &mut fields), decode(&line, &p)) {
                    (true, _) => scanned += 1,
                    (false, Ok(_)) => parsed += 1,
                    (false, Err(_)) => refused += 1,
                }
            }
            assert!(
                scanned > 200 && parsed > 50 && refused > 200,
                "{scanned} {parsed} {refused}"
            );
        }

        /// The scanner is not a no-op that hands everything to the parser: the usual shapes,
        /// nested and projected at several levels, are its own.
        #[test]
        fn the_usual_line_is_the_scanners() {
            let p = projection();
            for line in [
                r#"{"event_id":"e-1","ts":1700000000000,"user_id":"u-7","ip":"10.0.0.1","device":{"id":"d-1","os":"ios"},"geo":{"country":"FR","city_id":3},"amount":12.50,"tags":["a",1,[2]],"obj":{"k":[{"n":null}]}}"#,
                " {\"ts\" : 1 ,\n\"event_id\":17,\"device\":{}} \n",
                r#"{"ts":1,"device":"flat","geo":null}"#,
            ] {
                let mut fields = vec![FieldValue::Missing; p.slot_count() + 1];
                assert!(fast::decode(line, &p.root, &mut fields), "{line}");
                let (scanned, parsed) = (
                    decode(line.as_bytes(), &p).unwrap(),
                    decode_by_parser(line.as_bytes(), &p).unwrap(),
                );
                assert_eq!(scanned, parsed);
                // Equal text is not enough: a string must stay borrowed from the line, as the
                // parser's path keeps it.
                for (a, b) in scanned.fields.iter().zip(&parsed.fields) {
                    if let (FieldValue::Str(a), FieldValue::Str(b)) = (a, b) {
                        assert!(matches!((a, b), (Cow::Borrowed(_), Cow::Borrowed(_))));
                    }
                }
            }
            // Nested past the scanner's depth bound (the parser's path takes it, and agrees).
            let deep = format!(
                "{{\"ts\":1,\"user_id\":\"u\",\"x\":{}1{}}}",
                "[".repeat(70),
                "]".repeat(70)
            );
            let mut fields = vec![FieldValue::Missing; p.slot_count() + 1];
            assert!(!fast::decode(&deep, &p.root, &mut fields));
            assert_eq!(
                decode(deep.as_bytes(), &p).unwrap(),
                decode_by_parser(deep.as_bytes(), &p).unwrap()
            );
            let shallow = deep
                .replace(&"[".repeat(20), "")
                .replace(&"]".repeat(20), "");
            assert!(fast::decode(&shallow, &p.root, &mut fields));
            // What it leaves to the parser: escapes, a key named twice, a parent-only path over
            // a number, bad syntax.
            for line in [
                r#"{"ts":1,"user_id":"a\"b"}"#,
                r#"{"ts":1,"x":1,"x":2}"#,
                r#"{"ts":1,"device":1e999}"#,
                r#"{"ts":01}"#,
                r#"{"ts":1,}"#,
            ] {
                let mut fields = vec![FieldValue::Missing; p.slot_count() + 1];
                assert!(!fast::decode(line, &p.root, &mut fields), "{line}");
            }
        }
    }
}
