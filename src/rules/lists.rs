//! Lists: named sets of strings, numbers or IP networks that expressions test with `in @id`.
//! Pure: the caller reads list files and hands over their text.
//!
//! Membership is O(1) for strings and numbers (hash sets) and O(prefix lengths) for networks: a
//! hash set of masked networks per prefix length present, probed from the longest down.

use std::net::IpAddr;

use hashbrown::{HashMap, HashSet};
use ipnet::IpNet;

use crate::event::Decimal;
use crate::rules::expr::Literal;

/// What a list holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListKind {
    String,
    Number,
    Cidr,
    /// Keys (strings) to JSON scalar values.
    StringMap,
    /// Number keys (by exact value) to JSON scalar values.
    NumberMap,
}

impl ListKind {
    pub fn parse(s: &str) -> Option<ListKind> {
        match s {
            "string" => Some(ListKind::String),
            "number" => Some(ListKind::Number),
            "cidr" => Some(ListKind::Cidr),
            "map" => Some(ListKind::StringMap),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ListKind::String => "string",
            ListKind::Number => "number",
            ListKind::Cidr => "cidr",
            ListKind::StringMap | ListKind::NumberMap => "map",
        }
    }
}

/// IP networks by prefix length: `(prefix, masked address)`.
#[derive(Debug, Clone, Default)]
pub struct Networks {
    v4: HashSet<(u8, u32), foldhash::fast::RandomState>,
    v6: HashSet<(u8, u128), foldhash::fast::RandomState>,
    /// Prefix lengths present, longest first.
    v4_lengths: Vec<u8>,
    v6_lengths: Vec<u8>,
}

fn mask4(addr: u32, len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        addr & (u32::MAX << (32 - u32::from(len)))
    }
}

fn mask6(addr: u128, len: u8) -> u128 {
    if len == 0 {
        0
    } else {
        addr & (u128::MAX << (128 - u32::from(len)))
    }
}

impl Networks {
    pub fn insert(&mut self, net: IpNet) {
        match net {
            IpNet::V4(n) => {
                let len = n.prefix_len();
                self.v4.insert((len, mask4(u32::from(n.addr()), len)));
                if !self.v4_lengths.contains(&len) {
                    self.v4_lengths.push(len);
                    self.v4_lengths.sort_unstable_by(|a, b| b.cmp(a));
                }
            }
            IpNet::V6(n) => {
                let len = n.prefix_len();
                self.v6.insert((len, mask6(u128::from(n.addr()), len)));
                if !self.v6_lengths.contains(&len) {
                    self.v6_lengths.push(len);
                    self.v6_lengths.sort_unstable_by(|a, b| b.cmp(a));
                }
            }
        }
    }

    /// Whether a network of the set holds `ip` (an IPv4-mapped IPv6 address is IPv6).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(a) => {
                let a = u32::from(a);
                self.v4_lengths
                    .iter()
                    .any(|&len| self.v4.contains(&(len, mask4(a, len))))
            }
            IpAddr::V6(a) => {
                let a = u128::from(a);
                self.v6_lengths
                    .iter()
                    .any(|&len| self.v6.contains(&(len, mask6(a, len))))
            }
        }
    }

    pub fn len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A network (`10.0.0.0/8`, host bits allowed) or a bare address (a /32 or /128): a cidr list's
/// entry, and an argument of an expression's `cidr(...)`.
pub fn parse_network(text: &str) -> Option<IpNet> {
    if let Ok(net) = text.parse::<IpNet>() {
        return Some(net);
    }
    text.parse::<IpAddr>().ok().map(IpNet::from)
}

/// Whether `text` is written as JSON writes a number: an optional `-`, no leading zeros, no `+`.
fn json_number_syntax(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    let int_end = digits
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    int_end > 0 && !(int_end > 1 && digits.starts_with('0'))
}

/// A loaded list.
#[derive(Debug, Clone)]
pub enum ListSet {
    Strings(HashSet<String, foldhash::fast::RandomState>),
    Numbers(HashSet<Decimal, foldhash::fast::RandomState>),
    Networks(Networks),
    StringMap(HashMap<String, Literal, foldhash::fast::RandomState>),
    NumberMap(HashMap<Decimal, Literal, foldhash::fast::RandomState>),
}

