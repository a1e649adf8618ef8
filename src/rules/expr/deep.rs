//! Deep equality of arrays and objects (`==` / `!=`): elements in order, object keys in any
//! order, numbers by exact value, strict types. The composite values are compared from their JSON
//! text, built into a tree only when a comparison needs it; nesting deeper than
//! [`MAX_DEPTH`] makes the comparison unknown rather than recursing without bound.

use std::borrow::Cow;

use super::compiled::Literal;
use crate::event::Decimal;

/// Deepest nesting deep equality descends into; deeper values compare as unknown.
pub const MAX_DEPTH: usize = 64;

/// A JSON value as deep equality sees it; an object's members sorted by key.
#[derive(Debug, PartialEq)]
pub enum Tree<'t> {
    Null,
    Bool(bool),
    Num(Decimal),
    Str(Cow<'t, str>),
    Arr(Vec<Tree<'t>>),
    Obj(Vec<(Cow<'t, str>, Tree<'t>)>),
}

impl<'t> Tree<'t> {
    /// The tree of a JSON text the event parser has already validated; `None` past
    /// [`MAX_DEPTH`].
    pub fn from_json(text: &'t str) -> Option<Tree<'t>> {
        tree(text, 0)
    }

    /// A list literal's tree.
    pub fn from_literals(items: &'t [Literal]) -> Tree<'t> {
        Tree::Arr(items.iter().map(Tree::from_literal).collect())
    }

    pub fn from_literal(literal: &'t Literal) -> Tree<'t> {
        match literal {
            Literal::Null => Tree::Null,
            Literal::Bool(b) => Tree::Bool(*b),
            Literal::Num(d) => Tree::Num(d.clone()),
            Literal::Str(s) => Tree::Str(Cow::Borrowed(s)),
        }
    }
}

/// Builds the tree in one pass over the text (already validated JSON): each byte is read once,
/// whatever the nesting, and no level goes past [`MAX_DEPTH`].
fn tree(text: &str, depth: usize) -> Option<Tree<'_>> {
    let mut reader = Reader { text, at: 0 };
    let tree = reader.value(depth)?;
    reader.skip_space();
    (reader.at == text.len()).then_some(tree)
}

struct Reader<'t> {
    text: &'t str,
    at: usize,
}

impl<'t> Reader<'t> {
    fn skip_space(&mut self) {
        let bytes = self.text.as_bytes();
        while self.at < bytes.len() && bytes[self.at].is_ascii_whitespace() {
            self.at += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_space();
        self.text.as_bytes().get(self.at).copied()
    }

    fn eat(&mut self, byte: u8) -> bool {
        if self.peek() == Some(byte) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Option<Tree<'t>> {
        Some(match self.peek()? {
            b'n' => self.word("null", Tree::Null)?,
            b't' => self.word("true", Tree::Bool(true))?,
            b'f' => self.word("false", Tree::Bool(false))?,
            b'"' => Tree::Str(self.string()?),
            b'[' | b'{' if depth >= MAX_DEPTH => return None,
            b'[' => {
                self.at += 1;
                let mut items = Vec::new();
                if !self.eat(b']') {
                    loop {
                        items.push(self.value(depth + 1)?);
                        if self.eat(b']') {
                            break;
                        }
                        if !self.eat(b',') {
                            return None;
                        }
                    }
                }
                Tree::Arr(items)
            }
            b'{' => {
                self.at += 1;
                let mut members = Vec::new();
                if !self.eat(b'}') {
                    loop {
                        if self.peek() != Some(b'"') {
                            return None;
                        }
                        let key = self.string()?;
                        if !self.eat(b':') {
                            return None;
                        }
                        members.push((key, self.value(depth + 1)?));
                        if self.eat(b'}') {
                            break;
                        }
                        if !self.eat(b',') {
                            return None;
                        }
                    }
                }
                // Keys are unique: the event parser refuses an object that names one twice.
                members.sort_by(|a, b| a.0.cmp(&b.0));
                Tree::Obj(members)
            }
            _ => {
                let bytes = self.text.as_bytes();
                let start = self.at;
                while self.at < bytes.len()
                    && matches!(
                        bytes[self.at],
                        b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'
                    )
                {
                    self.at += 1;
                }
                Tree::Num(Decimal::parse(&self.text[start..self.at])?)
            }
        })
    }

    fn word(&mut self, word: &str, tree: Tree<'t>) -> Option<Tree<'t>> {
        self.text[self.at..].starts_with(word).then(|| {
            self.at += word.len();
            tree
        })
    }

    /// A string token at the cursor, unescaped (borrowed when it has no escapes).
    fn string(&mut self) -> Option<Cow<'t, str>> {
        let bytes = self.text.as_bytes();
        let start = self.at;
        let mut i = start + 1;
        let mut escaped = false;
        while i < bytes.len() {
            match bytes[i] {
                b'\\' => {
                    escaped = true;
                    i += 2;
                }
                b'"' => break,
                _ => i += 1,
            }
        }
        if i >= bytes.len() {
            return None;
        }
        self.at = i + 1;
        let token = &self.text[start..=i];
        if escaped {
            serde_json::from_str::<String>(token).ok().map(Cow::Owned)
        } else {
            Some(Cow::Borrowed(&token[1..token.len() - 1]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(text: &str) -> Tree<'_> {
        Tree::from_json(text).unwrap_or_else(|| panic!("{text}"))
    }

    #[test]
    fn objects_compare_in_any_key_order_and_numbers_by_value() {
        assert_eq!(
            t(r#"{"zip":10001,"city":"NY"}"#),
            t(r#"{"city":"NY","zip":10001.0}"#)
        );
        assert_ne!(t(r#"{"zip":10001}"#), t(r#"{"zip":"10001"}"#));
        assert_ne!(t(r#"{"zip":10001}"#), t(r#"{"zip":10001,"x":null}"#));
        assert_eq!(
            t(r#"[1,[2,{"a":"\u0041"}]]"#),
            t(r#"[1.0,[2e0,{"a":"A"}]]"#)
        );
        assert_ne!(t("[1,2]"), t("[2,1]"));
        assert_eq!(
            t(r#"["gift"]"#),
            Tree::from_literals(&[Literal::Str("gift".into())])
        );
    }

    #[test]
    fn nesting_past_the_bound_is_unknown_not_a_stack_overflow() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(Tree::from_json(&deep), None);
        let fits = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(Tree::from_json(&fits).is_some());
    }
}
