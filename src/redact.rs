//! Keeping the database password out of everything fine-settler prints: logs, error messages, reports and
//! `check-config`.

/// The URL with any password replaced by `***` (in the user-info part and in a `password=` parameter). A
/// multi-host URL (`u:pw@h1:5432,h2:5433/db`) has one user-info part, before its host list.
///
/// A password that contains `/`, `?` or `#` unescaped ends the authority early for a URL parser, which then
/// finds no user information and fails on a "port"; the text up to the last `@` is then taken as the user
/// information, so that the error quoting the URL does not show the password. (A URL without user information
/// but with a port and an `@` further on is shown with too much hidden, never too little.)
pub fn url(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return password_params(url);
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let userinfo_end = match rest[..authority_end].rfind('@') {
        Some(at) => Some(at),
        None if rest[..authority_end].contains(':') => rest.rfind('@'),
        None => None,
    };
    let Some(at) = userinfo_end else {
        return format!("{}{}", &url[..scheme_end], password_params(rest));
    };
    let userinfo = &rest[..at];
    let after = &rest[at..];
    let after_end = after.find(['/', '?', '#']).unwrap_or(after.len());
    let shown_userinfo = match userinfo.find(':') {
        Some(colon) => format!("{}:***", &userinfo[..colon]),
        None => userinfo.to_string(),
    };
    format!(
        "{}{}{}{}",
        &url[..scheme_end],
        shown_userinfo,
        &after[..after_end],
        password_params(&after[after_end..])
    )
}

fn password_params(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("password=") {
        let value_start = i + "password=".len();
        out.push_str(&rest[..value_start]);
        out.push_str("***");
        let tail = &rest[value_start..];
        let value_end = tail.find(['&', ' ', '#']).unwrap_or(tail.len());
        rest = &tail[value_end..];
    }
    out.push_str(rest);
    out
}

/// Redacts every URL-looking token of a message (errors from drivers may quote the URL they were given).
pub fn secrets_in(message: &str) -> String {
    message
        .split(' ')
        .map(|word| {
            if word.contains("://") {
                url(word)
            } else {
                password_params(word)
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(url("postgres://u:secret@h:5432/db"), "postgres://u:***@h:5432/db");
        assert_eq!(
            url("postgres://u@h/db?password=secret&sslmode=require"),
            "postgres://u@h/db?password=***&sslmode=require"
        );
        assert_eq!(url("postgres://h/db"), "postgres://h/db");
        assert_eq!(url("postgres://u:p@ss@h/db"), "postgres://u:***@h/db");
        // A multi-host URL: one user-info part before the hosts, and a password parameter.
        assert_eq!(
            url("postgres://u:secret@h1:5432,[::1]:5433,h3/db?target_session_attrs=read-write"),
            "postgres://u:***@h1:5432,[::1]:5433,h3/db?target_session_attrs=read-write"
        );
        assert_eq!(
            url("postgres://u@/db?host=h1,h2&password=secret&port=5432"),
            "postgres://u@/db?host=h1,h2&password=***&port=5432"
        );
        // A password with an unescaped delimiter is hidden whole.
        assert_eq!(url("postgres://u:se/cr?et@h1,h2/db"), "postgres://u:***@h1,h2/db");
        assert_eq!(
            url("postgres://u:s#x@h1:5432,h2/db"),
            "postgres://u:***@h1:5432,h2/db"
        );
        // Without user information nothing else is hidden.
        assert_eq!(
            url("postgres://h1:5432,h2/db?sslmode=require"),
            "postgres://h1:5432,h2/db?sslmode=require"
        );
        assert_eq!(
            secrets_in("cannot connect to postgres://u:hunter2@h/db: password=hunter2 refused"),
            "cannot connect to postgres://u:***@h/db: password=*** refused"
        );
    }
}
