//! Drafts: what a `[[counter]]`, `[[rule]]` or `[[list]]` table is read into before the tables
//! are resolved against each other (expressions still as text, with where they are written),
//! and the context a table reader reports into.

use toml_edit::Item;

use super::super::fields::matchers;
use super::super::positions::{item_offset, Diagnostic, Report};
use crate::event::{Decimal, FieldPath};
use crate::rules::lists::ListKind;
use crate::rules::model::{Action, Counter, FileLocation, Matcher, Mode, OnStoreError};

/// An expression string as written in a file: its value, and where its TOML token starts.
#[derive(Debug, Clone)]
pub(crate) struct ExprSite {
    pub(crate) file: usize,
    /// Byte offset of the TOML string token in the file.
    pub(crate) at: usize,
    pub(crate) value: String,
}

/// One entry of a key as read: a field path, or an expression compiled in the last pass.
#[derive(Debug, Clone)]
pub(crate) enum KeyDraft {
    Path(FieldPath),
    Expr(ExprSite),
}

impl KeyDraft {
    pub(crate) fn text(&self) -> &str {
        match self {
            KeyDraft::Path(p) => p.as_str(),
            KeyDraft::Expr(site) => &site.value,
        }
    }
}

/// A `match` as read: a table (checked already) or an expression (compiled in the last pass).
#[derive(Debug, Clone)]
pub(crate) enum DraftScope {
    All,
    Table(Vec<Matcher>),
    Expr(ExprSite),
}

#[derive(Debug)]
pub(crate) struct CounterDraft {
    /// Its `dimensions` and `tuple` are filled when the entries compile.
    pub(crate) counter: Counter,
    pub(crate) scope: DraftScope,
    pub(crate) dimensions: Vec<KeyDraft>,
    /// A distinct counter's tuple `field`.
    pub(crate) tuple: Vec<KeyDraft>,
}

#[derive(Debug)]
pub(crate) struct RuleDraft {
    pub(crate) id: String,
    pub(crate) description: Option<String>,
    pub(crate) action: Action,
    pub(crate) mode: Mode,
    pub(crate) enabled: bool,
    pub(crate) scope: DraftScope,
    pub(crate) when: Option<ExprSite>,
    /// v1 form: the limit (its counter has the rule's id).
    pub(crate) limit: Option<Decimal>,
    pub(crate) on_store_error: OnStoreError,
    /// `hold` (ms) and its key.
    pub(crate) hold: Option<(i64, Vec<KeyDraft>)>,
    pub(crate) priority: i32,
    pub(crate) is_final: Option<usize>,
    /// `score` in micro-units, with where its key is written.
    pub(crate) score: Option<(i64, usize)>,
    /// `rollout` below 100: (percent, basis points, key).
    pub(crate) rollout: Option<(Decimal, u32, Vec<KeyDraft>)>,
    pub(crate) entity: Option<Vec<KeyDraft>>,
    pub(crate) origin: FileLocation,
}

/// A `[[list]]` as read.
#[derive(Debug)]
pub(crate) struct ListDraft {
    pub(crate) id: String,
    pub(crate) kind: ListKind,
    pub(crate) file: usize,
    pub(crate) entries: ListEntries,
}

#[derive(Debug)]
pub(crate) enum ListEntries {
    /// Inline values: each value's text and where it is written.
    Inline(Vec<(InlineEntry, usize)>),
    /// A list file, relative to the rule file, and where `file` is written.
    File(String, usize),
    /// A map's inline `values` table: (key, value or what it is instead, where written).
    Map(
        Vec<(
            String,
            Result<crate::rules::expr::Literal, &'static str>,
            usize,
        )>,
    ),
}

#[derive(Debug)]
pub(crate) enum InlineEntry {
    Str(String),
    Num(Decimal),
    /// A value of no list kind (a table, a boolean…).
    Other(&'static str),
}

/// What a table reader reports into.
pub(crate) struct TableCx<'r, 'a> {
    pub(crate) file: usize,
    pub(crate) report: &'r mut Report<'a>,
    pub(crate) warnings: &'r mut Vec<Diagnostic>,
    /// Every valid id read, with where its table starts (duplicates are found across files,
    /// including tables with other errors).
    pub(crate) ids: &'r mut Vec<(String, FileLocation)>,
    /// The expressions of tables that had other errors (with whether counters are allowed):
    /// checked for their own errors too, so one `check` reports everything.
    pub(crate) orphans: &'r mut Vec<(ExprSite, bool)>,
}

impl TableCx<'_, '_> {
    pub(crate) fn record_id(&mut self, id: Option<&String>, header: usize) {
        if let Some(id) = id {
            self.ids
                .push((id.clone(), self.report.source.origin(header)));
        }
    }

    /// Whether the table being read reported an error since `errors_before`.
    pub(crate) fn failed_since(&self, errors_before: usize) -> bool {
        self.report.diagnostics.len() > errors_before
    }
}

/// A `match`: a table (v1) or an expression string.
pub(crate) fn read_scope(item: &Item, cx: &mut TableCx<'_, '_>) -> Option<DraftScope> {
    if let Some(text) = item.as_str() {
        return Some(DraftScope::Expr(ExprSite {
            file: cx.file,
            at: item_offset(item),
            value: text.to_owned(),
        }));
    }
    matchers(item, cx.report, cx.warnings).map(DraftScope::Table)
}
