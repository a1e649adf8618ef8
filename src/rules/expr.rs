//! Expressions: `match` and `when` strings, parsed once with a span on every node, resolved
//! against the event projection and the counters, and evaluated per event in three-valued logic
//! (true / false / unknown). Pure.

use std::borrow::Cow;
use std::net::IpAddr;

use hashbrown::HashSet;
use ipnet::IpNet;
use regex::Regex;

use super::lists::ListSet;
use crate::event::{quote_prefix, shorten, Decimal, FieldPath, FieldValue, Projection};

/// A syntax or name error at a byte offset of the expression text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExprError {
    pub offset: usize,
    pub message: String,
}

fn err<T>(offset: usize, message: impl Into<String>) -> Result<T, ExprError> {
    Err(ExprError { offset, message: message.into() })
}

// ---------------------------------------------------------------------------------------------
// Lexer

#[derive(Debug, Clone, PartialEq)]
enum Tok {
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

const OPS: [&str; 19] = ["||", "&&", "==", "!=", "<=", ">=", "<", ">", "!", "+", "-", "*", "/", "(", ")", "[", "]", ",", "."];

fn is_ref_char(c: u8) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'_' | b'.' | b'-')
}

fn lex(text: &str) -> Result<Vec<(Tok, usize)>, ExprError> {
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
                return err(start, format!("invalid number {}", quote_prefix(&text[start..=i])));
            }
            match Decimal::parse(&text[start..i]) {
                Some(d) => out.push((Tok::Num(d), start)),
                None => return err(start, format!("invalid number {}", quote_prefix(&text[start..i]))),
            }
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
                let Some(len) = text[i + 1..].find('`') else { return err(start, "unterminated backquoted name") };
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
                    let what = if c == b'$' { "a counter id after '$'" } else { "a list id after '@'" };
                    return err(start, format!("expected {what}"));
                }
                out.push((if c == b'$' { Tok::Counter(name) } else { Tok::List(name) }, start));
            }
            b'=' if !text[i..].starts_with("==") => return err(start, "'=' is not an operator: write '=='"),
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

