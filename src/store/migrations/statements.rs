//! A migration's SQL cut into its statements, for the servers that must be sent one statement at a time: a
//! Citus coordinator forwards some DDL to its workers as the text it received, and refuses a text of several
//! commands ("cannot insert multiple commands into a prepared statement").
//!
//! The cut is at each `;` outside a string, a quoted identifier, a dollar-quoted body and a comment — the
//! lexical rules of PostgreSQL's own scanner for the SQL the migrations are written in (no `E'…'` strings with
//! backslash escapes: the migrations use none, and a test holds them to that).

/// The statements of `sql`, each without its `;`, comments and blank statements left out.
pub fn split(sql: &str) -> Vec<String> {
    let mut statements = Vec::new();
    let mut current = String::new();
    let mut rest = sql;
    while let Some(c) = rest.chars().next() {
        let taken = match c {
            ';' => {
                push(&mut statements, &current);
                current.clear();
                rest = &rest[1..];
                continue;
            }
            '\'' => quoted(rest, '\''),
            '"' => quoted(rest, '"'),
            '-' if rest.starts_with("--") => {
                // A line comment: dropped, up to its line's end (kept, as a separator).
                rest = &rest[rest.find('\n').unwrap_or(rest.len())..];
                continue;
            }
            '/' if rest.starts_with("/*") => {
                rest = &rest[block_comment(rest)..];
                current.push(' ');
                continue;
            }
            // `$` inside an identifier (`a$b`) opens nothing.
            '$' if !current.ends_with(|p: char| p.is_alphanumeric() || p == '_') => {
                dollar_quoted(rest).unwrap_or(1)
            }
            _ => c.len_utf8(),
        };
        current.push_str(&rest[..taken]);
        rest = &rest[taken..];
    }
    push(&mut statements, &current);
    statements
}

fn push(statements: &mut Vec<String>, statement: &str) {
    let statement = statement.trim();
    if !statement.is_empty() {
        statements.push(statement.to_string());
    }
}

/// The length of the string or identifier opening `text` (quote `q`, doubled inside it), to its end.
fn quoted(text: &str, q: char) -> usize {
    let mut at = 1;
    loop {
        match text[at..].find(q) {
            None => return text.len(),
            Some(i) => {
                at += i + 1;
                if !text[at..].starts_with(q) {
                    return at;
                }
                at += 1;
            }
        }
    }
}

/// The length of the (nestable) block comment opening `text`.
fn block_comment(text: &str) -> usize {
    let mut depth = 0;
    let mut at = 0;
    while at < text.len() {
        if text[at..].starts_with("/*") {
            depth += 1;
            at += 2;
        } else if text[at..].starts_with("*/") {
            depth -= 1;
            at += 2;
            if depth == 0 {
                return at;
            }
        } else {
            at += text[at..].chars().next().map_or(1, char::len_utf8);
        }
    }
    text.len()
}

/// The length of the dollar-quoted body opening `text` (`$tag$ … $tag$`), if `text` opens one (`$1`, a
/// parameter, does not).
fn dollar_quoted(text: &str) -> Option<usize> {
    // A tag's characters: letters (any non-ASCII character counts as one, as PostgreSQL's scanner takes
    // them), digits and `_`.
    let tag_end = text[1..].find(|c: char| !(c.is_alphanumeric() || c == '_' || !c.is_ascii()))? + 1;
    if !text[tag_end..].starts_with('$') || text[1..].starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    let tag = &text[..=tag_end];
    let body = tag.len();
    Some(
        text[body..]
            .find(tag)
            .map_or(text.len(), |i| body + i + tag.len()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_end_at_semicolons_outside_quotes_bodies_and_comments() {
        let sql = "set local lock_timeout = '5s';\n\
                   -- a comment; with a semicolon\n\
                   create table t (a text default 'x;y', \"b;c\" int); /* a ; block /* nested; */ comment */\n\
                   create function f() returns int language sql as $$ select 1; $$;\n\
                   do $m$ declare s text := $f$ create x; $f$; begin execute s; end $m$;\n\
                   select $1::int; select 'it''s;' ;;\n\
                   select a$b$ from t;\n";
        assert_eq!(
            split(sql),
            vec![
                "set local lock_timeout = '5s'",
                "create table t (a text default 'x;y', \"b;c\" int)",
                "create function f() returns int language sql as $$ select 1; $$",
                "do $m$ declare s text := $f$ create x; $f$; begin execute s; end $m$",
                "select $1::int",
                "select 'it''s;'",
                "select a$b$ from t",
            ]
        );
    }

    #[test]
    fn a_text_without_a_final_semicolon_keeps_its_last_statement() {
        assert_eq!(split("select 1; select 2"), vec!["select 1", "select 2"]);
        assert!(split("  -- only a comment\n").is_empty());
    }

    /// The forms the cut does not know — `E'…'` strings (backslash escapes), `begin atomic … end` bodies and
    /// `create rule … do (…; …)` — appear in no migration. (That every migration cuts into statements
    /// PostgreSQL accepts one by one is tested against a server: tests/it/migrate.rs.)
    #[test]
    fn no_migration_uses_a_form_the_cut_does_not_know() {
        for migration in crate::store::migrations::MIGRATOR.iter() {
            let sql = migration.sql.to_lowercase();
            let escape_string = sql
                .match_indices("e'")
                .any(|(at, _)| !sql[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == '$'));
            assert!(
                !escape_string,
                "migration {} has an E'' string",
                migration.version
            );
            assert!(
                !sql.contains("begin atomic"),
                "migration {}: begin atomic",
                migration.version
            );
            assert!(
                !sql.contains("create rule") && !sql.contains("create or replace rule"),
                "migration {}: a rule",
                migration.version
            );
        }
    }

    #[test]
    fn a_dollar_tag_may_have_any_letter() {
        assert_eq!(
            split("select $é€$ a; b $é€$; select 2"),
            vec!["select $é€$ a; b $é€$", "select 2"]
        );
    }
}
