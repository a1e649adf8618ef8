//! The rule watcher thread: polls the rule files (and the list files they name), validates a
//! change and swaps it into the engine between two batches; a bad edit leaves the old rules.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::error::WorkerError;
use super::shared::Worker;
use crate::rule_files::{self, LoadError};
use crate::shutdown::Shutdown;
use crate::telemetry::ResultLabels;

impl Worker {
    /// Starts the rule watcher thread; it stops when `done` fires.
    pub(super) fn spawn_watcher(
        self: &Arc<Self>,
        done: &Shutdown,
    ) -> Result<JoinHandle<()>, WorkerError> {
        let (worker, done) = (Arc::clone(self), done.clone());
        let path = worker.config.rules.path.clone();
        std::thread::Builder::new()
            .name("vigil-rules".into())
            .spawn(move || worker.watch_rules(&path, &done))
            .map_err(|e| {
                WorkerError::ShutdownIncomplete(format!("cannot start the rule watcher: {e}"))
            })
    }

    /// Polls the rule files every `rules.reload_interval`; a change is validated and swapped in
    /// between two batches; a bad edit is logged with `file:line:col` and the old rules stay.
    /// Polling contents (not file events) also sees Kubernetes ConfigMap symlink swaps.
    fn watch_rules(&self, path: &Path, done: &Shutdown) {
        let mut list_files: Vec<String> = self.lock_engine().rules().list_file_names().to_vec();
        let mut seen = fingerprint(path, &list_files);
        while !done.wait(self.config.rules.reload_interval) {
            let now = fingerprint(path, &list_files);
            if now == seen {
                continue;
            }
            seen = now;
            match rule_files::load_with(path, self.config.rules.allow_empty) {
                Ok(rules) => {
                    let active = rules.active().len();
                    // A list file is watched from the load that names it.
                    list_files = rules.list_file_names().to_vec();
                    seen = fingerprint(path, &list_files);
                    let version = rules.version().to_owned();
                    let lists: Vec<String> = rules
                        .lists()
                        .map(|(id, set)| format!("{id} ({} {})", set.len(), set.kind().as_str()))
                        .collect();
                    self.metrics.rules_loaded(&rules);
                    let (_, changes) = self.lock_engine().reload_rules(rules);
                    self.metrics.rules_active.set(active as i64);
                    self.metrics
                        .rule_reloads
                        .get_or_create(&ResultLabels { result: "ok" })
                        .inc();
                    tracing::info!(
                        path = %path.display(),
                        active,
                        version,
                        fresh = ?changes.fresh,
                        kept = ?changes.kept,
                        lists = ?lists,
                        "rules reloaded: counters in `fresh` start from nothing, those in `kept` keep their state"
                    );
                    if !changes.redefined.is_empty() {
                        tracing::warn!(
                            counters = ?changes.redefined,
                            "counters keep the state counted under their previous match or allow_negative; rename a counter to start it afresh"
                        );
                    }
                }
                Err(error) => self.refuse_reload(path, &error),
            }
        }
    }

    /// A reload that failed: every diagnostic logged, the previous rules stay in force.
    fn refuse_reload(&self, path: &Path, error: &LoadError) {
        self.metrics
            .rule_reloads
            .get_or_create(&ResultLabels { result: "error" })
            .inc();
        match error {
            LoadError::Invalid(errors) => {
                for diagnostic in &errors.0 {
                    tracing::error!(target: "vigil::rules", "{diagnostic}");
                }
            }
            other => tracing::error!(target: "vigil::rules", "{other}"),
        }
        tracing::warn!(path = %path.display(), code = error.code(), "rule reload refused; the previous rules stay in force");
    }
}

/// A digest of the rule files' names and contents, and of the list files' sizes and times (a
/// million-line list is not re-read every interval); `None` if they cannot be read.
fn fingerprint(path: &Path, list_files: &[String]) -> Option<blake3::Hash> {
    let files: Vec<PathBuf> = rule_files::rule_files(path).ok()?;
    let mut hasher = blake3::Hasher::new();
    for file in files {
        hasher.update(file.to_string_lossy().as_bytes());
        hasher.update(&[0]);
        hasher.update(&std::fs::read(&file).ok()?);
        hasher.update(&[0]);
    }
    for file in list_files {
        hasher.update(file.as_bytes());
        match std::fs::metadata(file) {
            Ok(meta) => {
                hasher.update(&meta.len().to_le_bytes());
                let modified = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
                hasher.update(&modified.map_or(0, |d| d.as_nanos()).to_le_bytes());
            }
            Err(_) => {
                hasher.update(b"missing");
            }
        }
    }
    Some(hasher.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reload_fingerprint_follows_rule_files_and_the_list_files_they_name() {
        let dir = tempfile::tempdir().unwrap();
        let rules = dir.path().join("rules");
        std::fs::create_dir_all(rules.join("lists")).unwrap();
        std::fs::write(rules.join("r.toml"), "[[list]]\nid='cards'\nfile='lists/cards.txt'\n[[rule]]\nid='r'\naction='block'\nwhen=\"card in @cards\"\n").unwrap();
        let list = rules.join("lists/cards.txt");
        std::fs::write(&list, "c-1\n").unwrap();
        let loaded = rule_files::load(&rules).unwrap();
        let lists = loaded.list_file_names().to_vec();
        assert_eq!(lists, [list.display().to_string()]);
        let before = fingerprint(&rules, &lists);
        assert_eq!(fingerprint(&rules, &lists), before, "nothing changed");
        // A list file replaced whole (a new size) is a change, though no rule file changed.
        std::fs::write(&list, "c-1\nc-2\n").unwrap();
        let after = fingerprint(&rules, &lists);
        assert_ne!(after, before);
        assert!(rule_files::load(&rules).unwrap().rules().len() == 1);
        // A rule file edit is a change too.
        std::fs::write(rules.join("r.toml"), "[[rule]]\nid='r'\naction='alert'\n").unwrap();
        assert_ne!(fingerprint(&rules, &lists), after);
    }
}
