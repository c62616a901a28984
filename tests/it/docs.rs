//! The documentation as a reader follows it, checked without a database: every relative link in `README.md`,
//! `docs/*.md` and `bench/README.md` reaches a file and every `#anchor` a heading of its page (GitHub's slugs);
//! every alert's `runbook_url` reaches its own section of `docs/operations.md`; `docs/configuration.md` documents
//! exactly the keys of `config/default.toml`, with their defaults; and `README.md` stays short.
//!
//! Each check collects every problem before failing, so one run names them all.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use serde_json::Value;

/// Where every alert's `runbook_url` points: its own section of the runbook, `#` + the alert name in lowercase.
const RUNBOOK_BASE: &str = "https://github.com/fine-settler/fine-settler/blob/main/docs/operations.md#";
/// The README is the front door: what, quick start, tour, links. Everything else lives in `docs/`.
const README_MAX_LINES: usize = 250;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The pages whose links are checked: the README, every page of `docs/`, the benchmark's README.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md"), root().join("bench/README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|entry| entry.expect("docs/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// `text` with the lines of fenced code blocks emptied (newlines kept, so line numbers stay).
fn unfenced(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut fence: Option<&str> = None;
    for line in text.split_inclusive('\n') {
        let trimmed = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(open), Some(m)) if open == m => fence = None,
            (None, None) => {
                out.push_str(line);
                continue;
            }
            _ => {}
        }
        out.push('\n');
    }
    out
}

/// The inline code spans of unfenced text, as (first backtick, first character after the closing run) index
/// ranges into `chars`: a run of N backticks up to the next run of exactly N, which may be on a later line.
fn code_spans(chars: &[char]) -> Vec<(usize, usize)> {
    let run_at = |i: usize| chars[i..].iter().take_while(|&&c| c == '`').count();
    let mut spans = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let n = run_at(i);
        if n == 0 {
            i += 1;
            continue;
        }
        let mut j = i + n;
        while j < chars.len() && run_at(j) != n {
            j += run_at(j).max(1);
        }
        if j < chars.len() {
            spans.push((i, j + n));
            i = j + n;
        } else {
            i += n;
        }
    }
    spans
}

/// What Markdown renders as prose: fenced blocks emptied and inline code spans blanked (newlines kept). Links
/// inside code are not links.
fn prose(text: &str) -> String {
    let mut chars: Vec<char> = unfenced(text).chars().collect();
    for (start, end) in code_spans(&chars) {
        chars[start..end]
            .iter_mut()
            .filter(|c| **c != '\n')
            .for_each(|c| *c = ' ');
    }
    chars.into_iter().collect()
}

/// The contents of the inline code spans of a page (fenced blocks excluded).
fn inline_code(text: &str) -> Vec<String> {
    let chars: Vec<char> = unfenced(text).chars().collect();
    code_spans(&chars)
        .into_iter()
        .map(|(start, end)| {
            let span: String = chars[start..end].iter().collect();
            span.trim_matches('`').trim().to_string()
        })
        .collect()
}

/// GitHub's anchor for a heading: lowercase, inline link syntax reduced to its text, every character that is not
/// a letter, a digit, a space, `-` or `_` dropped, spaces turned into `-`.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // `[text](target)` renders as `text`.
    while let Some(open) = rest.find("](") {
        let close = rest[open..].find(')').map_or(rest.len(), |c| open + c + 1);
        text.push_str(&rest[..open]);
        rest = &rest[close..];
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// The text of every ATX heading of a page, in order (fenced code excluded).
fn headings(text: &str) -> Vec<String> {
    let mut fence: Option<&str> = None;
    let mut found = Vec::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if let Some(m) = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m)) {
            fence = match fence {
                None => Some(m),
                Some(open) if open == m => None,
                other => other,
            };
            continue;
        }
        let level = line.chars().take_while(|&c| c == '#').count();
        if fence.is_none() && (1..=6).contains(&level) && line[level..].starts_with(' ') {
            found.push(line[level..].trim().trim_end_matches('#').trim().to_string());
        }
    }
    found
}