/// A quoted string starting at `start`: its value and the offset after the closing quote.
fn lex_string(text: &str, start: usize) -> Result<(String, usize), ExprError> {
    let quote = text.as_bytes()[start] as char;
    let mut out = String::new();
    let mut chars = text[start + 1..].char_indices().map(|(j, c)| (start + 1 + j, c)).peekable();
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
                            _ => return err(at, "invalid \\u{…} escape: expected 1 to 6 hex digits and '}'"),
                        }
                    }
                    if hex.is_empty() {
                        return err(at, "invalid \\u{…} escape: expected 1 to 6 hex digits and '}'");
                    }
                    u32::from_str_radix(&hex, 16).ok()
                } else {
                    fn four(chars: &mut std::iter::Peekable<impl Iterator<Item = (usize, char)>>) -> Option<u32> {
                        let hex: String =
                            (0..4).filter_map(|_| chars.next_if(|(_, c)| c.is_ascii_hexdigit()).map(|(_, c)| c)).collect();
                        if hex.len() == 4 { u32::from_str_radix(&hex, 16).ok() } else { None }
                    }
                    let Some(high) = four(&mut chars) else { return err(at, "invalid \\u escape: expected 4 hex digits") };
                    if (0xD800..0xDC00).contains(&high) {
                        // A UTF-16 surrogate pair, as JSON writes characters beyond the BMP.
                        let low = if chars.next_if(|&(_, c)| c == '\\').is_some() && chars.next_if(|&(_, c)| c == 'u').is_some() {
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

// ---------------------------------------------------------------------------------------------
// Syntax tree

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinOp {
    Or,
    And,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Add,
    Sub,
    Mul,
    Div,
}

#[derive(Debug, Clone)]
enum Ast {
    Num(Decimal),
    Str(String),
    Bool(bool),
    Null,
    List(Vec<(Ast, usize)>),
    Path(FieldPath),
    Counter(String),
    ListRef(String),
    Not(Box<(Ast, usize)>),
    Neg(Box<(Ast, usize)>),
    Bin(BinOp, Box<(Ast, usize)>, Box<(Ast, usize)>),
    In { negated: bool, value: Box<(Ast, usize)>, set: Box<(Ast, usize)> },
    Call(String, Vec<(Ast, usize)>),
}

struct Parser {
    toks: Vec<(Tok, usize)>,
    pos: usize,
    /// Nodes above the one being parsed: parentheses, lists, calls, `!`, unary `-` and each link
    /// of a chain (`a && b && c` nests to the left). Bounded, so resolving, evaluating and
    /// dropping the tree never recurse deeper than [`MAX_NESTING`] (a hostile rule file of
    /// 100 000 parentheses would otherwise overflow the stack).
    depth: usize,
}

/// The deepest an expression may nest.
pub const MAX_NESTING: usize = 200;

const RESERVED: [&str; 7] = ["true", "false", "null", "and", "or", "not", "in"];

impl Parser {
    fn peek(&self) -> &Tok {
        &self.toks[self.pos].0
    }
    fn at(&self) -> usize {
        self.toks[self.pos].1
    }
    fn bump(&mut self) -> (Tok, usize) {
        let t = self.toks[self.pos].clone();
        if self.pos + 1 < self.toks.len() {
            self.pos += 1;
        }
        t
    }
    fn is_op(&self, op: &str) -> bool {
        matches!(self.peek(), Tok::Op(o) if *o == op)
    }
    fn is_word(&self, word: &str) -> bool {
        matches!(self.peek(), Tok::Ident(w) if w == word)
    }
    fn expect_op(&mut self, op: &str) -> Result<(), ExprError> {
        if self.is_op(op) {
            self.bump();
            Ok(())
        } else {
            err(self.at(), format!("expected '{op}', found {}", describe(self.peek())))
        }
    }

    /// One level deeper, refused past [`MAX_NESTING`].
    fn enter(&mut self) -> Result<(), ExprError> {
        self.depth += 1;
        if self.depth > MAX_NESTING {
            return err(
                self.at(),
                format!(
                    "expression nests too deeply (over {MAX_NESTING} levels of parentheses, operators or chained terms); \
                     split it, or test many values with `in [...]`"
                ),
            );
        }
        Ok(())
    }

    fn or(&mut self) -> Result<(Ast, usize), ExprError> {
        let mut left = self.and()?;
        let mut links = 0;
        while self.is_op("||") || self.is_word("or") {
            self.bump();
            self.enter()?;
            links += 1;
            let right = self.and()?;
            let at = left.1;
            left = (Ast::Bin(BinOp::Or, Box::new(left), Box::new(right)), at);
        }
        self.depth -= links;
        Ok(left)
    }

    fn and(&mut self) -> Result<(Ast, usize), ExprError> {
        let mut left = self.not()?;
        let mut links = 0;
        while self.is_op("&&") || self.is_word("and") {
            self.bump();
            self.enter()?;
            links += 1;
            let right = self.not()?;
            let at = left.1;
            left = (Ast::Bin(BinOp::And, Box::new(left), Box::new(right)), at);
        }
        self.depth -= links;
        Ok(left)
    }

    fn not(&mut self) -> Result<(Ast, usize), ExprError> {
        if self.is_op("!") || (self.is_word("not") && !self.next_is_word("in")) {
            let at = self.at();
            self.bump();
            self.enter()?;
            let inner = self.not()?;
            self.depth -= 1;
            return Ok((Ast::Not(Box::new(inner)), at));
        }
        self.comparison()
    }

    fn next_is_word(&self, word: &str) -> bool {
        matches!(self.toks.get(self.pos + 1), Some((Tok::Ident(w), _)) if w == word)
    }

    fn comparison_op(&self) -> Option<BinOp> {
        match self.peek() {
            Tok::Op("==") => Some(BinOp::Eq),
            Tok::Op("!=") => Some(BinOp::Ne),
            Tok::Op("<") => Some(BinOp::Lt),
            Tok::Op("<=") => Some(BinOp::Le),
            Tok::Op(">") => Some(BinOp::Gt),
            Tok::Op(">=") => Some(BinOp::Ge),
            _ => None,
        }
    }

    fn is_comparison(&self) -> bool {
        self.comparison_op().is_some() || self.is_word("in") || (self.is_word("not") && self.next_is_word("in"))
    }

    fn comparison(&mut self) -> Result<(Ast, usize), ExprError> {
        let left = self.additive()?;
        let at = left.1;
        let result = if let Some(op) = self.comparison_op() {
            self.bump();
            let right = self.additive()?;
            (Ast::Bin(op, Box::new(left), Box::new(right)), at)
        } else if self.is_word("in") || (self.is_word("not") && self.next_is_word("in")) {
            let negated = self.is_word("not");
            if negated {
                self.bump();
            }
            self.bump();
            let set = self.additive()?;
            (Ast::In { negated, value: Box::new(left), set: Box::new(set) }, at)
        } else {
            return Ok(left);
        };
        if self.is_comparison() {
            return err(self.at(), "comparisons do not chain: combine them with '&&' or parentheses");
        }
        Ok(result)
    }

    fn additive(&mut self) -> Result<(Ast, usize), ExprError> {
        let mut left = self.multiplicative()?;
        let mut links = 0;
        loop {
            let op = if self.is_op("+") {
                BinOp::Add
            } else if self.is_op("-") {
                BinOp::Sub
            } else {
                self.depth -= links;
                return Ok(left);
            };
            self.bump();
            self.enter()?;
            links += 1;
            let right = self.multiplicative()?;
            let at = left.1;
            left = (Ast::Bin(op, Box::new(left), Box::new(right)), at);
        }
    }

    fn multiplicative(&mut self) -> Result<(Ast, usize), ExprError> {
        let mut left = self.unary()?;
        let mut links = 0;
        loop {
            let op = if self.is_op("*") {
                BinOp::Mul
            } else if self.is_op("/") {
                BinOp::Div
            } else {
                self.depth -= links;
                return Ok(left);
            };
            self.bump();
            self.enter()?;
            links += 1;
            let right = self.unary()?;
            let at = left.1;
            left = (Ast::Bin(op, Box::new(left), Box::new(right)), at);
        }
    }

    fn unary(&mut self) -> Result<(Ast, usize), ExprError> {
        if self.is_op("-") {
            let at = self.at();
            self.bump();
            self.enter()?;
            let inner = self.unary()?;
            self.depth -= 1;
            if let Ast::Num(d) = inner.0 {
                return Ok((Ast::Num(-d), at));
            }
            return Ok((Ast::Neg(Box::new(inner)), at));
        }
        self.primary()
    }

    fn primary(&mut self) -> Result<(Ast, usize), ExprError> {
        let (tok, at) = self.bump();
        let ast = match tok {
            Tok::Num(d) => Ast::Num(d),
            Tok::Str(s) => Ast::Str(s),
            Tok::Counter(id) => Ast::Counter(id),
            Tok::List(id) => Ast::ListRef(id),
            Tok::Op("(") => {
                self.enter()?;
                let inner = self.or()?;
                self.expect_op(")")?;
                self.depth -= 1;
                return Ok((inner.0, at));
            }
            Tok::Op("[") => {
                self.enter()?;
                let mut items = Vec::new();
                if !self.is_op("]") {
                    loop {
                        items.push(self.or()?);
                        if self.is_op(",") {
                            self.bump();
                            if self.is_op("]") {
                                break;
                            }
                            continue;
                        }
                        break;
                    }
                }
                self.expect_op("]")?;
                self.depth -= 1;
                Ast::List(items)
            }
            Tok::Ident(word) if word == "true" => Ast::Bool(true),
            Tok::Ident(word) if word == "false" => Ast::Bool(false),
            Tok::Ident(word) if word == "null" => Ast::Null,
            Tok::Ident(word) if RESERVED.contains(&word.as_str()) => {
                return err(at, format!("unexpected '{word}' (as a field name, write it in backquotes: `{word}`)"))
            }
            Tok::Ident(name) if self.is_op("(") => {
                self.bump();
                self.enter()?;
                let mut args = Vec::new();
                if !self.is_op(")") {
                    loop {
                        args.push(self.or()?);
                        if self.is_op(",") {
                            self.bump();
                            continue;
                        }
                        break;
                    }
                }
                self.expect_op(")")?;
                self.depth -= 1;
                Ast::Call(name, args)
            }
            Tok::Ident(first) | Tok::Quoted(first) => {
                let mut path = first;
                while self.is_op(".") {
                    self.bump();
                    match self.bump() {
                        (Tok::Ident(seg) | Tok::Quoted(seg), _) => {
                            path.push('.');
                            path.push_str(&seg);
                        }
                        (other, at) => return err(at, format!("expected a field name after '.', found {}", describe(&other))),
                    }
                }
                match FieldPath::parse(&path) {
                    Some(p) => Ast::Path(p),
                    None => return err(at, format!("invalid field path {}", quote_prefix(&path))),
                }
            }
            other => return err(at, format!("expected a value, found {}", describe(&other))),
        };
        Ok((ast, at))
    }
}

fn describe(tok: &Tok) -> String {
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

// ---------------------------------------------------------------------------------------------
// Compiled form

/// A literal scalar, hashed for `in [...]` sets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Literal {
    Null,
    Bool(bool),
    Num(Decimal),
    Str(String),
}

/// What an expression may refer to, resolved at compile time.
pub trait Names {
    /// The index of counter `id`, or an error message.
    fn counter(&self, id: &str) -> Result<usize, String>;
    /// How many decimal places a counter's raw value has (6 for a sum's micro-units, else 0).
    fn counter_scale(&self, _index: usize) -> i32 {
        0
    }
    /// The list `id`, or an error message.
    fn list(&self, id: &str) -> Result<std::sync::Arc<ListSet>, String>;
}

/// The comparison of a [`Expr::CounterCmp`], with the counter on the left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CounterCmp {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
}

impl CounterCmp {
    /// `raw OP literal`, exactly, from the literal's scaled floor and ceiling.
    #[inline]
    fn holds(self, raw: i64, floor: i64, ceil: i64) -> bool {
        match self {
            CounterCmp::Gt => raw > floor,
            CounterCmp::Ge => raw >= ceil,
            CounterCmp::Lt => raw < ceil,
            CounterCmp::Le => raw <= floor,
            CounterCmp::Eq => floor == ceil && raw == floor,
            CounterCmp::Ne => !(floor == ceil && raw == floor),
        }
    }
}

/// The strings of an `in [...]` set: a few compared in turn (faster than hashing), many hashed.
#[derive(Debug, Clone)]
pub enum StrSet {
    Few(Vec<Box<str>>),
    Many(HashSet<Box<str>, foldhash::fast::FixedState>),
}

impl StrSet {
    /// Up to this many strings are compared in turn.
    const FEW: usize = 8;

    fn new(strings: Vec<Box<str>>) -> StrSet {
        if strings.len() <= StrSet::FEW {
            StrSet::Few(strings)
        } else {
            StrSet::Many(strings.into_iter().collect())
        }
    }

    #[inline]
    fn contains(&self, s: &str) -> bool {
        match self {
            StrSet::Few(few) => few.iter().any(|t| t.as_ref() == s),
            StrSet::Many(many) => many.contains(s),
        }
    }
}

/// A compiled expression node.
#[derive(Debug, Clone)]
pub enum Expr {
    Lit(Literal),
    /// A number literal, with its double computed once.
    Num(Num),
    Field(usize),
    Counter(usize),
    Not(Box<Expr>),
    Neg(Box<Expr>),
    Bin(BinOp, Box<Expr>, Box<Expr>),
    /// `field == 'text'` (or `!=`): the most common test, compared without building values.
    FieldIsStr { negated: bool, slot: usize, text: Box<str> },
    /// `$counter OP number` (either way round), compared on the counter's raw integer scale:
    /// `floor` and `ceil` are the literal times 10^scale rounded down and up, so `raw > floor`
    /// is exactly `value > literal` (see [`CounterCmp`]).
    CounterCmp { cmp: CounterCmp, index: usize, floor: i64, ceil: i64 },
    /// `x in [...]`: string elements apart (looked up by `&str`, no allocation), the others by
    /// literal.
    InSet { negated: bool, value: Box<Expr>, strings: StrSet, set: HashSet<Literal> },
    InField { negated: bool, value: Box<Expr>, field: usize },
    InCidr { negated: bool, value: Box<Expr>, nets: Vec<IpNet> },
    InList { negated: bool, value: Box<Expr>, list: std::sync::Arc<ListSet> },
    Exists(usize),
    StartsWith(Box<Expr>, Box<Expr>),
    EndsWith(Box<Expr>, Box<Expr>),
    Contains(Box<Expr>, Box<Expr>),
    Matches(Box<Expr>, Box<Regex>),
    Lower(Box<Expr>),
}

/// A parsed, resolved expression with what it reads.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub expr: Expr,
    /// Counters it refers to, in order of first reference.
    pub counters: Vec<usize>,
    /// Field paths it reads, for summaries.
    pub paths: Vec<FieldPath>,
}

/// Parses and resolves `text`. `allow_counters` is false for a `match`.
pub fn compile(text: &str, projection: &mut Projection, names: &dyn Names, allow_counters: bool) -> Result<Compiled, ExprError> {
    let toks = lex(text)?;
    if toks.len() == 1 {
        return err(0, "empty expression");
    }
    let mut parser = Parser { toks, pos: 0, depth: 0 };
    let ast = parser.or()?;
    if !matches!(parser.peek(), Tok::End) {
        return err(parser.at(), format!("unexpected {}", describe(parser.peek())));
    }
    let mut resolver = Resolver { projection, names, allow_counters, counters: Vec::new(), paths: Vec::new() };
    let expr = resolver.resolve(&ast)?;
    Ok(Compiled { expr, counters: resolver.counters, paths: resolver.paths })
}

struct Resolver<'a> {
    projection: &'a mut Projection,
    names: &'a dyn Names,
    allow_counters: bool,
    counters: Vec<usize>,
    paths: Vec<FieldPath>,
}

