//! Table readers: each rule file parsed as TOML and its `[[list]]`, `[[counter]]` and `[[rule]]`
//! tables read into drafts, kind by kind, every error of each file reported at its position.

pub(super) mod drafts;

mod counter;
mod list;
mod rule;
mod window;

pub use counter::{COUNTER_KEYS, MAX_DISTINCT_LIMIT};
pub use list::LIST_KEYS;
pub use rule::RULE_KEYS;
pub use window::{DEFAULT_BUCKETS, MAX_BUCKETS, MAX_WINDOW_MS};

use toml_edit::{Document, Table};

use super::positions::{key_offset, Diagnostic, Report, RuleFile};
use crate::event::quote_prefix as q;
use crate::rules::model::FileLocation;
use drafts::{CounterDraft, ExprSite, ListDraft, RuleDraft, TableCx};

/// What the tables of every file become, as they are read.
#[derive(Default)]
pub(super) struct ReadTables {
    pub(super) counters: Vec<CounterDraft>,
    pub(super) rules: Vec<RuleDraft>,
    pub(super) lists: Vec<ListDraft>,
    /// Every id with where it was defined, to find duplicates (a v1 rule's id once).
    pub(super) ids: Vec<(String, FileLocation)>,
    /// The expressions of tables that had other errors (with whether counters are allowed):
    /// checked for their own errors too, so one `check` reports everything.
    pub(super) orphans: Vec<(ExprSite, bool)>,
    /// Errors: file by file, each file's by position.
    pub(super) diagnostics: Vec<Diagnostic>,
    /// Likely mistakes that do not stop loading.
    pub(super) warnings: Vec<Diagnostic>,
}

/// Reads the tables of every file, in the order given.
pub(super) fn read_files(files: &[RuleFile<'_>]) -> ReadTables {
    let mut tables = ReadTables::default();
    for (file, source) in files.iter().enumerate() {
        let mut report = Report {
            source,
            file,
            diagnostics: Vec::new(),
        };
        read_file(file, &mut report, &mut tables);
        let mut file_diags = report.diagnostics;
        file_diags.sort_by_key(|d| (d.origin.line, d.origin.col));
        tables.diagnostics.extend(file_diags);
    }
    tables
}

fn read_file(file: usize, report: &mut Report<'_>, tables: &mut ReadTables) {
    let doc = match Document::parse(report.source.text) {
        Ok(doc) => doc,
        Err(err) => {
            let offset = err.span().map_or(0, |s| s.start);
            let message = err
                .message()
                .lines()
                .next()
                .unwrap_or("invalid TOML")
                .trim_end();
            // TOML integers are 64-bit; a longer id is exact in vigil when written as a float.
            let hint = if message.contains("integer number overflowed") {
                " (TOML integers are 64-bit: write a longer number with a fraction, as in \
                 `18446744073709551615.0`, which vigil reads exactly)"
            } else {
                ""
            };
            report.error(offset, format!("TOML syntax error: {message}{hint}"));
            return;
        }
    };
    let root = doc.as_table();
    check_top_level_keys(root, report);
    for kind in ["list", "counter", "rule"] {
        let Some(item) = root.get(kind) else { continue };
        let Some(array) = item.as_array_of_tables() else {
            report.error(
                key_offset(root, kind),
                format!(
                    "{kind_q} must be an array of tables: write each one as [[{kind}]]",
                    kind_q = q(kind)
                ),
            );
            continue;
        };
        for table in array.iter() {
            let mut cx = TableCx {
                file,
                report: &mut *report,
                warnings: &mut tables.warnings,
                ids: &mut tables.ids,
                orphans: &mut tables.orphans,
            };
            if kind == "list" {
                if let Some(draft) = list::read_list(table, &mut cx) {
                    tables.lists.push(draft);
                }
            } else if kind == "counter" {
                if let Some(draft) = counter::read_counter(table, &mut cx) {
                    tables.counters.push(draft);
                }
            } else if let Some((rule, counter)) = rule::read_rule(table, &mut cx) {
                if let Some(counter) = counter {
                    tables.counters.push(counter);
                }
                tables.rules.push(rule);
            }
        }
    }
}

/// A rule file holds only `[[counter]]`, `[[rule]]` and `[[list]]` tables.
fn check_top_level_keys(root: &Table, report: &mut Report<'_>) {
    for (key, _) in root.iter() {
        match key {
            "rule" | "counter" | "list" => {}
            _ => report.error(
                key_offset(root, key),
                format!("unknown top-level key {key_q}; a rule file holds [[counter]], [[rule]] and [[list]] tables", key_q = q(key)),
            ),
        }
    }
}

/// "unknown key … in <table>", with the closest known key when the unknown one looks like a typo
/// of it (`windw` → `window`), then every key the table takes.
pub(super) fn unknown_key(key: &str, table: &str, known: &[&str]) -> String {
    let near = crate::rules::lint::closest(key, known.iter().copied())
        .map(|k| format!(" (did you mean \"{k}\"?)"))
        .unwrap_or_default();
    format!(
        "unknown key {}{near} in {table}; expected one of: {}",
        crate::event::quote_prefix(key),
        known.join(", ")
    )
}