/// Every anchor of a page: the slug of each heading, a repeated slug getting `-1`, `-2`, … as on GitHub.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut anchors = BTreeSet::new();
    for heading in headings(text) {
        let base = slug(&heading);
        let count = seen.entry(base.clone()).or_insert(0);
        anchors.insert(if *count == 0 {
            base.clone()
        } else {
            format!("{base}-{count}")
        });
        *count += 1;
    }
    anchors
}

#[test]
fn slugs_follow_githubs_rules() {
    assert_eq!(
        slug("Throttling beside libraryd's traffic"),
        "throttling-beside-libraryds-traffic"
    );
    assert_eq!(slug("`verify` fails (exit 3)"), "verify-fails-exit-3");
    assert_eq!(
        slug("Compensation: PENDING → charged | DEAD"),
        "compensation-pending--charged--dead"
    );
    assert_eq!(slug("`[claim]`"), "claim");
    assert_eq!(
        slug("The replica (`fine-settler run`)"),
        "the-replica-fine-settler-run"
    );
    assert_eq!(slug("See [the page](x.md#y) now"), "see-the-page-now");
    assert_eq!(slug("snake_case Ünïcode 2"), "snake_case-ünïcode-2");
    let page = "# Top\n## Same\n```\n## Not a heading\n```\n### Same\n#NoSpace\n## Same\n";
    let expected: BTreeSet<String> = ["top", "same", "same-1", "same-2"].map(String::from).into();
    assert_eq!(anchors(page), expected);
}

#[test]
fn code_is_not_prose() {
    let text = "a [x](real.md) `[y](in-code.md)` b\n```\n[z](fenced.md)\n```\nc `` [w](`two`.md) `` and `split\nspan [v](v.md)` [u](u.md)\n";
    let links: Vec<String> = links(text).into_iter().map(|(_, target)| target).collect();
    assert_eq!(links, ["real.md", "u.md"]);
}

