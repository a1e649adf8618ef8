//! Rule files → validated counters and rules, with every error reported at once as
//! `file:line:col: message` (an error inside an expression at its column in the file). Pure: the
//! caller reads the files.
//!
//! Three passes: each file's tables are read into drafts (keys, types, durations); then every
//! id is known, so duplicates are found and `$counter` references resolve across files; then
//! expressions are compiled against the shared event projection.

use std::collections::HashMap;
use std::fmt;

use toml_edit::{Document, Item, Table, TableLike, Value};

use std::path::Path;
use std::sync::Arc;

use super::expr::{self, Names};
use super::lists::{ListKind, ListSet};
use super::model::{
    parse_duration, Action, Counter, Form, Hold, MatchValue, Matcher, Mode, OnStoreError, Origin, Rule, Scope,
};
use crate::event::{quote_prefix as q, shorten, Decimal, FieldPath, Projection};
use crate::window::{Aggregate, WindowSpec, DEFAULT_MAX_DISTINCT};

/// Keys a `[[rule]]` table may hold, in the order they are documented.
pub const RULE_KEYS: [&str; 16] = [
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
];
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
/// The most buckets a window may have.
pub const MAX_BUCKETS: i64 = 3600;
/// The longest window: 400 days.
pub const MAX_WINDOW_MS: i64 = 400 * 86_400_000;
/// The most dimension fields a counter may have.
pub const MAX_DIMENSIONS: usize = 4;
/// Buckets in a window when `bucket` is not given.
pub const DEFAULT_BUCKETS: i64 = 60;
/// The largest `max_distinct`.
pub const MAX_DISTINCT_LIMIT: i64 = 100_000;

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
    /// Byte offset of each line's start, found on first use: every rule records where it is, so
    /// a position costs a binary search, not a scan from the top (which made loading quadratic).
    line_starts: std::cell::OnceCell<Vec<usize>>,
}

impl<'a> Source<'a> {
    fn new(name: &'a str, text: &'a str) -> Source<'a> {
        Source { name, text, line_starts: std::cell::OnceCell::new() }
    }

    /// 1-based line and column (in characters) of a byte offset.
    fn origin(&self, offset: usize) -> Origin {
        let mut offset = offset.min(self.text.len());
        while !self.text.is_char_boundary(offset) {
            offset -= 1;
        }
        let starts = self.line_starts.get_or_init(|| {
            std::iter::once(0).chain(self.text.bytes().enumerate().filter(|&(_, b)| b == b'\n').map(|(i, _)| i + 1)).collect()
        });
        let line = starts.partition_point(|&start| start <= offset);
        let line_start = starts[line - 1];
        Origin { file: self.name.to_owned(), line, col: self.text[line_start..offset].chars().count() + 1 }
    }
}

/// Collects diagnostics for one file.
struct Report<'a> {
    source: &'a Source<'a>,
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
    let source = Source::new(name, valid);
    Diagnostic { origin: source.origin(valid_up_to), message: "file is not valid UTF-8".to_owned() }
}

/// An expression string as written in a file: its value, and where its TOML token starts.
#[derive(Debug, Clone)]
struct ExprSite {
    file: usize,
    /// Byte offset of the TOML string token in the file.
    at: usize,
    value: String,
}

/// A `match` as read: a table (checked already) or an expression (compiled in the last pass).
#[derive(Debug, Clone)]
enum DraftScope {
    All,
    Table(Vec<Matcher>),
    Expr(ExprSite),
}

#[derive(Debug)]
struct CounterDraft {
    counter: Counter,
    scope: DraftScope,
}

#[derive(Debug)]
struct RuleDraft {
    id: String,
    description: Option<String>,
    action: Action,
    mode: Mode,
    enabled: bool,
    scope: DraftScope,
    when: Option<ExprSite>,
    /// v1 form: the limit (its counter has the rule's id).
    limit: Option<Decimal>,
    on_store_error: OnStoreError,
    hold: Option<Hold>,
    origin: Origin,
}

/// What compiling a set of files gives.
pub struct CompiledSet {
    pub counters: Vec<Counter>,
    pub rules: Vec<Rule>,
    /// Every list, with its id, and the list files read (name, text) for the rules version.
    pub lists: Vec<(String, Arc<ListSet>)>,
    pub list_files: Vec<(String, String)>,
    pub projection: Projection,
    /// Likely mistakes that do not stop loading.
    pub warnings: Vec<Diagnostic>,
}

/// A `[[list]]` as read.
#[derive(Debug)]
struct ListDraft {
    id: String,
    kind: ListKind,
    file: usize,
    entries: ListEntries,
}

#[derive(Debug)]
enum ListEntries {
    /// Inline values: each value's text and where it is written.
    Inline(Vec<(InlineEntry, usize)>),
    /// A list file, relative to the rule file, and where `file` is written.
    File(String, usize),
}

