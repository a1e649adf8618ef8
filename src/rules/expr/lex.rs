//! The lexer: expression text → tokens, each with the byte offset it starts at. Numbers are
//! exact decimals, strings are unescaped here (JSON escapes and `\u{…}`), and `$counter` /
//! `@list` references are single tokens.

use super::error::{err, ExprError};
use crate::event::{quote_prefix, shorten, Decimal};

/// A token.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Tok {
    Num(Decimal),
    Str(String),
    Ident(String),
    /// A backquoted path segment.
    Quoted(String),
    Counter(String),
    List(String),
    Op(&'static str),
    End,
}

const OPS: [&str; 19] = [
    "||", "&&", "==", "!=", "<=", ">=", "<", ">", "!", "+", "-", "*", "/", "(", ")", "[", "]", ",",
    ".",
];

fn is_ref_char(c: u8) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'_' | b'.' | b'-')
}

/// Every token of `text`, ending with [`Tok::End`] at the text's length.
pub(super) fn lex(text: &str) -> Result<Vec<(Tok, usize)>, ExprError> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let start = i;
        if c.is_ascii_digit() {
            let (d, end) = lex_number(text, start)?;
            out.push((Tok::Num(d), start));
            i = end;
            continue;
        }
        if c.is_ascii_alphabetic() || c == b'_' {
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            out.push((Tok::Ident(text[start..i].to_owned()), start));
            continue;
        }
        match c {
            b'\'' | b'"' => {
                let (s, end) = lex_string(text, i)?;
                out.push((Tok::Str(s), start));
                i = end;
            }
            b'`' => {
                let Some(len) = text[i + 1..].find('`') else {
                    return err(start, "unterminated backquoted name");
                };
                if len == 0 {
                    return err(start, "empty backquoted name");
                }
                out.push((Tok::Quoted(text[i + 1..i + 1 + len].to_owned()), start));
                i += len + 2;
            }
            b'$' | b'@' => {
                i += 1;
                while i < bytes.len() && is_ref_char(bytes[i]) {
                    i += 1;
                }
                let name = text[start + 1..i].to_owned();
                if name.is_empty() {
                    let what = if c == b'$' {
                        "a counter id after '$'"
                    } else {
                        "a list id after '@'"
                    };
                    return err(start, format!("expected {what}"));
                }
                out.push((
                    if c == b'$' {
                        Tok::Counter(name)
                    } else {
                        Tok::List(name)
                    },
                    start,
                ));
            }
            b'=' if !text[i..].starts_with("==") => {
                return err(start, "'=' is not an operator: write '=='")
            }
            _ => {
                let Some(op) = OPS.iter().find(|op| text[i..].starts_with(**op)) else {
                    let ch = text[i..].chars().next().unwrap_or('?');
                    return err(start, format!("unexpected character {ch:?}"));
                };
                i += op.len();
                out.push((Tok::Op(op), start));
            }
        }
    }
    out.push((Tok::End, text.len()));
    Ok(out)
}

/// A number starting at `start` (a digit): its exact value and the offset after it.
fn lex_number(text: &str, start: usize) -> Result<(Decimal, usize), ExprError> {
    let bytes = text.as_bytes();
    let mut i = start;
    while i < bytes.len() && bytes[i].is_ascii_digit() {
        i += 1;
    }
    if i + 1 < bytes.len() && bytes[i] == b'.' && bytes[i + 1].is_ascii_digit() {
        i += 1;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
    }
    if i < bytes.len() && (bytes[i] == b'e' || bytes[i] == b'E') {
        let mut j = i + 1;
        if j < bytes.len() && (bytes[j] == b'+' || bytes[j] == b'-') {
            j += 1;
        }
        if j < bytes.len() && bytes[j].is_ascii_digit() {
            while j < bytes.len() && bytes[j].is_ascii_digit() {
                j += 1;
            }
            i = j;
        }
    }
    if i < bytes.len() && (bytes[i].is_ascii_alphabetic() || bytes[i] == b'_') {
        return err(
            start,
            format!("invalid number {}", quote_prefix(&text[start..=i])),
        );
    }
    match Decimal::parse(&text[start..i]) {
        Some(d) => Ok((d, i)),
        None => err(
            start,
            format!("invalid number {}", quote_prefix(&text[start..i])),
        ),
    }
}

