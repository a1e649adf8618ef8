//! Typed field readers: one TOML value read as an id, string, boolean, keyword, duration,
//! number, field path list or `match` table, each reporting its own error message at the
//! value's position.

use toml_edit::{Item, TableLike, Value};

use super::positions::{item_offset, key_offset, Diagnostic, Report};
use super::tables::drafts::{ExprSite, KeyDraft};
use crate::event::{quote_prefix as q, Decimal, FieldPath};
use crate::rules::model::{parse_duration, MatchValue, Matcher};

/// The most dimension fields a counter may have.
pub const MAX_DIMENSIONS: usize = 4;

/// Notes `key` as present but invalid, so it is not reported missing too.
pub(super) fn mark(invalid: &mut Vec<&'static str>, is_invalid: bool, key: &'static str) {
    if is_invalid {
        invalid.push(key);
    }
}

pub(super) fn valid_id(id: &str) -> bool {
    let bytes = id.as_bytes();
    let allowed = |b: u8, first: bool| {
        b.is_ascii_lowercase() || b.is_ascii_digit() || (!first && matches!(b, b'_' | b'.' | b'-'))
    };
    (1..=64).contains(&bytes.len())
        && allowed(bytes[0], true)
        && bytes[1..].iter().all(|&b| allowed(b, false))
}

pub(super) fn type_name(item: &Item) -> &'static str {
    match item {
        Item::Value(Value::String(_)) => "string",
        Item::Value(Value::Integer(_)) => "integer",
        Item::Value(Value::Float(_)) => "float",
        Item::Value(Value::Boolean(_)) => "boolean",
        Item::Value(Value::Datetime(_)) => "datetime",
        Item::Value(Value::Array(_)) => "array",
        Item::Value(Value::InlineTable(_)) | Item::Table(_) => "table",
        Item::ArrayOfTables(_) => "array of tables",
        Item::None => "nothing",
    }
}

pub(super) fn string<'t>(item: &'t Item, key: &str, report: &mut Report<'_>) -> Option<&'t str> {
    let s = item.as_str();
    if s.is_none() {
        report.error(
            item_offset(item),
            format!(
                "{key_q} must be a string, found {}",
                type_name(item),
                key_q = q(key)
            ),
        );
    }
    s
}

pub(super) fn boolean(item: &Item, key: &str, report: &mut Report<'_>) -> Option<bool> {
    let b = item.as_bool();
    if b.is_none() {
        report.error(
            item_offset(item),
            format!(
                "{key_q} must be a boolean, found {}",
                type_name(item),
                key_q = q(key)
            ),
        );
    }
    b
}

/// A string naming one of a few keywords (`what`: an action, a mode…), as `parse` reads it;
/// `expected` lists the keywords for the error message.
pub(super) fn keyword<T>(
    item: &Item,
    key: &str,
    what: &str,
    expected: &str,
    report: &mut Report<'_>,
    parse: impl FnOnce(&str) -> Option<T>,
) -> Option<T> {
    let at = item_offset(item);
    string(item, key, report).and_then(|s| {
        let parsed = parse(s);
        if parsed.is_none() {
            report.error(
                at,
                format!("invalid {what} {s_q}: expected {expected}", s_q = q(s)),
            );
        }
        parsed
    })
}

/// A table's `id`: a string matching `^[a-z0-9][a-z0-9_.-]{0,63}$`.
pub(super) fn read_id(item: &Item, report: &mut Report<'_>, what: &str) -> Option<String> {
    let at = item_offset(item);
    string(item, "id", report).and_then(|id| {
        if valid_id(id) {
            Some(id.to_owned())
        } else {
            report.error(
                at,
                format!(
                    "invalid {what} id {id_q}: must match ^[a-z0-9][a-z0-9_.-]{{0,63}}$",
                    id_q = q(id)
                ),
            );
            None
        }
    })
}

pub(super) fn bad_path(path: &str) -> String {
    format!(
        "invalid field path {path_q}: expected names separated by single dots, like \"device.id\"",
        path_q = q(path)
    )
}

/// A duration string (`"10m"`) longer than zero: its milliseconds, its text and where it is.
pub(super) fn duration<'t>(
    item: &'t Item,
    key: &str,
    report: &mut Report<'_>,
) -> Option<(i64, &'t str, usize)> {
    let at = item_offset(item);
    let Some(text) = item.as_str() else {
        report.error(
            at,
            format!(
                "{key_q} must be a duration string like \"10m\", found {}",
                type_name(item),
                key_q = q(key)
            ),
        );
        return None;
    };
    match parse_duration(text) {
        Some(0) => {
            report.error(
                at,
                format!(
                    "{key} must be longer than zero, found {text_q}",
                    text_q = q(text)
                ),
            );
            None
        }
        Some(ms) => Some((ms, text, at)),
        None => {
            report.error(
                at,
                format!("invalid duration {text_q} for {key}: expected an integer and a unit (ms, s, m, h, d or w), like \"10m\"", text_q = q(text)),
            );
            None
        }
    }
}

