//! What we print or store of text that is secret or untrusted: Redis URLs with their passwords
//! hidden, and names from payloads clipped to a bounded length.
//!
//! - [`redact_url`] / [`redact_urls_in`]: a Redis URL's password (and secret query parameters)
//!   replaced by `REDACTED`, in a URL or anywhere in free text (error and panic messages).
//! - [`redact_values`]: the quoted values of serde's messages blanked (they may be a job's
//!   arguments).
//! - [`clip`]: a name from a payload cut to a bounded length for log lines.
//!
//! Layer: support (beside `logging`'s formatting); depends on nothing internal, so every layer above
//! applies the same rules.

use std::borrow::Cow;

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

/// `text` with the password of every Redis URL in it hidden, for free text such as a panic or job
/// error message, where a URL can appear anywhere: one rule for every error text we store
/// (`error_message`) or print.
///
/// A URL runs from its scheme (`redis://`, `rediss://`, `unix://`, ...) to the end of its line or
/// the next URL, and goes through [`redact_url`] whole: a password may hold spaces
/// (`redis://:my pw@h`), so the user part ends at the last `@` of that stretch, never at a space.
/// That can hide more than the password (text up to an e-mail address later on the line), never
/// less. Outside URLs, a word holding `@` is taken for a URL without a scheme (`user:pw@host`).
pub(crate) fn redact_urls_in(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let mut rest = line;
        while let Some(start) = url_start(rest) {
            redact_words(&rest[..start], &mut out);
            let url = &rest[start..];
            let end = url_start(&url[3..]).map_or(url.len(), |n| n + 3);
            let (url, newline) = match url[..end].strip_suffix('\n') {
                Some(u) => (u, "\n"),
                None => (&url[..end], ""),
            };
            out.push_str(&redact_url(url));
            out.push_str(newline);
            rest = &rest[start + end..];
        }
        redact_words(rest, &mut out);
    }
    out
}

/// Where the first URL of `text` starts: the scheme before its first `://`.
fn url_start(text: &str) -> Option<usize> {
    let sep = text.find("://")?;
    let scheme = text[..sep]
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
        .map_or(0, |i| i + 1);
    Some(scheme)
}

/// Appends `text` (with no URL scheme in it), each word holding `@` through [`redact_url`].
fn redact_words(text: &str, out: &mut String) {
    let mut rest = text;
    while !rest.is_empty() {
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        let word = &rest[..end];
        if word.contains('@') {
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

/// How much of a name from a payload (a class, a jid) a log line shows.
pub(crate) const NAME_CHARS: usize = 200;

/// `s` cut to at most `max` characters, with `…(N bytes)` saying how long it was: a class name or a
/// jid from a payload can be megabytes, and a log line or a remembered set must not be.
pub(crate) fn clip(s: &str, max: usize) -> Cow<'_, str> {
    if s.len() <= max {
        return Cow::Borrowed(s);
    }
    match s.char_indices().nth(max) {
        Some((i, _)) => Cow::Owned(format!("{}…({} bytes)", &s[..i], s.len())),
        None => Cow::Borrowed(s),
    }
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
    fn a_password_with_spaces_in_free_text_is_hidden_whole() {
        for (text, pw) in [
            ("boom: redis://:my PANIC3@h:1/0 failed", "PANIC3"),
            ("x redis://u:a b c@h and rediss://v:d e@h2", "b c"),
            (
                "pool(redis://u:s3cr3t@h)\nnext unix:///s?pass=two words",
                "two",
            ),
            ("plain u:s3cr3t@h:6379", "s3cr3t"),
        ] {
            let got = redact_urls_in(text);
            assert!(!got.contains(pw), "{got}");
            assert!(got.contains("REDACTED"), "{got}");
        }
        assert_eq!(
            redact_urls_in("boom: redis://:my PANIC3@h:1/0 failed\nsecond line"),
            "boom: redis://:REDACTED@h:1/0 failed\nsecond line"
        );
        assert_eq!(
            redact_urls_in("x redis://u:a b c@h and rediss://v:d e@h2"),
            "x redis://u:REDACTED@h and rediss://v:REDACTED@h2"
        );
        assert_eq!(redact_urls_in("no url: h:1/0"), "no url: h:1/0");
    }
    #[test]
    fn clip_keeps_short_text_and_says_how_long_the_long_was() {
        assert_eq!(super::clip("abc", 3), "abc");
        assert_eq!(super::clip("abcd", 3), "abc…(4 bytes)");
        assert_eq!(super::clip("ééé", 2), "éé…(6 bytes)");
    }

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
