//! Rule files → validated [`Rule`]s, with every error reported at once as
//! `file:line:col: message`. Pure: the caller reads the files.

use std::collections::HashMap;
use std::fmt;

use toml_edit::{Document, Item, Table, TableLike, Value};

use super::model::{parse_duration, Action, MatchValue, Matcher, Mode, OnStoreError, Origin, Rule};
use crate::event::{CanonicalNumber, FieldPath, Number};
use crate::window::{Aggregate, WindowSpec};

/// Keys a `[[rule]]` table may hold, in the order they are documented.
pub const RULE_KEYS: [&str; 13] = [
    "id",
    "description",
    "action",
    "mode",
    "enabled",
    "match",
    "dimensions",
    "window",
    "bucket",
    "aggregate",
    "field",
    "limit",
    "on_store_error",
];
/// The most buckets a window may have.
pub const MAX_BUCKETS: i64 = 3600;
/// The most dimension fields a rule may have.
pub const MAX_DIMENSIONS: usize = 4;
/// Buckets in a window when `bucket` is not given.
pub const DEFAULT_BUCKETS: i64 = 60;

/// One problem in a rule file, at a position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub origin: Origin,
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.origin, self.message)
    }
}

/// Source text of one file, for turning byte offsets into line and column.
struct Source<'a> {
    name: &'a str,
    text: &'a str,
}

impl Source<'_> {
    /// 1-based line and column (in characters) of a byte offset.
    fn origin(&self, offset: usize) -> Origin {
        let offset = offset.min(self.text.len());
        let before = &self.text[..offset];
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        Origin {
            file: self.name.to_owned(),
            line: before.matches('\n').count() + 1,
            col: before[line_start..].chars().count() + 1,
        }
    }
}

/// Collects diagnostics for one file.
struct Report<'a> {
    source: Source<'a>,
    diagnostics: Vec<Diagnostic>,
}

impl Report<'_> {
    fn error(&mut self, offset: usize, message: impl Into<String>) {
        self.diagnostics.push(Diagnostic { origin: self.source.origin(offset), message: message.into() });
    }
}

/// The diagnostic for a rule file that is not UTF-8: at its first invalid byte.
pub fn not_utf8(name: &str, bytes: &[u8], valid_up_to: usize) -> Diagnostic {
    let valid = std::str::from_utf8(&bytes[..valid_up_to]).unwrap_or_default();
    let source = Source { name, text: valid };
    Diagnostic { origin: source.origin(valid_up_to), message: "file is not valid UTF-8".to_owned() }
}

/// Parses and validates one rule file. Rules that are valid on their own are returned even when
/// others are not; cross-file checks (duplicate ids) are done by [`check_ids`].
pub fn compile_file(name: &str, text: &str) -> (Vec<Rule>, Vec<Diagnostic>) {
    let mut report = Report { source: Source { name, text }, diagnostics: Vec::new() };
    let doc = match Document::parse(text) {
        Ok(doc) => doc,
        Err(err) => {
            let offset = err.span().map_or(0, |s| s.start);
            let message = err.message().lines().next().unwrap_or("invalid TOML").trim_end();
            report.error(offset, format!("TOML syntax error: {message}"));
            return (Vec::new(), report.diagnostics);
        }
    };
    let root = doc.as_table();
    for (key, _) in root.iter() {
        if key != "rule" {
            let at = key_offset(root, key);
            report.error(at, format!("unknown top-level key {key:?}; rules are [[rule]] tables"));
        }
    }
    let mut rules = Vec::new();
    if let Some(item) = root.get("rule") {
        match item.as_array_of_tables() {
            Some(tables) => {
                for table in tables.iter() {
                    if let Some(rule) = compile_rule(table, &mut report) {
                        rules.push(rule);
                    }
                }
            }
            None => {
                let at = key_offset(root, "rule");
                report.error(at, "\"rule\" must be an array of tables: write each rule as [[rule]]");
            }
        }
    }
    let mut diagnostics = report.diagnostics;
    diagnostics.sort_by_key(|d| (d.origin.line, d.origin.col));
    (rules, diagnostics)
}