impl Resolver<'_> {
    fn field(&mut self, path: &FieldPath) -> usize {
        if !self.paths.contains(path) {
            self.paths.push(path.clone());
        }
        self.projection.slot(path)
    }

    fn resolve(&mut self, (ast, at): &(Ast, usize)) -> Result<Expr, ExprError> {
        let at = *at;
        Ok(match ast {
            Ast::Num(d) => Expr::Num(Num::exact(*d)),
            Ast::Str(s) => Expr::Lit(Literal::Str(s.clone())),
            Ast::Bool(b) => Expr::Lit(Literal::Bool(*b)),
            Ast::Null => Expr::Lit(Literal::Null),
            Ast::List(_) => return err(at, "a list [...] can only follow 'in' or 'not in'"),
            Ast::Path(p) => Expr::Field(self.field(p)),
            Ast::Counter(id) => {
                if !self.allow_counters {
                    return err(at, format!("a match cannot use counters (${}): test it in the rule's `when`", shorten(id)));
                }
                let index = self.names.counter(id).or_else(|m| err(at, m))?;
                if !self.counters.contains(&index) {
                    self.counters.push(index);
                }
                Expr::Counter(index)
            }
            Ast::ListRef(id) => {
                self.names.list(id).or_else(|m| err(at, m))?;
                return err(at, format!("@{} can only follow 'in' or 'not in'", shorten(id)));
            }
            Ast::Not(inner) => Expr::Not(Box::new(self.resolve(inner)?)),
            Ast::Neg(inner) => Expr::Neg(Box::new(self.resolve(inner)?)),
            Ast::Bin(op, l, r) => {
                let (l, r) = (self.resolve(l)?, self.resolve(r)?);
                match (op, l, r) {
                    (op, Expr::Counter(index), Expr::Num(n)) if counter_cmp(*op, false).is_some() && n.exact.is_some() => {
                        self.counter_cmp(counter_cmp(*op, false), index, n)
                    }
                    (op, Expr::Num(n), Expr::Counter(index)) if counter_cmp(*op, true).is_some() && n.exact.is_some() => {
                        self.counter_cmp(counter_cmp(*op, true), index, n)
                    }
                    (BinOp::Eq | BinOp::Ne, Expr::Field(slot), Expr::Lit(Literal::Str(text)))
                    | (BinOp::Eq | BinOp::Ne, Expr::Lit(Literal::Str(text)), Expr::Field(slot)) => {
                        Expr::FieldIsStr { negated: *op == BinOp::Ne, slot, text: text.into_boxed_str() }
                    }
                    (op, l, r) => Expr::Bin(*op, Box::new(l), Box::new(r)),
                }
            }
            Ast::In { negated, value, set } => {
                let value = Box::new(self.resolve(value)?);
                let negated = *negated;
                match &set.0 {
                    Ast::List(items) => {
                        let (mut strings, mut literals) = (HashSet::<Box<str>>::new(), HashSet::new());
                        for item in items {
                            match literal(item)? {
                                Literal::Str(s) => {
                                    strings.insert(s.into_boxed_str());
                                }
                                other => {
                                    literals.insert(other);
                                }
                            }
                        }
                        Expr::InSet { negated, value, strings: StrSet::new(strings.into_iter().collect()), set: literals }
                    }
                    Ast::Path(p) => Expr::InField { negated, value, field: self.field(p) },
                    Ast::ListRef(id) => Expr::InList { negated, value, list: self.names.list(id).or_else(|m| err(set.1, m))? },
                    Ast::Call(name, args) if name == "cidr" => Expr::InCidr { negated, value, nets: networks(args, set.1)? },
                    _ => return err(set.1, "'in' needs a list [...], an event array field, @list or cidr(...)"),
                }
            }
            Ast::Call(name, args) => self.call(name, args, at)?,
        })
    }

    /// `$counter cmp literal` on the raw scale, or the general comparison when the scaled
    /// literal does not fit 64 bits (then a raw integer cannot decide it exactly).
    fn counter_cmp(&self, cmp: Option<CounterCmp>, index: usize, literal: Num) -> Expr {
        let (Some(cmp), Some(exact)) = (cmp, literal.exact) else { unreachable!("checked by the caller") };
        let scale = self.names.counter_scale(index);
        let floor = exact.floor_scaled(scale);
        let ceil = (-exact).floor_scaled(scale).checked_neg();
        match ceil {
            Some(ceil) if floor != i64::MAX && floor != i64::MIN && ceil != i64::MAX && ceil != i64::MIN + 1 => {
                Expr::CounterCmp { cmp, index, floor, ceil }
            }
            _ => {
                let op = match cmp {
                    CounterCmp::Lt => BinOp::Lt,
                    CounterCmp::Le => BinOp::Le,
                    CounterCmp::Gt => BinOp::Gt,
                    CounterCmp::Ge => BinOp::Ge,
                    CounterCmp::Eq => BinOp::Eq,
                    CounterCmp::Ne => BinOp::Ne,
                };
                Expr::Bin(op, Box::new(Expr::Counter(index)), Box::new(Expr::Num(literal)))
            }
        }
    }

    fn call(&mut self, name: &str, args: &[(Ast, usize)], at: usize) -> Result<Expr, ExprError> {
        let arity = |n: usize| -> Result<(), ExprError> {
            if args.len() == n {
                Ok(())
            } else {
                err(at, format!("{name}() takes {n} argument{}, found {}", if n == 1 { "" } else { "s" }, args.len()))
            }
        };
        Ok(match name {
            "exists" => {
                arity(1)?;
                match &args[0].0 {
                    Ast::Path(p) => Expr::Exists(self.field(p)),
                    _ => return err(args[0].1, "exists() takes a field path"),
                }
            }
            "starts_with" | "ends_with" | "contains" => {
                arity(2)?;
                let (a, b) = (Box::new(self.resolve(&args[0])?), Box::new(self.resolve(&args[1])?));
                match name {
                    "starts_with" => Expr::StartsWith(a, b),
                    "ends_with" => Expr::EndsWith(a, b),
                    _ => Expr::Contains(a, b),
                }
            }
            "lower" => {
                arity(1)?;
                Expr::Lower(Box::new(self.resolve(&args[0])?))
            }
            "matches" => {
                arity(2)?;
                let Ast::Str(pattern) = &args[1].0 else {
                    return err(args[1].1, "matches() takes a regular expression as a string literal");
                };
                let regex = regex::RegexBuilder::new(pattern).size_limit(1 << 20).build().or_else(|e| {
                    let first = e.to_string().lines().last().unwrap_or("invalid").trim().trim_start_matches("error: ").to_owned();
                    err(args[1].1, format!("invalid regular expression: {first}"))
                })?;
                Expr::Matches(Box::new(self.resolve(&args[0])?), Box::new(regex))
            }
            "cidr" => return err(at, "cidr(...) can only follow 'in' or 'not in'"),
            other => {
                return err(
                    at,
                    format!("unknown function {}; expected exists, starts_with, ends_with, contains, matches, lower or cidr", quote_prefix(other)),
                )
            }
        })
    }
}

