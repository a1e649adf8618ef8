//! Cross-table resolution, once every file's tables are read: duplicate ids across files, the
//! lists filled (inline values or list files), the counters and lists expressions name, the
//! v1 form's counter, and the warnings only the whole set shows (a `when` that can never hold,
//! a counter no rule reads).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use super::positions::{raw_offset, Diagnostic, RuleFile};
use super::tables::drafts::{
    CounterDraft, DraftScope, ExprSite, InlineEntry, KeyDraft, ListDraft, ListEntries, RuleDraft,
};
use super::tables::ReadTables;
use crate::event::{quote_prefix as q, Projection};
use crate::rules::expr::{self, Names};
use crate::rules::lists::{ListKind, ListSet};
use crate::rules::model::{Counter, FileLocation, Form, Hold, KeyPart, Rollout, Rule, Scope};
use crate::window::Aggregate;

/// What compiling a set of files gives.
pub struct CompiledSet {
    pub counters: Vec<Counter>,
    pub rules: Vec<Rule>,
    /// Every list, with its id, and the list files read (name, text) for the rules version.
    pub lists: Vec<(String, Arc<ListSet>)>,
    pub list_files: Vec<(String, String)>,
    pub projection: Projection,
    /// Likely mistakes that do not stop loading.
    pub warnings: Vec<Diagnostic>,
}

/// Reads a list file by path (the caller's I/O; an error message when it cannot).
pub type ReadFile<'a> = &'a dyn Fn(&str) -> Result<String, String>;

/// A reader for callers without files: every list file is an error.
pub fn no_files(path: &str) -> Result<String, String> {
    Err(format!(
        "cannot read {path}: list files are read only when loading a rule directory"
    ))
}

/// Resolves the tables read from `files` against each other; every error, in file order then
/// by position, if there is any.
pub(super) fn resolve(
    files: &[RuleFile<'_>],
    tables: ReadTables,
    read: ReadFile<'_>,
) -> Result<CompiledSet, Vec<Diagnostic>> {
    let ReadTables {
        counters,
        rules,
        lists: list_drafts,
        mut ids,
        orphans,
        mut diagnostics,
        mut warnings,
    } = tables;
    let file_order = file_order(files);
    report_duplicate_ids(&mut ids, &file_order, &mut diagnostics);
    let (lists, list_files) = read_lists(&list_drafts, files, read, &mut diagnostics);

    // Names resolve against every counter that was read, so a reference to a counter with an
    // error of its own is not reported a second time as unknown.
    let index: HashMap<String, (usize, bool)> = counters
        .iter()
        .enumerate()
        .map(|(i, c)| (c.counter.id.clone(), (i, c.counter.enabled)))
        .collect();
    let rule_ids: HashSet<&str> = rules.iter().map(|r| r.id.as_str()).collect();
    let scales: Vec<i32> = counters
        .iter()
        .map(|c| {
            if c.counter.aggregate().is_amount() {
                6
            } else {
                0
            }
        })
        .collect();
    let lasts: Vec<bool> = counters
        .iter()
        .map(|c| c.counter.aggregate() == Aggregate::Last)
        .collect();
    let list_index: HashMap<&str, usize> = lists
        .iter()
        .enumerate()
        .rev()
        .map(|(i, (id, _))| (id.as_str(), i))
        .collect();
    let names = CounterNames {
        index: &index,
        scales: &scales,
        lasts: &lasts,
        rule_ids: &rule_ids,
        lists: &lists,
        list_index: &list_index,
    };
    let exprs = Exprs {
        files,
        names: &names,
    };
    let mut projection = Projection::new();
    exprs.check_orphans(&orphans, &mut diagnostics);
    let built_counters = build_counters(&counters, &exprs, &mut projection, &mut diagnostics);
    let built_rules = build_rules(
        &rules,
        &counters,
        &exprs,
        &mut projection,
        &mut diagnostics,
        &mut warnings,
    );
    if !diagnostics.is_empty() {
        // By file (in load order), then by position.
        let file_index = |d: &Diagnostic| {
            file_order
                .get(d.origin.file.as_str())
                .copied()
                .unwrap_or(usize::MAX)
        };
        diagnostics.sort_by_key(|d| (file_index(d), d.origin.line, d.origin.col));
        return Err(diagnostics);
    }
    warn_unread_counters(&built_counters, &built_rules, &mut warnings);
    warn_always_suppressed(&built_rules, &mut warnings);
    warn_beyond_max_distinct(&built_counters, &built_rules, &mut warnings);
    Ok(CompiledSet {
        counters: built_counters,
        rules: built_rules,
        lists,
        list_files,
        projection,
        warnings,
    })
}

/// Each file's position in load order, by name (the first, if a name is given twice).
fn file_order<'a>(files: &[RuleFile<'a>]) -> HashMap<&'a str, usize> {
    files
        .iter()
        .enumerate()
        .rev()
        .map(|(i, source)| (source.name, i))
        .collect()
}

