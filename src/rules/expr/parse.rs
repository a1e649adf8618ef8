//! The parser: tokens → a syntax tree with the byte offset of every node. Infix operators are
//! read by precedence climbing over one table ([`Infix::binding`]), so `a || b && c` and
//! `a + b * c` group as usual; how deep the tree may nest is bounded by [`MAX_NESTING`].

use super::error::{err, ExprError};
use super::lex::{describe, lex, Tok};
use crate::event::{quote_prefix, Decimal, FieldPath};

/// A binary operator, of the syntax tree and of the compiled expression.
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

/// A syntax tree node; every node is paired with the byte offset it starts at.
#[derive(Debug, Clone)]
pub(super) enum Ast {
    Num(Decimal),
    Str(String),
    Bool(bool),
    Null,
    List(Vec<(Ast, usize)>),
    Path(FieldPath),
    Counter(String),
    ListRef(String),
    /// `@map[key]`.
    MapGet(String, Box<(Ast, usize)>),
    Not(Box<(Ast, usize)>),
    Neg(Box<(Ast, usize)>),
    Bin(BinOp, Box<(Ast, usize)>, Box<(Ast, usize)>),
    In {
        negated: bool,
        value: Box<(Ast, usize)>,
        set: Box<(Ast, usize)>,
    },
    Call(String, Vec<(Ast, usize)>),
}

/// The deepest an expression may nest.
pub const MAX_NESTING: usize = 200;

const RESERVED: [&str; 7] = ["true", "false", "null", "and", "or", "not", "in"];

/// How tightly an operator binds: the higher, the earlier it takes its operands.
type Level = u8;

/// `||`, `or`: the loosest level, a whole expression.
const OR: Level = 1;
const AND: Level = 2;
/// Prefix `!`, `not`: looser than a comparison (`!a == b` is `!(a == b)`), so it may only start
/// an operand of `&&` or `||` (or the whole expression).
const NOT: Level = 3;
const COMPARE: Level = 4;
const SUM: Level = 5;
const PRODUCT: Level = 6;
/// Prefix `-`: the tightest (its operand is a `-` again or a single value).
const NEG: Level = 7;

/// How a chain of operators of one level groups.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Assoc {
    /// `a - b - c` is `(a - b) - c`; each link of the chain is one level of nesting.
    Left,
    /// No chain: `a < b < c` is an error.
    None,
}

/// An infix operator.
#[derive(Clone, Copy)]
enum Infix {
    Bin(BinOp),
    /// `in`, `not in`.
    In {
        negated: bool,
    },
}

impl Infix {
    /// The precedence table: each infix operator's level and how a chain of it groups.
    fn binding(self) -> (Level, Assoc) {
        match self {
            Infix::Bin(BinOp::Or) => (OR, Assoc::Left),
            Infix::Bin(BinOp::And) => (AND, Assoc::Left),
            Infix::Bin(BinOp::Eq | BinOp::Ne | BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge)
            | Infix::In { .. } => (COMPARE, Assoc::None),
            Infix::Bin(BinOp::Add | BinOp::Sub) => (SUM, Assoc::Left),
            Infix::Bin(BinOp::Mul | BinOp::Div) => (PRODUCT, Assoc::Left),
        }
    }

    /// The node joining `left` and `right`, at `left`'s offset.
    fn join(self, left: (Ast, usize), right: (Ast, usize)) -> (Ast, usize) {
        let at = left.1;
        let ast = match self {
            Infix::Bin(op) => Ast::Bin(op, Box::new(left), Box::new(right)),
            Infix::In { negated } => Ast::In {
                negated,
                value: Box::new(left),
                set: Box::new(right),
            },
        };
        (ast, at)
    }
}