/// The counter comparison `op` is, with the counter on the left (`flipped`: it was on the right).
fn counter_cmp(op: BinOp, flipped: bool) -> Option<CounterCmp> {
    Some(match (op, flipped) {
        (BinOp::Lt, false) | (BinOp::Gt, true) => CounterCmp::Lt,
        (BinOp::Le, false) | (BinOp::Ge, true) => CounterCmp::Le,
        (BinOp::Gt, false) | (BinOp::Lt, true) => CounterCmp::Gt,
        (BinOp::Ge, false) | (BinOp::Le, true) => CounterCmp::Ge,
        (BinOp::Eq, _) => CounterCmp::Eq,
        (BinOp::Ne, _) => CounterCmp::Ne,
        _ => return None,
    })
}

fn literal((ast, at): &(Ast, usize)) -> Result<Literal, ExprError> {
    Ok(match ast {
        Ast::Num(d) => Literal::Num(*d),
        Ast::Str(s) => Literal::Str(s.clone()),
        Ast::Bool(b) => Literal::Bool(*b),
        Ast::Null => Literal::Null,
        _ => return err(*at, "list elements must be literals (numbers, strings, true, false, null)"),
    })
}

fn networks(args: &[(Ast, usize)], at: usize) -> Result<Vec<IpNet>, ExprError> {
    if args.is_empty() {
        return err(at, "cidr() needs at least one network");
    }
    args.iter()
        .map(|(ast, at)| match ast {
            Ast::Str(s) => parse_network(s).ok_or_else(|| ExprError {
                offset: *at,
                message: format!("invalid network {}: expected an IPv4 or IPv6 address or CIDR like \"10.0.0.0/8\"", quote_prefix(s)),
            }),
            _ => err(*at, "cidr() takes networks as string literals"),
        })
        .collect()
}