/// A second definition of an id, anywhere in the set, is an error at that definition.
fn report_duplicate_ids(
    ids: &mut [(String, FileLocation)],
    file_order: &HashMap<&str, usize>,
    diagnostics: &mut Vec<Diagnostic>,
) {
    // In file order, then by position (tables are read kind by kind).
    ids.sort_by_key(|(_, o)| (file_order.get(o.file.as_str()).copied(), o.line, o.col));
    let mut first: HashMap<&str, &FileLocation> = HashMap::new();
    for (id, origin) in ids.iter() {
        if let Some(prev) = first.get(id.as_str()) {
            diagnostics.push(Diagnostic {
                origin: origin.clone(),
                message: format!("duplicate id {id_q} (first defined at {prev}); counters, rules and lists share one namespace", id_q = q(id)),
            });
        } else {
            first.insert(id, origin);
        }
    }
}

/// Every list, by id, with the list files read: inline values, or a file next to the rule
/// file (its errors at its own lines).
#[allow(clippy::type_complexity)]
fn read_lists(
    drafts: &[ListDraft],
    files: &[RuleFile<'_>],
    read: ReadFile<'_>,
    diagnostics: &mut Vec<Diagnostic>,
) -> (Vec<(String, Arc<ListSet>)>, Vec<(String, String)>) {
    let mut lists: Vec<(String, Arc<ListSet>)> = Vec::new();
    let mut list_files = Vec::new();
    for draft in drafts {
        let source = &files[draft.file];
        let mut set = ListSet::new(draft.kind);
        match &draft.entries {
            ListEntries::Inline(values) => add_inline(&mut set, draft, values, source, diagnostics),
            ListEntries::Map(pairs) => {
                for (key, value, at) in pairs {
                    let result = match value {
                        Ok(value) => set.add_map_entry(key, value.clone()),
                        Err(what) => Err(format!(
                            "{} {what} is not a map value (a number, a string, true, false or null)",
                            if what.starts_with(['a', 'e', 'i', 'o', 'u']) { "an" } else { "a" }
                        )),
                    };
                    if let Err(message) = result {
                        diagnostics.push(Diagnostic {
                            origin: source.origin(*at),
                            message: format!("list {:?}: {message}", draft.id),
                        });
                    }
                }
            }
            ListEntries::File(file, at) => {
                let path = Path::new(source.name)
                    .parent()
                    .unwrap_or(Path::new(""))
                    .join(file)
                    .display()
                    .to_string();
                match read(&path) {
                    Ok(text) => {
                        for (line, col, message) in set.add_file(&text) {
                            diagnostics.push(Diagnostic {
                                origin: FileLocation {
                                    file: path.clone(),
                                    line,
                                    col,
                                },
                                message,
                            });
                        }
                        list_files.push((path, text));
                    }
                    Err(message) => diagnostics.push(Diagnostic {
                        origin: source.origin(*at),
                        message,
                    }),
                }
            }
        }
        lists.push((draft.id.clone(), Arc::new(set)));
    }
    (lists, list_files)
}

/// Adds a list's inline values to its set; a value of the wrong kind is an error where written.
fn add_inline(
    set: &mut ListSet,
    draft: &ListDraft,
    values: &[(InlineEntry, usize)],
    source: &RuleFile<'_>,
    diagnostics: &mut Vec<Diagnostic>,
) {
    for (entry, at) in values {
        let result = match (entry, draft.kind) {
            (InlineEntry::Str(s), ListKind::String | ListKind::Cidr) => set.add(s),
            (InlineEntry::Num(d), ListKind::Number) => set.add(&d.to_string()),
            (InlineEntry::Num(_), _) => Err(format!("a number in a {} list", draft.kind.as_str())),
            (InlineEntry::Str(_), ListKind::Number) => Err("a string in a number list".to_owned()),
            (_, ListKind::StringMap | ListKind::NumberMap) => {
                Err("a map's values are a table".to_owned())
            }
            (InlineEntry::Other(what), _) => {
                Err(format!("a {what} in a {} list", draft.kind.as_str()))
            }
        };
        if let Err(message) = result {
            diagnostics.push(Diagnostic {
                origin: source.origin(*at),
                message: format!("list {:?}: {message}", draft.id),
            });
        }
    }
}

/// Compiles the expressions written in the files against the set's names.
struct Exprs<'a, 's> {
    files: &'a [RuleFile<'s>],
    names: &'a CounterNames<'a>,
}