/// A map entry's value as a list file writes it: a JSON scalar (`5000`, `"gold"`, `true`,
/// `null`), numbers exactly.
pub fn parse_map_value(text: &str) -> Result<Literal, String> {
    let text = text.trim();
    match text {
        "null" => return Ok(Literal::Null),
        "true" => return Ok(Literal::Bool(true)),
        "false" => return Ok(Literal::Bool(false)),
        _ => {}
    }
    if text.starts_with('"') {
        return serde_json::from_str::<String>(text)
            .map(Literal::Str)
            .map_err(|_| format!("{} is not a JSON string", crate::event::quote_prefix(text)));
    }
    match Decimal::parse(text).filter(|_| json_number_syntax(text)) {
        Some(d) => Ok(Literal::Num(d)),
        None => Err(format!(
            "{} is not a JSON scalar (a number, a \"string\", true, false or null)",
            crate::event::quote_prefix(text)
        )),
    }
}

impl ListSet {
    pub fn new(kind: ListKind) -> ListSet {
        match kind {
            ListKind::String => ListSet::Strings(HashSet::default()),
            ListKind::Number => ListSet::Numbers(HashSet::default()),
            ListKind::Cidr => ListSet::Networks(Networks::default()),
            ListKind::StringMap => ListSet::StringMap(HashMap::default()),
            ListKind::NumberMap => ListSet::NumberMap(HashMap::default()),
        }
    }

    /// Whether this is a map (`@id[key]` reads it).
    pub fn is_map(&self) -> bool {
        matches!(self, ListSet::StringMap(_) | ListSet::NumberMap(_))
    }

    /// Adds a map entry; `Err` says why the key is not of the map's key kind. A key given twice
    /// keeps its last value.
    pub fn add_map_entry(&mut self, key: &str, value: Literal) -> Result<(), String> {
        match self {
            ListSet::StringMap(m) => {
                m.insert(key.to_owned(), value);
            }
            ListSet::NumberMap(m) => {
                match Decimal::parse(key).filter(|_| json_number_syntax(key)) {
                    Some(d) => {
                        m.insert(d, value);
                    }
                    None => {
                        return Err(format!(
                            "key {} is not a number (the map's key_kind is \"number\")",
                            crate::event::quote_prefix(key)
                        ))
                    }
                }
            }
            _ => return Err("not a map".to_owned()),
        }
        Ok(())
    }

