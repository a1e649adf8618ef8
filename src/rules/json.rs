//! JSON text written by hand for the decision record, escaped exactly as serde_json escapes it:
//! records are copied from pre-rendered parts, not serialised field by field.

use crate::decimal::Decimal;
use crate::event::Scalar;

/// The bytes `write` appends to an empty buffer.
pub(super) fn render(write: impl FnOnce(&mut Vec<u8>)) -> Box<[u8]> {
    let mut out = Vec::new();
    write(&mut out);
    out.into_boxed_slice()
}

/// Appends `s` as a JSON string, escaped as serde_json escapes it (`"`, `\` and control
/// characters; everything else verbatim).
pub(super) fn write_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    write_str_body(out, s);
    out.push(b'"');
}

/// Appends `s` escaped, without the quotes.
pub(super) fn write_str_body(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if escape.is_empty() {
            out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 0xf)],
            ]);
        } else {
            out.extend_from_slice(escape);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
}

pub(super) fn write_int(out: &mut Vec<u8>, v: impl itoa::Integer) {
    out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
}

/// An exact decimal as a JSON number: its shortest exact text; beyond the range of a double
/// (which serde_json and most readers refuse as a number), a JSON string of that text; longer
/// than [`MAX_QUOTED_BYTES`], quoted as [`write_long_value`] does.
pub(super) fn write_decimal(out: &mut Vec<u8>, d: &Decimal) {
    if let Some(v) = d.as_i64() {
        return write_int(out, v);
    }
    let text = d.to_string();
    if text.len() > MAX_QUOTED_BYTES {
        write_long_value(out, &text);
    } else if d.fits_f64() {
        out.extend_from_slice(text.as_bytes());
    } else {
        write_str(out, &text);
    }
}

/// An event's number as the event wrote it (`1.50` stays `1.50`) if it is within a double's
/// range, else by its exact value as [`write_decimal`] writes it.
pub(super) fn write_number(out: &mut Vec<u8>, exact: &Decimal, text: Option<&str>) {
    match text {
        Some(text) if text.len() > MAX_QUOTED_BYTES => write_long_value(out, text),
        // The parser validated the text as one JSON number token.
        Some(text) if exact.fits_f64() => out.extend_from_slice(text.as_bytes()),
        _ => write_decimal(out, exact),
    }
}

pub(super) fn write_scalar(out: &mut Vec<u8>, scalar: Option<Scalar<'_>>) {
    match scalar {
        None => out.extend_from_slice(b"null"),
        Some(Scalar::Bool(b)) => out.extend_from_slice(if b { b"true" } else { b"false" }),
        // A key value by its canonical text: one key, one rendering, whichever event wrote it.
        Some(Scalar::Number(n)) => write_decimal(out, n),
        Some(Scalar::Str(s)) if s.len() > MAX_QUOTED_BYTES => write_long_value(out, s),
        Some(Scalar::Str(s)) => write_str(out, s),
    }
}

/// A key value whole, as compact JSON (numbers by their shortest exact decimal): what another
/// service hashes to reproduce a rollout bucket.
pub(super) fn write_scalar_exact(out: &mut Vec<u8>, scalar: Scalar<'_>) {
    match scalar {
        Scalar::Bool(b) => out.extend_from_slice(if b { b"true" } else { b"false" }),
        Scalar::Number(n) => match n.as_i64() {
            Some(v) => write_int(out, v),
            None => out.extend_from_slice(n.to_string().as_bytes()),
        },
        Scalar::Str(s) => write_str(out, s),
    }
}

/// Longest value (an id, a key value) a record quotes whole.
pub const MAX_QUOTED_BYTES: usize = 256;

/// A value longer than [`MAX_QUOTED_BYTES`], as a JSON string of its first characters, its
/// length and a digest that tells two such values apart: a record of a hostile megabyte-long
/// id stays small, and whoever holds the value can still match it (BLAKE3 of its text).
#[cold]
pub(super) fn write_long_value(out: &mut Vec<u8>, text: &str) {
    let mut cut = 64.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let hash = blake3::hash(text.as_bytes());
    let hex: String = hash.as_bytes()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let quoted = format!("{}… ({} bytes, blake3 {hex})", &text[..cut], text.len());
    write_str(out, &quoted);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Strings are escaped exactly as serde_json escapes them: hostile ids, keys and
        /// values stay one valid JSON string.
        #[test]
        fn strings_are_escaped_as_serde_json_does(s in any::<String>()) {
            let mut out = Vec::new();
            write_str(&mut out, &s);
            prop_assert_eq!(String::from_utf8(out).unwrap(), serde_json::to_string(&s).unwrap());
        }
    }

    #[test]
    fn control_characters_and_quotes_are_escaped() {
        let mut out = Vec::new();
        write_str(&mut out, "a\"b\\c\n\r\t\u{8}\u{c}\u{1}\u{1f}é\u{7f}/");
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "\"a\\\"b\\\\c\\n\\r\\t\\b\\f\\u0001\\u001fé\u{7f}/\""
        );
    }
}
