//! The validated rule model.

use std::fmt;

use super::expr::Compiled;
use crate::event::{Decimal, FieldPath};
use crate::window::{Aggregate, WindowSpec};

/// What a hit asks downstream to do. Ordered by severity: `Block > Challenge > Review > Alert`;
/// `Allow` is not a severity but an override (an enforce-mode allow hit decides the event).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Action {
    /// Adds the rule's `score` to the event's score and decides nothing.
    Score,
    Alert,
    Review,
    Challenge,
    Block,
    Allow,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Block => "block",
            Action::Challenge => "challenge",
            Action::Review => "review",
            Action::Alert => "alert",
            Action::Allow => "allow",
            Action::Score => "score",
        }
    }

    pub fn parse(s: &str) -> Option<Action> {
        match s {
            "block" => Some(Action::Block),
            "challenge" => Some(Action::Challenge),
            "review" => Some(Action::Review),
            "alert" => Some(Action::Alert),
            "allow" => Some(Action::Allow),
            "score" => Some(Action::Score),
            _ => None,
        }
    }
}

/// Enforce-mode hits decide the action; shadow-mode hits are reported but never act.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    Enforce,
    Shadow,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
        }
    }

    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "enforce" => Some(Mode::Enforce),
            "shadow" => Some(Mode::Shadow),
            _ => None,
        }
    }
}

/// How a rule judges while the shared counter store is unavailable (see [RELIABILITY.md](RELIABILITY.md)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum OnStoreError {
    /// On the values counted locally; its hits are marked `degraded`.
    #[default]
    Local,
    /// The rule does not fire.
    Allow,
    /// The rule fires, with reason `store_unavailable`.
    Block,
}

impl OnStoreError {
    pub fn as_str(self) -> &'static str {
        match self {
            OnStoreError::Local => "local",
            OnStoreError::Allow => "allow",
            OnStoreError::Block => "block",
        }
    }

    pub fn parse(s: &str) -> Option<OnStoreError> {
        match s {
            "local" => Some(OnStoreError::Local),
            "allow" => Some(OnStoreError::Allow),
            "block" => Some(OnStoreError::Block),
            _ => None,
        }
    }
}

/// A value a `match` table entry accepts, with JSON's types (strings never equal numbers).
#[derive(Debug, Clone, PartialEq)]
pub enum MatchValue {
    Bool(bool),
    Number(Decimal),
    Str(String),
}

/// One `match` table entry: the field must hold one of `any_of`.
#[derive(Debug, Clone, PartialEq)]
pub struct Matcher {
    pub path: FieldPath,
    pub any_of: Vec<MatchValue>,
}

/// Which events a counter counts or a rule judges.
#[derive(Debug, Clone)]
pub enum Scope {
    /// No `match`: every event.
    All,
    /// A `match` table: every entry must hold.
    Table(Vec<Matcher>),
    /// A `match` expression: it must be true.
    Expr(Box<Compiled>),
}

/// Where a rule was defined, for messages and `vigil check`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileLocation {
    pub file: String,
    pub line: usize,
    pub col: usize,
}

impl fmt::Display for FileLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file, self.line, self.col)
    }
}

/// One entry of a key (`dimensions`, `hold_key`, `rollout_key`, `entity`, a distinct tuple): a
/// field path, or an expression over the event's fields whose value is the key value.
#[derive(Debug, Clone)]
pub enum KeyPart {
    Path(FieldPath),
    Expr {
        /// As written: records name the value by it.
        text: String,
        compiled: Box<Compiled>,
    },
}

impl KeyPart {
    /// The entry as written (a path, or the expression's text).
    pub fn text(&self) -> &str {
        match self {
            KeyPart::Path(p) => p.as_str(),
            KeyPart::Expr { text, .. } => text,
        }
    }

    pub fn path(&self) -> Option<&FieldPath> {
        match self {
            KeyPart::Path(p) => Some(p),
            KeyPart::Expr { .. } => None,
        }
    }

    /// Every field path the entry reads.
    pub fn paths(&self) -> Vec<FieldPath> {
        match self {
            KeyPart::Path(p) => vec![p.clone()],
            KeyPart::Expr { compiled, .. } => compiled.paths.clone(),
        }
    }
}

/// Two entries are the same when written the same.
impl PartialEq for KeyPart {
    fn eq(&self, other: &KeyPart) -> bool {
        self.text() == other.text()
    }
}

impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.text())
    }
}

/// A counter that passed validation: a sliding-window aggregate per dimension key.
#[derive(Debug, Clone)]
pub struct Counter {
    pub id: String,
    pub description: Option<String>,
    pub enabled: bool,
    pub scope: Scope,
    /// The `match` expression as written (for summaries).
    pub scope_text: Option<String>,
    pub dimensions: Vec<KeyPart>,
    pub window: WindowSpec,
    /// The aggregated field (sum, distinct, max, min, last); `None` for count and for a
    /// distinct tuple.
    pub field: Option<FieldPath>,
    /// A distinct counter over a tuple (`field = ["card", "device"]`): its entries.
    pub tuple: Vec<KeyPart>,
    /// Sums: amounts may be negative (down to -1e12).
    pub allow_negative: bool,
    /// Defined by a rule in the v1 form (`window` + `limit`): no warning when no rule reads it.
    pub from_rule: bool,
    pub origin: FileLocation,
}

