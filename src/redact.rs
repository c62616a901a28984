//! Keeping the database password out of everything fine-settler prints: logs, error messages, reports and
//! `check-config`.

/// The URL with any password replaced by `***` (in the user-info part and in a `password=` parameter).
pub fn url(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return password_params(url);
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let redacted_authority = match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            match userinfo.find(':') {
                Some(colon) => format!("{}:***{}", &userinfo[..colon], &authority[at..]),
                None => authority.to_string(),
            }
        }
        None => authority.to_string(),
    };
    format!(
        "{}{}{}",
        &url[..scheme_end],
        redacted_authority,
        password_params(&rest[authority_end..])
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
        assert_eq!(
            secrets_in("cannot connect to postgres://u:hunter2@h/db: password=hunter2 refused"),
            "cannot connect to postgres://u:***@h/db: password=*** refused"
        );
    }
}
