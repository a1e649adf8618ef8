//! The `[[list]]` table reader: its id, kind and entries (inline `values` or a list `file`),
//! read into a list draft; the entries are added to the list when the tables are resolved.

use toml_edit::{Array, Table, Value};

use super::super::fields::{exact_number, keyword, mark, read_id, string, type_name};
use super::super::positions::{item_offset, key_offset, Report};
use super::drafts::{InlineEntry, ListDraft, ListEntries, TableCx};
use crate::event::quote_prefix as q;
use crate::rules::lists::ListKind;

/// Keys a `[[list]]` table may hold.
pub const LIST_KEYS: [&str; 5] = ["id", "description", "kind", "file", "values"];

pub(crate) fn read_list(table: &Table, cx: &mut TableCx<'_, '_>) -> Option<ListDraft> {
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
                let expected = "\"string\", \"number\" or \"cidr\"";
                kind = keyword(
                    item,
                    "kind",
                    "list kind",
                    expected,
                    cx.report,
                    ListKind::parse,
                );
            }
            "file" => {
                if let Some(path) = string(item, "file", cx.report) {
                    entries.push(ListEntries::File(path.to_owned(), at));
                }
            }
            "values" => match item.as_array() {
                Some(array) => {
                    entries.push(ListEntries::Inline(inline_entries(array, at, cx.report)))
                }
                None => cx.report.error(
                    at,
                    format!("\"values\" must be an array, found {}", type_name(item)),
                ),
            },
            other => cx.report.error(
                key_at,
                super::unknown_key(other, "list", &LIST_KEYS),
            ),
        }
    }
    let name = id.as_deref().map_or_else(
        || "list".to_owned(),
        |id| format!("list {id_q}", id_q = q(id)),
    );
    if id.is_none() && !invalid.contains(&"id") {
        cx.report
            .error(header, format!("{name} is missing required key \"id\""));
    }
    if entries.len() != 1 {
        cx.report.error(
            header,
            format!("{name} needs exactly one of \"file\" and \"values\""),
        );
    }
    cx.record_id(id.as_ref(), header);
    if cx.failed_since(errors_before) {
        return None;
    }
    Some(ListDraft {
        id: id?,
        kind: kind.unwrap_or(ListKind::String),
        file: cx.file,
        entries: entries.pop()?,
    })
}

/// The values of an inline list, each with where it is written (`at`: the array's position).
fn inline_entries(array: &Array, at: usize, report: &Report<'_>) -> Vec<(InlineEntry, usize)> {
    array
        .iter()
        .map(|v| {
            let at = v.span().map_or(at, |s| s.start);
            let entry = match v {
                Value::String(s) => InlineEntry::Str(s.value().clone()),
                Value::Integer(_) | Value::Float(_) => match exact_number(v, report) {
                    Some(d) => InlineEntry::Num(d),
                    None => InlineEntry::Other("non-finite number"),
                },
                other => InlineEntry::Other(other.type_name()),
            };
            (entry, at)
        })
        .collect()
}
