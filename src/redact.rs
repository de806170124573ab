//! Secrets kept out of logs and errors: the passwords of Redis URLs ([`redact_url`], and every URL in
//! free text, [`redact_urls_in`]) and the quoted values of serde's messages ([`redact_values`]), which
//! may be a job's arguments.
//!
//! A support module at the bottom of the ladder (docs/layout.md): it uses nothing of the crate, so the
//! connection, Sentinel, the config, logging and the registry's argument errors can all call it.

/// Query parameters whose value is a secret: redis-rs reads `pass` for `redis+unix://` and `unix://`
/// URLs; `password` and the others are what people write by analogy, and hiding them costs nothing.
const SECRET_PARAMS: [&str; 7] = [
    "pass", "password", "passwd", "pwd", "secret", "token", "auth",
];

/// The URL with every password in it replaced by `REDACTED`, for logs and errors. One function for
/// every form a Redis URL takes:
///
/// - `redis://user:pw@host:port/db`, `rediss://...`, and a user part alone (`redis://pw@host`:
///   redis-rs reads it as a user name, but people write passwords there, so it is hidden too);
/// - no scheme at all (`user:pw@host:port`, which redis-rs refuses, so it shows up in errors);
/// - a password in the query: `redis+unix:///path?user=u&pass=pw`, `unix:///path?pass=pw`,
///   `redis://host?password=pw`, and `passwd`, `pwd`, `secret`, `token`, `auth` likewise.
///
/// The user part ends at the last `@` before the first secret query parameter, even for a password
/// with an unencoded `/`, `?` or `#` in it (a URL that does not parse is shown in errors too): no `@`
/// ever appears in the host or path of a Redis URL, so the rule never hides more than the password,
/// and an `@` inside a query password stays inside the hidden value.
pub(crate) fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => (&url[..i + 3], &url[i + 3..]),
        None => ("", url),
    };
    let user_part_ends_before = secret_param_start(rest).unwrap_or(rest.len());
    let (user, rest) = match rest[..user_part_ends_before].rfind('@') {
        Some(at) => {
            let userinfo = &rest[..at];
            let shown = match userinfo.find(':') {
                Some(c) => format!("{}:REDACTED@", &userinfo[..c]),
                None => "REDACTED@".to_string(),
            };
            (shown, &rest[at + 1..])
        }
        None => (String::new(), rest),
    };
    format!("{scheme}{user}{}", redact_query(rest))
}

/// `text` with every word that may be a Redis URL (it holds `://` or `@`) passed through
/// [`redact_url`]: for free text such as a panic message, where a URL could appear anywhere.
pub(crate) fn redact_urls_in(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        let word = &rest[..end];
        if word.contains("://") || word.contains('@') {
            out.push_str(&redact_url(word));
        } else {
            out.push_str(word);
        }
        let spaces = rest[end..]
            .find(|c: char| !c.is_whitespace())
            .map_or(rest.len(), |n| end + n);
        out.push_str(&rest[end..spaces]);
        rest = &rest[spaces..];
    }
    out
}

/// Where the first `?name=` or `&name=` with a name of [`SECRET_PARAMS`] starts.
fn secret_param_start(s: &str) -> Option<usize> {
    s.char_indices()
        .filter(|(_, c)| matches!(c, '?' | '&'))
        .map(|(i, _)| i)
        .find(|&i| {
            let after = &s[i + 1..];
            after
                .split_once('=')
                .is_some_and(|(key, _)| is_secret_param(key))
        })
}

fn is_secret_param(key: &str) -> bool {
    SECRET_PARAMS
        .iter()
        .any(|s| key.trim().eq_ignore_ascii_case(s))
}

/// `host/path?a=1&pass=pw#insecure` with the values of [`SECRET_PARAMS`] hidden. A secret value runs
/// to the next `&` or the end, `#` included (a password may hold one), except a final `#insecure`.
fn redact_query(rest: &str) -> String {
    let Some(q) = rest.find('?') else {
        return rest.to_string();
    };
    let mut out = rest[..=q].to_string();
    for (i, param) in rest[q + 1..].split('&').enumerate() {
        if i > 0 {
            out.push('&');
        }
        let key = param.split('=').next().unwrap_or("");
        let secret = param.contains('=') && is_secret_param(key);
        if secret {
            out.push_str(key);
            out.push_str("=REDACTED");
            if param.ends_with("#insecure") {
                out.push_str("#insecure");
            }
        } else {
            out.push_str(param);
        }
    }
    out
}