/// Every link target of a page's prose, with its line number: inline links and images (`[text](target)`,
/// `![alt](target)`, an optional title after the target) and reference definitions (`[name]: target`).
fn links(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (index, line) in prose(text).lines().enumerate() {
        let mut rest = line;
        while let Some(open) = rest.find("](") {
            let after = &rest[open + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let target = after[..end].split_whitespace().next().unwrap_or("");
            found.push((index + 1, target.trim_matches(['<', '>']).to_string()));
            rest = &after[end..];
        }
        let trimmed = line.trim_start();
        if let Some(definition) = trimmed.strip_prefix('[').and_then(|d| d.split_once("]:")) {
            if let Some(target) = definition.1.split_whitespace().next() {
                found.push((index + 1, target.to_string()));
            }
        }
    }
    found
}

/// What is wrong with one link of `page`, if anything: its file must exist and its anchor, if any, must be a
/// heading of the Markdown page it names (the page itself when the link is only `#anchor`).
fn check_link(page: &Path, target: &str) -> Option<String> {
    if target.is_empty() {
        return Some("an empty link target".into());
    }
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (file, anchor) = match target.split_once('#') {
        Some((file, anchor)) => (file, Some(anchor)),
        None => (target, None),
    };
    let path = if file.is_empty() {
        page.to_path_buf()
    } else {
        page.parent().expect("a page's folder").join(file)
    };
    if !path.exists() {
        return Some(format!("{target}: no file {}", path.display()));
    }
    let anchor = anchor?;
    if path.extension().is_none_or(|ext| ext != "md") {
        return Some(format!(
            "{target}: an anchor into a file that is not a Markdown page"
        ));
    }
    let known = anchors(&read(&path));
    let page_name = if file.is_empty() { "this page" } else { file };
    (!known.contains(anchor))
        .then(|| format!("{target}: no heading with the anchor #{anchor} in {page_name}"))
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let (mut problems, mut checked) = (Vec::new(), 0);
    for page in pages() {
        let rel = page
            .strip_prefix(root())
            .expect("a page of the checkout")
            .display()
            .to_string();
        for (line, target) in links(&read(&page)) {
            checked += 1;
            if let Some(problem) = check_link(&page, &target) {
                problems.push(format!("{rel}:{line}: {problem}"));
            }
        }
    }
    assert!(problems.is_empty(), "broken links:\n{}", problems.join("\n"));
    // The pages link to each other both ways; far fewer links means the parser stopped seeing them.
    assert!(
        checked > 100,
        "only {checked} links found: is the link parser broken?"
    );
}

/// The alert rules, as JSON values (`name`, `annotations`, …).
fn alerts() -> Vec<Value> {
    let text = read(&root().join("deploy/prometheus/fine-settler.rules.yml"));
    let rules: Value = serde_yaml_ng::from_str(&text).expect("the alert rules are YAML");
    rules["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|group| group["rules"].as_array().expect("rules").iter().cloned())
        .collect()
}

#[test]
fn every_alert_links_its_own_runbook_section() {
    let runbook = anchors(&read(&root().join("docs/operations.md")));
    let alerts = alerts();
    assert!(!alerts.is_empty(), "no alerts found");
    let mut problems = Vec::new();
    for alert in &alerts {
        let name = alert["alert"].as_str().expect("every rule is an alert");
        let Some(url) = alert["annotations"]["runbook_url"].as_str() else {
            problems.push(format!("{name}: no runbook_url annotation"));
            continue;
        };
        let own = name.to_lowercase();
        match url.strip_prefix(RUNBOOK_BASE) {
            None => problems.push(format!(
                "{name}: runbook_url {url:?} does not start with {RUNBOOK_BASE:?}"
            )),
            Some(anchor) if anchor != own => problems.push(format!(
                "{name}: runbook_url points at #{anchor}, not its own section #{own}"
            )),
            Some(anchor) if !runbook.contains(anchor) => problems.push(format!(
                "{name}: docs/operations.md has no heading with the anchor #{anchor}"
            )),
            Some(_) => {}
        }
    }
    assert!(problems.is_empty(), "runbook links:\n{}", problems.join("\n"));
}

/// A default as `docs/configuration.md` writes it in backticks: strings bare (`""` when empty), the rest as TOML.
fn rendered(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) if s.is_empty() => "\"\"".into(),
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The keys of `config/default.toml`: per section, each key set in the file with its default, and the keys the
/// file leaves commented out (`# key = …`: known to the binary, unset by default).
struct DefaultToml {
    set: BTreeMap<String, BTreeMap<String, String>>,
    unset: BTreeMap<String, BTreeSet<String>>,
}

fn default_toml() -> DefaultToml {
    let text = read(&root().join("config/default.toml"));
    let table: toml::Table = text.parse().expect("config/default.toml is TOML");
    let mut set = BTreeMap::new();
    for (section, keys) in &table {
        let keys = keys
            .as_table()
            .unwrap_or_else(|| panic!("[{section}] is a table"));
        let keys = keys.iter().map(|(k, v)| (k.clone(), rendered(v))).collect();
        set.insert(section.clone(), keys);
    }
    let mut unset: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut section = String::new();
    for line in text.lines() {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.to_string();
        } else if let Some((key, _)) = line.strip_prefix('#').and_then(|l| l.split_once('=')) {
            let key = key.trim();
            if !key.is_empty() && key.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
                unset.entry(section.clone()).or_default().insert(key.to_string());
            }
        }
    }
    DefaultToml { set, unset }
}

/// One row of a key table of `docs/configuration.md`: the section it is under, the key, the default cell.
struct KeyRow {
    line: usize,
    section: String,
    key: String,
    default: String,
}

/// The key tables of `docs/configuration.md`: under each `## `[section]`` heading, the table rows whose first
/// cell is a key in backticks. Also the sections those headings name.
fn key_rows(text: &str) -> (Vec<KeyRow>, Vec<(usize, String)>) {
    let (mut rows, mut sections) = (Vec::new(), Vec::new());
    let mut section: Option<String> = None;
    for (index, line) in text.lines().enumerate() {
        let level = line.chars().take_while(|&c| c == '#').count();
        if (1..=2).contains(&level) {
            let title = line[level..].trim();
            section = title
                .strip_prefix("`[")
                .and_then(|t| t.strip_suffix("]`"))
                .map(String::from);
            if let Some(name) = &section {
                sections.push((index + 1, name.clone()));
            }
            continue;
        }
        let (Some(section), Some(row)) = (&section, line.strip_prefix("| `")) else {
            continue;
        };
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let (Some(key), Some(default)) = (cells[0].strip_suffix('`'), cells.get(1)) else {
            continue;
        };
        rows.push(KeyRow {
            line: index + 1,
            section: section.clone(),
            key: key.to_string(),
            default: default.to_string(),
        });
    }
    (rows, sections)
}