impl Counter {
    pub fn aggregate(&self) -> Aggregate {
        self.window.aggregate
    }
}

/// How a rule decides whether it fires.
#[derive(Debug, Clone, PartialEq)]
pub enum Form {
    /// `window` + `limit`: fires when its own counter (by index) counted the event and the value
    /// exceeds the limit.
    V1 {
        counter: usize,
        limit: Decimal,
        /// The limit on the counter's raw scale (micro-units for a sum), floored: a raw value
        /// exceeds the limit exactly when it exceeds this.
        threshold: i64,
    },
    /// `when` (absent: always).
    V2,
}

/// A rule that passed validation.
#[derive(Debug, Clone)]
pub struct Rule {
    pub id: String,
    pub description: Option<String>,
    pub action: Action,
    pub mode: Mode,
    pub enabled: bool,
    pub scope: Scope,
    /// The `match` expression as written (for summaries).
    pub scope_text: Option<String>,
    pub when: Option<Box<Compiled>>,
    /// The `when` expression as written.
    pub when_text: Option<String>,
    pub form: Form,
    pub on_store_error: OnStoreError,
    /// `hold`: once fired by its condition, the rule keeps firing for the same hold key.
    pub hold: Option<Hold>,
    /// `priority` (-1000..=1000): a firing enforce-mode `final` rule suppresses every rule of
    /// lower priority for the event.
    pub priority: i32,
    /// `final`: see `priority`.
    pub is_final: bool,
    /// `score`: added to the event's score when the rule fires in enforce mode, in micro-units.
    pub score: Option<i64>,
    /// `rollout` below 100: enforced only for keys whose bucket falls under it.
    pub rollout: Option<Rollout>,
    /// Whom a hit is about (`entity`, else the hold key); empty: no one.
    pub entity: Vec<KeyPart>,
    /// Its `when` calls `score()`: judged after every other rule.
    pub calls_score: bool,
    pub origin: FileLocation,
}

/// A partial rollout: the rule is in its mode for keys whose bucket (0..10 000) is below
/// `basis_points`, in shadow mode for the others.
#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    /// The percent × 100 (`12.5` → 1250).
    pub basis_points: u32,
    /// The percent as written, for records.
    pub percent: Decimal,
    pub key: Vec<KeyPart>,
}

/// A rule's hold: after the rule fires by its condition on an event at time `t`, events in its
/// scope with the same hold key and a time before `t + ms` fire it too.
#[derive(Debug, Clone, PartialEq)]
pub struct Hold {
    pub ms: i64,
    /// The hold key (`hold_key`; a v1-form rule's dimensions by default).
    pub key: Vec<KeyPart>,
}

impl Rule {
    /// The counters the rule's `when` refers to, in order of first reference.
    pub fn counters(&self) -> &[usize] {
        self.when.as_ref().map_or(&[], |w| &w.counters)
    }
}

/// Formats milliseconds in the largest rule-file unit that divides them exactly.
pub fn format_duration(ms: i64) -> String {
    const UNITS: [(&str, i64); 4] = [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ];
    for (unit, size) in UNITS {
        if ms != 0 && ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// Parses a rule-file duration: `<int>` followed by `ms`, `s`, `m`, `h`, `d` or `w` (7 days). `None` if malformed
/// or out of range; zero is returned as `Some(0)` for the caller to refuse with its own message.
pub fn parse_duration(text: &str) -> Option<i64> {
    let digits_end = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(digits_end);
    if digits.is_empty() {
        return None;
    }
    let n: i64 = digits.parse().ok()?;
    let scale = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "w" => 7 * 86_400_000,
        _ => return None,
    };
    n.checked_mul(scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_trip() {
        assert_eq!(parse_duration("10m"), Some(600_000));
        assert_eq!(parse_duration("250ms"), Some(250));
        assert_eq!(parse_duration("1d"), Some(86_400_000));
        assert_eq!(parse_duration("2w"), parse_duration("14d"));
        assert_eq!(parse_duration("0s"), Some(0));
        for bad in [
            "",
            "m",
            "10",
            "10 m",
            "1.5h",
            "-1s",
            "10min",
            "1H",
            "99999999999999999999d",
        ] {
            assert_eq!(parse_duration(bad), None, "{bad:?}");
        }
        assert_eq!(format_duration(600_000), "10m");
        assert_eq!(format_duration(90_000), "90s");
        assert_eq!(format_duration(1_500), "1500ms");
        assert_eq!(format_duration(86_400_000 * 2), "2d");
    }

    #[test]
    fn action_severity_order() {
        assert!(
            Action::Block > Action::Challenge
                && Action::Challenge > Action::Review
                && Action::Review > Action::Alert
        );
    }
}
