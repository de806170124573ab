//! The ERB subset of a `sidekiq.yml`: `<%= %>` tags whose Ruby is an environment lookup.
//!
//! Expressions are parsed into a tree first and evaluated after, so `ENV["A"] || ENV.fetch("B")`
//! short-circuits as Ruby does and never complains about `B` when `A` is set. Messages name variables,
//! never their values, which may be secrets.

use crate::error::Error;

/// Evaluates the ERB of a `sidekiq.yml`: environment lookups only (see the module docs); any other tag
/// is an error naming its line.
pub fn render_erb(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<String, Error> {
    render(text, env).map_err(Error::Config)
}

/// A Ruby value the subset can produce.
#[derive(Debug, Clone, PartialEq)]
enum Val {
    Str(String),
    Int(i64),
    Float(f64),
    /// `nil`; `Some(name)` when it is the value of an unset `ENV[name]`, so using it can say which.
    Nil(Option<String>),
}

/// A method call the subset knows.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Method {
    ToI,
    ToF,
    ToS,
}

#[derive(Debug, Clone, PartialEq)]
enum Expr {
    Lit(Val),
    /// `ENV["X"]`: `nil` when unset.
    Env(String),
    /// `ENV.fetch("X", default)` or `ENV.fetch("X") { default }`: an error when unset without one.
    Fetch(String, Option<Box<Expr>>),
    Or(Box<Expr>, Box<Expr>),
    Call(Box<Expr>, Method),
}

type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// Renders the template; errors start with `line N:`.
pub(super) fn render(text: &str, env: Env<'_>) -> Result<String, String> {
    render_collecting(text, env, &mut Vec::new())
}

/// [`render`], pushing every value a tag printed onto `printed` (to keep them out of errors).
pub(super) fn render_collecting(
    text: &str,
    env: Env<'_>,
    printed: &mut Vec<String>,
) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut line = 1usize;
    while let Some(start) = rest.find("<%") {
        let before = &rest[..start];
        out.push_str(before);
        line += before.matches('\n').count();
        let after = &rest[start + 2..];
        // `<%%` is ERB's escape for a literal `<%`.
        if let Some(r) = after.strip_prefix('%') {
            out.push_str("<%");
            rest = r;
            continue;
        }
        let Some(end) = after.find("%>") else {
            return Err(format!(
                "line {line}: ERB tag opened here is never closed with %>"
            ));
        };
        let inner = &after[..end];
        let tag_line = line;
        line += inner.matches('\n').count();
        rest = &after[end + 2..];
        if inner.starts_with('#') {
            continue; // an ERB comment
        }
        let Some(code) = inner.strip_prefix('=') else {
            return Err(format!(
                "line {tag_line}: unsupported ERB tag `<%{}%>`: only `<%= ENV[...] %>` lookups are evaluated",
                shorten(inner)
            ));
        };
        let value = parse(code)
            .and_then(|e| eval(&e, env))
            .and_then(output)
            .map_err(|m| format!("line {tag_line}: {m} in `<%={}%>`", shorten(code)))?;
        out.push_str(&value);
        printed.push(value);
    }
    out.push_str(rest);
    Ok(out)
}

/// The tag's code as written (its spaces kept, so the message quotes the tag exactly), cut to 60
/// characters.
fn shorten(s: &str) -> String {
    if s.chars().count() > 60 {
        let cut: String = s.chars().take(57).collect();
        format!("{cut}...")
    } else {
        s.to_string()
    }
}

/// What `<%= %>` prints: `to_s` of the value.
fn output(v: Val) -> Result<String, String> {
    match call(v, Method::ToS)? {
        Val::Str(s) => Ok(s),
        _ => Ok(String::new()),
    }
}

fn eval(e: &Expr, env: Env<'_>) -> Result<Val, String> {
    match e {
        Expr::Lit(v) => Ok(v.clone()),
        Expr::Env(name) => Ok(match env(name) {
            Some(v) => Val::Str(v),
            None => Val::Nil(Some(name.clone())),
        }),
        Expr::Fetch(name, default) => match (env(name), default) {
            (Some(v), _) => Ok(Val::Str(v)),
            (None, Some(d)) => eval(d, env),
            (None, None) => Err(format!(
                "environment variable {name} is not set (ENV.fetch without a default)"
            )),
        },
        Expr::Or(a, b) => match eval(a, env)? {
            Val::Nil(_) => eval(b, env),
            v => Ok(v),
        },
        Expr::Call(target, m) => call(eval(target, env)?, *m),
    }
}