/// What is wrong with one documented key, if anything: it must be a key of the file (or one the file leaves
/// commented out, documented as "unset"), with the file's default as the first code span of its default cell.
fn check_row(file: &DefaultToml, row: &KeyRow) -> Option<String> {
    let name = format!("[{}] {}", row.section, row.key);
    let unset = file
        .unset
        .get(&row.section)
        .is_some_and(|keys| keys.contains(&row.key));
    let Some(default) = file.set.get(&row.section).and_then(|keys| keys.get(&row.key)) else {
        return match (unset, row.default.starts_with("unset")) {
            (true, true) => None,
            (true, false) => Some(format!(
                "{name}: commented out in config/default.toml; write its default as \"unset: …\""
            )),
            (false, _) => Some(format!("{name}: config/default.toml has no such key")),
        };
    };
    let written = row.default.split('`').nth(1);
    (written != Some(default.as_str())).then(|| {
        format!(
            "{name}: documented default {:?}, config/default.toml says `{default}`",
            row.default
        )
    })
}

#[test]
fn configuration_page_documents_exactly_the_keys_of_default_toml() {
    let file = default_toml();
    let (rows, sections) = key_rows(&read(&root().join("docs/configuration.md")));
    let mut problems = Vec::new();
    for (line, section) in &sections {
        if !file.set.contains_key(section) {
            problems.push(format!(
                "line {line}: config/default.toml has no section [{section}]"
            ));
        }
    }
    let mut documented: BTreeMap<(String, String), usize> = BTreeMap::new();
    for row in &rows {
        if let Some(line) = documented.insert((row.section.clone(), row.key.clone()), row.line) {
            problems.push(format!(
                "line {}: [{}] {} is documented twice (also line {line})",
                row.line, row.section, row.key
            ));
        }
        if let Some(problem) = check_row(&file, row) {
            problems.push(format!("line {}: {problem}", row.line));
        }
    }
    for (section, keys) in &file.set {
        for key in keys.keys() {
            if !documented.contains_key(&(section.clone(), key.clone())) {
                problems.push(format!(
                    "[{section}] {key}: in config/default.toml, not in docs/configuration.md"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "docs/configuration.md against config/default.toml:\n{}",
        problems.join("\n")
    );
}

/// Dotted names of configuration keys in the prose of every page (`claim.lease`, `throttle.standbys`, …) name
/// keys that exist: a renamed or removed key leaves no stale mention behind. A code span `section.key` whose
/// section is one of the file's counts as such a name, unless it is a file name (`fine.rs`).
#[test]
fn dotted_key_names_in_the_docs_exist() {
    let file = default_toml();
    let mut problems = Vec::new();
    for page in pages() {
        for span in inline_code(&read(&page)) {
            let Some((section, key)) = span.split_once('.') else {
                continue;
            };
            let is_name = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c == '_');
            let file_name = ["rs", "md", "toml", "yml", "yaml", "sql", "json", "sh", "png"].contains(&key);
            if !is_name(section) || !is_name(key) || file_name || !file.set.contains_key(section) {
                continue;
            }
            let known = file.set[section].contains_key(key)
                || file.unset.get(section).is_some_and(|keys| keys.contains(key));
            if !known {
                problems.push(format!("{}: `{span}` is not a configuration key", page.display()));
            }
        }
    }
    assert!(problems.is_empty(), "stale key names:\n{}", problems.join("\n"));
}

#[test]
fn readme_is_short() {
    let lines = read(&root().join("README.md")).lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines (at most {README_MAX_LINES}): move the detail into a page of docs/"
    );
}