/// A quoted string starting at `start`: its value and the offset after the closing quote.
fn lex_string(text: &str, start: usize) -> Result<(String, usize), ExprError> {
    let quote = text.as_bytes()[start] as char;
    let mut out = String::new();
    let mut chars = text[start + 1..]
        .char_indices()
        .map(|(j, c)| (start + 1 + j, c))
        .peekable();
    while let Some((at, c)) = chars.next() {
        if c == quote {
            return Ok((out, at + 1));
        }
        if c != '\\' {
            out.push(c);
            continue;
        }
        let Some((_, e)) = chars.next() else { break };
        match e {
            'n' => out.push('\n'),
            't' => out.push('\t'),
            'r' => out.push('\r'),
            '0' => out.push('\0'),
            '\\' | '\'' | '"' | '/' => out.push(e),
            'u' => {
                let code = if chars.peek().map(|&(_, c)| c) == Some('{') {
                    chars.next();
                    let mut hex = String::new();
                    loop {
                        match chars.next() {
                            Some((_, '}')) => break,
                            Some((_, h)) if h.is_ascii_hexdigit() && hex.len() < 6 => hex.push(h),
                            _ => {
                                return err(
                                    at,
                                    "invalid \\u{…} escape: expected 1 to 6 hex digits and '}'",
                                )
                            }
                        }
                    }
                    if hex.is_empty() {
                        return err(
                            at,
                            "invalid \\u{…} escape: expected 1 to 6 hex digits and '}'",
                        );
                    }
                    u32::from_str_radix(&hex, 16).ok()
                } else {
                    fn four(
                        chars: &mut std::iter::Peekable<impl Iterator<Item = (usize, char)>>,
                    ) -> Option<u32> {
                        let hex: String = (0..4)
                            .filter_map(|_| {
                                chars
                                    .next_if(|(_, c)| c.is_ascii_hexdigit())
                                    .map(|(_, c)| c)
                            })
                            .collect();
                        if hex.len() == 4 {
                            u32::from_str_radix(&hex, 16).ok()
                        } else {
                            None
                        }
                    }
                    let Some(high) = four(&mut chars) else {
                        return err(at, "invalid \\u escape: expected 4 hex digits");
                    };
                    if (0xD800..0xDC00).contains(&high) {
                        // A UTF-16 surrogate pair, as JSON writes characters beyond the BMP.
                        let low = if chars.next_if(|&(_, c)| c == '\\').is_some()
                            && chars.next_if(|&(_, c)| c == 'u').is_some()
                        {
                            four(&mut chars)
                        } else {
                            None
                        };
                        match low {
                            Some(low) if (0xDC00..0xE000).contains(&low) => Some(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00)),
                            _ => return err(at, "\\u escape is a lone surrogate: write the pair, like \\uD83D\\uDE00"),
                        }
                    } else {
                        Some(high)
                    }
                };
                match code.and_then(char::from_u32) {
                    Some(ch) => out.push(ch),
                    None => return err(at, "\\u escape is not a Unicode scalar value"),
                }
            }
            other => return err(at, format!("invalid escape '\\{other}'")),
        }
    }
    err(start, "unterminated string")
}

/// A token as error messages name it.
pub(super) fn describe(tok: &Tok) -> String {
    match tok {
        Tok::Num(d) => format!("number {}", shorten(&d.to_string())),
        Tok::Str(s) => format!("string {}", quote_prefix(s)),
        Tok::Ident(w) => format!("'{}'", shorten(w)),
        Tok::Quoted(w) => format!("`{}`", shorten(w)),
        Tok::Counter(c) => format!("${}", shorten(c)),
        Tok::List(l) => format!("@{}", shorten(l)),
        Tok::Op(op) => format!("'{op}'"),
        Tok::End => "the end of the expression".to_owned(),
    }
}