impl Exprs<'_, '_> {
    /// An expression error, at its column in the file.
    fn site_error(&self, site: &ExprSite, e: expr::ExprError) -> Diagnostic {
        let source = &self.files[site.file];
        Diagnostic {
            origin: source.origin(site.at + raw_offset(&source.text[site.at..], e.offset)),
            message: e.message,
        }
    }

    /// Expressions of tables with other errors: their own errors too (names they use may belong
    /// to tables that failed, so only what is wrong in the expression itself is reported).
    fn check_orphans(&self, orphans: &[(ExprSite, bool)], diagnostics: &mut Vec<Diagnostic>) {
        let lenient = LenientNames(self.names);
        for (site, allow_counters) in orphans {
            if let Err(e) = expr::compile(
                &site.value,
                &mut Projection::new(),
                &lenient,
                *allow_counters,
            ) {
                diagnostics.push(self.site_error(site, e));
            }
        }
    }

    /// A `match` (`None`: its expression has an error, reported).
    fn scope(
        &self,
        scope: &DraftScope,
        projection: &mut Projection,
        diagnostics: &mut Vec<Diagnostic>,
    ) -> Option<Scope> {
        match scope {
            DraftScope::All => Some(Scope::All),
            DraftScope::Table(m) => Some(Scope::Table(m.clone())),
            DraftScope::Expr(site) => {
                match expr::compile(&site.value, projection, self.names, false) {
                    Ok(c) => Some(Scope::Expr(Box::new(c))),
                    Err(e) => {
                        diagnostics.push(self.site_error(site, e));
                        None
                    }
                }
            }
        }
    }

    /// Key entries: paths as they are, expressions compiled (`None`: one has an error, reported).
    fn key(
        &self,
        entries: &[KeyDraft],
        projection: &mut Projection,
        diagnostics: &mut Vec<Diagnostic>,
    ) -> Option<Vec<KeyPart>> {
        let mut parts = Vec::with_capacity(entries.len());
        let mut ok = true;
        for entry in entries {
            match entry {
                KeyDraft::Path(p) => parts.push(KeyPart::Path(p.clone())),
                KeyDraft::Expr(site) => {
                    match expr::compile_key(&site.value, projection, self.names) {
                        Ok(c) => parts.push(KeyPart::Expr {
                            text: site.value.clone(),
                            compiled: Box::new(c),
                        }),
                        Err(e) => {
                            diagnostics.push(self.site_error(site, e));
                            ok = false;
                        }
                    }
                }
            }
        }
        ok.then_some(parts)
    }

    /// A rule's `when`, if it has one (`None`: it has an error, reported).
    fn when(
        &self,
        when: Option<&ExprSite>,
        projection: &mut Projection,
        diagnostics: &mut Vec<Diagnostic>,
    ) -> Option<Option<Box<expr::Compiled>>> {
        match when {
            None => Some(None),
            Some(site) => match expr::compile(&site.value, projection, self.names, true) {
                Ok(c) => Some(Some(Box::new(c))),
                Err(e) => {
                    diagnostics.push(self.site_error(site, e));
                    None
                }
            },
        }
    }
}

