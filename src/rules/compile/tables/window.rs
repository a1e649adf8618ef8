//! The window keys a `[[counter]]` and a v1-form `[[rule]]` share (`dimensions`, `window`,
//! `bucket`, `aggregate`, `field`): reading them, checking them together, and the window's
//! identity.

use toml_edit::Item;

use super::super::fields::{bad_path, dimensions, duration, key_entries, keyword, mark, string};
use super::super::positions::{item_offset, Report};
use super::drafts::KeyDraft;
use crate::event::{shorten, FieldPath};
use crate::window::{Aggregate, WindowSpec};

/// The most buckets a window may have.
pub const MAX_BUCKETS: i64 = 3600;
/// The longest window: 400 days.
pub const MAX_WINDOW_MS: i64 = 400 * 86_400_000;
/// Buckets in a window when `bucket` is not given.
pub const DEFAULT_BUCKETS: i64 = 60;

/// The keys shared by counters and v1 rules, as read.
#[derive(Default)]
pub(crate) struct WindowKeys<'t> {
    pub(crate) dimensions: Option<Vec<KeyDraft>>,
    pub(crate) window: Option<(i64, &'t str, usize)>,
    pub(crate) bucket: Option<(i64, &'t str, usize)>,
    pub(crate) aggregate: Option<(Aggregate, usize)>,
    pub(crate) field: Option<(FieldPath, usize)>,
    /// A distinct tuple: `field = ["card", "device"]`.
    pub(crate) tuple: Option<(Vec<KeyDraft>, usize)>,
}

/// Reads one key shared by counters and v1 rules; false if `key` is not one of them.
pub(crate) fn window_key<'t>(
    key: &str,
    item: &'t Item,
    key_at: usize,
    w: &mut WindowKeys<'t>,
    invalid: &mut Vec<&'static str>,
    report: &mut Report<'_>,
) -> bool {
    let at = item_offset(item);
    match key {
        "dimensions" => {
            w.dimensions = dimensions(item, report);
            mark(invalid, w.dimensions.is_none(), "dimensions");
        }
        "window" => {
            w.window = duration(item, "window", report);
            if let Some((ms, text, at)) = w.window {
                if ms > MAX_WINDOW_MS {
                    report.error(at, format!("window {} is longer than 400d", shorten(text)));
                    w.window = None;
                }
            }
            mark(invalid, w.window.is_none(), "window");
        }
        "bucket" => w.bucket = duration(item, "bucket", report),
        "aggregate" => {
            let expected = "\"count\", \"sum\", \"distinct\", \"max\", \"min\" or \"last\"";
            w.aggregate = keyword(
                item,
                "aggregate",
                "aggregate",
                expected,
                report,
                |s| match s {
                    "count" => Some(Aggregate::Count),
                    "sum" => Some(Aggregate::Sum),
                    "distinct" => Some(Aggregate::Distinct),
                    "max" => Some(Aggregate::Max),
                    "min" => Some(Aggregate::Min),
                    "last" => Some(Aggregate::Last),
                    _ => None,
                },
            )
            .map(|a| (a, at));
            mark(invalid, w.aggregate.is_none(), "aggregate");
        }
        "field" if item.is_array() => {
            w.tuple = key_entries(item, "field", report).map(|entries| (entries, key_at));
            mark(invalid, w.tuple.is_none(), "field");
        }
        "field" => {
            w.field = string(item, "field", report).and_then(|s| match FieldPath::parse(s) {
                Some(p) => Some((p, key_at)),
                None => {
                    report.error(at, bad_path(s));
                    None
                }
            });
            mark(invalid, w.field.is_none(), "field");
        }
        _ => return false,
    }
    true
}

/// What a counter's window counts, as a digest of its dimensions and field (see
/// `WindowSpec::identity`).
pub(crate) fn window_identity(
    dimensions: &[KeyDraft],
    field: Option<&FieldPath>,
    tuple: &[KeyDraft],
) -> u64 {
    let mut hasher = blake3::Hasher::new();
    for entry in dimensions {
        hasher.update(entry.text().as_bytes());
        hasher.update(b"\0");
    }
    hasher.update(b"\x01");
    if let Some(field) = field {
        hasher.update(field.to_string().as_bytes());
    }
    // A tuple is told from a path written the same by its separator.
    for entry in tuple {
        hasher.update(b"\x02");
        hasher.update(entry.text().as_bytes());
    }
    let mut first = [0u8; 8];
    first.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    u64::from_le_bytes(first).max(1)
}

/// Which counters may share a Redis hash per key (see `WindowSpec::group`): a digest of the
/// dimensions alone, for every aggregate but `distinct`.
pub(crate) fn window_group(dimensions: &[KeyDraft], aggregate: Aggregate) -> u64 {
    if aggregate == Aggregate::Distinct {
        return 0;
    }
    let mut hasher = blake3::Hasher::new();
    hasher.update(b"group\0");
    for entry in dimensions {
        hasher.update(entry.text().as_bytes());
        hasher.update(b"\0");
    }
    let mut first = [0u8; 8];
    first.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    u64::from_le_bytes(first).max(1)
}

/// Cross-key checks of the window keys; the spec if they hold.
pub(crate) fn window_spec(
    w: &WindowKeys<'_>,
    invalid: &[&'static str],
    header: usize,
    report: &mut Report<'_>,
) -> Option<WindowSpec> {
    let aggregate = w.aggregate.map_or(Aggregate::Count, |(a, _)| a);
    if !invalid.contains(&"aggregate") {
        match (aggregate, &w.field) {
            _ if w.tuple.is_some() && aggregate != Aggregate::Distinct => {
                let at = w.tuple.as_ref().map_or(header, |(_, at)| *at);
                report.error(
                    at,
                    "a tuple \"field\" (an array) is only for aggregate \"distinct\"",
                );
            }
            (Aggregate::Distinct, None) if w.tuple.is_some() => {}
            (Aggregate::Count, Some((_, at))) => {
                report.error(*at, "\"field\" is not allowed with aggregate \"count\"");
            }
            (
                Aggregate::Sum
                | Aggregate::Distinct
                | Aggregate::Max
                | Aggregate::Min
                | Aggregate::Last,
                None,
            ) if !invalid.contains(&"field") => {
                let at = w.aggregate.map_or(header, |(_, at)| at);
                report.error(
                    at,
                    format!("aggregate {:?} requires \"field\"", aggregate.as_str()),
                );
            }
            _ => {}
        }
    }
    let (window, window_text, window_at) = w.window?;
    let (bucket_ms, bucket_at) = match w.bucket {
        Some((b, _, at)) => (b, at),
        None => {
            if window % DEFAULT_BUCKETS != 0 {
                report.error(
                    window_at,
                    format!(
                        "window {window_text} has no default bucket (window/60 is not a whole number of milliseconds); set \"bucket\""
                    ),
                );
                return None;
            }
            (window / DEFAULT_BUCKETS, header)
        }
    };
    let bucket_text = w.bucket.map_or("", |(_, t, _)| t);
    if window % bucket_ms != 0 {
        report.error(
            bucket_at,
            format!(
                "bucket {} does not divide window {}",
                shorten(bucket_text),
                shorten(window_text)
            ),
        );
        return None;
    }
    let buckets = window / bucket_ms;
    if buckets > MAX_BUCKETS {
        report.error(
            bucket_at,
            format!("window {window_text} with bucket {bucket_text} has {buckets} buckets; at most {MAX_BUCKETS} are allowed"),
        );
        return None;
    }
    Some(WindowSpec::new(bucket_ms, buckets, aggregate))
}
