//! The `[[rule]]` table reader: its keys, their checks (the v1 form `window` + `limit` against
//! the new form `when`, holds), and the rule draft, with the counter a v1-form rule defines.

use toml_edit::{Item, Table};

use super::super::fields::{
    boolean, bounded_number, duration, found_value, key_entries, keyword, mark, read_id,
    read_limit, string, type_name,
};
use super::super::positions::{item_offset, key_offset, Report};
use super::drafts::{read_scope, CounterDraft, DraftScope, ExprSite, KeyDraft, RuleDraft, TableCx};
use super::window::{
    window_group, window_identity, window_key, window_spec, WindowKeys, MAX_WINDOW_MS,
};
use crate::event::{quote_prefix as q, shorten, Decimal};
use crate::rules::model::{Action, Counter, FileLocation, Mode, OnStoreError, Scope};
use crate::window::{Aggregate, WindowSpec};

/// Keys a `[[rule]]` table may hold, in the order they are documented.
pub const RULE_KEYS: [&str; 22] = [
    "id",
    "description",
    "action",
    "mode",
    "enabled",
    "match",
    "when",
    "on_store_error",
    "dimensions",
    "window",
    "bucket",
    "aggregate",
    "field",
    "limit",
    "hold",
    "hold_key",
    "priority",
    "final",
    "score",
    "rollout",
    "rollout_key",
    "entity",
];

/// The keys of a `[[rule]]` table as read (`None`: absent or invalid), with where the ones a
/// later check may point at are written.
#[derive(Default)]
struct RuleKeys<'t> {
    w: WindowKeys<'t>,
    /// The window keys present, with where: they need `window`.
    window_keys_at: Vec<(&'t str, usize)>,
    id: Option<String>,
    description: Option<String>,
    action: Option<Action>,
    mode: Option<Mode>,
    enabled: Option<bool>,
    scope: Option<DraftScope>,
    when: Option<(ExprSite, usize)>,
    limit: Option<(Decimal, usize)>,
    on_store_error: Option<OnStoreError>,
    hold: Option<(i64, usize)>,
    hold_key: Option<(Vec<KeyDraft>, usize)>,
    priority: Option<i32>,
    is_final: Option<(bool, usize)>,
    score: Option<(i64, usize)>,
    /// (percent, basis points, where written)
    rollout: Option<(Decimal, u32, usize)>,
    rollout_key: Option<(Vec<KeyDraft>, usize)>,
    entity: Option<Vec<KeyDraft>>,
    /// Keys present but invalid (not reported missing too).
    invalid: Vec<&'static str>,
}

#[allow(clippy::type_complexity)]
pub(crate) fn read_rule(
    table: &Table,
    cx: &mut TableCx<'_, '_>,
) -> Option<(RuleDraft, Option<CounterDraft>)> {
    let header = table.span().map_or(0, |s| s.start);
    let errors_before = cx.report.diagnostics.len();
    let mut keys = RuleKeys::default();
    for (key, item) in table.iter() {
        read_rule_key(table, key, item, &mut keys, cx);
    }
    // The v1 form (`window` + `limit`) is a counter and a rule in one table.
    let v1 = keys.w.window.is_some() || keys.invalid.contains(&"window");
    check_rule(&keys, v1, header, cx.report);
    let spec = if v1 {
        window_spec(&keys.w, &keys.invalid, header, cx.report)
    } else {
        None
    };
    if let (Some(spec), Some((_, at))) = (&spec, &keys.w.aggregate) {
        if spec.aggregate == Aggregate::Last {
            cx.report.error(
                *at,
                "aggregate \"last\" holds a value, not an amount a limit could exceed: define a [[counter]] and compare it in `when`, like \"$last-country != geo.country\"",
            );
        }
    }
    if let (Some(spec), Some((limit, at))) = (&spec, &keys.limit) {
        let most = Decimal::from_i64(i64::from(spec.max_distinct));
        if spec.aggregate == Aggregate::Distinct && *limit >= most {
            cx.report.error(
                *at,
                format!(
                    "limit {limit} can never be exceeded: a distinct window records at most {most} values (its max_distinct); for a higher limit, define a [[counter]] with a larger \"max_distinct\" and test it in `when`"
                ),
            );
        }
    }
    cx.record_id(keys.id.as_ref(), header);
    if cx.failed_since(errors_before) {
        if let Some(DraftScope::Expr(site)) = keys.scope {
            cx.orphans.push((site, false));
        }
        if let Some((site, _)) = keys.when {
            cx.orphans.push((site, true));
        }
        return None;
    }
    build_rule(keys, v1, spec, cx.report.source.origin(header))
}