#[derive(Debug)]
enum InlineEntry {
    Str(String),
    Num(Decimal),
    /// A value of no list kind (a table, a boolean…).
    Other(&'static str),
}

/// Reads a list file by path (the caller's I/O; an error message when it cannot).
pub type ReadFile<'a> = &'a dyn Fn(&str) -> Result<String, String>;

/// A reader for callers without files: every list file is an error.
pub fn no_files(path: &str) -> Result<String, String> {
    Err(format!("cannot read {path}: list files are read only when loading a rule directory"))
}

/// Compiles `(file name, text)` pairs, in the order given, reading list files with `read`.
/// Every error of every file is reported; nothing is built if there is any.
pub fn compile_sources(sources: &[(&str, &str)], read: ReadFile<'_>) -> Result<CompiledSet, Vec<Diagnostic>> {
    let mut diagnostics = Vec::new();
    let mut warnings = Vec::new();
    let mut counters: Vec<CounterDraft> = Vec::new();
    let mut rules: Vec<RuleDraft> = Vec::new();
    let mut list_drafts: Vec<ListDraft> = Vec::new();
    // Every id with where it was defined, to find duplicates (a v1 rule's id once).
    let mut ids: Vec<(String, Origin)> = Vec::new();
    let mut orphans: Vec<(ExprSite, bool)> = Vec::new();
    // One line index per file, shared by every position reported in it.
    let files: Vec<Source> = sources.iter().map(|(name, text)| Source::new(name, text)).collect();
    for (file, (_, text)) in sources.iter().enumerate() {
        let mut report = Report { source: &files[file], diagnostics: Vec::new() };
        read_file(file, text, &mut report, &mut Drafts { counters: &mut counters, rules: &mut rules, lists: &mut list_drafts, orphans: &mut orphans }, &mut ids, &mut warnings);
        let mut file_diags = report.diagnostics;
        file_diags.sort_by_key(|d| (d.origin.line, d.origin.col));
        diagnostics.extend(file_diags);
    }
    // In file order, then by position (tables are read kind by kind).
    let file_order: HashMap<&str, usize> = sources.iter().enumerate().rev().map(|(i, (name, _))| (*name, i)).collect();
    ids.sort_by_key(|(_, o)| (file_order.get(o.file.as_str()).copied(), o.line, o.col));
    let mut first: HashMap<&str, &Origin> = HashMap::new();
    for (id, origin) in &ids {
        if let Some(prev) = first.get(id.as_str()) {
            diagnostics.push(Diagnostic {
                origin: origin.clone(),
                message: format!("duplicate id {id_q} (first defined at {prev}); counters, rules and lists share one namespace", id_q = q(id)),
            });
        } else {
            first.insert(id, origin);
        }
    }

    // Lists: inline values, or a file next to the rule file (its errors at its own lines).
    let mut lists: Vec<(String, Arc<ListSet>)> = Vec::new();
    let mut list_files = Vec::new();
    for draft in &list_drafts {
        let (name, _) = sources[draft.file];
        let source = &files[draft.file];
        let mut set = ListSet::new(draft.kind);
        match &draft.entries {
            ListEntries::Inline(values) => {
                for (entry, at) in values {
                    let result = match (entry, draft.kind) {
                        (InlineEntry::Str(s), ListKind::String | ListKind::Cidr) => set.add(s),
                        (InlineEntry::Num(d), ListKind::Number) => set.add(&d.to_string()),
                        (InlineEntry::Num(_), _) => Err(format!("a number in a {} list", draft.kind.as_str())),
                        (InlineEntry::Str(_), ListKind::Number) => Err("a string in a number list".to_owned()),
                        (InlineEntry::Other(what), _) => Err(format!("a {what} in a {} list", draft.kind.as_str())),
                    };
                    if let Err(message) = result {
                        diagnostics.push(Diagnostic { origin: source.origin(*at), message: format!("list {:?}: {message}", draft.id) });
                    }
                }
            }
            ListEntries::File(file, at) => {
                let path = Path::new(name).parent().unwrap_or(Path::new("")).join(file).display().to_string();
                match read(&path) {
                    Ok(text) => {
                        for (line, col, message) in set.add_file(&text) {
                            diagnostics.push(Diagnostic { origin: Origin { file: path.clone(), line, col }, message });
                        }
                        list_files.push((path, text));
                    }
                    Err(message) => diagnostics.push(Diagnostic { origin: source.origin(*at), message }),
                }
            }
        }
        lists.push((draft.id.clone(), Arc::new(set)));
    }

    // Names resolve against every counter that was read, so a reference to a counter with an
    // error of its own is not reported a second time as unknown.
    let index: HashMap<String, (usize, bool)> =
        counters.iter().enumerate().map(|(i, c)| (c.counter.id.clone(), (i, c.counter.enabled))).collect();
    let rule_ids: std::collections::HashSet<&str> = rules.iter().map(|r| r.id.as_str()).collect();
    let scales: Vec<i32> = counters.iter().map(|c| if c.counter.aggregate() == Aggregate::Sum { 6 } else { 0 }).collect();
    let list_index: HashMap<&str, usize> = lists.iter().enumerate().rev().map(|(i, (id, _))| (id.as_str(), i)).collect();
    let names = CounterNames { index: &index, scales: &scales, rule_ids: &rule_ids, lists: &lists, list_index: &list_index };
    let mut projection = Projection::new();
    let site_error = |site: &ExprSite, e: expr::ExprError| {
        let source = &files[site.file];
        Diagnostic { origin: source.origin(site.at + raw_offset(&source.text[site.at..], e.offset)), message: e.message }
    };
    let compile_scope = |scope: &DraftScope, projection: &mut Projection, diagnostics: &mut Vec<Diagnostic>| match scope {
        DraftScope::All => Some(Scope::All),
        DraftScope::Table(m) => Some(Scope::Table(m.clone())),
        DraftScope::Expr(site) => match expr::compile(&site.value, projection, &names, false) {
            Ok(c) => Some(Scope::Expr(Box::new(c))),
            Err(e) => {
                diagnostics.push(site_error(site, e));
                None
            }
        },
    };
    // Expressions of tables with other errors: their own errors too (names they use may belong
    // to tables that failed, so only what is wrong in the expression itself is reported).
    for (site, allow_counters) in &orphans {
        let lenient = LenientNames(&names);
        if let Err(e) = expr::compile(&site.value, &mut Projection::new(), &lenient, *allow_counters) {
            diagnostics.push(site_error(site, e));
        }
    }
    let mut built_counters = Vec::with_capacity(counters.len());
    for draft in &counters {
        if let Some(scope) = compile_scope(&draft.scope, &mut projection, &mut diagnostics) {
            built_counters.push(Counter { scope, scope_text: scope_text(&draft.scope), ..draft.counter.clone() });
        }
    }
    let mut built_rules = Vec::with_capacity(rules.len());
    for draft in &rules {
        let scope = compile_scope(&draft.scope, &mut projection, &mut diagnostics);
        let when = match &draft.when {
            None => Some(None),
            Some(site) => match expr::compile(&site.value, &mut projection, &names, true) {
                Ok(c) => Some(Some(Box::new(c))),
                Err(e) => {
                    diagnostics.push(site_error(site, e));
                    None
                }
            },
        };
        let (Some(scope), Some(when)) = (scope, when) else { continue };
        let form = match draft.limit {
            Some(limit) => {
                let counter = index[&draft.id].0;
                let scale = if counters[counter].counter.aggregate() == Aggregate::Sum { 6 } else { 0 };
                Form::V1 { counter, limit, threshold: limit.floor_scaled(scale) }
            }
            None => Form::V2,
        };
        if let Some(w) = &when {
            if let Some(value) = w.expr.constant() {
                if value != expr::Val::Bool(true) {
                    warnings.push(Diagnostic {
                        origin: draft.origin.clone(),
                        message: format!("rule {:?} can never fire: its `when` is always {}", draft.id, constant_name(&value)),
                    });
                }
            }
        }
        built_rules.push(Rule {
            id: draft.id.clone(),
            description: draft.description.clone(),
            action: draft.action,
            mode: draft.mode,
            enabled: draft.enabled,
            scope,
            scope_text: scope_text(&draft.scope),
            when,
            when_text: draft.when.as_ref().map(|w| w.value.clone()),
            form,
            on_store_error: draft.on_store_error,
            hold: draft.hold.clone(),
            origin: draft.origin.clone(),
        });
    }
    if !diagnostics.is_empty() {
        // By file (in load order), then by position.
        let files: HashMap<&str, usize> = sources.iter().enumerate().rev().map(|(i, (name, _))| (*name, i)).collect();
        let file_index = |d: &Diagnostic| files.get(d.origin.file.as_str()).copied().unwrap_or(usize::MAX);
        diagnostics.sort_by_key(|d| (file_index(d), d.origin.line, d.origin.col));
        return Err(diagnostics);
    }
    // Counters no rule reads are almost always a mistake (a v1 rule reads its own).
    let mut read = vec![false; built_counters.len()];
    for rule in &built_rules {
        for &i in rule.counters() {
            read[i] = true;
        }
        if let Form::V1 { counter, .. } = rule.form {
            read[counter] = true;
        }
    }
    for (counter, read) in built_counters.iter().zip(read) {
        if !read && counter.enabled {
            warnings.push(Diagnostic {
                origin: counter.origin.clone(),
                message: format!("counter {:?} is not read by any rule", counter.id),
            });
        }
    }
    Ok(CompiledSet { counters: built_counters, rules: built_rules, lists, list_files, projection, warnings })
}

fn scope_text(scope: &DraftScope) -> Option<String> {
    match scope {
        DraftScope::Expr(site) => Some(site.value.clone()),
        _ => None,
    }
}

fn constant_name(v: &expr::Val<'_>) -> &'static str {
    match v {
        expr::Val::Bool(false) => "false",
        expr::Val::Unknown => "unknown (it compares or computes across types)",
        _ => "a value that is not a boolean",
    }
}

struct CounterNames<'a> {
    index: &'a HashMap<String, (usize, bool)>,
    /// Per counter: decimal places of its raw values.
    scales: &'a [i32],
    rule_ids: &'a std::collections::HashSet<&'a str>,
    lists: &'a [(String, Arc<ListSet>)],
    /// Each list id's position in `lists` (the first, if an id is defined twice).
    list_index: &'a HashMap<&'a str, usize>,
}

/// Names that resolve every counter and list (an unknown list as an empty string list): for
/// checking an expression on its own.
struct LenientNames<'n>(&'n CounterNames<'n>);

impl Names for LenientNames<'_> {
    fn counter(&self, id: &str) -> Result<usize, String> {
        Ok(self.0.counter(id).unwrap_or(usize::MAX))
    }

