//! Source positions: a rule file's line index, the diagnostics reported at `file:line:col`,
//! and the byte offsets of TOML keys, values and string contents (an expression error points at
//! its column inside the TOML string).

use std::fmt;

use toml_edit::{Item, TableLike};

use super::super::model::FileLocation;

/// One problem in a rule file, at a position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub origin: FileLocation,
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.origin, self.message)
    }
}

/// One rule file's name and text, for turning byte offsets into line and column.
pub(super) struct RuleFile<'a> {
    pub(super) name: &'a str,
    pub(super) text: &'a str,
    /// Byte offset of each line's start, found on first use: every rule records where it is, so
    /// a position costs a binary search, not a scan from the top (which made loading quadratic).
    line_starts: std::cell::OnceCell<Vec<usize>>,
}

impl<'a> RuleFile<'a> {
    pub(super) fn new(name: &'a str, text: &'a str) -> RuleFile<'a> {
        RuleFile {
            name,
            text,
            line_starts: std::cell::OnceCell::new(),
        }
    }

    /// 1-based line and column (in characters) of a byte offset.
    pub(super) fn origin(&self, offset: usize) -> FileLocation {
        let mut offset = offset.min(self.text.len());
        while !self.text.is_char_boundary(offset) {
            offset -= 1;
        }
        let starts = self.line_starts.get_or_init(|| {
            std::iter::once(0)
                .chain(
                    self.text
                        .bytes()
                        .enumerate()
                        .filter(|&(_, b)| b == b'\n')
                        .map(|(i, _)| i + 1),
                )
                .collect()
        });
        let line = starts.partition_point(|&start| start <= offset);
        let line_start = starts[line - 1];
        FileLocation {
            file: self.name.to_owned(),
            line,
            col: self.text[line_start..offset].chars().count() + 1,
        }
    }
}

/// Collects diagnostics for one file.
pub(super) struct Report<'a> {
    pub(super) source: &'a RuleFile<'a>,
    /// The file's index in the set (where its expressions are written).
    pub(super) file: usize,
    pub(super) diagnostics: Vec<Diagnostic>,
}

impl Report<'_> {
    pub(super) fn error(&mut self, offset: usize, message: impl Into<String>) {
        self.diagnostics.push(Diagnostic {
            origin: self.source.origin(offset),
            message: message.into(),
        });
    }
}

/// The diagnostic for a rule file that is not UTF-8: at its first invalid byte.
pub fn not_utf8(name: &str, bytes: &[u8], valid_up_to: usize) -> Diagnostic {
    let valid = std::str::from_utf8(&bytes[..valid_up_to]).unwrap_or_default();
    let source = RuleFile::new(name, valid);
    Diagnostic {
        origin: source.origin(valid_up_to),
        message: "file is not valid UTF-8".to_owned(),
    }
}

/// The byte offset, within a TOML string token `raw` (starting at its opening quote), of the
/// `decoded`-th byte of its value: so an expression error points at its column in the file.
pub(super) fn raw_offset(raw: &str, decoded: usize) -> usize {
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

/// Where `key` is written in `table` (0 if it has no span).
pub(super) fn key_offset(table: &dyn TableLike, key: &str) -> usize {
    table
        .get_key_value(key)
        .and_then(|(k, _)| k.span())
        .map_or(0, |s| s.start)
}

/// Where a value is written (0 if it has no span).
pub(super) fn item_offset(item: &Item) -> usize {
    item.span().map_or(0, |s| s.start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_offsets_follow_escapes_and_delimiters() {
        assert_eq!(raw_offset("'abc'", 2), 3);
        assert_eq!(raw_offset(r#""a\"b""#, 2), 4);
        assert_eq!(raw_offset(r#""\u00e9x""#, 2), 7);
        assert_eq!(raw_offset("'''\nab'''", 1), 5);
    }
}