/// A network (`10.0.0.0/8`, host bits allowed) or a bare address (a /32 or /128).
pub fn parse_network(text: &str) -> Option<IpNet> {
    if let Ok(net) = text.parse::<IpNet>() {
        return Some(net);
    }
    text.parse::<IpAddr>().ok().map(IpNet::from)
}

// ---------------------------------------------------------------------------------------------
// Evaluation

/// A number as an expression sees it: exact when it came from the event, a literal or a
/// counter; a double once arithmetic made it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Num {
    pub float: f64,
    pub exact: Option<Decimal>,
}

impl Num {
    pub fn exact(d: Decimal) -> Num {
        Num { float: d.to_f64(), exact: Some(d) }
    }
}

/// A value during evaluation.
#[derive(Debug, Clone, PartialEq)]
pub enum Val<'e> {
    Unknown,
    Null,
    Bool(bool),
    Num(Num),
    Str(Cow<'e, str>),
    /// An event array.
    Array(&'e [FieldValue<'e>]),
    /// An event object: equal to nothing.
    Object,
}

/// Where an expression gets field and counter values.
pub trait Context<'e> {
    fn field(&self, slot: usize) -> &'e FieldValue<'e>;
    /// The counter's value for this event, or `None` when it is unknown (late, key unusable).
    fn counter(&mut self, index: usize) -> Option<Num>;
    /// The same value on the counter's raw integer scale (micro-units for a sum).
    fn counter_raw(&mut self, index: usize) -> Option<i64>;
}

fn field_val<'e>(v: &'e FieldValue<'e>) -> Val<'e> {
    match v {
        FieldValue::Missing => Val::Unknown,
        FieldValue::Null => Val::Null,
        FieldValue::Bool(b) => Val::Bool(*b),
        FieldValue::Number(n) => Val::Num(Num::exact(n.exact)),
        FieldValue::Str(s) => Val::Str(Cow::Borrowed(s.as_ref())),
        FieldValue::Object => Val::Object,
        FieldValue::Array(items) => Val::Array(items),
    }
}

fn lit_val(l: &Literal) -> Val<'_> {
    match l {
        Literal::Null => Val::Null,
        Literal::Bool(b) => Val::Bool(*b),
        Literal::Num(d) => Val::Num(Num::exact(*d)),
        Literal::Str(s) => Val::Str(Cow::Borrowed(s)),
    }
}

/// Three-valued truth: `None` is unknown.
pub type Truth = Option<bool>;

fn truth(v: &Val<'_>) -> Truth {
    match v {
        Val::Bool(b) => Some(*b),
        _ => None,
    }
}

fn truth_val(t: Truth) -> Val<'static> {
    t.map_or(Val::Unknown, Val::Bool)
}

/// Strict equality; `None` when either side is unknown.
fn equal(a: &Val<'_>, b: &Val<'_>) -> Truth {
    Some(match (a, b) {
        (Val::Unknown, _) | (_, Val::Unknown) => return None,
        (Val::Null, Val::Null) => true,
        (Val::Bool(x), Val::Bool(y)) => x == y,
        (Val::Num(x), Val::Num(y)) => match (x.exact, y.exact) {
            (Some(p), Some(q)) => p == q,
            _ => x.float == y.float,
        },
        (Val::Str(x), Val::Str(y)) => x == y,
        _ => false,
    })
}

fn order(a: &Val<'_>, b: &Val<'_>) -> Option<std::cmp::Ordering> {
    match (a, b) {
        (Val::Num(x), Val::Num(y)) => match (x.exact, y.exact) {
            (Some(p), Some(q)) => Some(p.cmp(&q)),
            _ => x.float.partial_cmp(&y.float),
        },
        (Val::Str(x), Val::Str(y)) => Some(x.as_ref().cmp(y.as_ref())),
        _ => None,
    }
}

/// Whether a value equals a literal (strict types, numbers by decimal value).
fn equals_literal(v: &Val<'_>, l: &Literal) -> bool {
    match (v, l) {
        (Val::Null, Literal::Null) => true,
        (Val::Bool(a), Literal::Bool(b)) => a == b,
        (Val::Num(n), Literal::Num(d)) => match n.exact {
            Some(e) => e == *d,
            None => n.float == d.to_f64(),
        },
        (Val::Str(s), Literal::Str(t)) => s.as_ref() == t.as_str(),
        _ => false,
    }
}

/// The literal a value is, for a set lookup (`None`: it can be in no literal set).
fn as_literal_key(v: &Val<'_>) -> Option<Literal> {
    match v {
        Val::Null => Some(Literal::Null),
        Val::Bool(b) => Some(Literal::Bool(*b)),
        Val::Num(Num { exact: Some(d), .. }) => Some(Literal::Num(*d)),
        _ => None,
    }
}

fn negate_if(negated: bool, t: Truth) -> Truth {
    t.map(|b| b != negated)
}