/// Reads one key of a rule table into `keys`.
fn read_rule_key<'t>(
    table: &Table,
    key: &'t str,
    item: &'t Item,
    keys: &mut RuleKeys<'t>,
    cx: &mut TableCx<'_, '_>,
) {
    let key_at = key_offset(table, key);
    let at = item_offset(item);
    if window_key(key, item, key_at, &mut keys.w, &mut keys.invalid, cx.report) {
        keys.window_keys_at.push((key, key_at));
        return;
    }
    match key {
        "id" => {
            keys.id = read_id(item, cx.report, "rule");
            mark(&mut keys.invalid, keys.id.is_none(), "id");
        }
        "description" => {
            keys.description = string(item, "description", cx.report).map(str::to_owned)
        }
        "action" => {
            let expected =
                "\"block\", \"challenge\", \"review\", \"alert\", \"allow\" or \"score\"";
            keys.action = keyword(item, "action", "action", expected, cx.report, Action::parse);
            mark(&mut keys.invalid, keys.action.is_none(), "action");
        }
        "mode" => {
            keys.mode = keyword(
                item,
                "mode",
                "mode",
                "\"enforce\" or \"shadow\"",
                cx.report,
                Mode::parse,
            )
        }
        "on_store_error" => {
            let expected = "\"local\", \"allow\" or \"block\"";
            keys.on_store_error = keyword(
                item,
                "on_store_error",
                "on_store_error",
                expected,
                cx.report,
                OnStoreError::parse,
            );
        }
        "enabled" => keys.enabled = boolean(item, "enabled", cx.report),
        "match" => keys.scope = read_scope(item, cx),
        "when" => match item.as_str() {
            Some(text) => {
                keys.when = Some((
                    ExprSite {
                        file: cx.file,
                        at,
                        value: text.to_owned(),
                    },
                    key_at,
                ))
            }
            None => cx.report.error(
                at,
                format!(
                    "\"when\" must be an expression string, found {}",
                    type_name(item)
                ),
            ),
        },
        "limit" => {
            keys.limit = read_limit(item, cx.report).map(|l| (l, key_at));
            mark(&mut keys.invalid, keys.limit.is_none(), "limit");
        }
        "hold" => {
            keys.hold = read_hold(item, key_at, cx.report);
            mark(&mut keys.invalid, keys.hold.is_none(), "hold");
        }
        "hold_key" => {
            keys.hold_key = key_entries(item, "hold_key", cx.report).map(|paths| (paths, key_at));
            mark(&mut keys.invalid, keys.hold_key.is_none(), "hold_key");
        }
        "priority" => match item.as_integer() {
            Some(n) if (-1000..=1000).contains(&n) => keys.priority = Some(n as i32),
            _ => cx.report.error(
                at,
                format!(
                    "\"priority\" must be an integer from -1000 to 1000, found {}",
                    found_value(item, cx.report)
                ),
            ),
        },
        "final" => keys.is_final = boolean(item, "final", cx.report).map(|b| (b, key_at)),
        "score" => {
            keys.score = bounded_number(item, "score", (-1_000_000, 1_000_000), 6, cx.report)
                .map(|(_, micros)| (micros, key_at));
            mark(&mut keys.invalid, keys.score.is_none(), "score");
        }
        "rollout" => {
            keys.rollout = bounded_number(item, "rollout", (0, 100), 2, cx.report)
                .map(|(percent, bp)| (percent, bp as u32, key_at));
            mark(&mut keys.invalid, keys.rollout.is_none(), "rollout");
        }
        "rollout_key" => {
            keys.rollout_key =
                key_entries(item, "rollout_key", cx.report).map(|entries| (entries, key_at));
            mark(&mut keys.invalid, keys.rollout_key.is_none(), "rollout_key");
        }
        "entity" => keys.entity = key_entries(item, "entity", cx.report),
        other => cx
            .report
            .error(key_at, super::unknown_key(other, "rule", &RULE_KEYS)),
    }
}

/// `hold`: a duration of at most 400 days, with where its key is written.
fn read_hold(item: &Item, key_at: usize, report: &mut Report<'_>) -> Option<(i64, usize)> {
    duration(item, "hold", report).and_then(|(ms, text, at)| {
        if ms > MAX_WINDOW_MS {
            report.error(at, format!("hold {} is longer than 400d", shorten(text)));
            return None;
        }
        Some((ms, key_at))
    })
}