/// `nil` (an unset `ENV["X"]`) behaves as in Ruby: `to_s` is `""`, `to_i` is 0, `to_f` is 0.0.
fn call(v: Val, m: Method) -> Result<Val, String> {
    Ok(match (m, v) {
        (Method::ToI, Val::Str(s)) => Val::Int(ruby_to_i(&s)?),
        (Method::ToI, Val::Int(i)) => Val::Int(i),
        (Method::ToI, Val::Float(f)) => {
            if !f.is_finite() || f.abs() >= 9.2e18 {
                return Err(format!("{f} cannot be turned into an integer"));
            }
            Val::Int(f.trunc() as i64)
        }
        (Method::ToI, Val::Nil(_)) => Val::Int(0),
        (Method::ToF, Val::Str(s)) => Val::Float(ruby_to_f(&s)),
        (Method::ToF, Val::Int(i)) => Val::Float(i as f64),
        (Method::ToF, Val::Float(f)) => Val::Float(f),
        (Method::ToF, Val::Nil(_)) => Val::Float(0.0),
        (Method::ToS, Val::Str(s)) => Val::Str(s),
        (Method::ToS, Val::Int(i)) => Val::Str(i.to_string()),
        (Method::ToS, Val::Float(f)) => Val::Str(ruby_float(f)),
        (Method::ToS, Val::Nil(_)) => Val::Str(String::new()),
    })
}

/// Ruby's `String#to_i`: leading blanks, a sign, digits (single `_` between them); else 0.
fn ruby_to_i(s: &str) -> Result<i64, String> {
    let t = s.trim_start();
    let (neg, t) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let mut digits = String::new();
    let mut prev_digit = false;
    for c in t.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            prev_digit = true;
        } else if c == '_' && prev_digit {
            prev_digit = false;
        } else {
            break;
        }
    }
    if digits.is_empty() {
        return Ok(0);
    }
    let n: i64 = digits
        .parse()
        .map_err(|_| "a number too large for an integer".to_string())?;
    Ok(if neg { -n } else { n })
}

/// Ruby's `String#to_f`: the longest leading decimal number, else 0.0.
fn ruby_to_f(s: &str) -> f64 {
    let t = s.trim_start().as_bytes();
    let mut end = 0;
    if matches!(t.first(), Some(b'-' | b'+')) {
        end = 1;
    }
    let int_start = end;
    while t.get(end).is_some_and(u8::is_ascii_digit) {
        end += 1;
    }
    if end == int_start {
        return 0.0;
    }
    if t.get(end) == Some(&b'.') && t.get(end + 1).is_some_and(u8::is_ascii_digit) {
        end += 1;
        while t.get(end).is_some_and(u8::is_ascii_digit) {
            end += 1;
        }
    }
    if matches!(t.get(end), Some(b'e' | b'E')) {
        let mut e = end + 1;
        if matches!(t.get(e), Some(b'-' | b'+')) {
            e += 1;
        }
        if t.get(e).is_some_and(u8::is_ascii_digit) {
            while t.get(e).is_some_and(u8::is_ascii_digit) {
                e += 1;
            }
            end = e;
        }
    }
    std::str::from_utf8(&t[..end])
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0.0)
}

/// Ruby's `Float#to_s` for ordinary values: `5.0`, `2.5`.
fn ruby_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        }
    } else if f == f.trunc() && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        format!("{f}")
    }
}

fn parse(code: &str) -> Result<Expr, String> {
    let mut p = Parser { s: code, pos: 0 };
    let e = p.or_expr()?;
    p.ws();
    if p.pos < p.s.len() {
        return Err(format!("unexpected `{}`", p.s[p.pos..].trim()));
    }
    Ok(e)
}

const SUPPORTED: &str = "only ENV[\"NAME\"], ENV.fetch(\"NAME\", default), literals, `||` and .to_i/.to_f/.to_s are evaluated";

struct Parser<'a> {
    s: &'a str,
    pos: usize,
}