    fn counter_scale(&self, index: usize) -> i32 {
        self.0.scales.get(index).copied().unwrap_or(0)
    }

    fn list(&self, id: &str) -> Result<Arc<ListSet>, String> {
        Ok(self.0.list(id).unwrap_or_else(|_| Arc::new(ListSet::new(ListKind::String))))
    }
}

impl Names for CounterNames<'_> {
    fn counter(&self, id: &str) -> Result<usize, String> {
        match self.index.get(id) {
            Some(&(i, true)) => Ok(i),
            Some(&(_, false)) => Err(format!("counter {} is disabled (enabled = false)", q(id))),
            None if self.rule_ids.contains(id) => Err(format!("{} is a rule, not a counter", q(id))),
            None => Err(format!("unknown counter {}", q(id))),
        }
    }

    fn counter_scale(&self, index: usize) -> i32 {
        self.scales[index]
    }

    fn list(&self, id: &str) -> Result<Arc<ListSet>, String> {
        match self.list_index.get(id) {
            Some(&i) => Ok(Arc::clone(&self.lists[i].1)),
            None if self.index.contains_key(id) => Err(format!("{} is a counter, not a list (write ${id})", q(id))),
            None => Err(format!("unknown list {}", q(id))),
        }
    }
}

/// The byte offset, within a TOML string token `raw` (starting at its opening quote), of the
/// `decoded`-th byte of its value: so an expression error points at its column in the file.
fn raw_offset(raw: &str, decoded: usize) -> usize {
    let (delim, literal) = if raw.starts_with("'''") {
        (3, true)
    } else if raw.starts_with("\"\"\"") {
        (3, false)
    } else if raw.starts_with('\'') {
        (1, true)
    } else {
        (1, false)
    };
    let mut at = delim;
    // A newline right after a multi-line string's opening delimiter is not part of the value.
    if delim == 3 {
        if raw[at..].starts_with("\r\n") {
            at += 2;
        } else if raw[at..].starts_with('\n') {
            at += 1;
        }
    }
    if literal {
        return at + decoded;
    }
    let bytes = raw.as_bytes();
    let mut count = 0;
    while count < decoded && at < bytes.len() {
        if bytes[at] == b'\\' && at + 1 < bytes.len() {
            match bytes[at + 1] {
                b'u' => {
                    let code = u32::from_str_radix(raw.get(at + 2..at + 6).unwrap_or(""), 16).ok();
                    count += code.and_then(char::from_u32).map_or(1, char::len_utf8);
                    at += 6;
                }
                b'U' => {
                    let code = u32::from_str_radix(raw.get(at + 2..at + 10).unwrap_or(""), 16).ok();
                    count += code.and_then(char::from_u32).map_or(1, char::len_utf8);
                    at += 10;
                }
                b' ' | b'\t' | b'\n' | b'\r' => {
                    // A line-ending backslash: the whitespace up to the next text is dropped.
                    at += 1;
                    while at < bytes.len() && bytes[at].is_ascii_whitespace() {
                        at += 1;
                    }
                }
                _ => {
                    count += 1;
                    at += 2;
                }
            }
        } else {
            let len = raw[at..].chars().next().map_or(1, char::len_utf8);
            count += len;
            at += len;
        }
    }
    at
}

