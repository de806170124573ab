//! The fuzz oracle: [`scan`](super::reader::scan) held to serde_json's reading of the same text.

use super::reader::scan;
use super::*;

/// Reads `raw` with [`scan`] and with serde_json: `Ok(found)` when they agree (`found`: [`scan`]
/// read it and found `job_data`), or when [`scan`] refused it; `Err` says how they differ. The tests
/// and the fuzz target (`crate::fuzzing`) hold [`scan`] to this.
#[cfg(any(test, fuzzing))]
pub(crate) fn both_ways(raw: &str) -> Result<bool, String> {
    let plain = Header::read_plain(raw);
    match (scan(raw), plain) {
        (None, _) => Ok(false),
        (Some(mut s), Ok(p)) => {
            let found = s.job_data.is_some();
            notes_hold(raw, &s)?;
            // What only the hand-written reader notes (serde_json's reading leaves each unknown),
            // checked above.
            s.job_data = None;
            s.plain = 0;
            s.activejob = false;
            s.named = p.named;
            if s == p {
                Ok(found)
            } else {
                Err(format!("scan {s:?} / serde {p:?}"))
            }
        }
        (Some(s), Err(e)) => Err(format!("scan {s:?} / serde error {e}")),
    }
}

/// What [`scan`] notes beyond the fields, held to serde_json's reading of `raw`: each `plain` bit
/// names a string field without a backslash; each `named` bit says exactly whether the payload has
/// that top-level key; the `job_data` fields are the texts of those keys of the one hash in `args`, and
/// their `plain` bits name strings without a backslash.
#[cfg(any(test, fuzzing))]
pub(super) fn notes_hold(raw: &str, s: &Header<'_>) -> Result<(), String> {
    use std::collections::HashMap;
    let unescaped = |text: Option<&str>| {
        text.is_some_and(|t| t.len() >= 2 && t.starts_with('"') && !t.contains('\\'))
    };
    for (bit, text) in [
        (CLASS, s.class),
        (JID, s.jid),
        (QUEUE, s.queue),
        (WRAPPED, s.wrapped),
    ] {
        if s.plain & bit != 0 && !unescaped(text) {
            return Err(format!("plain bit {bit} on {text:?}"));
        }
    }
    let wrapper = s
        .class
        .and_then(|c| c.strip_prefix('"')?.strip_suffix('"'))
        .is_some_and(|c| super::super::ACTIVEJOB_WRAPPERS.contains(&c));
    if s.activejob != wrapper {
        return Err(format!(
            "activejob noted {}, class {:?}",
            s.activejob, s.class
        ));
    }
    // Keys borrowed (scan refused any with an escape) and values left as text, as `Plain` reads them.
    let top: HashMap<&str, &RawValue> = serde_json::from_str(raw).map_err(|e| e.to_string())?;
    for (bit, names) in [
        (UNIQUE_KEY, &[UNIQUE_KEY_FIELD][..]),
        (TIMEOUT, &[TIMEOUT_FIELD][..]),
        (GEM_LOCK, &GEM_LOCK_KEYS[..]),
    ] {
        let present = names.iter().any(|n| top.contains_key(n));
        if (s.named & bit != 0) != present {
            return Err(format!(
                "{names:?} noted {}, present {present}",
                s.named & bit != 0
            ));
        }
    }
    let Some(jd) = s.job_data else {
        return Ok(());
    };
    // The one hash of `args`, its fields as texts (no key of it has an escape when the reader noted
    // its fields; serde_json keeps the last of a duplicate key, the reader gives up on a duplicate of
    // the four, so the texts agree).
    let hashes: Vec<HashMap<&str, &RawValue>> =
        serde_json::from_str(s.args.ok_or("job_data without args")?).map_err(|e| e.to_string())?;
    let [hash] = hashes.as_slice() else {
        return Err(format!("job_data noted in {} hashes", hashes.len()));
    };
    let get = |k: &str| hash.get(k).map(|v| v.get());
    for (name, noted, bit) in [
        ("job_class", jd.job_class, Some(JOB_CLASS)),
        ("job_id", jd.job_id, Some(JOB_ID)),
        ("executions", jd.executions, None),
        ("arguments", jd.arguments, None),
    ] {
        if noted != get(name) {
            return Err(format!(
                "job_data {name}: noted {noted:?}, serde {:?}",
                get(name)
            ));
        }
        if let Some(bit) = bit
            && jd.plain & bit != 0
            && !unescaped(noted)
        {
            return Err(format!("job_data plain bit {bit} on {noted:?}"));
        }
    }
    Ok(())
}