pub(super) fn dimensions(item: &Item, report: &mut Report<'_>) -> Option<Vec<KeyDraft>> {
    key_entries(item, "dimensions", report)
}

/// Whether a key entry is written as a field path (names, digits, `_`, `-`, dots): anything
/// else (`ip_prefix(ip, 24)`, `lower(email)`) is an expression.
fn written_as_path(text: &str) -> bool {
    !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// A key made of 1 to `MAX_DIMENSIONS` distinct entries (`dimensions`, `hold_key`,
/// `rollout_key`, `entity`, a distinct tuple `field`), each a field path or an expression.
pub(super) fn key_entries(
    item: &Item,
    key: &str,
    report: &mut Report<'_>,
) -> Option<Vec<KeyDraft>> {
    let at = item_offset(item);
    let Some(array) = item.as_array() else {
        report.error(
            at,
            format!(
                "{key_q} must be an array of field paths, found {}",
                type_name(item),
                key_q = q(key)
            ),
        );
        return None;
    };
    if array.is_empty() || array.len() > MAX_DIMENSIONS {
        report.error(
            at,
            format!(
                "{key_q} must list 1 to {MAX_DIMENSIONS} field paths, found {}",
                array.len(),
                key_q = q(key)
            ),
        );
        return None;
    }
    let noun = match key {
        "dimensions" => "dimension".to_owned(),
        other => format!("{other} entry"),
    };
    let mut entries: Vec<KeyDraft> = Vec::new();
    let mut ok = true;
    for value in array.iter() {
        let at = value.span().map_or(at, |s| s.start);
        let Some(s) = value.as_str() else {
            report.error(
                at,
                format!(
                    "{noun} must be a field path string, found {}",
                    value.type_name()
                ),
            );
            ok = false;
            continue;
        };
        let entry = if written_as_path(s) {
            match FieldPath::parse(s) {
                Some(p) => KeyDraft::Path(p),
                None => {
                    report.error(at, bad_path(s));
                    ok = false;
                    continue;
                }
            }
        } else {
            KeyDraft::Expr(ExprSite {
                file: report.file,
                at,
                value: s.to_owned(),
            })
        };
        if entries.iter().any(|e| e.text() == entry.text()) {
            report.error(at, format!("duplicate {noun} {s_q}", s_q = q(s)));
            ok = false;
            continue;
        }
        entries.push(entry);
    }
    ok.then_some(entries)
}

/// A v1-form rule's `limit`: a finite number >= 0, exactly as written.
pub(super) fn read_limit(item: &Item, report: &mut Report<'_>) -> Option<Decimal> {
    let at = item_offset(item);
    let number = match item {
        Item::Value(v @ (Value::Integer(_) | Value::Float(_))) => exact_number(v, report),
        other => {
            report.error(
                at,
                format!(
                    "\"limit\" must be a number >= 0, found {}",
                    type_name(other)
                ),
            );
            return None;
        }
    };
    let Some(number) = number else {
        report.error(at, "\"limit\" must be a finite number");
        return None;
    };
    if number.is_negative() {
        report.error(
            at,
            format!("\"limit\" must be a number >= 0, found {number}"),
        );
        return None;
    }
    Some(number)
}

/// A TOML number as the exact decimal its text writes.
fn toml_number(value: &Value) -> Option<Decimal> {
    match value {
        Value::Integer(i) => Some(Decimal::from_i64(*i.value())),
        Value::Float(f) => Decimal::from_f64(*f.value()),
        _ => None,
    }
}

/// A TOML number as the exact decimal its text in the file writes (`None` for inf and nan).
pub(super) fn exact_number(value: &Value, report: &Report<'_>) -> Option<Decimal> {
    if let Value::Float(_) = value {
        if let Some(span) = value.span() {
            if let Some(text) = report.source.text.get(span) {
                return Decimal::parse(&text.trim().replace('_', ""));
            }
        }
    }
    toml_number(value)
}

/// What a value is, for "found …": a number as written, else its type.
pub(super) fn found_value(item: &Item, report: &Report<'_>) -> String {
    match item {
        Item::Value(v @ (Value::Integer(_) | Value::Float(_))) => {
            exact_number(v, report).map_or_else(|| type_name(item).to_owned(), |n| n.to_string())
        }
        _ => type_name(item).to_owned(),
    }
}

/// A number from `low` to `high` with at most `places` decimal places (`score`, `rollout`):
/// the number as written and its value times 10^places.
pub(super) fn bounded_number(
    item: &Item,
    key: &str,
    (low, high): (i64, i64),
    places: i32,
    report: &mut Report<'_>,
) -> Option<(Decimal, i64)> {
    let at = item_offset(item);
    let number = match item {
        Item::Value(v @ (Value::Integer(_) | Value::Float(_))) => exact_number(v, report),
        _ => None,
    };
    let scaled = number.as_ref().and_then(|n| {
        if *n < Decimal::from_i64(low) || *n > Decimal::from_i64(high) {
            return None;
        }
        let scaled = n.floor_scaled(places);
        // Exactly representable at `places`: scaling back gives the number.
        let back = Decimal::from_micros(scaled.checked_mul(10i64.pow((6 - places) as u32))?);
        (back == *n).then_some(scaled)
    });
    match (number, scaled) {
        (Some(n), Some(scaled)) => Some((n, scaled)),
        _ => {
            report.error(
                at,
                format!(
                    "{key_q} must be a number from {low} to {high} with at most {places} decimal places, found {}",
                    found_value(item, report),
                    key_q = q(key)
                ),
            );
            None
        }
    }
}

/// A `match` table value that reads like a comparison (`"> 500"`): a table matches it literally.
fn looks_like_comparison(s: &str) -> bool {
    let t = s.trim_start();
    ["<", ">", "!=", "==", ">=", "<="]
        .iter()
        .any(|op| t.starts_with(op))
        && t.len() > 1
}

/// A `match` table: field = value(s), nested tables as dotted paths.
pub(super) fn matchers(
    item: &Item,
    report: &mut Report<'_>,
    warnings: &mut Vec<Diagnostic>,
) -> Option<Vec<Matcher>> {
    let Some(table) = item.as_table_like() else {
        report.error(
            item_offset(item),
            format!(
                "\"match\" must be an expression string or a table of field = value(s), found {}",
                type_name(item)
            ),
        );
        return None;
    };
    if table.is_empty() {
        report.error(item_offset(item), "\"match\" is an empty table, which would match every event; list field = value(s) or remove it");
        return None;
    }
    let mut out = Vec::new();
    let ok = collect_matchers(table, "", report, warnings, &mut out);
    ok.then_some(out)
}

/// Flattens nested tables (`match.device.os = "ios"`) into dotted paths.
fn collect_matchers(
    table: &dyn TableLike,
    prefix: &str,
    report: &mut Report<'_>,
    warnings: &mut Vec<Diagnostic>,
    out: &mut Vec<Matcher>,
) -> bool {
    let mut ok = true;
    for (key, item) in table.iter() {
        let path_text = if prefix.is_empty() {
            key.to_owned()
        } else {
            format!("{prefix}.{key}")
        };
        if let Some(nested) = item.as_table_like() {
            if nested.is_empty() {
                // An empty table would add no condition: the match would hold for every event.
                report.error(key_offset(table, key), format!("match on {path_text_q} is an empty table, which would match every event; list values or remove it", path_text_q = q(&path_text)));
                ok = false;
                continue;
            }
            ok &= collect_matchers(nested, &path_text, report, warnings, out);
            continue;
        }
        let at = item_offset(item);
        let Some(path) = FieldPath::parse(&path_text) else {
            report.error(key_offset(table, key), bad_path(&path_text));
            ok = false;
            continue;
        };
        let values: Vec<&Value> = match item {
            Item::Value(Value::Array(array)) => array.iter().collect(),
            Item::Value(v) => vec![v],
            _ => Vec::new(),
        };
        if values.is_empty() {
            report.error(
                at,
                format!(
                    "match on {path_text_q} lists no values, so it could never hold",
                    path_text_q = q(&path_text)
                ),
            );
            ok = false;
            continue;
        }
        let mut any_of = Vec::with_capacity(values.len());
        for value in values {
            match match_value(value, &path_text, at, report, warnings) {
                Some(v) => any_of.push(v),
                None => {
                    let at = value.span().map_or(at, |s| s.start);
                    report.error(
                        at,
                        format!(
                            "match value for {path_text:?} must be a string, finite number or boolean (or an array of them), found {}",
                            value.type_name()
                        ),
                    );
                    ok = false;
                }
            }
        }
        out.push(Matcher { path, any_of });
    }
    ok
}

/// One value a `match` table lists for `path_text` (`None`: not a string, finite number or
/// boolean); a string that reads like a comparison is warned about.
fn match_value(
    value: &Value,
    path_text: &str,
    at: usize,
    report: &Report<'_>,
    warnings: &mut Vec<Diagnostic>,
) -> Option<MatchValue> {
    match value {
        Value::String(s) => {
            if looks_like_comparison(s.value()) {
                let at = value.span().map_or(at, |s| s.start);
                warnings.push(Diagnostic {
                    origin: report.source.origin(at),
                    message: format!(
                        "match value {:?} for {path_text:?} is compared as a plain string; to compare, write an expression: match = \"{path_text} {}\"",
                        s.value(),
                        s.value().trim()
                    ),
                });
            }
            Some(MatchValue::Str(s.value().clone()))
        }
        Value::Integer(_) | Value::Float(_) => exact_number(value, report).map(MatchValue::Number),
        Value::Boolean(b) => Some(MatchValue::Bool(*b.value())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(valid_id("a"));
        assert!(valid_id("0-a_b.c"));
        assert!(valid_id(&"a".repeat(64)));
        assert!(!valid_id(&"a".repeat(65)));
        assert!(!valid_id("-a"));
        assert!(!valid_id("A"));
        assert!(!valid_id(""));
        assert!(!valid_id("a b"));
    }
}