fn key_offset(table: &dyn TableLike, key: &str) -> usize {
    table.get_key_value(key).and_then(|(k, _)| k.span()).map_or(0, |s| s.start)
}

fn item_offset(item: &Item) -> usize {
    item.span().map_or(0, |s| s.start)
}

/// What the tables of the files become, as they are read.
struct Drafts<'d> {
    counters: &'d mut Vec<CounterDraft>,
    rules: &'d mut Vec<RuleDraft>,
    lists: &'d mut Vec<ListDraft>,
    /// The expressions of tables that had other errors (with whether counters are allowed):
    /// checked for their own errors too, so one `check` reports everything.
    orphans: &'d mut Vec<(ExprSite, bool)>,
}

fn read_file(
    file: usize,
    text: &str,
    report: &mut Report<'_>,
    drafts: &mut Drafts<'_>,
    ids: &mut Vec<(String, Origin)>,
    warnings: &mut Vec<Diagnostic>,
) {
    let doc = match Document::parse(text) {
        Ok(doc) => doc,
        Err(err) => {
            let offset = err.span().map_or(0, |s| s.start);
            let message = err.message().lines().next().unwrap_or("invalid TOML").trim_end();
            report.error(offset, format!("TOML syntax error: {message}"));
            return;
        }
    };
    let root = doc.as_table();
    for (key, _) in root.iter() {
        match key {
            "rule" | "counter" | "list" => {}
            _ => report.error(
                key_offset(root, key),
                format!("unknown top-level key {key_q}; a rule file holds [[counter]], [[rule]] and [[list]] tables", key_q = q(key)),
            ),
        }
    }
    for kind in ["list", "counter", "rule"] {
        let Some(item) = root.get(kind) else { continue };
        let Some(tables) = item.as_array_of_tables() else {
            report.error(key_offset(root, kind), format!("{kind_q} must be an array of tables: write each one as [[{kind}]]", kind_q = q(kind)));
            continue;
        };
        for table in tables.iter() {
            let mut cx = TableCx { file, report: &mut *report, warnings: &mut *warnings, ids: &mut *ids, orphans: &mut *drafts.orphans };
            if kind == "list" {
                if let Some(draft) = read_list(table, &mut cx) {
                    drafts.lists.push(draft);
                }
            } else if kind == "counter" {
                if let Some(draft) = read_counter(table, &mut cx) {
                    drafts.counters.push(draft);
                }
            } else if let Some((rule, counter)) = read_rule(table, &mut cx) {
                if let Some(counter) = counter {
                    drafts.counters.push(counter);
                }
                drafts.rules.push(rule);
            }
        }
    }
}

struct TableCx<'r, 'a> {
    file: usize,
    report: &'r mut Report<'a>,
    warnings: &'r mut Vec<Diagnostic>,
    /// Every valid id read, with where its table starts (duplicates are found across files,
    /// including tables with other errors).
    ids: &'r mut Vec<(String, Origin)>,
    orphans: &'r mut Vec<(ExprSite, bool)>,
}

impl TableCx<'_, '_> {
    fn record_id(&mut self, id: Option<&String>, header: usize) {
        if let Some(id) = id {
            self.ids.push((id.clone(), self.report.source.origin(header)));
        }
    }
}