/// Parses `text` whole.
pub(super) fn parse(text: &str) -> Result<(Ast, usize), ExprError> {
    let toks = lex(text)?;
    if toks.len() == 1 {
        return err(0, "empty expression");
    }
    let mut parser = Parser {
        toks,
        pos: 0,
        depth: 0,
    };
    let ast = parser.expression()?;
    if !matches!(parser.peek(), Tok::End) {
        return err(
            parser.at(),
            format!("unexpected {}", describe(parser.peek())),
        );
    }
    Ok(ast)
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
    fn next_is_word(&self, word: &str) -> bool {
        matches!(self.toks.get(self.pos + 1), Some((Tok::Ident(w), _)) if w == word)
    }
    fn expect_op(&mut self, op: &str) -> Result<(), ExprError> {
        if self.is_op(op) {
            self.bump();
            Ok(())
        } else {
            err(
                self.at(),
                format!("expected '{op}', found {}", describe(self.peek())),
            )
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

    /// The infix operator at the cursor, if any, and how many tokens it takes (`not in`: two).
    fn infix(&self) -> Option<(Infix, usize)> {
        let op = match self.peek() {
            Tok::Op("||") => BinOp::Or,
            Tok::Op("&&") => BinOp::And,
            Tok::Op("==") => BinOp::Eq,
            Tok::Op("!=") => BinOp::Ne,
            Tok::Op("<") => BinOp::Lt,
            Tok::Op("<=") => BinOp::Le,
            Tok::Op(">") => BinOp::Gt,
            Tok::Op(">=") => BinOp::Ge,
            Tok::Op("+") => BinOp::Add,
            Tok::Op("-") => BinOp::Sub,
            Tok::Op("*") => BinOp::Mul,
            Tok::Op("/") => BinOp::Div,
            Tok::Ident(w) if w == "or" => BinOp::Or,
            Tok::Ident(w) if w == "and" => BinOp::And,
            Tok::Ident(w) if w == "in" => return Some((Infix::In { negated: false }, 1)),
            Tok::Ident(w) if w == "not" && self.next_is_word("in") => {
                return Some((Infix::In { negated: true }, 2))
            }
            _ => return None,
        };
        Some((Infix::Bin(op), 1))
    }

    /// A whole expression.
    fn expression(&mut self) -> Result<(Ast, usize), ExprError> {
        self.climb(OR)
    }

    /// An operand followed by every infix operator of level `min` or tighter (precedence
    /// climbing): each right operand takes the operators binding tighter than its own, so the
    /// levels met here only ever loosen.
    fn climb(&mut self, min: Level) -> Result<(Ast, usize), ExprError> {
        let mut left = self.operand(min)?;
        // The level of the chain being read and its links so far (each one level of nesting,
        // given back when a looser operator ends the chain).
        let (mut chain, mut links) = (Level::MAX, 0);
        while let Some((op, width)) = self.infix() {
            let (level, assoc) = op.binding();
            if level < min {
                break;
            }
            if level < chain {
                self.depth -= links;
                (chain, links) = (level, 0);
            } else if assoc == Assoc::None {
                return err(
                    self.at(),
                    "comparisons do not chain: combine them with '&&' or parentheses",
                );
            }
            for _ in 0..width {
                self.bump();
            }
            if assoc == Assoc::Left {
                self.enter()?;
                links += 1;
            }
            let right = self.climb(level + 1)?;
            left = op.join(left, right);
        }
        self.depth -= links;
        Ok(left)
    }

    /// An operand at level `min`: `!` / `not` (where a `!` term may stand), `-`, or a value.
    fn operand(&mut self, min: Level) -> Result<(Ast, usize), ExprError> {
        if min <= NOT && (self.is_op("!") || (self.is_word("not") && !self.next_is_word("in"))) {
            let at = self.at();
            self.bump();
            self.enter()?;
            let inner = self.climb(NOT)?;
            self.depth -= 1;
            return Ok((Ast::Not(Box::new(inner)), at));
        }
        if self.is_op("-") {
            let at = self.at();
            self.bump();
            self.enter()?;
            let inner = self.operand(NEG)?;
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
            Tok::List(id) if self.is_op("[") => {
                self.bump();
                self.enter()?;
                let key = self.expression()?;
                self.expect_op("]")?;
                self.depth -= 1;
                Ast::MapGet(id, Box::new(key))
            }
            Tok::List(id) => Ast::ListRef(id),
            Tok::Op("(") => {
                self.enter()?;
                let inner = self.expression()?;
                self.expect_op(")")?;
                self.depth -= 1;
                return Ok((inner.0, at));
            }
            Tok::Op("[") => self.list()?,
            Tok::Ident(word) if word == "true" => Ast::Bool(true),
            Tok::Ident(word) if word == "false" => Ast::Bool(false),
            Tok::Ident(word) if word == "null" => Ast::Null,
            Tok::Ident(word) if RESERVED.contains(&word.as_str()) => {
                return err(
                    at,
                    format!(
                        "unexpected '{word}' (as a field name, write it in backquotes: `{word}`)"
                    ),
                )
            }
            Tok::Ident(name) if self.is_op("(") => self.call(name)?,
            Tok::Ident(first) | Tok::Quoted(first) => self.path(first, at)?,
            other => return err(at, format!("expected a value, found {}", describe(&other))),
        };
        Ok((ast, at))
    }

    /// `[a, b, …]` after its `[`; a trailing comma is allowed.
    fn list(&mut self) -> Result<Ast, ExprError> {
        self.enter()?;
        let mut items = Vec::new();
        if !self.is_op("]") {
            loop {
                items.push(self.expression()?);
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
        Ok(Ast::List(items))
    }

    /// `name(a, b, …)` after its name, the cursor on the `(`.
    fn call(&mut self, name: String) -> Result<Ast, ExprError> {
        self.bump();
        self.enter()?;
        let mut args = Vec::new();
        if !self.is_op(")") {
            loop {
                args.push(self.expression()?);
                if self.is_op(",") {
                    self.bump();
                    continue;
                }
                break;
            }
        }
        self.expect_op(")")?;
        self.depth -= 1;
        Ok(Ast::Call(name, args))
    }

    /// A field path `a.b.`c``, after its first segment (at `at`).
    fn path(&mut self, first: String, at: usize) -> Result<Ast, ExprError> {
        let mut path = first;
        while self.is_op(".") {
            self.bump();
            match self.bump() {
                (Tok::Ident(seg) | Tok::Quoted(seg), _) => {
                    path.push('.');
                    path.push_str(&seg);
                }
                (other, at) => {
                    return err(
                        at,
                        format!(
                            "expected a field name after '.', found {}",
                            describe(&other)
                        ),
                    )
                }
            }
        }
        match FieldPath::parse(&path) {
            Some(p) => Ok(Ast::Path(p)),
            None => err(at, format!("invalid field path {}", quote_prefix(&path))),
        }
    }
}
