//! The `[[list]]` table reader: its id, kind and entries (inline `values` or a list `file`),
//! read into a list draft; the entries are added to the list when the tables are resolved.

use toml_edit::{Array, Table, Value};

use super::super::fields::{exact_number, keyword, mark, read_id, string, type_name};
use super::super::positions::{item_offset, key_offset, Report};
use super::drafts::{InlineEntry, ListDraft, ListEntries, TableCx};
use crate::event::quote_prefix as q;
use crate::rules::expr::Literal;
use crate::rules::lists::ListKind;

/// Keys a `[[list]]` table may hold.
pub const LIST_KEYS: [&str; 6] = ["id", "description", "kind", "key_kind", "file", "values"];

pub(crate) fn read_list(table: &Table, cx: &mut TableCx<'_, '_>) -> Option<ListDraft> {
    let header = table.span().map_or(0, |s| s.start);
    let errors_before = cx.report.diagnostics.len();
    let (mut id, mut kind, mut entries) = (None, None, Vec::new());
    let mut number_keys: Option<(bool, usize)> = None;
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
                let expected = "\"string\", \"number\", \"cidr\" or \"map\"";
                kind = keyword(
                    item,
                    "kind",
                    "list kind",
                    expected,
                    cx.report,
                    ListKind::parse,
                );
            }
            "key_kind" => {
                number_keys = keyword(
                    item,
                    "key_kind",
                    "key kind",
                    "\"string\" or \"number\"",
                    cx.report,
                    |s| match s {
                        "string" => Some(false),
                        "number" => Some(true),
                        _ => None,
                    },
                )
                .map(|n| (n, key_at));
            }
            "file" => {
                if let Some(path) = string(item, "file", cx.report) {
                    entries.push(ListEntries::File(path.to_owned(), at));
                }
            }
            "values" => match (item.as_array(), item.as_table_like()) {
                (Some(array), _) => {
                    entries.push(ListEntries::Inline(inline_entries(array, at, cx.report)))
                }
                (None, Some(table)) => {
                    let mut pairs = Vec::new();
                    for (key, value) in table.iter() {
                        let at = key_offset_like(table, key).unwrap_or(at);
                        let entry = match value.as_value() {
                            Some(v @ Value::String(s)) => {
                                let _ = v;
                                Ok(Literal::Str(s.value().clone()))
                            }
                            Some(Value::Boolean(b)) => Ok(Literal::Bool(*b.value())),
                            Some(v @ (Value::Integer(_) | Value::Float(_))) => {
                                exact_number(v, cx.report)
                                    .map(Literal::Num)
                                    .ok_or("a non-finite number")
                            }
                            Some(other) => Err(other.type_name()),
                            None => Err("table"),
                        };
                        pairs.push((key.to_owned(), entry, at));
                    }
                    entries.push(ListEntries::Map(pairs));
                }
                (None, None) => cx.report.error(
                    at,
                    format!("\"values\" must be an array, found {}", type_name(item)),
                ),
            },
            other => cx
                .report
                .error(key_at, super::unknown_key(other, "list", &LIST_KEYS)),
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
    let mut kind = kind.unwrap_or(ListKind::String);
    match (kind, number_keys) {
        (ListKind::StringMap, Some((true, _))) => kind = ListKind::NumberMap,
        (ListKind::StringMap, _) => {}
        (_, Some((_, at))) => cx
            .report
            .error(at, "\"key_kind\" is only for a list of kind \"map\""),
        _ => {}
    }
    let is_map = matches!(kind, ListKind::StringMap | ListKind::NumberMap);
    match entries.last() {
        Some(ListEntries::Map(_)) if !is_map => cx.report.error(
            header,
            format!("{name}: \"values\" as a table (key = value) is only for a list of kind \"map\""),
        ),
        Some(ListEntries::Inline(_)) if is_map => cx.report.error(
            header,
            format!("{name} is a map: write \"values\" as a table of key = value, like {{ \"m-1\" = 5000 }}"),
        ),
        _ => {}
    }
    cx.record_id(id.as_ref(), header);
    if cx.failed_since(errors_before) {
        return None;
    }
    Some(ListDraft {
        id: id?,
        kind,
        file: cx.file,
        entries: entries.pop()?,
    })
}

/// Where a key of an inline table is written.
fn key_offset_like(table: &dyn toml_edit::TableLike, key: &str) -> Option<usize> {
    table
        .get_key_value(key)
        .and_then(|(k, _)| k.span())
        .map(|s| s.start)
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