impl Parser<'_> {
    fn rest(&self) -> &str {
        &self.s[self.pos..]
    }

    fn ws(&mut self) {
        while self.rest().starts_with(|c: char| c.is_ascii_whitespace()) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, token: &str) -> bool {
        self.ws();
        if self.rest().starts_with(token) {
            self.pos += token.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, token: &str) -> Result<(), String> {
        if self.eat(token) {
            Ok(())
        } else {
            Err(format!("expected `{token}`"))
        }
    }

    fn ident(&mut self) -> &str {
        self.ws();
        let start = self.pos;
        while self
            .rest()
            .starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == '?' || c == '!')
        {
            self.pos += 1;
        }
        &self.s[start..self.pos]
    }

    fn or_expr(&mut self) -> Result<Expr, String> {
        let mut left = self.postfix()?;
        while self.eat("||") {
            let right = self.postfix()?;
            left = Expr::Or(Box::new(left), Box::new(right));
        }
        Ok(left)
    }

    fn postfix(&mut self) -> Result<Expr, String> {
        let mut e = self.primary()?;
        while self.eat(".") {
            let m = match self.ident() {
                "to_i" => Method::ToI,
                "to_f" => Method::ToF,
                "to_s" => Method::ToS,
                other => return Err(format!("unsupported method `.{other}`: {SUPPORTED}")),
            };
            if self.eat("(") {
                self.expect(")")?;
            }
            e = Expr::Call(Box::new(e), m);
        }
        Ok(e)
    }

    fn primary(&mut self) -> Result<Expr, String> {
        self.ws();
        if self.eat("(") {
            let e = self.or_expr()?;
            self.expect(")")?;
            return Ok(e);
        }
        let rest = self.rest();
        if rest.starts_with('"') || rest.starts_with('\'') {
            return Ok(Expr::Lit(Val::Str(self.string()?)));
        }
        if rest.starts_with(|c: char| c.is_ascii_digit())
            || (rest.starts_with('-') && rest[1..].starts_with(|c: char| c.is_ascii_digit()))
        {
            return self.number();
        }
        let word = self.ident().to_string();
        match word.as_str() {
            "nil" => Ok(Expr::Lit(Val::Nil(None))),
            "ENV" => self.env(),
            "" => Err(format!("unsupported expression: {SUPPORTED}")),
            other => Err(format!("unsupported expression `{other}`: {SUPPORTED}")),
        }
    }

    /// After `ENV`: `["X"]` or `.fetch("X"[, default]) [{ default }]`.
    fn env(&mut self) -> Result<Expr, String> {
        if self.eat("[") {
            let name = self.string()?;
            self.expect("]")?;
            return Ok(Expr::Env(name));
        }
        let at = self.pos;
        if self.eat(".") && self.ident() == "fetch" {
            self.expect("(")?;
            let name = self.string()?;
            let mut default = None;
            if self.eat(",") {
                default = Some(Box::new(self.or_expr()?));
            }
            self.expect(")")?;
            // A block supersedes the default argument in Ruby.
            if self.eat("{") {
                if self.rest().trim_start().starts_with('|') {
                    return Err(format!("block parameters are not supported: {SUPPORTED}"));
                }
                default = Some(Box::new(self.or_expr()?));
                self.expect("}")?;
            }
            return Ok(Expr::Fetch(name, default));
        }
        self.pos = at;
        Err(format!("unsupported use of ENV: {SUPPORTED}"))
    }

    fn string(&mut self) -> Result<String, String> {
        self.ws();
        let quote = match self.rest().chars().next() {
            Some(q @ ('"' | '\'')) => q,
            _ => return Err("expected a quoted string".into()),
        };
        self.pos += 1;
        let mut out = String::new();
        let mut chars = self.rest().char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                c if c == quote => {
                    self.pos += i + 1;
                    return Ok(out);
                }
                '\\' => {
                    let Some((_, next)) = chars.next() else { break };
                    match (quote, next) {
                        ('\'', '\'' | '\\') => out.push(next),
                        ('\'', other) => {
                            out.push('\\');
                            out.push(other);
                        }
                        ('"', 'n') => out.push('\n'),
                        ('"', 't') => out.push('\t'),
                        ('"', 'r') => out.push('\r'),
                        ('"', 's') => out.push(' '),
                        ('"', '0') => out.push('\0'),
                        (_, other) => out.push(other),
                    }
                }
                '#' if quote == '"' && self.s[self.pos + i..].starts_with("#{") => {
                    return Err("string interpolation is not supported".into());
                }
                c => out.push(c),
            }
        }
        Err("a string is never closed".into())
    }

    fn number(&mut self) -> Result<Expr, String> {
        let start = self.pos;
        let b = self.s.as_bytes();
        let mut end = self.pos;
        if b.get(end) == Some(&b'-') {
            end += 1;
        }
        while b.get(end).is_some_and(|c| c.is_ascii_digit() || *c == b'_') {
            end += 1;
        }
        let mut float = false;
        if b.get(end) == Some(&b'.') && b.get(end + 1).is_some_and(u8::is_ascii_digit) {
            float = true;
            end += 1;
            while b.get(end).is_some_and(|c| c.is_ascii_digit() || *c == b'_') {
                end += 1;
            }
        }
        if matches!(b.get(end), Some(b'e' | b'E')) {
            float = true;
            end += 1;
            if matches!(b.get(end), Some(b'-' | b'+')) {
                end += 1;
            }
            while b.get(end).is_some_and(u8::is_ascii_digit) {
                end += 1;
            }
        }
        self.pos = end;
        let text: String = self.s[start..end].chars().filter(|c| *c != '_').collect();
        if float {
            text.parse::<f64>()
                .map(|f| Expr::Lit(Val::Float(f)))
                .map_err(|_| format!("bad number `{text}`"))
        } else {
            text.parse::<i64>()
                .map(|i| Expr::Lit(Val::Int(i)))
                .map_err(|_| format!("bad number `{text}`"))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn with(vars: &[(&str, &str)], text: &str) -> Result<String, String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        render(text, &move |k| map.get(k).cloned())
    }

    #[test]
    fn every_supported_lookup_form_reads_the_environment() {
        let v = [("X", "7")];
        for code in [
            r#"ENV["X"]"#,
            "ENV['X']",
            r#"ENV.fetch("X", 5)"#,
            r#"ENV.fetch("X") { 5 }"#,
            r#"ENV["X"] || 5"#,
            r#"ENV["X"].to_i"#,
            r#"ENV.fetch("X", "3").to_i"#,
            r#"(ENV["X"] || 5).to_i"#,
        ] {
            assert_eq!(
                with(&v, &format!("c: <%= {code} %>")).unwrap(),
                "c: 7",
                "{code}"
            );
        }
    }

    #[test]
    fn defaults_apply_when_the_variable_is_unset() {
        assert_eq!(with(&[], r#"<%= ENV.fetch("X", 5) %>"#).unwrap(), "5");
        assert_eq!(with(&[], r#"<%= ENV.fetch("X") { 6 } %>"#).unwrap(), "6");
        assert_eq!(with(&[], r#"<%= ENV.fetch("X", "str") %>"#).unwrap(), "str");
        assert_eq!(with(&[], r#"<%= ENV["X"] || 5 %>"#).unwrap(), "5");
        assert_eq!(
            with(&[], r#"<%= ENV["X"] || ENV["Y"] || 'z' %>"#).unwrap(),
            "z"
        );
        assert_eq!(with(&[], r#"<%= ENV.fetch("X", 2.5) %>"#).unwrap(), "2.5");
        assert_eq!(
            with(&[], r#"<%= ENV.fetch("X", "2.0").to_f %>"#).unwrap(),
            "2.0"
        );
    }

    #[test]
    fn or_short_circuits_so_an_unneeded_fetch_is_not_an_error() {
        assert_eq!(
            with(&[("A", "a")], r#"<%= ENV["A"] || ENV.fetch("B") %>"#).unwrap(),
            "a"
        );
    }

    #[test]
    fn to_i_reads_a_leading_integer_like_ruby() {
        assert_eq!(
            with(&[("X", " 12abc")], r#"<%= ENV["X"].to_i %>"#).unwrap(),
            "12"
        );
        assert_eq!(
            with(&[("X", "abc")], r#"<%= ENV["X"].to_i %>"#).unwrap(),
            "0"
        );
        assert_eq!(
            with(&[("X", "-1_000")], r#"<%= ENV["X"].to_i %>"#).unwrap(),
            "-1000"
        );
    }

    #[test]
    fn an_unset_variable_is_nil_as_in_ruby_and_a_fetch_without_default_an_error() {
        assert_eq!(
            with(&[], r#"a: "<%= ENV["MISSING_X"] %>""#).unwrap(),
            r#"a: """#
        );
        assert_eq!(with(&[], r#"<%= ENV["MISSING_X"].to_i %>"#).unwrap(), "0");
        assert_eq!(with(&[], r#"<%= ENV["MISSING_X"].to_f %>"#).unwrap(), "0.0");
        let e = with(&[], "a: 1\nb: <%= ENV.fetch(\"MISSING_X\") %>\n").unwrap_err();
        assert!(e.starts_with("line 2:"), "{e}");
        assert!(e.contains("MISSING_X"), "{e}");
        assert!(
            e.contains(r#"`<%= ENV.fetch("MISSING_X") %>`"#),
            "the tag as written: {e}"
        );
    }

    #[test]
    fn other_ruby_is_an_error_naming_its_line() {
        for tag in [
            "<%= Rails.env %>",
            "<% if true %>",
            "<%= ENV.keys %>",
            "<%= `id` %>",
            "<%= 1 + 1 %>",
        ] {
            let e = with(&[], &format!("a: 1\n\nb: {tag}\n")).unwrap_err();
            assert!(e.starts_with("line 3:"), "{tag}: {e}");
        }
    }

    #[test]
    fn comments_and_escapes_are_plain_erb() {
        assert_eq!(with(&[], "a<%# note %>b <%% c").unwrap(), "ab <% c");
    }

    #[test]
    fn an_unclosed_tag_is_an_error() {
        assert!(
            with(&[], "\n<%= ENV['X']")
                .unwrap_err()
                .starts_with("line 2:")
        );
    }

    #[test]
    fn errors_never_contain_variable_values() {
        let e = with(&[("S", "hunter2")], r#"<%= ENV["S"].upcase %>"#).unwrap_err();
        assert!(!e.contains("hunter2"), "{e}");
    }
}