/// serde's message with the quoted values blanked (`invalid type: string "…", expected u64`): error
/// messages are logged, and job arguments must not be.
pub fn redact_values(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut open: Option<char> = None;
    for ch in message.chars() {
        match open {
            Some(q) if ch == q => {
                out.push('…');
                out.push(ch);
                open = None;
            }
            Some(_) => {}
            None => {
                out.push(ch);
                if ch == '"' || ch == '`' {
                    open = Some(ch);
                }
            }
        }
    }
    if open.is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_appear_in_a_redacted_url() {
        assert_eq!(
            redact_url("redis://app:s3cret@h:6380/2"),
            "redis://app:REDACTED@h:6380/2"
        );
        assert_eq!(redact_url("rediss://:s3cret@h"), "rediss://:REDACTED@h");
        assert_eq!(redact_url("redis://h:1"), "redis://h:1");
        assert_eq!(
            redact_url("rediss://app:s3cret@h:6380/0#insecure"),
            "rediss://app:REDACTED@h:6380/0#insecure"
        );
    }

    #[test]
    fn every_url_form_hides_its_password() {
        let pw = "s3cr3t-Pw";
        for (url, shown) in [
            (
                "redis+unix:///run/redis.sock?user=u&pass=s3cr3t-Pw",
                "redis+unix:///run/redis.sock?user=u&pass=REDACTED",
            ),
            (
                "redis+unix:///run/redis.sock?pass=s3cr3t-Pw&db=2",
                "redis+unix:///run/redis.sock?pass=REDACTED&db=2",
            ),
            (
                "unix:///run/redis.sock?pass=s3cr3t-Pw",
                "unix:///run/redis.sock?pass=REDACTED",
            ),
            ("app:s3cr3t-Pw@h:6379", "app:REDACTED@h:6379"),
            ("s3cr3t-Pw@h:6379", "REDACTED@h:6379"),
            (
                "redis://h:6379/0?password=s3cr3t-Pw",
                "redis://h:6379/0?password=REDACTED",
            ),
            (
                "redis://h:6379/0?Password=s3cr3t-Pw#insecure",
                "redis://h:6379/0?Password=REDACTED#insecure",
            ),
            ("redis://s3cr3t-Pw@h", "redis://REDACTED@h"),
            (
                "rediss://u:s3cr3t-Pw@h?pass=s3cr3t-Pw",
                "rediss://u:REDACTED@h?pass=REDACTED",
            ),
            // An `@` inside a query password stays inside the hidden value.
            (
                "redis+unix:///s.sock?pass=s3cr@t-Pw",
                "redis+unix:///s.sock?pass=REDACTED",
            ),
            (
                "redis://h?password=a@s3cr3t-Pw",
                "redis://h?password=REDACTED",
            ),
        ] {
            let got = redact_url(url);
            assert_eq!(got, shown, "{url}");
            assert!(!got.contains(pw) && !got.contains("s3cr@t"), "{got}");
        }
    }

    #[test]
    fn urls_in_free_text_are_redacted_and_the_rest_is_kept() {
        assert_eq!(
            redact_urls_in("cannot use `redis://u:pw1234@h:1/0` now\n  (unix:///s?pass=pw1234)"),
            "cannot use `redis://u:REDACTED@h:1/0` now\n  (unix:///s?pass=REDACTED"
        );
        assert_eq!(redact_urls_in("plain words"), "plain words");
    }

    #[test]
    fn a_password_with_unencoded_delimiters_is_still_redacted() {
        for (url, shown) in [
            ("redis://app:pa/ss@h:1/0", "redis://app:REDACTED@h:1/0"),
            ("redis://app:pa#ss@h", "redis://app:REDACTED@h"),
            ("redis://app:p@ss@h", "redis://app:REDACTED@h"),
            ("redis://:pa?ss@h", "redis://:REDACTED@h"),
        ] {
            assert_eq!(redact_url(url), shown);
        }
    }

    #[test]
    fn quoted_values_are_blanked_in_argument_errors() {
        let e = serde_json::from_str::<(u64,)>(r#"["SECRET"]"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("SECRET"));
        let r = redact_values(&e);
        assert!(!r.contains("SECRET"), "{r}");
        assert!(r.contains("expected u64"), "{r}");
        let e = serde_json::from_str::<(String,)>("[12345]")
            .unwrap_err()
            .to_string();
        assert!(!redact_values(&e).contains("12345"));
    }
}