/// The keys shared by counters and v1 rules, as read.
#[derive(Default)]
struct WindowKeys<'t> {
    dimensions: Option<Vec<FieldPath>>,
    window: Option<(i64, &'t str, usize)>,
    bucket: Option<(i64, &'t str, usize)>,
    aggregate: Option<(Aggregate, usize)>,
    field: Option<(FieldPath, usize)>,
}

/// Reads one key shared by counters and v1 rules; false if `key` is not one of them.
fn window_key<'t>(key: &str, item: &'t Item, key_at: usize, w: &mut WindowKeys<'t>, invalid: &mut Vec<&'static str>, report: &mut Report<'_>) -> bool {
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
            w.aggregate = string(item, "aggregate", report).and_then(|s| {
                let parsed = match s {
                    "count" => Some(Aggregate::Count),
                    "sum" => Some(Aggregate::Sum),
                    "distinct" => Some(Aggregate::Distinct),
                    _ => None,
                };
                if parsed.is_none() {
                    report.error(at, format!("invalid aggregate {s_q}: expected \"count\", \"sum\" or \"distinct\"", s_q = q(s)));
                }
                parsed.map(|a| (a, at))
            });
            mark(invalid, w.aggregate.is_none(), "aggregate");
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
fn window_identity(dimensions: &[FieldPath], field: Option<&FieldPath>) -> u64 {
    let mut hasher = blake3::Hasher::new();
    for path in dimensions {
        hasher.update(path.to_string().as_bytes());
        hasher.update(b"\0");
    }
    hasher.update(b"\x01");
    if let Some(field) = field {
        hasher.update(field.to_string().as_bytes());
    }
    let mut first = [0u8; 8];
    first.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    u64::from_le_bytes(first).max(1)
}

/// Cross-key checks of the window keys; the spec if they hold.
fn window_spec(w: &WindowKeys<'_>, invalid: &[&'static str], header: usize, report: &mut Report<'_>) -> Option<WindowSpec> {
    let aggregate = w.aggregate.map_or(Aggregate::Count, |(a, _)| a);
    if !invalid.contains(&"aggregate") {
        match (aggregate, &w.field) {
            (Aggregate::Count, Some((_, at))) => {
                report.error(*at, "\"field\" is not allowed with aggregate \"count\"");
            }
            (Aggregate::Sum | Aggregate::Distinct, None) if !invalid.contains(&"field") => {
                let at = w.aggregate.map_or(header, |(_, at)| at);
                report.error(at, format!("aggregate {:?} requires \"field\"", aggregate.as_str()));
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
        report.error(bucket_at, format!("bucket {} does not divide window {}", shorten(bucket_text), shorten(window_text)));
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

fn read_id(item: &Item, report: &mut Report<'_>, what: &str) -> Option<String> {
    let at = item_offset(item);
    string(item, "id", report).and_then(|id| {
        if valid_id(id) {
            Some(id.to_owned())
        } else {
            report.error(at, format!("invalid {what} id {id_q}: must match ^[a-z0-9][a-z0-9_.-]{{0,63}}$", id_q = q(id)));
            None
        }
    })
}

/// A `match`: a table (v1) or an expression string.
fn read_scope(item: &Item, cx: &mut TableCx<'_, '_>) -> Option<DraftScope> {
    if let Some(text) = item.as_str() {
        return Some(DraftScope::Expr(ExprSite { file: cx.file, at: item_offset(item), value: text.to_owned() }));
    }
    matchers(item, cx.report, cx.warnings).map(DraftScope::Table)
}

/// Keys a `[[list]]` table may hold.
pub const LIST_KEYS: [&str; 5] = ["id", "description", "kind", "file", "values"];

fn read_list(table: &Table, cx: &mut TableCx<'_, '_>) -> Option<ListDraft> {
    let header = table.span().map_or(0, |s| s.start);
    let errors_before = cx.report.diagnostics.len();
    let (mut id, mut kind, mut entries) = (None, None, Vec::new());
    let mut invalid = Vec::new();
    for (key, item) in table.iter() {
        let key_at = key_offset(table, key);
        let at = item_offset(item);
        match key {
            "id" => {
                id = read_id(item, cx.report, "list");
                mark(&mut invalid, id.is_none(), "id");
            }
            "description" => {
                string(item, "description", cx.report);
            }
            "kind" => {
                kind = string(item, "kind", cx.report).and_then(|s| {
                    let parsed = ListKind::parse(s);
                    if parsed.is_none() {
                        cx.report.error(at, format!("invalid list kind {s_q}: expected \"string\", \"number\" or \"cidr\"", s_q = q(s)));
                    }
                    parsed
                });
            }
            "file" => {
                if let Some(path) = string(item, "file", cx.report) {
                    entries.push(ListEntries::File(path.to_owned(), at));
                }
            }
            "values" => match item.as_array() {
                Some(array) => {
                    let values = array
                        .iter()
                        .map(|v| {
                            let at = v.span().map_or(at, |s| s.start);
                            let entry = match v {
                                Value::String(s) => InlineEntry::Str(s.value().clone()),
                                Value::Integer(_) | Value::Float(_) => match exact_number(v, cx.report) {
                                    Some(d) => InlineEntry::Num(d),
                                    None => InlineEntry::Other("non-finite number"),
                                },
                                other => InlineEntry::Other(other.type_name()),
                            };
                            (entry, at)
                        })
                        .collect();
                    entries.push(ListEntries::Inline(values));
                }
                None => cx.report.error(at, format!("\"values\" must be an array, found {}", type_name(item))),
            },
            other => cx.report.error(key_at, format!("unknown key {other_q} in list; expected one of: {}", LIST_KEYS.join(", "), other_q = q(other))),
        }
    }
    let name = id.as_deref().map_or_else(|| "list".to_owned(), |id| format!("list {id_q}", id_q = q(id)));
    if id.is_none() && !invalid.contains(&"id") {
        cx.report.error(header, format!("{name} is missing required key \"id\""));
    }
    if entries.len() != 1 {
        cx.report.error(header, format!("{name} needs exactly one of \"file\" and \"values\""));
    }
    cx.record_id(id.as_ref(), header);
    if cx.report.diagnostics.len() > errors_before {
        return None;
    }
    Some(ListDraft { id: id?, kind: kind.unwrap_or(ListKind::String), file: cx.file, entries: entries.pop()? })
}

fn read_counter(table: &Table, cx: &mut TableCx<'_, '_>) -> Option<CounterDraft> {
    let header = table.span().map_or(0, |s| s.start);
    let errors_before = cx.report.diagnostics.len();
    let mut invalid = Vec::new();
    let mut w = WindowKeys::default();
    let (mut id, mut description, mut scope, mut enabled) = (None, None, None, None);
    let (mut allow_negative, mut max_distinct) = (None, None);
    for (key, item) in table.iter() {
        let key_at = key_offset(table, key);
        let at = item_offset(item);
        if window_key(key, item, key_at, &mut w, &mut invalid, cx.report) {
            continue;
        }
        match key {
            "id" => {
                id = read_id(item, cx.report, "counter");
                mark(&mut invalid, id.is_none(), "id");
            }
            "description" => description = string(item, "description", cx.report).map(str::to_owned),
            "match" => scope = read_scope(item, cx),
            "enabled" => enabled = boolean(item, "enabled", cx.report),
            "allow_negative" => allow_negative = boolean(item, "allow_negative", cx.report).map(|b| (b, key_at)),
            "max_distinct" => match item.as_integer() {
                Some(n) if (1..=MAX_DISTINCT_LIMIT).contains(&n) => max_distinct = Some((n as u32, key_at)),
                _ => cx.report.error(at, format!("\"max_distinct\" must be an integer from 1 to {MAX_DISTINCT_LIMIT}")),
            },
            "when" | "action" | "limit" => cx.report.error(
                key_at,
                format!("{key_q} belongs in a [[rule]]: a counter only counts; a rule reads it as $<counter id>", key_q = q(key)),
            ),
            other => cx.report.error(
                key_at,
                format!("unknown key {other_q} in counter; expected one of: {}", COUNTER_KEYS.join(", "), other_q = q(other)),
            ),
        }
    }
    let name = id.as_deref().map_or_else(|| "counter".to_owned(), |id| format!("counter {id_q}", id_q = q(id)));
    for (key, present) in [("id", id.is_some()), ("dimensions", w.dimensions.is_some()), ("window", w.window.is_some())] {
        if !present && !invalid.contains(&key) {
            cx.report.error(header, format!("{name} is missing required key {key_q}", key_q = q(key)));
        }
    }
    let spec = window_spec(&w, &invalid, header, cx.report);
    let aggregate = w.aggregate.map_or(Aggregate::Count, |(a, _)| a);
    if let Some((_, at)) = allow_negative.filter(|_| aggregate != Aggregate::Sum) {
        cx.report.error(at, "\"allow_negative\" is only for aggregate \"sum\"");
    }
    if let Some((_, at)) = max_distinct.filter(|_| aggregate != Aggregate::Distinct) {
        cx.report.error(at, "\"max_distinct\" is only for aggregate \"distinct\"");
    }
    cx.record_id(id.as_ref(), header);
    if cx.report.diagnostics.len() > errors_before {
        if let Some(DraftScope::Expr(site)) = scope {
            cx.orphans.push((site, false));
        }
        return None;
    }
    let origin = cx.report.source.origin(header);
    let id = id?;
    let mut window = spec?;
    window.max_distinct = max_distinct.map_or(DEFAULT_MAX_DISTINCT, |(n, _)| n);
    let dimensions = w.dimensions?;
    let field = w.field.map(|(p, _)| p);
    window.identity = window_identity(&dimensions, field.as_ref());
    let counter = Counter {
        id: id.clone(),
        description,
        enabled: enabled.unwrap_or(true),
        scope: Scope::All,
        scope_text: None,
        dimensions,
        window,
        field,
        allow_negative: allow_negative.is_some_and(|(b, _)| b),
        from_rule: false,
        origin: origin.clone(),
    };
    Some(CounterDraft { counter, scope: scope.unwrap_or(DraftScope::All) })
}

#[allow(clippy::type_complexity)]
fn read_rule(table: &Table, cx: &mut TableCx<'_, '_>) -> Option<(RuleDraft, Option<CounterDraft>)> {
    let header = table.span().map_or(0, |s| s.start);
    let errors_before = cx.report.diagnostics.len();
    let mut invalid = Vec::new();
    let mut w = WindowKeys::default();
    let mut window_keys_at: Vec<(&str, usize)> = Vec::new();
    let (mut id, mut description, mut action, mut mode, mut enabled) = (None, None, None, None, None);
    let (mut scope, mut when, mut limit, mut on_store_error) = (None, None, None, None);
    let (mut hold, mut hold_key) = (None, None);
    for (key, item) in table.iter() {
        let key_at = key_offset(table, key);
        let at = item_offset(item);
        if window_key(key, item, key_at, &mut w, &mut invalid, cx.report) {
            window_keys_at.push((key, key_at));
            continue;
        }
        match key {
            "id" => {
                id = read_id(item, cx.report, "rule");
                mark(&mut invalid, id.is_none(), "id");
            }
            "description" => description = string(item, "description", cx.report).map(str::to_owned),
            "action" => {
                action = string(item, "action", cx.report).and_then(|s| {
                    let parsed = Action::parse(s);
                    if parsed.is_none() {
                        cx.report.error(
                            at,
                            format!("invalid action {s_q}: expected \"block\", \"challenge\", \"review\", \"alert\" or \"allow\"", s_q = q(s)),
                        );
                    }
                    parsed
                });
                mark(&mut invalid, action.is_none(), "action");
            }
            "mode" => {
                mode = string(item, "mode", cx.report).and_then(|s| {
                    let parsed = Mode::parse(s);
                    if parsed.is_none() {
                        cx.report.error(at, format!("invalid mode {s_q}: expected \"enforce\" or \"shadow\"", s_q = q(s)));
                    }
                    parsed
                });
            }
            "on_store_error" => {
                on_store_error = string(item, "on_store_error", cx.report).and_then(|s| {
                    let parsed = OnStoreError::parse(s);
                    if parsed.is_none() {
                        cx.report.error(at, format!("invalid on_store_error {s_q}: expected \"local\", \"allow\" or \"block\"", s_q = q(s)));
                    }
                    parsed
                });
            }
            "enabled" => enabled = boolean(item, "enabled", cx.report),
            "match" => scope = read_scope(item, cx),
            "when" => match item.as_str() {
                Some(text) => when = Some((ExprSite { file: cx.file, at, value: text.to_owned() }, key_at)),
                None => cx.report.error(at, format!("\"when\" must be an expression string, found {}", type_name(item))),
            },
            "limit" => {
                limit = read_limit(item, cx.report).map(|l| (l, key_at));
                mark(&mut invalid, limit.is_none(), "limit");
            }
            "hold" => {
                hold = duration(item, "hold", cx.report).and_then(|(ms, text, at)| {
                    if ms > MAX_WINDOW_MS {
                        cx.report.error(at, format!("hold {} is longer than 400d", shorten(text)));
                        return None;
                    }
                    Some((ms, key_at))
                });
                mark(&mut invalid, hold.is_none(), "hold");
            }
            "hold_key" => {
                hold_key = field_paths(item, "hold_key", cx.report).map(|paths| (paths, key_at));
                mark(&mut invalid, hold_key.is_none(), "hold_key");
            }
            other => cx.report.error(
                key_at,
                format!("unknown key {other_q} in rule; expected one of: {}", RULE_KEYS.join(", "), other_q = q(other)),
            ),
        }
    }
    let name = id.as_deref().map_or_else(|| "rule".to_owned(), |id| format!("rule {id_q}", id_q = q(id)));
    // The v1 form (`window` + `limit`) is a counter and a rule in one table.
    let v1 = w.window.is_some() || invalid.contains(&"window");
    let mut required = vec![("id", id.is_some()), ("action", action.is_some())];
    if v1 {
        required.extend([("dimensions", w.dimensions.is_some()), ("limit", limit.is_some())]);
        if let Some((_, at)) = &when {
            cx.report.error(*at, "\"when\" is not allowed with \"window\" and \"limit\" (the v1 form fires on its limit): define a [[counter]] and test it in `when`");
        }
    } else {
        if let Some((_, at)) = limit {
            cx.report.error(at, "\"limit\" needs \"window\" (the v1 form); otherwise write the condition in `when`, like \"$counter-id > 5\"");
        }
        for (key, at) in &window_keys_at {
            cx.report.error(*at, format!("{key_q} needs \"window\" (the v1 form); otherwise define a [[counter]] and test it in `when`", key_q = q(key)));
        }
    }
    match (&hold, &hold_key) {
        (None, Some((_, at))) if !invalid.contains(&"hold") => {
            cx.report.error(*at, "\"hold_key\" needs \"hold\" (how long a fired rule keeps firing for that key)");
        }
        (Some(_), None) if !v1 && !invalid.contains(&"hold_key") => {
            required.push(("hold_key", false));
        }
        _ => {}
    }
    for (key, present) in required {
        if !present && !invalid.contains(&key) {
            cx.report.error(header, format!("{name} is missing required key {key_q}", key_q = q(key)));
        }
    }
    let spec = if v1 { window_spec(&w, &invalid, header, cx.report) } else { None };
    cx.record_id(id.as_ref(), header);
    if cx.report.diagnostics.len() > errors_before {
        if let Some(DraftScope::Expr(site)) = scope {
            cx.orphans.push((site, false));
        }
        if let Some((site, _)) = when {
            cx.orphans.push((site, true));
        }
        return None;
    }
    let origin = cx.report.source.origin(header);
    let id = id?;
    let enabled = enabled.unwrap_or(true);
    let scope = scope.unwrap_or(DraftScope::All);
    // A v1-form rule holds its own dimension key unless told otherwise.
    let hold = match (hold, hold_key) {
        (Some((ms, _)), Some((key, _))) => Some(Hold { ms, key }),
        (Some((ms, _)), None) => Some(Hold { ms, key: w.dimensions.clone()? }),
        (None, _) => None,
    };
    let counter = if v1 {
        let dimensions = w.dimensions?;
        let field = w.field.map(|(p, _)| p);
        let mut window = spec?;
        window.identity = window_identity(&dimensions, field.as_ref());
        let counter = Counter {
            id: id.clone(),
            description: None,
            enabled,
            scope: Scope::All,
            scope_text: None,
            dimensions,
            window,
            field,
            allow_negative: false,
            from_rule: true,
            origin: origin.clone(),
        };
        Some(CounterDraft { counter, scope: scope.clone() })
    } else {
        None
    };
    let rule = RuleDraft {
        id: id.clone(),
        description,
        action: action?,
        mode: mode.unwrap_or(Mode::Enforce),
        enabled,
        scope,
        when: when.map(|(site, _)| site),
        limit: limit.map(|(l, _)| l),
        on_store_error: on_store_error.unwrap_or_default(),
        hold,
        origin: origin.clone(),
    };
    Some((rule, counter))
}

fn boolean(item: &Item, key: &str, report: &mut Report<'_>) -> Option<bool> {
    let b = item.as_bool();
    if b.is_none() {
        report.error(item_offset(item), format!("{key_q} must be a boolean, found {}", type_name(item), key_q = q(key)));
    }
    b
}

/// A TOML number as the exact decimal its text writes.
fn toml_number(value: &Value) -> Option<Decimal> {
    match value {
        Value::Integer(i) => Some(Decimal::from_i64(*i.value())),
        Value::Float(f) => Decimal::from_f64(*f.value()),
        _ => None,
    }
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
        report.error(item_offset(item), format!("{key_q} must be a string, found {}", type_name(item), key_q = q(key)));
    }
    s
}

fn bad_path(path: &str) -> String {
    format!("invalid field path {path_q}: expected names separated by single dots, like \"device.id\"", path_q = q(path))
}

fn duration<'t>(item: &'t Item, key: &str, report: &mut Report<'_>) -> Option<(i64, &'t str, usize)> {
    let at = item_offset(item);
    let Some(text) = item.as_str() else {
        report.error(at, format!("{key_q} must be a duration string like \"10m\", found {}", type_name(item), key_q = q(key)));
        return None;
    };
    match parse_duration(text) {
        Some(0) => {
            report.error(at, format!("{key} must be longer than zero, found {text_q}", text_q = q(text)));
            None
        }
        Some(ms) => Some((ms, text, at)),
        None => {
            report.error(
                at,
                format!("invalid duration {text_q} for {key}: expected an integer and a unit (ms, s, m, h or d), like \"10m\"", text_q = q(text)),
            );
            None
        }
    }
}

fn dimensions(item: &Item, report: &mut Report<'_>) -> Option<Vec<FieldPath>> {
    field_paths(item, "dimensions", report)
}

/// A key made of 1 to `MAX_DIMENSIONS` distinct field paths (`dimensions`, `hold_key`).
fn field_paths(item: &Item, key: &str, report: &mut Report<'_>) -> Option<Vec<FieldPath>> {
    let at = item_offset(item);
    let Some(array) = item.as_array() else {
        report.error(at, format!("{key_q} must be an array of field paths, found {}", type_name(item), key_q = q(key)));
        return None;
    };
    if array.is_empty() || array.len() > MAX_DIMENSIONS {
        report.error(
            at,
            format!("{key_q} must list 1 to {MAX_DIMENSIONS} field paths, found {}", array.len(), key_q = q(key)),
        );
        return None;
    }
    let noun = if key == "dimensions" { "dimension" } else { "hold_key entry" };
    let mut paths: Vec<FieldPath> = Vec::new();
    let mut ok = true;
    for value in array.iter() {
        let at = value.span().map_or(at, |s| s.start);
        match value.as_str() {
            None => {
                report.error(at, format!("{noun} must be a field path string, found {}", value.type_name()));
                ok = false;
            }
            Some(s) => match FieldPath::parse(s) {
                None => {
                    report.error(at, bad_path(s));
                    ok = false;
                }
                Some(p) if paths.contains(&p) => {
                    report.error(at, format!("duplicate {noun} {s_q}", s_q = q(s)));
                    ok = false;
                }
                Some(p) => paths.push(p),
            },
        }
    }
    ok.then_some(paths)
}

fn read_limit(item: &Item, report: &mut Report<'_>) -> Option<Decimal> {
    let at = item_offset(item);
    let number = match item {
        Item::Value(v @ (Value::Integer(_) | Value::Float(_))) => exact_number(v, report),
        other => {
            report.error(at, format!("\"limit\" must be a number >= 0, found {}", type_name(other)));
            return None;
        }
    };
    let Some(number) = number else {
        report.error(at, "\"limit\" must be a finite number");
        return None;
    };
    if number.is_negative() {
        report.error(at, format!("\"limit\" must be a number >= 0, found {number}"));
        return None;
    }
    Some(number)
}

/// A TOML number as the exact decimal its text in the file writes (`None` for inf and nan).
fn exact_number(value: &Value, report: &Report<'_>) -> Option<Decimal> {
    if let Value::Float(_) = value {
        if let Some(span) = value.span() {
            if let Some(text) = report.source.text.get(span) {
                return Decimal::parse(&text.trim().replace('_', ""));
            }
        }
    }
    toml_number(value)
}

/// A `match` table value that reads like a comparison (`"> 500"`): a table matches it literally.
fn looks_like_comparison(s: &str) -> bool {
    let t = s.trim_start();
    ["<", ">", "!=", "==", ">=", "<="].iter().any(|op| t.starts_with(op)) && t.len() > 1
}

fn matchers(item: &Item, report: &mut Report<'_>, warnings: &mut Vec<Diagnostic>) -> Option<Vec<Matcher>> {
    let Some(table) = item.as_table_like() else {
        report.error(
            item_offset(item),
            format!("\"match\" must be an expression string or a table of field = value(s), found {}", type_name(item)),
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
        let path_text = if prefix.is_empty() { key.to_owned() } else { format!("{prefix}.{key}") };
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
            report.error(at, format!("match on {path_text_q} lists no values, so it could never hold", path_text_q = q(&path_text)));
            ok = false;
            continue;
        }
        let mut any_of = Vec::with_capacity(values.len());
        for value in values {
            let parsed = match value {
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
        match compile_sources(&[("r.toml", text)], &no_files) {
            Ok(_) => Vec::new(),
            Err(diags) => diags.iter().map(ToString::to_string).collect(),
        }
    }

    fn compile_one(text: &str) -> CompiledSet {
        compile_sources(&[("r.toml", text)], &no_files).unwrap_or_else(|d| panic!("{d:?}"))
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
        let set = compile_one(VALID);
        let r = &set.rules[0];
        assert_eq!(r.id, "login-fail-user-10m");
        assert_eq!(r.mode, Mode::Enforce);
        assert!(r.enabled);
        assert_eq!(r.form, Form::V1 { counter: 0, limit: Decimal::from_i64(5), threshold: 5 });
        let c = &set.counters[0];
        assert_eq!(c.id, r.id);
        assert_eq!((c.window.bucket_ms, c.window.buckets, c.window.aggregate), (10_000, 60, Aggregate::Count));
        assert_ne!(c.window.identity, 0, "what the window counts is part of its identity");
        assert!(matches!(&r.scope, Scope::Table(m) if m.len() == 2));
        assert_eq!(r.origin.to_string(), "r.toml:2:1");
    }

    #[test]
    fn nested_match_tables_become_dotted_paths() {
        let text = "[[rule]]\nid='a'\naction='alert'\ndimensions=['u']\nwindow='1m'\nlimit=1\nmatch.device.os='ios'\n[rule.match.geo]\ncountry=['FR','DE']\n";
        let set = compile_one(text);
        let Scope::Table(matchers) = &set.rules[0].scope else { panic!("a table") };
        let paths: Vec<&str> = matchers.iter().map(|m| m.path.as_str()).collect();
        assert_eq!(paths, ["device.os", "geo.country"]);
    }

    #[test]
    fn reports_every_error_at_once() {
        let text = "[[rule]]\nid = \"A\"\naction = \"deny\"\ndimensions = []\nwindow = \"10x\"\nlimit = -1\ncolour = 1\n";
        assert_eq!(
            errors(text),
            [
                "r.toml:2:6: invalid rule id \"A\": must match ^[a-z0-9][a-z0-9_.-]{0,63}$",
                "r.toml:3:10: invalid action \"deny\": expected \"block\", \"challenge\", \"review\", \"alert\" or \"allow\"",
                "r.toml:4:14: \"dimensions\" must list 1 to 4 field paths, found 0",
                "r.toml:5:10: invalid duration \"10x\" for window: expected an integer and a unit (ms, s, m, h or d), like \"10m\"",
                "r.toml:6:9: \"limit\" must be a number >= 0, found -1",
                "r.toml:7:1: unknown key \"colour\" in rule; expected one of: id, description, action, mode, enabled, match, when, on_store_error, dimensions, window, bucket, aggregate, field, limit, hold, hold_key",
            ]
        );
    }

    #[test]
    fn expression_errors_point_into_the_file() {
        // The column is that of the offending token inside the TOML string, escapes included.
        let text = r#"[[counter]]
id = 'c'
dimensions = ['u']
window = '1m'

[[rule]]
id = 'r'
action = 'block'
when = "$c > 1 && \"a\" == $nope"
match = '''
  type == 'x' &&
  $c > 1'''
"#;
        assert_eq!(
            errors(text),
            [
                "r.toml:9:28: unknown counter \"nope\"",
                "r.toml:12:3: a match cannot use counters ($c): test it in the rule's `when`",
            ]
        );
    }

    #[test]
    fn the_two_forms_do_not_mix() {
        let text = "[[rule]]\nid='r'\naction='block'\nlimit=5\nwhen='true'\n";
        assert_eq!(
            errors(text),
            ["r.toml:4:1: \"limit\" needs \"window\" (the v1 form); otherwise write the condition in `when`, like \"$counter-id > 5\""]
        );
        let text = "[[rule]]\nid='r'\naction='block'\ndimensions=['u']\nwindow='1m'\nlimit=5\nwhen='true'\n";
        assert_eq!(
            errors(text),
            ["r.toml:7:1: \"when\" is not allowed with \"window\" and \"limit\" (the v1 form fires on its limit): define a [[counter]] and test it in `when`"]
        );
    }

    #[test]
    fn warns_about_likely_mistakes() {
        let text = "[[counter]]\nid='unread'\ndimensions=['u']\nwindow='1m'\n\n[[rule]]\nid='never'\naction='block'\nwhen=\"'a' > 1\"\n\n[[rule]]\nid='cmp'\naction='review'\nmatch={ amount = '> 500' }\n";
        let warnings: Vec<String> = compile_one(text).warnings.iter().map(ToString::to_string).collect();
        assert_eq!(
            warnings,
            [
                "r.toml:14:18: match value \"> 500\" for \"amount\" is compared as a plain string; to compare, write an expression: match = \"amount > 500\"",
                "r.toml:6:1: rule \"never\" can never fire: its `when` is always unknown (it compares or computes across types)",
                "r.toml:1:1: counter \"unread\" is not read by any rule",
            ]
        );
    }

    #[test]
    fn raw_offsets_follow_escapes_and_delimiters() {
        assert_eq!(raw_offset("'abc'", 2), 3);
        assert_eq!(raw_offset(r#""a\"b""#, 2), 4);
        assert_eq!(raw_offset(r#""\u00e9x""#, 2), 7);
        assert_eq!(raw_offset("'''\nab'''", 1), 5);
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