impl Expr {
    /// Evaluates to a value.
    pub fn eval<'e, 's: 'e, C: Context<'e> + ?Sized>(&'s self, cx: &mut C) -> Val<'e> {
        match self {
            Expr::Lit(l) => lit_val(l),
            Expr::Num(n) => Val::Num(*n),
            Expr::Field(slot) => field_val(cx.field(*slot)),
            Expr::Counter(index) => cx.counter(*index).map_or(Val::Unknown, Val::Num),
            Expr::Neg(inner) => match inner.eval(cx) {
                Val::Num(n) => Val::Num(Num { float: -n.float, exact: n.exact.map(|d| -d) }),
                _ => Val::Unknown,
            },
            Expr::Bin(op @ (BinOp::Add | BinOp::Sub | BinOp::Mul | BinOp::Div), l, r) => match (l.eval(cx), r.eval(cx)) {
                (Val::Num(x), Val::Num(y)) => {
                    let (x, y) = (x.float, y.float);
                    let v = match op {
                        BinOp::Add => x + y,
                        BinOp::Sub => x - y,
                        BinOp::Mul => x * y,
                        _ if y == 0.0 => return Val::Unknown,
                        _ => x / y,
                    };
                    if v.is_nan() {
                        Val::Unknown
                    } else {
                        Val::Num(Num { float: v, exact: None })
                    }
                }
                _ => Val::Unknown,
            },
            Expr::Lower(a) => match a.eval(cx) {
                Val::Str(s) if s.bytes().any(|b| b.is_ascii_uppercase()) || !s.is_ascii() => Val::Str(Cow::Owned(s.to_lowercase())),
                Val::Str(s) => Val::Str(s),
                _ => Val::Unknown,
            },
            // Every other node is a test: its value is its truth.
            _ => truth_val(self.test(cx)),
        }
    }

    /// The truth of the expression (`None`: unknown, including every non-boolean value),
    /// computed without building intermediate values where the node is a test: a `match` or
    /// `when` is almost always a tree of tests.
    pub fn test<'e, 's: 'e, C: Context<'e> + ?Sized>(&'s self, cx: &mut C) -> Truth {
        match self {
            Expr::Not(inner) => inner.test(cx).map(|b| !b),
            Expr::Bin(BinOp::And, l, r) => {
                let a = l.test(cx);
                if a == Some(false) {
                    return Some(false);
                }
                match (a, r.test(cx)) {
                    (_, Some(false)) => Some(false),
                    (Some(true), Some(true)) => Some(true),
                    _ => None,
                }
            }
            Expr::Bin(BinOp::Or, l, r) => {
                let a = l.test(cx);
                if a == Some(true) {
                    return Some(true);
                }
                match (a, r.test(cx)) {
                    (_, Some(true)) => Some(true),
                    (Some(false), Some(false)) => Some(false),
                    _ => None,
                }
            }
            Expr::Bin(op @ (BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge), l, r) => {
                let (a, b) = (l.eval(cx), r.eval(cx));
                match op {
                    BinOp::Eq => equal(&a, &b),
                    BinOp::Ne => equal(&a, &b).map(|e| !e),
                    _ => order(&a, &b).map(|o| match op {
                        BinOp::Lt => o.is_lt(),
                        BinOp::Le => o.is_le(),
                        BinOp::Gt => o.is_gt(),
                        _ => o.is_ge(),
                    }),
                }
            }
            Expr::CounterCmp { cmp, index, floor, ceil } => cx.counter_raw(*index).map(|raw| cmp.holds(raw, *floor, *ceil)),
            Expr::FieldIsStr { negated, slot, text } => match cx.field(*slot) {
                FieldValue::Missing => None,
                FieldValue::Str(s) => Some((s.as_ref() == text.as_ref()) != *negated),
                // Strict types: a value of any other type is not equal to a string.
                _ => Some(*negated),
            },
            Expr::InSet { negated, value, strings, set } => {
                let v = value.eval(cx);
                let found = match &v {
                    Val::Unknown => None,
                    Val::Str(s) => Some(strings.contains(s)),
                    Val::Num(Num { exact: None, .. }) => Some(set.iter().any(|l| equals_literal(&v, l))),
                    other => Some(as_literal_key(other).is_some_and(|key| set.contains(&key))),
                };
                negate_if(*negated, found)
            }
            Expr::InField { negated, value, field } => {
                let v = value.eval(cx);
                let found = match (&v, cx.field(*field)) {
                    (Val::Unknown, _) => None,
                    (_, FieldValue::Array(items)) => Some(items.iter().any(|item| equal(&v, &field_val(item)) == Some(true))),
                    _ => None,
                };
                negate_if(*negated, found)
            }
            Expr::InCidr { negated, value, nets } => {
                let found = match value.eval(cx) {
                    Val::Str(s) => s.parse::<IpAddr>().ok().map(|ip| nets.iter().any(|n| n.contains(&ip))),
                    _ => None,
                };
                negate_if(*negated, found)
            }
            Expr::InList { negated, value, list } => {
                // Strict types: a value of another type is simply not in a string or number
                // list; a cidr list needs a string address (else unknown).
                let found = match (value.eval(cx), list.as_ref()) {
                    (Val::Unknown, _) => None,
                    (Val::Str(s), ListSet::Strings(set)) => Some(set.contains(s.as_ref())),
                    (Val::Num(Num { exact: Some(d), .. }), ListSet::Numbers(set)) => Some(set.contains(&d)),
                    (Val::Num(n), ListSet::Numbers(set)) => Some(Decimal::from_f64(n.float).is_some_and(|d| set.contains(&d))),
                    (_, ListSet::Strings(_) | ListSet::Numbers(_)) => Some(false),
                    (Val::Str(s), ListSet::Networks(nets)) => s.parse::<IpAddr>().ok().map(|ip| nets.contains(ip)),
                    (_, ListSet::Networks(_)) => None,
                };
                negate_if(*negated, found)
            }
            Expr::Exists(slot) => Some(!matches!(cx.field(*slot), FieldValue::Missing | FieldValue::Null)),
            Expr::StartsWith(a, b) | Expr::EndsWith(a, b) | Expr::Contains(a, b) => match (a.eval(cx), b.eval(cx)) {
                (Val::Str(s), Val::Str(p)) => Some(match self {
                    Expr::StartsWith(..) => s.starts_with(p.as_ref()),
                    Expr::EndsWith(..) => s.ends_with(p.as_ref()),
                    _ => s.contains(p.as_ref()),
                }),
                _ => None,
            },
            Expr::Matches(a, regex) => match a.eval(cx) {
                Val::Str(s) => Some(regex.is_match(&s)),
                _ => None,
            },
            // A value: true only if it is the boolean true.
            Expr::Lit(_) | Expr::Num(_) | Expr::Field(_) | Expr::Counter(_) | Expr::Neg(_) | Expr::Bin(..) | Expr::Lower(_) => {
                truth(&self.eval(cx))
            }
        }
    }

    /// Whether the expression is true (a `match` or `when` acts only on true).
    #[inline]
    pub fn holds<'e, 's: 'e, C: Context<'e> + ?Sized>(&'s self, cx: &mut C) -> bool {
        self.test(cx) == Some(true)
    }

    /// Splits a top-level `a && b && …` into its conjuncts, in order (one item otherwise): an
    /// expression is true exactly when each of them is.
    pub fn conjuncts(&self) -> Vec<&Expr> {
        match self {
            Expr::Bin(BinOp::And, l, r) => {
                let mut all = l.conjuncts();
                all.extend(r.conjuncts());
                all
            }
            other => vec![other],
        }
    }

    /// A text equal for two expressions exactly when they are the same computation over the
    /// same inputs (lists by identity, sets in sorted order): conjuncts with the same identity
    /// are evaluated once per event, however many counters and rules repeat them.
    pub fn identity(&self) -> String {
        let mut out = String::new();
        self.write_identity(&mut out);
        out
    }

    fn write_identity(&self, out: &mut String) {
        use std::fmt::Write;
        let sub = |out: &mut String, tag: &str, children: &[&Expr]| {
            out.push_str(tag);
            out.push('(');
            for child in children {
                child.write_identity(out);
                out.push(',');
            }
            out.push(')');
        };
        match self {
            Expr::Lit(_) | Expr::Num(_) | Expr::Field(_) | Expr::Counter(_) | Expr::Exists(_) | Expr::FieldIsStr { .. } | Expr::CounterCmp { .. } => {
                let _ = write!(out, "{self:?}");
            }
            Expr::InField { negated, value, field } => sub(out, &format!("in_field{negated}{field}"), &[value]),
            Expr::Not(a) => sub(out, "not", &[a]),
            Expr::Neg(a) => sub(out, "neg", &[a]),
            Expr::Lower(a) => sub(out, "lower", &[a]),
            Expr::Bin(op, a, b) => sub(out, &format!("{op:?}"), &[a, b]),
            Expr::StartsWith(a, b) => sub(out, "starts_with", &[a, b]),
            Expr::EndsWith(a, b) => sub(out, "ends_with", &[a, b]),
            Expr::Contains(a, b) => sub(out, "contains", &[a, b]),
            Expr::Matches(a, regex) => sub(out, &format!("matches{:?}", regex.as_str()), &[a]),
            Expr::InSet { negated, value, strings, set } => {
                let mut members: Vec<String> = match strings {
                    StrSet::Few(few) => few.iter().map(|s| format!("{s:?}")).collect(),
                    StrSet::Many(many) => many.iter().map(|s| format!("{s:?}")).collect(),
                };
                members.extend(set.iter().map(|l| format!("{l:?}")));
                members.sort_unstable();
                sub(out, &format!("in{negated}{members:?}"), &[value]);
            }
            Expr::InCidr { negated, value, nets } => sub(out, &format!("cidr{negated}{nets:?}"), &[value]),
            Expr::InList { negated, value, list } => {
                sub(out, &format!("list{negated}{:p}", std::sync::Arc::as_ptr(list)), &[value]);
            }
        }
    }

    /// A constant value, when the expression reads nothing (for "can never fire" warnings).
    pub fn constant(&self) -> Option<Val<'_>> {
        struct NoInput;
        impl<'e> Context<'e> for NoInput {
            fn field(&self, _: usize) -> &'e FieldValue<'e> {
                &FieldValue::Missing
            }
            fn counter(&mut self, _: usize) -> Option<Num> {
                None
            }
            fn counter_raw(&mut self, _: usize) -> Option<i64> {
                None
            }
        }
        if self.reads_input() {
            return None;
        }
        Some(self.eval(&mut NoInput))
    }

