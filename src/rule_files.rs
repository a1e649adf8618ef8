//! Reads rule files from disk: one `.toml` file, or every `*.toml` in a directory (sorted by
//! name, so rule-file order is stable), and compiles them with [`RuleSet::from_sources`].

use std::fs;
use std::path::{Path, PathBuf};

use crate::rules::{compile, RuleErrors, RuleSet};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: no rule files (*.toml) found")]
    NoRuleFiles { path: String },
    #[error("{path}: is a directory, not a rule file")]
    NotAFile { path: String },
    #[error("{path}: no rules defined (an empty rule set judges nothing); set rules.allow_empty = true to run without rules")]
    Empty { path: String },
    #[error("{0}")]
    Invalid(RuleErrors),
}

impl LoadError {
    /// Low-cardinality code for metrics.
    pub fn code(&self) -> &'static str {
        match self {
            LoadError::Io { .. } => "io",
            LoadError::NoRuleFiles { .. } => "no_rule_files",
            LoadError::NotAFile { .. } => "not_a_file",
            LoadError::Empty { .. } => "empty",
            LoadError::Invalid(e) => e.code(),
        }
    }
}

/// The rule files at `path`, in load order.
pub fn rule_files(path: &Path) -> Result<Vec<PathBuf>, LoadError> {
    let io = |source| LoadError::Io {
        path: path.display().to_string(),
        source,
    };
    if !fs::metadata(path).map_err(io)?.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(path).map_err(io)? {
        let entry = entry.map_err(io)?;
        let file = entry.path();
        let is_toml = file.extension().is_some_and(|e| e == "toml");
        let hidden = entry.file_name().to_string_lossy().starts_with('.');
        if !is_toml || hidden {
            continue;
        }
        // Followed like any other file: a link that does not resolve (or loops) is an error with
        // its path, not a file silently left out of the rules.
        let metadata = fs::metadata(&file).map_err(|source| LoadError::Io {
            path: file.display().to_string(),
            source,
        })?;
        if metadata.is_dir() {
            return Err(LoadError::NotAFile {
                path: file.display().to_string(),
            });
        }
        files.push(file);
    }
    files.sort();
    if files.is_empty() {
        return Err(LoadError::NoRuleFiles {
            path: path.display().to_string(),
        });
    }
    Ok(files)
}

/// A UTF-8 byte order mark some editors write at the start of a file: not part of the text.
const BOM: &str = "\u{feff}";

/// Reads a list file named by a rule file.
fn read_list_file(path: &str) -> Result<String, String> {
    let bytes = fs::read(path).map_err(|e| format!("cannot read list file {path}: {e}"))?;
    let mut text = String::from_utf8(bytes).map_err(|e| {
        format!(
            "list file {path} is not valid UTF-8 (at byte {})",
            e.utf8_error().valid_up_to()
        )
    })?;
    if text.starts_with(BOM) {
        text.drain(..BOM.len());
    }
    Ok(text)
}

/// Loads and validates every rule at `path`; every error of every file is reported. A set
/// without any rule is refused (an emptied file would otherwise hot-reload to judging nothing).
pub fn load(path: &Path) -> Result<RuleSet, LoadError> {
    load_with(path, false)
}

/// [`load`], accepting a set without rules when `allow_empty` (`rules.allow_empty`).
pub fn load_with(path: &Path, allow_empty: bool) -> Result<RuleSet, LoadError> {
    let rules = load_any(path)?;
    if rules.rules().is_empty() && !allow_empty {
        return Err(LoadError::Empty {
            path: path.display().to_string(),
        });
    }
    Ok(rules)
}

fn load_any(path: &Path) -> Result<RuleSet, LoadError> {
    let mut sources = Vec::new();
    let mut not_utf8 = Vec::new();
    for file in rule_files(path)? {
        let name = file.display().to_string();
        let bytes = fs::read(&file).map_err(|source| LoadError::Io {
            path: name.clone(),
            source,
        })?;
        match String::from_utf8(bytes) {
            Ok(mut text) => {
                if text.starts_with(BOM) {
                    text.drain(..BOM.len());
                }
                sources.push((name, text));
            }
            Err(e) => not_utf8.push(compile::not_utf8(
                &name,
                e.as_bytes(),
                e.utf8_error().valid_up_to(),
            )),
        }
    }
    if !not_utf8.is_empty() {
        // Report these with every error of the other files.
        let mut errors =
            match RuleSet::from_sources(sources.iter().map(|(n, t)| (n.as_str(), t.as_str()))) {
                Err(errors) => errors.0,
                Ok(_) => Vec::new(),
            };
        errors.splice(0..0, not_utf8);
        return Err(LoadError::Invalid(RuleErrors(errors)));
    }
    RuleSet::from_sources_with_files(
        sources.iter().map(|(n, t)| (n.as_str(), t.as_str())),
        &read_list_file,
    )
    .map_err(LoadError::Invalid)
}
