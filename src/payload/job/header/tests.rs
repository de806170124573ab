use rand::{Rng, SeedableRng};

use super::fields::*;
use super::oracle::*;
use super::reader::*;
use super::*;

/// Every recorded payload (`fixtures/`, Sidekiq 6.4 to 8.1 and Rails 6.1).
fn recorded() -> Vec<String> {
    crate::test_support::fixture_files("")
        .into_iter()
        .map(|(_, text)| text)
        .filter(|text| text.trim_start().starts_with('{'))
        .collect()
}

#[test]
fn every_recorded_payload_is_read_by_scan_as_serde_reads_it() {
    let payloads = recorded();
    assert!(payloads.len() >= 20, "{} fixtures", payloads.len());
    for raw in &payloads {
        assert!(scan(raw).is_some(), "scan refused {raw}");
        both_ways(raw).unwrap();
    }
}

#[test]
fn scan_refuses_what_it_does_not_read_exactly() {
    for raw in [
        r#"{"class":"A","class":"B","args":[]}"#,
        r#"{"class":null,"class":"B","args":[]}"#,
        r#"{"class":"A","args":null}"#,
        r#"{"cl\u0061ss":"A","args":[]}"#,
        r#"{"class":"A","args":[01]}"#,
        r#"{"class":"A","args":["\x"]}"#,
        r#"{"class":"A","args":[1,]}"#,
        r#"{"class":"A","args":[]} x"#,
        "{\"class\":\"A\",\"args\":[\"\u{1}\"]}",
    ] {
        assert!(scan(raw).is_none(), "{raw}");
    }
    let deep = format!(
        r#"{{"class":"A","args":{}{}}}"#,
        "[".repeat(MAX_DEPTH),
        "]".repeat(MAX_DEPTH)
    );
    assert!(scan(&deep).is_none());
    assert!(Header::read(&deep).is_ok());
}

/// Recorded payloads with bytes replaced, inserted or removed: whatever `scan` accepts, serde_json
/// accepts too and reads the same.
#[test]
fn mutated_payloads_are_never_accepted_by_scan_alone() {
    let seed = rand::random::<u64>();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let payloads = recorded();
    let alphabet = b"{}[]\",:\\ \t\n0123456789.-+eEtrufalsn\x01\x1fuA";
    let mut accepted = 0;
    for _ in 0..20_000 {
        let mut b = payloads[rng.random_range(0..payloads.len())]
            .clone()
            .into_bytes();
        for _ in 0..rng.random_range(1..4) {
            let at = rng.random_range(0..b.len());
            let c = alphabet[rng.random_range(0..alphabet.len())];
            match rng.random_range(0..3) {
                0 => b[at] = c,
                1 => b.insert(at, c),
                _ => {
                    b.remove(at);
                }
            }
        }
        let Ok(raw) = String::from_utf8(b) else {
            continue;
        };
        if let Err(e) = both_ways(&raw) {
            panic!("seed {seed}: {raw}: {e}");
        }
        accepted += usize::from(scan(&raw).is_some());
    }
    // Many mutations land inside strings and keep the payload valid.
    assert!(accepted > 1_000, "seed {seed}: {accepted}");
}

/// The word-at-a-time digit run stops exactly where a byte-by-byte one does: every byte value
/// after 0 to 19 digits (so at every place of a word and past one), and random runs of bytes.
#[test]
fn digit_runs_end_where_the_byte_loop_ends() {
    let by_bytes = |b: &[u8]| b.iter().take_while(|c| c.is_ascii_digit()).count();
    let check = |b: &[u8], from: usize| {
        let mut r = Reader { s: "", b, i: from };
        let n = r.digits();
        let expected = by_bytes(b.get(from..).unwrap_or_default());
        assert_eq!((n, r.i), (expected, from + expected), "{b:?} from {from}");
    };
    for run in 0..20 {
        for stop in 0..=255u8 {
            for tail in [&b""[..], b"5", b"0123456789"] {
                let mut b: Vec<u8> = (0..run).map(|k| b'0' + (k % 10) as u8).collect();
                b.push(stop);
                b.extend_from_slice(tail);
                check(&b, 0);
                check(&b, run.min(3));
            }
        }
    }
    let seed = rand::random::<u64>();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let alphabet = b"0123456789/:.eE-+\x00\x7f\x80\xb9\xba\xff ";
    for _ in 0..50_000 {
        let len = rng.random_range(0..24);
        let b: Vec<u8> = (0..len)
            .map(|_| {
                if rng.random_bool(0.8) {
                    b'0' + rng.random_range(0..10)
                } else {
                    alphabet[rng.random_range(0..alphabet.len())]
                }
            })
            .collect();
        let from = rng.random_range(0..=len);
        let r = std::panic::catch_unwind(|| check(&b, from));
        assert!(r.is_ok(), "seed {seed}");
    }
}

/// The literals `wrapper_at` compares are the wrappers' names, quoted; a name cut short, run on or
/// escaped is not one.
#[test]
fn wrapper_literals_are_the_wrappers() {
    for name in super::super::ACTIVEJOB_WRAPPERS {
        let quoted = format!("\"{name}\"");
        assert_eq!(wrapper_at(quoted.as_bytes(), 0), quoted.len(), "{name}");
        let padded = format!("xx{quoted},");
        assert_eq!(wrapper_at(padded.as_bytes(), 2), quoted.len(), "{name}");
        assert_eq!(wrapper_at(&quoted.as_bytes()[..quoted.len() - 1], 0), 0);
        let longer = format!("\"{name}X\"");
        assert_eq!(wrapper_at(longer.as_bytes(), 0), 0);
        let escaped = quoted.replacen('A', "\\u0041", 1);
        assert_eq!(wrapper_at(escaped.as_bytes(), 0), 0);
    }
    assert_eq!(wrapper_at(b"\"NoopJob\"", 0), 0);
}

/// The literals `rails_key_at` compares are the table's, each at its own place.
#[test]
fn rails_keys_are_compared_in_their_order() {
    for (at, lit) in RAILS_KEYS.iter().enumerate() {
        for next in 0..=RAILS_KEYS.len() {
            let want = if next == at { lit.len() } else { 0 };
            assert_eq!(rails_key_at(lit, 0, next), want, "key {at} at {next}");
        }
        // Cut short, or one byte off: no match.
        assert_eq!(rails_key_at(&lit[..lit.len() - 1], 0, at), 0);
        let mut off = lit.to_vec();
        off[lit.len() / 2] ^= 1;
        assert_eq!(rails_key_at(&off, 0, at), 0);
    }
}