    fn reads_input(&self) -> bool {
        match self {
            Expr::Lit(_) | Expr::Num(_) => false,
            Expr::Field(_) | Expr::Counter(_) | Expr::Exists(_) | Expr::InField { .. } | Expr::FieldIsStr { .. } | Expr::CounterCmp { .. } => true,
            Expr::Not(a) | Expr::Neg(a) | Expr::Lower(a) | Expr::Matches(a, _) => a.reads_input(),
            Expr::Bin(_, a, b) | Expr::StartsWith(a, b) | Expr::EndsWith(a, b) | Expr::Contains(a, b) => {
                a.reads_input() || b.reads_input()
            }
            Expr::InSet { value, .. } | Expr::InCidr { value, .. } | Expr::InList { value, .. } => value.reads_input(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::decode;

    struct Counters;
    impl Names for Counters {
        fn counter(&self, id: &str) -> Result<usize, String> {
            match id {
                "fails" => Ok(0),
                "sum-1" => Ok(1),
                other => Err(format!("unknown counter {}", quote_prefix(other))),
            }
        }
        fn list(&self, id: &str) -> Result<std::sync::Arc<ListSet>, String> {
            Err(format!("unknown list {}", quote_prefix(id)))
        }
    }

    struct Cx<'e> {
        event: &'e crate::event::Event<'e>,
        counters: [Option<Num>; 2],
    }
    impl<'e> Context<'e> for Cx<'e> {
        fn field(&self, slot: usize) -> &'e FieldValue<'e> {
            self.event.field(slot)
        }
        fn counter(&mut self, index: usize) -> Option<Num> {
            self.counters[index]
        }
        fn counter_raw(&mut self, index: usize) -> Option<i64> {
            self.counters[index].map(|n| n.exact.and_then(Decimal::as_i64).unwrap())
        }
    }

    /// Evaluates `expr` on `event`: Some(true/false) or None (unknown).
    fn eval(expr: &str, event: &str) -> Option<bool> {
        let mut p = Projection::new();
        let c = compile(expr, &mut p, &Counters, true).unwrap_or_else(|e| panic!("{expr}: {e:?}"));
        let e = decode(event.as_bytes(), &p).unwrap();
        let mut cx = Cx { event: &e, counters: [Some(Num::exact(Decimal::from_i64(6))), None] };
        truth(&c.expr.eval(&mut cx))
    }

    fn error(expr: &str, allow_counters: bool) -> (usize, String) {
        let mut p = Projection::new();
        let e = compile(expr, &mut p, &Counters, allow_counters).unwrap_err();
        (e.offset, e.message)
    }

    #[test]
    fn three_valued_logic() {
        let ev = r#"{"ts":1,"a":true,"b":false}"#;
        assert_eq!(eval("a && b", ev), Some(false));
        assert_eq!(eval("missing && b", ev), Some(false));
        assert_eq!(eval("b && missing", ev), Some(false));
        assert_eq!(eval("a && missing", ev), None);
        assert_eq!(eval("a || missing", ev), Some(true));
        assert_eq!(eval("missing || a", ev), Some(true));
        assert_eq!(eval("b || missing", ev), None);
        assert_eq!(eval("!missing", ev), None);
        assert_eq!(eval("not b", ev), Some(true));
        assert_eq!(eval("!(missing == 1)", ev), None);
        assert_eq!(eval("!missing == true", ev), None);
        // Non-booleans are unknown to logic.
        assert_eq!(eval("1 && a", ev), None);
        assert_eq!(eval("'x' || b", ev), None);
    }

    #[test]
    fn strict_types_and_exact_numbers() {
        let ev = r#"{"ts":1,"n":1.0000000000000001,"one":1.0,"s":"1","z":null,"x":0.1,"y":0.2}"#;
        assert_eq!(eval("one == 1", ev), Some(true));
        assert_eq!(eval("n == 1", ev), Some(false));
        assert_eq!(eval("n > 1", ev), Some(true));
        assert_eq!(eval("s == 1", ev), Some(false));
        assert_eq!(eval("s != 1", ev), Some(true));
        assert_eq!(eval("s < 2", ev), None);
        assert_eq!(eval("z == null", ev), Some(true));
        assert_eq!(eval("z != 1", ev), Some(true));
        assert_eq!(eval("exists(z)", ev), Some(false));
        assert_eq!(eval("exists(s)", ev), Some(true));
        assert_eq!(eval("missing != 1", ev), None);
        assert_eq!(eval("x + y > 0.3", ev), Some(true));
        assert_eq!(eval("x + y == 0.30000000000000004", ev), Some(true));
        assert_eq!(eval("one / 0 > 1", ev), None);
        assert_eq!(eval("-one == -1", ev), Some(true));
        assert_eq!(eval("2 * 3 - 1 == 5", ev), Some(true));
        assert_eq!(eval("$fails > 5", ev), Some(true));
        assert_eq!(eval("$sum-1 > 5", ev), None);
        assert_eq!(eval("$fails / 4 == 1.5", ev), Some(true));
    }

    #[test]
    fn membership_and_functions() {
        let ev = r#"{"ts":1,"c":"FR","n":3,"tags":["vip",3],"ip":"10.1.2.3","ip6":"2001:db8::1","mapped":"::ffff:10.0.0.1","email":"Bob@Example.COM"}"#;
        assert_eq!(eval("c in ['FR', 'DE']", ev), Some(true));
        assert_eq!(eval("c not in ['FR', 'DE']", ev), Some(false));
        assert_eq!(eval("n in ['3']", ev), Some(false));
        assert_eq!(eval("n in [3.0]", ev), Some(true));
        assert_eq!(eval("missing in [1]", ev), None);
        assert_eq!(eval("'vip' in tags", ev), Some(true));
        assert_eq!(eval("n in tags", ev), Some(true));
        assert_eq!(eval("'x' in tags", ev), Some(false));
        assert_eq!(eval("'x' in c", ev), None);
        assert_eq!(eval("ip in cidr('10.0.0.0/8')", ev), Some(true));
        assert_eq!(eval("ip in cidr('192.168.0.0/16', '10.1.2.3')", ev), Some(true));
        assert_eq!(eval("ip6 in cidr('2001:db8::/32')", ev), Some(true));
        assert_eq!(eval("mapped in cidr('10.0.0.0/8')", ev), Some(false));
        assert_eq!(eval("c in cidr('10.0.0.0/8')", ev), None);
        assert_eq!(eval("n not in cidr('10.0.0.0/8')", ev), None);
        assert_eq!(eval("lower(email) == 'bob@example.com'", ev), Some(true));
        assert_eq!(eval("ends_with(lower(email), '.com')", ev), Some(true));
        assert_eq!(eval("starts_with(email, 'Bob')", ev), Some(true));
        assert_eq!(eval("contains(email, '@')", ev), Some(true));
        assert_eq!(eval("contains(n, '3')", ev), None);
        assert_eq!(eval("matches(email, '@example\\\\.com$')", ev), Some(false));
        assert_eq!(eval("matches(lower(email), '@example\\\\.com$')", ev), Some(true));
        assert_eq!(eval("headers.`x-forwarded-for` == null", r#"{"ts":1,"headers":{"x-forwarded-for":null}}"#), Some(true));
        assert_eq!(eval("`in` == 1", r#"{"ts":1,"in":1}"#), Some(true));
        assert_eq!(eval("'\\u{1F600}' == '\\uD83D\\uDE00' && 'a\\tb' == \"a\\tb\"", ev), Some(true));
    }

    #[test]
    fn errors_point_at_their_column() {
        assert_eq!(error("a < b < c", true), (6, "comparisons do not chain: combine them with '&&' or parentheses".into()));
        assert_eq!(error("amount > ", true), (9, "expected a value, found the end of the expression".into()));
        assert_eq!(error("$nope > 1", true), (0, "unknown counter \"nope\"".into()));
        assert_eq!(error("x && $fails > 1", false).0, 5);
        assert_eq!(error("ip in @bad", true), (6, "unknown list \"bad\"".into()));
        assert_eq!(error("foo(x)", true).1, "unknown function \"foo\"; expected exists, starts_with, ends_with, contains, matches, lower or cidr");
        assert_eq!(error("x == 'a\\q'", true), (7, "invalid escape '\\q'".into()));
        assert_eq!(error("x = 1", true), (2, "'=' is not an operator: write '=='".into()));
        assert_eq!(error("matches(x, '(')", true).0, 11);
        assert_eq!(error("exists('x')", true), (7, "exists() takes a field path".into()));
        assert_eq!(error("ip in cidr('10.0.0.0/33')", true).0, 11);
        assert_eq!(error("in == 1", true).0, 0);
        assert_eq!(error("x == 'open", true), (5, "unterminated string".into()));
        assert_eq!(error("", true), (0, "empty expression".into()));
    }
}