/// The counters whose `match` compiles.
fn build_counters(
    drafts: &[CounterDraft],
    exprs: &Exprs<'_, '_>,
    projection: &mut Projection,
    diagnostics: &mut Vec<Diagnostic>,
) -> Vec<Counter> {
    let mut built = Vec::with_capacity(drafts.len());
    for draft in drafts {
        let scope = exprs.scope(&draft.scope, projection, diagnostics);
        let dimensions = exprs.key(&draft.dimensions, projection, diagnostics);
        let tuple = exprs.key(&draft.tuple, projection, diagnostics);
        if let (Some(scope), Some(dimensions), Some(tuple)) = (scope, dimensions, tuple) {
            built.push(Counter {
                scope,
                scope_text: scope_text(&draft.scope),
                dimensions,
                tuple,
                ..draft.counter.clone()
            });
        }
    }
    built
}

/// The rules whose `match` and `when` compile, a v1-form rule tied to its counter.
fn build_rules(
    drafts: &[RuleDraft],
    counters: &[CounterDraft],
    exprs: &Exprs<'_, '_>,
    projection: &mut Projection,
    diagnostics: &mut Vec<Diagnostic>,
    warnings: &mut Vec<Diagnostic>,
) -> Vec<Rule> {
    let mut built = Vec::with_capacity(drafts.len());
    for draft in drafts {
        let scope = exprs.scope(&draft.scope, projection, diagnostics);
        let when = exprs.when(draft.when.as_ref(), projection, diagnostics);
        let hold = match &draft.hold {
            Some((ms, key)) => exprs
                .key(key, projection, diagnostics)
                .map(|key| Some(Hold { ms: *ms, key })),
            None => Some(None),
        };
        let rollout = match &draft.rollout {
            Some((percent, basis_points, key)) => {
                exprs.key(key, projection, diagnostics).map(|key| {
                    Some(Rollout {
                        basis_points: *basis_points,
                        percent: percent.clone(),
                        key,
                    })
                })
            }
            None => Some(None),
        };
        let entity = match &draft.entity {
            Some(entity) => exprs.key(entity, projection, diagnostics),
            None => Some(Vec::new()),
        };
        let (Some(scope), Some(when), Some(hold), Some(rollout), Some(mut entity)) =
            (scope, when, hold, rollout, entity)
        else {
            continue;
        };
        // Whom a hit is about: `entity`, else the hold key.
        if draft.entity.is_none() {
            if let Some(hold) = &hold {
                entity = hold.key.clone();
            }
        }
        let calls_score = when.as_ref().is_some_and(|w| w.calls_score);
        if calls_score {
            let file = &draft.origin.file;
            for (key, at) in [
                ("score", draft.score.map(|(_, at)| at)),
                ("final", draft.is_final),
            ] {
                if let Some(at) = at {
                    let source = exprs.files.iter().find(|f| f.name == file.as_str());
                    diagnostics.push(Diagnostic {
                        origin: source.map_or_else(|| draft.origin.clone(), |f| f.origin(at)),
                        message: format!(
                            "rule {:?} calls score() in its `when`, so it may not have {key:?}: it is judged after the rules that make the score",
                            draft.id
                        ),
                    });
                }
            }
        }
        let form = rule_form(draft, exprs.names, counters);
        if let Some(w) = &when {
            warn_if_constant(draft, w, warnings);
        }
        built.push(Rule {
            id: draft.id.clone(),
            description: draft.description.clone(),
            action: draft.action,
            mode: draft.mode,
            enabled: draft.enabled,
            scope,
            scope_text: scope_text(&draft.scope),
            when,
            when_text: draft.when.as_ref().map(|w| w.value.clone()),
            form,
            on_store_error: draft.on_store_error,
            hold,
            priority: draft.priority,
            is_final: draft.is_final.is_some(),
            score: draft.score.map(|(micros, _)| micros),
            rollout,
            entity,
            calls_score,
            origin: draft.origin.clone(),
        });
    }
    built
}