/// Refuses duplicate ids across every rule loaded together, pointing at each later definition.
pub fn check_ids(rules: &[Rule]) -> Vec<Diagnostic> {
    let mut first: HashMap<&str, &Origin> = HashMap::new();
    let mut diagnostics = Vec::new();
    for rule in rules {
        if let Some(prev) = first.get(rule.id.as_str()) {
            diagnostics.push(Diagnostic {
                origin: rule.origin.clone(),
                message: format!("duplicate rule id {:?} (first defined at {prev})", rule.id),
            });
        } else {
            first.insert(&rule.id, &rule.origin);
        }
    }
    diagnostics
}

fn key_offset(table: &dyn TableLike, key: &str) -> usize {
    table.get_key_value(key).and_then(|(k, _)| k.span()).map_or(0, |s| s.start)
}

fn item_offset(item: &Item) -> usize {
    item.span().map_or(0, |s| s.start)
}

/// The fields of one `[[rule]]` as read, before cross-field checks.
#[derive(Default)]
struct Fields<'t> {
    id: Option<String>,
    description: Option<String>,
    action: Option<Action>,
    mode: Option<Mode>,
    enabled: Option<bool>,
    matchers: Option<Vec<Matcher>>,
    dimensions: Option<Vec<FieldPath>>,
    window: Option<(i64, &'t str, usize)>,
    bucket: Option<(i64, &'t str, usize)>,
    aggregate: Option<(Aggregate, usize)>,
    field: Option<(FieldPath, usize)>,
    limit: Option<CanonicalNumber>,
    on_store_error: Option<OnStoreError>,
    /// Set when a key was present but invalid: the rule is refused, but without a second,
    /// misleading "missing" error for that key.
    invalid: Vec<&'static str>,
}

fn compile_rule(table: &Table, report: &mut Report<'_>) -> Option<Rule> {
    let header = table.span().map_or(0, |s| s.start);
    let errors_before = report.diagnostics.len();
    let mut f = Fields::default();
    for (key, item) in table.iter() {
        let key_at = key_offset(table, key);
        let at = item_offset(item);
        match key {
            "id" => {
                f.id = string(item, "id", report).and_then(|id| {
                    if valid_id(id) {
                        Some(id.to_owned())
                    } else {
                        report.error(
                            at,
                            format!("invalid rule id {id:?}: must match ^[a-z0-9][a-z0-9_.-]{{0,63}}$"),
                        );
                        None
                    }
                });
                mark(&mut f.invalid, f.id.is_none(), "id");
            }
            "description" => f.description = string(item, "description", report).map(str::to_owned),
            "action" => {
                f.action = string(item, "action", report).and_then(|s| {
                    let parsed = Action::parse(s);
                    if parsed.is_none() {
                        report.error(at, format!("invalid action {s:?}: expected \"block\", \"review\" or \"alert\""));
                    }
                    parsed
                });
                mark(&mut f.invalid, f.action.is_none(), "action");
            }
            "mode" => {
                f.mode = string(item, "mode", report).and_then(|s| {
                    let parsed = Mode::parse(s);
                    if parsed.is_none() {
                        report.error(at, format!("invalid mode {s:?}: expected \"enforce\" or \"shadow\""));
                    }
                    parsed
                });
            }
            "on_store_error" => {
                f.on_store_error = string(item, "on_store_error", report).and_then(|s| {
                    let parsed = OnStoreError::parse(s);
                    if parsed.is_none() {
                        report.error(at, format!("invalid on_store_error {s:?}: expected \"local\", \"allow\" or \"block\""));
                    }
                    parsed
                });
            }
            "enabled" => match item.as_bool() {
                Some(b) => f.enabled = Some(b),
                None => report.error(at, format!("\"enabled\" must be a boolean, found {}", type_name(item))),
            },
            "match" => f.matchers = matchers(item, report),
            "dimensions" => {
                f.dimensions = dimensions(item, report);
                mark(&mut f.invalid, f.dimensions.is_none(), "dimensions");
            }
            "window" => {
                f.window = duration(item, "window", report);
                mark(&mut f.invalid, f.window.is_none(), "window");
            }
            "bucket" => f.bucket = duration(item, "bucket", report),
            "aggregate" => {
                f.aggregate = string(item, "aggregate", report).and_then(|s| {
                    let parsed = match s {
                        "count" => Some(Aggregate::Count),
                        "sum" => Some(Aggregate::Sum),
                        "distinct" => Some(Aggregate::Distinct),
                        _ => None,
                    };
                    if parsed.is_none() {
                        report.error(
                            at,
                            format!("invalid aggregate {s:?}: expected \"count\", \"sum\" or \"distinct\""),
                        );
                    }
                    parsed.map(|a| (a, at))
                });
                mark(&mut f.invalid, f.aggregate.is_none(), "aggregate");
            }
            "field" => {
                f.field = string(item, "field", report).and_then(|s| match FieldPath::parse(s) {
                    Some(p) => Some((p, key_at)),
                    None => {
                        report.error(at, bad_path(s));
                        None
                    }
                });
                mark(&mut f.invalid, f.field.is_none(), "field");
            }
            "limit" => {
                f.limit = limit(item, report);
                mark(&mut f.invalid, f.limit.is_none(), "limit");
            }
            other => report.error(
                key_at,
                format!("unknown key {other:?} in rule; expected one of: {}", RULE_KEYS.join(", ")),
            ),
        }
    }

    let name = f.id.as_deref().map_or_else(|| "rule".to_owned(), |id| format!("rule {id:?}"));
    for (key, present) in [
        ("id", f.id.is_some()),
        ("action", f.action.is_some()),
        ("dimensions", f.dimensions.is_some()),
        ("window", f.window.is_some()),
        ("limit", f.limit.is_some()),
    ] {
        if !present && !f.invalid.contains(&key) {
            report.error(header, format!("{name} is missing required key {key:?}"));
        }
    }

    let aggregate = f.aggregate.map_or(Aggregate::Count, |(a, _)| a);
    if !f.invalid.contains(&"aggregate") {
        match (aggregate, &f.field) {
            (Aggregate::Count, Some((_, at))) => {
                report.error(*at, "\"field\" is not allowed with aggregate \"count\"");
            }
            (Aggregate::Sum | Aggregate::Distinct, None) if !f.invalid.contains(&"field") => {
                let at = f.aggregate.map_or(header, |(_, at)| at);
                report.error(at, format!("aggregate {:?} requires \"field\"", aggregate.as_str()));
            }
            _ => {}
        }
    }

    let spec = f.window.and_then(|(window, window_text, _)| {
        let (bucket_ms, bucket_at) = match f.bucket {
            Some((b, _, at)) => (b, at),
            None => {
                if window % DEFAULT_BUCKETS != 0 {
                    let at = f.window.map_or(header, |(_, _, at)| at);
                    report.error(
                        at,
                        format!(
                            "window {window_text} has no default bucket (window/60 is not a whole number of milliseconds); set \"bucket\""
                        ),
                    );
                    return None;
                }
                (window / DEFAULT_BUCKETS, header)
            }
        };
        let bucket_text = f.bucket.map_or("", |(_, t, _)| t);
        if window % bucket_ms != 0 {
            report.error(bucket_at, format!("bucket {bucket_text} does not divide window {window_text}"));
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
        Some(WindowSpec { bucket_ms, buckets, aggregate })
    });

    if report.diagnostics.len() > errors_before {
        return None;
    }
    Some(Rule {
        id: f.id?,
        description: f.description,
        action: f.action?,
        mode: f.mode.unwrap_or(Mode::Enforce),
        enabled: f.enabled.unwrap_or(true),
        matchers: f.matchers.unwrap_or_default(),
        dimensions: f.dimensions?,
        window: spec?,
        field: f.field.map(|(p, _)| p),
        limit: f.limit?,
        on_store_error: f.on_store_error.unwrap_or_default(),
        origin: report.source.origin(header),
    })
}

fn mark(invalid: &mut Vec<&'static str>, is_invalid: bool, key: &'static str) {
    if is_invalid {
        invalid.push(key);
    }
}

fn valid_id(id: &str) -> bool {
    let bytes = id.as_bytes();
    let allowed = |b: u8, first: bool| {
        b.is_ascii_lowercase() || b.is_ascii_digit() || (!first && matches!(b, b'_' | b'.' | b'-'))
    };
    (1..=64).contains(&bytes.len())
        && allowed(bytes[0], true)
        && bytes[1..].iter().all(|&b| allowed(b, false))
}

fn type_name(item: &Item) -> &'static str {
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

fn string<'t>(item: &'t Item, key: &str, report: &mut Report<'_>) -> Option<&'t str> {
    let s = item.as_str();
    if s.is_none() {
        report.error(item_offset(item), format!("{key:?} must be a string, found {}", type_name(item)));
    }
    s
}

fn bad_path(path: &str) -> String {
    format!("invalid field path {path:?}: expected names separated by single dots, like \"device.id\"")
}

fn duration<'t>(item: &'t Item, key: &str, report: &mut Report<'_>) -> Option<(i64, &'t str, usize)> {
    let at = item_offset(item);
    let Some(text) = item.as_str() else {
        report.error(at, format!("{key:?} must be a duration string like \"10m\", found {}", type_name(item)));
        return None;
    };
    match parse_duration(text) {
        Some(0) => {
            report.error(at, format!("{key} must be longer than zero, found {text:?}"));
            None
        }
        Some(ms) => Some((ms, text, at)),
        None => {
            report.error(
                at,
                format!("invalid duration {text:?} for {key}: expected an integer and a unit (ms, s, m, h or d), like \"10m\""),
            );
            None
        }
    }
}

fn dimensions(item: &Item, report: &mut Report<'_>) -> Option<Vec<FieldPath>> {
    let at = item_offset(item);
    let Some(array) = item.as_array() else {
        report.error(at, format!("\"dimensions\" must be an array of field paths, found {}", type_name(item)));
        return None;
    };
    if array.is_empty() || array.len() > MAX_DIMENSIONS {
        report.error(
            at,
            format!("\"dimensions\" must list 1 to {MAX_DIMENSIONS} field paths, found {}", array.len()),
        );
        return None;
    }
    let mut paths: Vec<FieldPath> = Vec::new();
    let mut ok = true;
    for value in array.iter() {
        let at = value.span().map_or(at, |s| s.start);
        match value.as_str() {
            None => {
                report.error(at, format!("dimension must be a field path string, found {}", value.type_name()));
                ok = false;
            }
            Some(s) => match FieldPath::parse(s) {
                None => {
                    report.error(at, bad_path(s));
                    ok = false;
                }
                Some(p) if paths.contains(&p) => {
                    report.error(at, format!("duplicate dimension {s:?}"));
                    ok = false;
                }
                Some(p) => paths.push(p),
            },
        }
    }
    ok.then_some(paths)
}

fn limit(item: &Item, report: &mut Report<'_>) -> Option<CanonicalNumber> {
    let at = item_offset(item);
    let number = match item {
        Item::Value(Value::Integer(i)) => Number::Int(*i.value()),
        Item::Value(Value::Float(f)) => Number::Float(*f.value()),
        other => {
            report.error(at, format!("\"limit\" must be a number >= 0, found {}", type_name(other)));
            return None;
        }
    };
    let value = number.as_f64();
    if !value.is_finite() {
        report.error(at, "\"limit\" must be a finite number");
        return None;
    }
    if value < 0.0 {
        let shown = match number {
            Number::Float(f) => f.to_string(),
            _ => format!("{value}"),
        };
        report.error(at, format!("\"limit\" must be a number >= 0, found {shown}"));
        return None;
    }
    Some(number.canonical())
}

fn matchers(item: &Item, report: &mut Report<'_>) -> Option<Vec<Matcher>> {
    let Some(table) = item.as_table_like() else {
        report.error(
            item_offset(item),
            format!("\"match\" must be a table of field = value(s), found {}", type_name(item)),
        );
        return None;
    };
    let mut out = Vec::new();
    let ok = collect_matchers(table, "", report, &mut out);
    ok.then_some(out)
}

/// Flattens nested tables (`match.device.os = "ios"`) into dotted paths.
fn collect_matchers(table: &dyn TableLike, prefix: &str, report: &mut Report<'_>, out: &mut Vec<Matcher>) -> bool {
    let mut ok = true;
    for (key, item) in table.iter() {
        let path_text = if prefix.is_empty() { key.to_owned() } else { format!("{prefix}.{key}") };
        if let Some(nested) = item.as_table_like() {
            ok &= collect_matchers(nested, &path_text, report, out);
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
            report.error(at, format!("match on {path_text:?} lists no values, so it could never hold"));
            ok = false;
            continue;
        }
        let mut any_of = Vec::with_capacity(values.len());
        for value in values {
            let parsed = match value {
                Value::String(s) => Some(MatchValue::Str(s.value().clone())),
                Value::Integer(i) => Some(MatchValue::Number(Number::Int(*i.value()).canonical())),
                Value::Float(f) if f.value().is_finite() => {
                    Some(MatchValue::Number(Number::Float(*f.value()).canonical()))
                }
                Value::Boolean(b) => Some(MatchValue::Bool(*b.value())),
                _ => None,
            };
            match parsed {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(text: &str) -> Vec<String> {
        compile_file("r.toml", text).1.iter().map(ToString::to_string).collect()
    }

    const VALID: &str = r#"
[[rule]]
id = "login-fail-user-10m"
action = "block"
match = { type = "login", result = ["fail", "locked"] }
dimensions = ["user_id"]
window = "10m"
limit = 5
"#;

    #[test]
    fn compiles_a_valid_rule_with_defaults() {
        let (rules, diags) = compile_file("r.toml", VALID);
        assert!(diags.is_empty(), "{diags:?}");
        let r = &rules[0];
        assert_eq!(r.id, "login-fail-user-10m");
        assert_eq!(r.mode, Mode::Enforce);
        assert!(r.enabled);
        assert_eq!(r.window, WindowSpec { bucket_ms: 10_000, buckets: 60, aggregate: Aggregate::Count });
        assert_eq!(r.matchers.len(), 2);
        assert_eq!(r.origin.to_string(), "r.toml:2:1");
    }

    #[test]
    fn nested_match_tables_become_dotted_paths() {
        let text = "[[rule]]\nid='a'\naction='alert'\ndimensions=['u']\nwindow='1m'\nlimit=1\nmatch.device.os='ios'\n[rule.match.geo]\ncountry=['FR','DE']\n";
        let (rules, diags) = compile_file("r.toml", text);
        assert!(diags.is_empty(), "{diags:?}");
        let paths: Vec<&str> = rules[0].matchers.iter().map(|m| m.path.as_str()).collect();
        assert_eq!(paths, ["device.os", "geo.country"]);
    }

    #[test]
    fn reports_every_error_at_once() {
        let text = "[[rule]]\nid = \"A\"\naction = \"deny\"\ndimensions = []\nwindow = \"10x\"\nlimit = -1\ncolour = 1\n";
        assert_eq!(
            errors(text),
            [
                "r.toml:2:6: invalid rule id \"A\": must match ^[a-z0-9][a-z0-9_.-]{0,63}$",
                "r.toml:3:10: invalid action \"deny\": expected \"block\", \"review\" or \"alert\"",
                "r.toml:4:14: \"dimensions\" must list 1 to 4 field paths, found 0",
                "r.toml:5:10: invalid duration \"10x\" for window: expected an integer and a unit (ms, s, m, h or d), like \"10m\"",
                "r.toml:6:9: \"limit\" must be a number >= 0, found -1",
                "r.toml:7:1: unknown key \"colour\" in rule; expected one of: id, description, action, mode, enabled, match, dimensions, window, bucket, aggregate, field, limit, on_store_error",
            ]
        );
    }

    #[test]
    fn columns_count_characters_not_bytes() {
        let text = "# é\n[[rule]]\nid = \"ü\"\n";
        assert!(errors(text).iter().any(|e| e.starts_with("r.toml:3:6: invalid rule id")));
    }

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