/// Cross-key checks: the keys each form requires or refuses, and `hold` with `hold_key`.
fn check_rule(keys: &RuleKeys<'_>, v1: bool, header: usize, report: &mut Report<'_>) {
    let (id, w, invalid) = (&keys.id, &keys.w, &keys.invalid);
    let name = id.as_deref().map_or_else(
        || "rule".to_owned(),
        |id| format!("rule {id_q}", id_q = q(id)),
    );
    let mut required = vec![("id", id.is_some()), ("action", keys.action.is_some())];
    if v1 {
        required.extend([
            ("dimensions", w.dimensions.is_some()),
            ("limit", keys.limit.is_some()),
        ]);
        if let Some((_, at)) = &keys.when {
            report.error(*at, "\"when\" is not allowed with \"window\" and \"limit\" (the v1 form fires on its limit): define a [[counter]] and test it in `when`");
        }
    } else {
        if let Some((_, at)) = keys.limit {
            report.error(at, "\"limit\" needs \"window\" (the v1 form); otherwise write the condition in `when`, like \"$counter-id > 5\"");
        }
        for (key, at) in &keys.window_keys_at {
            report.error(*at, format!("{key_q} needs \"window\" (the v1 form); otherwise define a [[counter]] and test it in `when`", key_q = q(key)));
        }
    }
    if keys.action == Some(Action::Score) && keys.score.is_none() && !invalid.contains(&"score") {
        report.error(
            header,
            format!("{name} has action \"score\" and is missing required key \"score\" (what it adds to the event's score)"),
        );
    }
    match (&keys.rollout, &keys.rollout_key) {
        (Some((_, bp, at)), None) if *bp < 10_000 && !invalid.contains(&"rollout_key") => {
            report.error(
                *at,
                "a \"rollout\" below 100 needs \"rollout_key\" (the key whose bucket decides who is in the rollout)",
            );
        }
        (None, Some((_, at))) if !invalid.contains(&"rollout") => {
            report.error(
                *at,
                "\"rollout_key\" needs \"rollout\" (the percent of keys the rule enforces)",
            );
        }
        _ => {}
    }
    match (&keys.hold, &keys.hold_key) {
        (None, Some((_, at))) if !invalid.contains(&"hold") => {
            report.error(
                *at,
                "\"hold_key\" needs \"hold\" (how long a fired rule keeps firing for that key)",
            );
        }
        (Some(_), None) if !v1 && !invalid.contains(&"hold_key") => {
            required.push(("hold_key", false));
        }
        _ => {}
    }
    for (key, present) in required {
        if !present && !invalid.contains(&key) {
            report.error(
                header,
                format!("{name} is missing required key {key_q}", key_q = q(key)),
            );
        }
    }
}

/// The draft of a rule table that had no error, and in the v1 form the counter it defines
/// (under the rule's id, counting the rule's `match`).
fn build_rule(
    keys: RuleKeys<'_>,
    v1: bool,
    spec: Option<WindowSpec>,
    origin: FileLocation,
) -> Option<(RuleDraft, Option<CounterDraft>)> {
    let id = keys.id?;
    let enabled = keys.enabled.unwrap_or(true);
    let scope = keys.scope.unwrap_or(DraftScope::All);
    // A v1-form rule holds its own dimension key unless told otherwise.
    let hold = match (keys.hold, keys.hold_key) {
        (Some((ms, _)), Some((key, _))) => Some((ms, key)),
        (Some((ms, _)), None) => Some((ms, keys.w.dimensions.clone()?)),
        (None, _) => None,
    };
    let counter = if v1 {
        let dimensions = keys.w.dimensions?;
        let field = keys.w.field.map(|(p, _)| p);
        let tuple = keys.w.tuple.map_or_else(Vec::new, |(t, _)| t);
        let mut window = spec?;
        window.identity = window_identity(&dimensions, field.as_ref(), &tuple);
        window.group = window_group(&dimensions, window.aggregate);
        let counter = Counter {
            id: id.clone(),
            description: None,
            enabled,
            scope: Scope::All,
            scope_text: None,
            dimensions: Vec::new(),
            window,
            field,
            tuple: Vec::new(),
            allow_negative: false,
            from_rule: true,
            origin: origin.clone(),
        };
        Some(CounterDraft {
            counter,
            scope: scope.clone(),
            dimensions,
            tuple,
        })
    } else {
        None
    };
    let rollout = match (keys.rollout, keys.rollout_key) {
        (Some((percent, bp, _)), Some((key, _))) if bp < 10_000 => Some((percent, bp, key)),
        _ => None,
    };
    let rule = RuleDraft {
        id,
        description: keys.description,
        action: keys.action?,
        mode: keys.mode.unwrap_or(Mode::Enforce),
        enabled,
        scope,
        when: keys.when.map(|(site, _)| site),
        limit: keys.limit.map(|(l, _)| l),
        on_store_error: keys.on_store_error.unwrap_or_default(),
        hold,
        priority: keys.priority.unwrap_or(0),
        is_final: keys.is_final.filter(|(b, _)| *b).map(|(_, at)| at),
        score: keys.score,
        rollout,
        entity: keys.entity,
        origin,
    };
    Some((rule, counter))
}
