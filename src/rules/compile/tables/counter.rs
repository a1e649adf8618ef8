//! The `[[counter]]` table reader: its keys, their checks, and the counter draft.

use toml_edit::{Item, Table};

use super::super::fields::{boolean, mark, read_id, string};
use super::super::positions::{item_offset, key_offset, Report};
use super::drafts::{read_scope, CounterDraft, DraftScope, TableCx};
use super::window::{window_group, window_identity, window_key, window_spec, WindowKeys};
use crate::event::quote_prefix as q;
use crate::rules::model::{Counter, Scope};
use crate::window::{Aggregate, WindowSpec, DEFAULT_MAX_DISTINCT};

/// Keys a `[[counter]]` table may hold.
pub const COUNTER_KEYS: [&str; 11] = [
    "id",
    "description",
    "match",
    "dimensions",
    "window",
    "bucket",
    "aggregate",
    "field",
    "allow_negative",
    "max_distinct",
    "enabled",
];
/// The largest `max_distinct`.
pub const MAX_DISTINCT_LIMIT: i64 = 100_000;

/// The keys of a `[[counter]]` table as read (`None`: absent or invalid).
#[derive(Default)]
struct CounterKeys<'t> {
    w: WindowKeys<'t>,
    id: Option<String>,
    description: Option<String>,
    scope: Option<DraftScope>,
    enabled: Option<bool>,
    allow_negative: Option<(bool, usize)>,
    max_distinct: Option<(u32, usize)>,
    /// Keys present but invalid (not reported missing too).
    invalid: Vec<&'static str>,
}

pub(crate) fn read_counter(table: &Table, cx: &mut TableCx<'_, '_>) -> Option<CounterDraft> {
    let header = table.span().map_or(0, |s| s.start);
    let errors_before = cx.report.diagnostics.len();
    let mut keys = CounterKeys::default();
    for (key, item) in table.iter() {
        read_counter_key(table, key, item, &mut keys, cx);
    }
    let spec = check_counter(&keys, header, cx.report);
    cx.record_id(keys.id.as_ref(), header);
    if cx.failed_since(errors_before) {
        if let Some(DraftScope::Expr(site)) = keys.scope {
            cx.orphans.push((site, false));
        }
        return None;
    }
    build_counter(keys, spec, header, cx.report)
}

/// Reads one key of a counter table into `keys`.
fn read_counter_key<'t>(
    table: &Table,
    key: &str,
    item: &'t Item,
    keys: &mut CounterKeys<'t>,
    cx: &mut TableCx<'_, '_>,
) {
    let key_at = key_offset(table, key);
    let at = item_offset(item);
    if window_key(key, item, key_at, &mut keys.w, &mut keys.invalid, cx.report) {
        return;
    }
    match key {
        "id" => {
            keys.id = read_id(item, cx.report, "counter");
            mark(&mut keys.invalid, keys.id.is_none(), "id");
        }
        "description" => keys.description = string(item, "description", cx.report).map(str::to_owned),
        "match" => keys.scope = read_scope(item, cx),
        "enabled" => keys.enabled = boolean(item, "enabled", cx.report),
        "allow_negative" => keys.allow_negative = boolean(item, "allow_negative", cx.report).map(|b| (b, key_at)),
        "max_distinct" => match item.as_integer() {
            Some(n) if (1..=MAX_DISTINCT_LIMIT).contains(&n) => keys.max_distinct = Some((n as u32, key_at)),
            _ => cx.report.error(at, format!("\"max_distinct\" must be an integer from 1 to {MAX_DISTINCT_LIMIT}")),
        },
        "when" | "action" | "limit" => cx.report.error(
            key_at,
            format!("{key_q} belongs in a [[rule]]: a counter only counts; a rule reads it as $<counter id>", key_q = q(key)),
        ),
        other => cx.report.error(
            key_at,
            super::unknown_key(other, "counter", &COUNTER_KEYS),
        ),
    }
}

/// Cross-key checks: required keys, the window, and the keys only one aggregate takes.
fn check_counter(
    keys: &CounterKeys<'_>,
    header: usize,
    report: &mut Report<'_>,
) -> Option<WindowSpec> {
    let (id, w) = (&keys.id, &keys.w);
    let name = id.as_deref().map_or_else(
        || "counter".to_owned(),
        |id| format!("counter {id_q}", id_q = q(id)),
    );
    for (key, present) in [
        ("id", id.is_some()),
        ("dimensions", w.dimensions.is_some()),
        ("window", w.window.is_some()),
    ] {
        if !present && !keys.invalid.contains(&key) {
            report.error(
                header,
                format!("{name} is missing required key {key_q}", key_q = q(key)),
            );
        }
    }
    let spec = window_spec(w, &keys.invalid, header, report);
    let aggregate = w.aggregate.map_or(Aggregate::Count, |(a, _)| a);
    if let Some((_, at)) = keys.allow_negative.filter(|_| !aggregate.is_amount()) {
        report.error(
            at,
            "\"allow_negative\" is only for aggregates \"sum\", \"max\" and \"min\"",
        );
    }
    if let Some((_, at)) = keys
        .max_distinct
        .filter(|_| aggregate != Aggregate::Distinct)
    {
        report.error(at, "\"max_distinct\" is only for aggregate \"distinct\"");
    }
    spec
}

/// The draft of a counter table that had no error.
fn build_counter(
    keys: CounterKeys<'_>,
    spec: Option<WindowSpec>,
    header: usize,
    report: &Report<'_>,
) -> Option<CounterDraft> {
    let origin = report.source.origin(header);
    let id = keys.id?;
    let mut window = spec?;
    window.max_distinct = keys.max_distinct.map_or(DEFAULT_MAX_DISTINCT, |(n, _)| n);
    let dimensions = keys.w.dimensions?;
    let field = keys.w.field.map(|(p, _)| p);
    let tuple = keys.w.tuple.map_or_else(Vec::new, |(t, _)| t);
    window.identity = window_identity(&dimensions, field.as_ref(), &tuple);
    window.group = window_group(&dimensions, window.aggregate);
    let counter = Counter {
        id,
        description: keys.description,
        enabled: keys.enabled.unwrap_or(true),
        scope: Scope::All,
        scope_text: None,
        dimensions: Vec::new(),
        window,
        field,
        tuple: Vec::new(),
        allow_negative: keys.allow_negative.is_some_and(|(b, _)| b),
        from_rule: false,
        origin,
    };
    Some(CounterDraft {
        counter,
        scope: keys.scope.unwrap_or(DraftScope::All),
        dimensions,
        tuple,
    })
}