/// A rule with a `limit` is in the v1 form: its counter is the one with its id.
fn rule_form(draft: &RuleDraft, names: &CounterNames<'_>, counters: &[CounterDraft]) -> Form {
    match &draft.limit {
        Some(limit) => {
            let counter = names.index[&draft.id].0;
            let scale = if counters[counter].counter.aggregate().is_amount() {
                6
            } else {
                0
            };
            Form::V1 {
                counter,
                limit: limit.clone(),
                threshold: limit.floor_scaled(scale),
            }
        }
        None => Form::V2,
    }
}

/// A `when` that is constant and not true: the rule can never fire.
fn warn_if_constant(draft: &RuleDraft, when: &expr::Compiled, warnings: &mut Vec<Diagnostic>) {
    if let Some(value) = when.expr.constant() {
        if value != expr::Val::Bool(true) {
            warnings.push(Diagnostic {
                origin: draft.origin.clone(),
                message: format!(
                    "rule {:?} can never fire: its `when` is always {}",
                    draft.id,
                    constant_name(&value)
                ),
            });
        }
    }
}

/// A rule that a `final` enforce-mode rule of higher priority always suppresses: that rule has
/// no `when`, no rollout and the same scope, so it fires on every event the other judges. The
/// highest-priority such rule per scope is found in one pass, so a large set stays linear.
fn warn_always_suppressed(rules: &[Rule], warnings: &mut Vec<Diagnostic>) {
    let mut silencers: HashMap<String, &Rule> = HashMap::new();
    for f in rules.iter().filter(|f| {
        f.enabled
            && f.is_final
            && f.mode == crate::rules::model::Mode::Enforce
            && f.when.is_none()
            && f.rollout.is_none()
            && matches!(f.form, Form::V2)
    }) {
        silencers
            .entry(scope_key(f))
            .and_modify(|best| {
                if f.priority > best.priority {
                    *best = f;
                }
            })
            .or_insert(f);
    }
    if silencers.is_empty() {
        return;
    }
    for rule in rules.iter().filter(|r| r.enabled) {
        let Some(f) = silencers.get(&scope_key(rule)) else {
            continue;
        };
        if f.priority > rule.priority {
            warnings.push(Diagnostic {
                origin: rule.origin.clone(),
                message: format!(
                    "rule {:?} never fires: the final rule {:?} (priority {} > {}) fires on every event it judges and suppresses it",
                    rule.id, f.id, f.priority, rule.priority
                ),
            });
        }
    }
}

/// Equal for two rules exactly when they judge the same events by the same `match`: none, the
/// same table, or the same expression text.
fn scope_key(rule: &Rule) -> String {
    match &rule.scope {
        Scope::All => "all".to_owned(),
        Scope::Table(matchers) => format!("table {matchers:?}"),
        Scope::Expr(_) => format!("expr {:?}", rule.scope_text),
    }
}

/// A rule whose `when` cannot be true without a distinct counter above what it records
/// (`max_distinct`) never fires. (A v1 limit that high is refused where the rule is read.)
fn warn_beyond_max_distinct(counters: &[Counter], rules: &[Rule], warnings: &mut Vec<Diagnostic>) {
    use crate::window::Aggregate;
    for rule in rules.iter().filter(|r| r.enabled) {
        // (counter, what the rule needs of it, the least value that gives it)
        let mut needs: Vec<(usize, String, i64)> = Vec::new();
        for conjunct in rule.when.iter().flat_map(|when| when.expr.conjuncts()) {
            if let expr::Expr::CounterCmp {
                cmp,
                index,
                floor,
                ceil,
            } = *conjunct
            {
                match cmp {
                    expr::CounterCmp::Gt => {
                        needs.push((index, format!("more than {floor}"), floor.saturating_add(1)))
                    }
                    expr::CounterCmp::Ge => needs.push((index, format!("at least {ceil}"), ceil)),
                    expr::CounterCmp::Eq if floor == ceil => {
                        needs.push((index, format!("exactly {floor}"), floor))
                    }
                    _ => {}
                }
            }
        }
        // One warning per rule: the first comparison out of reach.
        let beyond = needs.into_iter().find(|&(index, _, least)| {
            let counter = &counters[index];
            counter.aggregate() == Aggregate::Distinct
                && least > i64::from(counter.window.max_distinct)
        });
        if let Some((index, need, _)) = beyond {
            let counter = &counters[index];
            warnings.push(Diagnostic {
                origin: rule.origin.clone(),
                message: format!(
                    "rule {:?}: its `when` can never be true: it needs {need} distinct values in counter {:?}, which records at most {} (raise its max_distinct)",
                    rule.id, counter.id, counter.window.max_distinct
                ),
            });
        }
    }
}