    pub fn kind(&self) -> ListKind {
        match self {
            ListSet::Strings(_) => ListKind::String,
            ListSet::Numbers(_) => ListKind::Number,
            ListSet::Networks(_) => ListKind::Cidr,
            ListSet::StringMap(_) => ListKind::StringMap,
            ListSet::NumberMap(_) => ListKind::NumberMap,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            ListSet::Strings(s) => s.len(),
            ListSet::Numbers(s) => s.len(),
            ListSet::Networks(n) => n.len(),
            ListSet::StringMap(m) => m.len(),
            ListSet::NumberMap(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adds an entry written as `text` (a list-file line, stripped; or an inline value's text).
    /// `Err` says why the entry is not of the list's kind.
    pub fn add(&mut self, text: &str) -> Result<(), String> {
        match self {
            ListSet::Strings(s) => {
                s.insert(text.to_owned());
            }
            ListSet::Numbers(s) => {
                match Decimal::parse(text).filter(|_| json_number_syntax(text)) {
                    Some(d) => {
                        s.insert(d);
                    }
                    None => {
                        return Err(format!(
                            "{} is not a number",
                            crate::event::quote_prefix(text)
                        ))
                    }
                }
            }
            ListSet::StringMap(_) | ListSet::NumberMap(_) => {
                // `key,value`: the first comma splits.
                let Some((key, value)) = text.split_once(',') else {
                    return Err(format!(
                        "{} is not a map entry: expected key,value (like m-1,5000)",
                        crate::event::quote_prefix(text)
                    ));
                };
                let value = parse_map_value(value)?;
                return self.add_map_entry(key.trim(), value);
            }
            ListSet::Networks(n) => match parse_network(text) {
                Some(net) => n.insert(net),
                None => {
                    return Err(format!(
                        "{} is not an IPv4 or IPv6 address or network (like 10.0.0.0/8)",
                        crate::event::quote_prefix(text)
                    ))
                }
            },
        }
        Ok(())
    }

    /// Adds every entry of a list file: one per line, stripped; blank lines and lines starting
    /// with `#` are ignored. Errors are `(line, column, message)`, 1-based, every one of them.
    pub fn add_file(&mut self, text: &str) -> Vec<(usize, usize, String)> {
        let mut errors = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let entry = line.trim();
            if entry.is_empty() || entry.starts_with('#') {
                continue;
            }
            if let Err(message) = self.add(entry) {
                let col = line[..line.len() - line.trim_start().len()].chars().count() + 1;
                errors.push((n + 1, col, message));
            }
        }
        errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn networks_use_the_longest_matching_prefix_structure() {
        let mut n = ListSet::new(ListKind::Cidr);
        for entry in [
            "10.0.0.0/8",
            "192.0.2.7",
            "203.0.113.5/24",
            "2001:db8::/32",
            "::1",
        ] {
            n.add(entry).unwrap();
        }
        let ListSet::Networks(n) = n else {
            unreachable!()
        };
        let has = |ip: &str| n.contains(ip.parse().unwrap());
        assert!(has("10.200.1.1"));
        assert!(has("192.0.2.7") && !has("192.0.2.8"));
        assert!(has("203.0.113.200"), "host bits of an entry are ignored");
        assert!(has("2001:db8:ffff::1") && has("::1"));
        assert!(
            !has("::ffff:10.0.0.1"),
            "an IPv4-mapped IPv6 address is not in IPv4 networks"
        );
        assert!(!has("11.0.0.1"));
    }

    #[test]
    fn files_skip_comments_and_report_every_bad_line() {
        let mut l = ListSet::new(ListKind::Number);
        let errors =
            l.add_file("# risky codes\n6051.0\n\n  4.829e3  \nseven\n12\n  x1\n+5\n007\n-0.5\n");
        assert_eq!(l.len(), 4);
        assert_eq!(
            errors,
            [
                (5, 1, "\"seven\" is not a number".to_owned()),
                (7, 3, "\"x1\" is not a number".to_owned()),
                (8, 1, "\"+5\" is not a number".to_owned()),
                (9, 1, "\"007\" is not a number".to_owned()),
            ]
        );
        let ListSet::Numbers(set) = l else {
            unreachable!()
        };
        assert!(set.contains(&Decimal::from_i64(6051)) && set.contains(&Decimal::from_i64(4829)));
    }

    /// A map file: `key,value` lines, the first comma splitting, the value a JSON scalar; number
    /// keys by exact value.
    #[test]
    fn map_files_split_at_the_first_comma() {
        let mut m = ListSet::new(ListKind::StringMap);
        let errors = m.add_file("# merchant,limit\nm-1,500\nm-2, \"gold, silver\"\nm-3,true\nm,4,null\nm-5\nm-6,0x10\nm-7,\"open\n");
        assert_eq!(m.len(), 3);
        // `m,4,null` (the value is `4,null`), `m-5` (no comma), `0x10`, an open string.
        assert_eq!(
            errors.iter().map(|e| e.0).collect::<Vec<_>>(),
            [5, 6, 7, 8],
            "{errors:?}"
        );
        let ListSet::StringMap(map) = &m else {
            unreachable!()
        };
        assert_eq!(map["m-1"], Literal::Num(Decimal::from_i64(500)));
        assert_eq!(map["m-2"], Literal::Str("gold, silver".into()));
        assert_eq!(map["m-3"], Literal::Bool(true));
        let mut n = ListSet::new(ListKind::NumberMap);
        assert!(n.add_file("7995,3\n4829.0,2\n").is_empty());
        let ListSet::NumberMap(map) = &n else {
            unreachable!()
        };
        assert_eq!(
            map[&Decimal::from_i64(4829)],
            Literal::Num(Decimal::from_i64(2))
        );
        assert!(n.add("x,1").is_err());
    }
}
