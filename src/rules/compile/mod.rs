//! Rule files → validated counters and rules, with every error reported at once as
//! `file:line:col: message` (an error inside an expression at its column in the file). Pure: the
//! caller reads the files.
//!
//! Three passes: each file's tables are read into drafts (keys, types, durations); then every
//! id is known, so duplicates are found and `$counter` references resolve across files; then
//! expressions are compiled against the shared event projection.
//!
//! - `positions`: line index, diagnostics, offsets. `fields`: one TOML value read as a typed
//!   field. `tables`: the `[[list]]`, `[[counter]]` and `[[rule]]` readers (the first pass).
//!   `resolve`: the tables against each other (the other two).

mod fields;
mod positions;
mod resolve;
mod tables;

pub use fields::MAX_DIMENSIONS;
pub use positions::{not_utf8, Diagnostic};
pub use resolve::{no_files, CompiledSet, ReadFile};
pub use tables::{
    COUNTER_KEYS, DEFAULT_BUCKETS, LIST_KEYS, MAX_BUCKETS, MAX_DISTINCT_LIMIT, MAX_WINDOW_MS,
    RULE_KEYS,
};

use positions::RuleFile;

/// Compiles `(file name, text)` pairs, in the order given, reading list files with `read`.
/// Every error of every file is reported; nothing is built if there is any.
pub fn compile_sources(
    sources: &[(&str, &str)],
    read: ReadFile<'_>,
) -> Result<CompiledSet, Vec<Diagnostic>> {
    // One line index per file, shared by every position reported in it.
    let files: Vec<RuleFile> = sources
        .iter()
        .map(|(name, text)| RuleFile::new(name, text))
        .collect();
    let tables = tables::read_files(&files);
    resolve::resolve(&files, tables, read)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Decimal;
    use crate::rules::model::{Form, Mode, Scope};
    use crate::window::Aggregate;

    fn errors(text: &str) -> Vec<String> {
        match compile_sources(&[("r.toml", text)], &no_files) {
            Ok(_) => Vec::new(),
            Err(diags) => diags.iter().map(ToString::to_string).collect(),
        }
    }

    fn compile_one(text: &str) -> CompiledSet {
        compile_sources(&[("r.toml", text)], &no_files).unwrap_or_else(|d| panic!("{d:?}"))
    }

    const VALID: &str = r#"
[[rule]]
id = "login-fail-user-10m"
action = "block"
match = { type = "login", result = ["fail", "locked"] }
dimensions = ["user_id"]
window = "10m"
limit = 5
"#;

    #[test]
    fn compiles_a_valid_rule_with_defaults() {
        let set = compile_one(VALID);
        let r = &set.rules[0];
        assert_eq!(r.id, "login-fail-user-10m");
        assert_eq!(r.mode, Mode::Enforce);
        assert!(r.enabled);
        assert_eq!(
            r.form,
            Form::V1 {
                counter: 0,
                limit: Decimal::from_i64(5),
                threshold: 5
            }
        );
        let c = &set.counters[0];
        assert_eq!(c.id, r.id);
        assert_eq!(
            (c.window.bucket_ms, c.window.buckets, c.window.aggregate),
            (10_000, 60, Aggregate::Count)
        );
        assert_ne!(
            c.window.identity, 0,
            "what the window counts is part of its identity"
        );
        assert!(matches!(&r.scope, Scope::Table(m) if m.len() == 2));
        assert_eq!(r.origin.to_string(), "r.toml:2:1");
    }

    #[test]
    fn nested_match_tables_become_dotted_paths() {
        let text = "[[rule]]\nid='a'\naction='alert'\ndimensions=['u']\nwindow='1m'\nlimit=1\nmatch.device.os='ios'\n[rule.match.geo]\ncountry=['FR','DE']\n";
        let set = compile_one(text);
        let Scope::Table(matchers) = &set.rules[0].scope else {
            panic!("a table")
        };
        let paths: Vec<&str> = matchers.iter().map(|m| m.path.as_str()).collect();
        assert_eq!(paths, ["device.os", "geo.country"]);
    }

    #[test]
    fn reports_every_error_at_once() {
        let text = "[[rule]]\nid = \"A\"\naction = \"deny\"\ndimensions = []\nwindow = \"10x\"\nlimit = -1\ncolour = 1\n";
        assert_eq!(
            errors(text),
            [
                "r.toml:2:6: invalid rule id \"A\": must match ^[a-z0-9][a-z0-9_.-]{0,63}$",
                "r.toml:3:10: invalid action \"deny\": expected \"block\", \"challenge\", \"review\", \"alert\", \"allow\" or \"score\"",
                "r.toml:4:14: \"dimensions\" must list 1 to 4 field paths, found 0",
                "r.toml:5:10: invalid duration \"10x\" for window: expected an integer and a unit (ms, s, m, h, d or w), like \"10m\"",
                "r.toml:6:9: \"limit\" must be a number >= 0, found -1",
                "r.toml:7:1: unknown key \"colour\" in rule; expected one of: id, description, action, mode, enabled, match, when, on_store_error, dimensions, window, bucket, aggregate, field, limit, hold, hold_key, priority, final, score, rollout, rollout_key, entity",
            ]
        );
    }

    #[test]
    fn expression_errors_point_into_the_file() {
        // The column is that of the offending token inside the TOML string, escapes included.
        let text = r#"[[counter]]
id = 'c'
dimensions = ['u']
window = '1m'

[[rule]]
id = 'r'
action = 'block'
when = "$c > 1 && \"a\" == $nope"
match = '''
  type == 'x' &&
  $c > 1'''
"#;
        assert_eq!(
            errors(text),
            [
                "r.toml:9:28: unknown counter \"nope\"",
                "r.toml:12:3: a match cannot use counters ($c): test it in the rule's `when`",
            ]
        );
    }

    #[test]
    fn the_two_forms_do_not_mix() {
        let text = "[[rule]]\nid='r'\naction='block'\nlimit=5\nwhen='true'\n";
        assert_eq!(
            errors(text),
            ["r.toml:4:1: \"limit\" needs \"window\" (the v1 form); otherwise write the condition in `when`, like \"$counter-id > 5\""]
        );
        let text = "[[rule]]\nid='r'\naction='block'\ndimensions=['u']\nwindow='1m'\nlimit=5\nwhen='true'\n";
        assert_eq!(
            errors(text),
            ["r.toml:7:1: \"when\" is not allowed with \"window\" and \"limit\" (the v1 form fires on its limit): define a [[counter]] and test it in `when`"]
        );
    }

    #[test]
    fn warns_about_likely_mistakes() {
        let text = "[[counter]]\nid='unread'\ndimensions=['u']\nwindow='1m'\n\n[[rule]]\nid='never'\naction='block'\nwhen=\"'a' > 1\"\n\n[[rule]]\nid='cmp'\naction='review'\nmatch={ amount = '> 500' }\n";
        let warnings: Vec<String> = compile_one(text)
            .warnings
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            warnings,
            [
                "r.toml:14:18: match value \"> 500\" for \"amount\" is compared as a plain string; to compare, write an expression: match = \"amount > 500\"",
                "r.toml:6:1: rule \"never\" can never fire: its `when` is always unknown (it compares or computes across types)",
                "r.toml:1:1: counter \"unread\" is not read by any rule",
            ]
        );
    }

    #[test]
    fn columns_count_characters_not_bytes() {
        let text = "# é\n[[rule]]\nid = \"ü\"\n";
        assert!(errors(text)
            .iter()
            .any(|e| e.starts_with("r.toml:3:6: invalid rule id")));
    }
}