/// Counters no rule reads are almost always a mistake (a v1 rule reads its own).
fn warn_unread_counters(counters: &[Counter], rules: &[Rule], warnings: &mut Vec<Diagnostic>) {
    let mut read = vec![false; counters.len()];
    for rule in rules {
        for &i in rule.counters() {
            read[i] = true;
        }
        if let Form::V1 { counter, .. } = rule.form {
            read[counter] = true;
        }
    }
    for (counter, read) in counters.iter().zip(read) {
        if !read && counter.enabled {
            warnings.push(Diagnostic {
                origin: counter.origin.clone(),
                message: format!("counter {:?} is not read by any rule", counter.id),
            });
        }
    }
}

fn scope_text(scope: &DraftScope) -> Option<String> {
    match scope {
        DraftScope::Expr(site) => Some(site.value.clone()),
        _ => None,
    }
}

fn constant_name(v: &expr::Val<'_>) -> &'static str {
    match v {
        expr::Val::Bool(false) => "false",
        expr::Val::Unknown => "unknown (it compares or computes across types)",
        _ => "a value that is not a boolean",
    }
}

/// The names an expression may use: counters (by id, enabled), lists (by id).
struct CounterNames<'a> {
    index: &'a HashMap<String, (usize, bool)>,
    /// Per counter: decimal places of its raw values.
    scales: &'a [i32],
    /// Per counter: whether its aggregate is `last`.
    lasts: &'a [bool],
    rule_ids: &'a HashSet<&'a str>,
    lists: &'a [(String, Arc<ListSet>)],
    /// Each list id's position in `lists` (the first, if an id is defined twice).
    list_index: &'a HashMap<&'a str, usize>,
}

/// Names that resolve every counter and list (an unknown list as an empty string list): for
/// checking an expression on its own.
struct LenientNames<'n>(&'n CounterNames<'n>);

impl Names for LenientNames<'_> {
    fn counter(&self, id: &str) -> Result<usize, String> {
        Ok(self.0.counter(id).unwrap_or(usize::MAX))
    }

    fn counter_scale(&self, index: usize) -> i32 {
        self.0.scales.get(index).copied().unwrap_or(0)
    }

    fn counter_is_last(&self, index: usize) -> bool {
        self.0.lasts.get(index).copied().unwrap_or(true)
    }

    fn list(&self, id: &str) -> Result<Arc<ListSet>, String> {
        Ok(self
            .0
            .list(id)
            .unwrap_or_else(|_| Arc::new(ListSet::new(ListKind::String))))
    }
}

impl Names for CounterNames<'_> {
    fn counter(&self, id: &str) -> Result<usize, String> {
        match self.index.get(id) {
            Some(&(i, true)) => Ok(i),
            Some(&(_, false)) => Err(format!("counter {} is disabled (enabled = false)", q(id))),
            None if self.rule_ids.contains(id) => {
                Err(format!("{} is a rule, not a counter", q(id)))
            }
            None => Err(format!("unknown counter {}", q(id))),
        }
    }

    fn counter_scale(&self, index: usize) -> i32 {
        self.scales[index]
    }

    fn counter_is_last(&self, index: usize) -> bool {
        self.lasts[index]
    }

    fn list(&self, id: &str) -> Result<Arc<ListSet>, String> {
        match self.list_index.get(id) {
            Some(&i) => Ok(Arc::clone(&self.lists[i].1)),
            None if self.index.contains_key(id) => {
                Err(format!("{} is a counter, not a list (write ${id})", q(id)))
            }
            None => Err(format!("unknown list {}", q(id))),
        }
    }
}
