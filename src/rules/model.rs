//! The validated rule model.

use std::fmt;

use crate::event::{CanonicalNumber, FieldPath};
use crate::window::{Aggregate, WindowSpec};

/// What a hit asks downstream to do. Ordered by severity: `Block > Review > Alert`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Action {
    Alert,
    Review,
    Block,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Block => "block",
            Action::Review => "review",
            Action::Alert => "alert",
        }
    }

    pub fn parse(s: &str) -> Option<Action> {
        match s {
            "block" => Some(Action::Block),
            "review" => Some(Action::Review),
            "alert" => Some(Action::Alert),
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

/// A value a `match` entry accepts, with JSON's types (strings never equal numbers).
#[derive(Debug, Clone, PartialEq)]
pub enum MatchValue {
    Bool(bool),
    Number(CanonicalNumber),
    Str(String),
}

/// One `match` entry: the field must hold one of `any_of`.
#[derive(Debug, Clone, PartialEq)]
pub struct Matcher {
    pub path: FieldPath,
    pub any_of: Vec<MatchValue>,
}

/// Where a rule was defined, for messages and `vigil check`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub file: String,
    pub line: usize,
    pub col: usize,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file, self.line, self.col)
    }
}

/// A rule that passed validation.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub id: String,
    pub description: Option<String>,
    pub action: Action,
    pub mode: Mode,
    pub enabled: bool,
    pub matchers: Vec<Matcher>,
    pub dimensions: Vec<FieldPath>,
    pub window: WindowSpec,
    /// The summed or distinct field; `None` for count.
    pub field: Option<FieldPath>,
    /// Fires when the window value exceeds it.
    pub limit: CanonicalNumber,
    pub on_store_error: OnStoreError,
    pub origin: Origin,
}

impl Rule {
    pub fn aggregate(&self) -> Aggregate {
        self.window.aggregate
    }

    /// One line for `vigil check`: what the rule counts and when it fires.
    pub fn summary(&self) -> String {
        let what = match &self.field {
            Some(f) => format!("{}({f})", self.aggregate().as_str()),
            None => "count".to_owned(),
        };
        let dims: Vec<&str> = self.dimensions.iter().map(FieldPath::as_str).collect();
        let matches = if self.matchers.is_empty() {
            String::new()
        } else {
            let m: Vec<&str> = self.matchers.iter().map(|m| m.path.as_str()).collect();
            format!(" where {}", m.join(", "))
        };
        format!(
            "{id}: {action}/{mode}{disabled} {what} per {dims} over {window} (bucket {bucket}){matches} > {limit}  [{origin}]",
            id = self.id,
            action = self.action.as_str(),
            mode = self.mode.as_str(),
            disabled = if self.enabled { "" } else { " (disabled)" },
            dims = dims.join("+"),
            window = format_duration(self.window.window_ms()),
            bucket = format_duration(self.window.bucket_ms),
            limit = serde_json::to_string(&self.limit).unwrap_or_default(),
            origin = self.origin,
        )
    }
}

/// Formats milliseconds in the largest rule-file unit that divides them exactly.
pub fn format_duration(ms: i64) -> String {
    const UNITS: [(&str, i64); 4] =
        [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)];
    for (unit, size) in UNITS {
        if ms != 0 && ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// Parses a rule-file duration: `<int>` followed by `ms`, `s`, `m`, `h` or `d`. `None` if malformed
/// or out of range; zero is returned as `Some(0)` for the caller to refuse with its own message.
pub fn parse_duration(text: &str) -> Option<i64> {
    let digits_end = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
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
        assert_eq!(parse_duration("0s"), Some(0));
        for bad in ["", "m", "10", "10 m", "1.5h", "-1s", "10min", "1H", "99999999999999999999d"] {
            assert_eq!(parse_duration(bad), None, "{bad:?}");
        }
        assert_eq!(format_duration(600_000), "10m");
        assert_eq!(format_duration(90_000), "90s");
        assert_eq!(format_duration(1_500), "1500ms");
        assert_eq!(format_duration(86_400_000 * 2), "2d");
    }

    #[test]
    fn action_severity_order() {
        assert!(Action::Block > Action::Review && Action::Review > Action::Alert);
    }
}
