//! The usual event decoded in one pass over its bytes, without the parser's machinery.
//!
//! Decoding through `serde_json` visits every key through a `MapAccess`, takes each value as a
//! `RawValue` and then reads that text again; on the shipped rules it was a quarter of a replay's
//! time. This scanner handles the shapes almost every event has — keys and strings without escapes,
//! objects nested a few levels — and gives up on anything else (an escape, a control character, a
//! duplicate key, deep nesting, a value it cannot interpret, any syntax error). Giving up is not a
//! verdict: [`super::decode_at`] then decodes the line with the parser, which accepts, refuses and
//! explains exactly as before. So this scanner only ever has to be right about what it accepts: the
//! fields it fills are the ones the parser would fill (a property test compares the two).

use std::borrow::Cow;

use super::{interpret, FieldValue, Node, Number, SeenKeys, EVENT_ID_SLOT};

/// Deeper than this, the parser decodes the line (it takes any depth in values it skips and
/// refuses past 128 levels of projected objects).
const MAX_DEPTH: u32 = 64;

/// Fills `out` with the projected values of the JSON object `text`; false if this scanner gave up
/// (then `out` holds whatever it filled so far, and the caller must start over).
pub(super) fn decode<'a>(text: &'a str, root: &Node, out: &mut [FieldValue<'a>]) -> bool {
    let mut scanner = Scanner { text, pos: 0 };
    scanner.whitespace();
    if scanner.peek() != Some(b'{') {
        return false;
    }
    if scanner.object(Some(root), out, 1).is_none() {
        return false;
    }
    scanner.whitespace();
    scanner.pos == text.len()
}

struct Scanner<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Scanner<'a> {
    #[inline]
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    #[inline]
    fn eat(&mut self, byte: u8) -> bool {
        if self.peek() == Some(byte) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// JSON's four whitespace bytes.
    #[inline]
    fn whitespace(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    /// An object at `{`. Under a projected node, its projected values go to `out`; under `None`
    /// it is only checked.
    fn object(
        &mut self,
        node: Option<&Node>,
        out: &mut [FieldValue<'a>],
        depth: u32,
    ) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.pos += 1;
        self.whitespace();
        if self.eat(b'}') {
            return Some(());
        }
        let mut seen = SeenKeys::default();
        loop {
            if !self.eat(b'"') {
                return None;
            }
            let key = self.string_body()?;
            self.whitespace();
            if !self.eat(b':') {
                return None;
            }
            self.whitespace();
            match node.and_then(|n| n.child(key)) {
                Some(child) => self.projected(child, out, depth)?,
                None => self.value(out, depth)?,
            }
            if !seen.insert(key) {
                return None;
            }
            self.whitespace();
            match self.peek()? {
                b',' => {
                    self.pos += 1;
                    self.whitespace();
                }
                b'}' => {
                    self.pos += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// The value under a projected name, as the parser's `ValueSeed` takes it.
    fn projected(&mut self, node: &Node, out: &mut [FieldValue<'a>], depth: u32) -> Option<()> {
        let start = self.pos;
        let Some(slot) = node.slot else {
            // Only a parent of projected paths: an object is descended into, anything else is
            // recorded nowhere — but the parser reads a number there as a double and refuses one
            // out of range, so a number is left to it.
            return match self.peek()? {
                b'{' => self.object(Some(node), out, depth + 1),
                b'-' | b'0'..=b'9' => None,
                _ => self.value(out, depth),
            };
        };
        if !node.children.is_empty() && self.peek() == Some(b'{') {
            self.object(Some(node), out, depth + 1)?;
            out[slot] = FieldValue::Object(&self.text[start..self.pos]);
            return Some(());
        }
        // Strings and numbers, the usual values, directly; the rest as the parser's path reads
        // them.
        out[slot] = match self.peek()? {
            b'"' => {
                self.pos += 1;
                FieldValue::Str(Cow::Borrowed(self.string_body()?))
            }
            b'-' | b'0'..=b'9' => {
                self.number()?;
                let text = &self.text[start..self.pos];
                if slot == EVENT_ID_SLOT {
                    // Records echo a numeric id as written (see `ValueSeed`).
                    let last = out.len() - 1;
                    out[last] = FieldValue::Str(Cow::Borrowed(text));
                }
                FieldValue::Number(Number::parse(text)?)
            }
            _ => {
                self.value(out, depth)?;
                interpret(&self.text[start..self.pos]).ok()?
            }
        };
        Some(())
    }

    /// Checks one value (of any kind) and steps past it.
    fn value(&mut self, out: &mut [FieldValue<'a>], depth: u32) -> Option<()> {
        match self.peek()? {
            b'"' => {
                self.pos += 1;
                self.string_body().map(drop)
            }
            b'{' => self.object(None, out, depth + 1),
            b'[' => self.array(out, depth + 1),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn array(&mut self, out: &mut [FieldValue<'a>], depth: u32) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.pos += 1;
        self.whitespace();
        if self.eat(b']') {
            return Some(());
        }
        loop {
            self.value(out, depth)?;
            self.whitespace();
            match self.peek()? {
                b',' => {
                    self.pos += 1;
                    self.whitespace();
                }
                b']' => {
                    self.pos += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let rest = self.text.as_bytes().get(self.pos..)?;
        if rest.starts_with(word) {
            self.pos += word.len();
            Some(())
        } else {
            None
        }
    }

    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, RFC 8259's grammar.
    fn number(&mut self) -> Option<()> {
        self.eat(b'-');
        match self.peek()? {
            b'0' => self.pos += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.eat(b'.') {
            self.some_digits()?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            self.some_digits()?;
        }
        Some(())
    }

    #[inline]
    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }

    fn some_digits(&mut self) -> Option<()> {
        let start = self.pos;
        self.digits();
        (self.pos > start).then_some(())
    }

    /// A string's text after its opening quote, up to the closing one (stepped past). Gives up on
    /// an escape (the text would need unescaping) and on a control character (JSON refuses it).
    #[inline]
    fn string_body(&mut self) -> Option<&'a str> {
        const ONES: u64 = 0x0101_0101_0101_0101;
        const HIGHS: u64 = 0x8080_8080_8080_8080;
        let bytes = self.text.as_bytes();
        let start = self.pos;
        let mut at = start;
        // Eight bytes at a time while eight remain: a word's bytes below `limit` get their high
        // bit set — exactly for the lowest such byte (no borrow reaches below it), so the
        // lowest bit of the three marks is the first quote, backslash or control character.
        let below = |word: u64, limit: u64| word.wrapping_sub(ONES * limit) & !word & HIGHS;
        while let Some(chunk) = bytes.get(at..at + 8) {
            let word = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
            let marks = below(word ^ (ONES * u64::from(b'"')), 1)
                | below(word ^ (ONES * u64::from(b'\\')), 1)
                | below(word, 0x20);
            if marks != 0 {
                at += (marks.trailing_zeros() / 8) as usize;
                break;
            }
            at += 8;
        }
        loop {
            match *bytes.get(at)? {
                b'"' => break,
                b'\\' | 0..=0x1f => return None,
                _ => at += 1,
            }
        }
        self.pos = at + 1;
        // Both ends are ASCII quotes in text that is UTF-8: a char boundary each.
        self.text.get(start..at)
    }
}
