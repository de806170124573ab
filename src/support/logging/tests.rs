use super::escape::printable_ascii;
use super::text::{needs_quotes, plain_value, stamp_at, stamp_now};
use super::*;

/// Issue 43 item 6: every field's value, the message too, is clipped to [`MAX_VALUE_CHARS`] in
/// both formats and in the job span (a 1 MB value made a 1 MB line); short values are untouched.
#[test]
fn every_value_of_a_log_line_is_clipped_as_it_is_where_stored() {
    let huge = "x".repeat(1_000_000);
    for format in [LogFormat::Text, LogFormat::Json] {
        let out = captured(format, || {
            let span = tracing::info_span!(target: JOB_TARGET, "job", class = huge.as_str(), jid = "j", queue = "q");
            let _in = span.enter();
            tracing::warn!(error_message = %huge, cursor = huge.as_str(), short = "kept", "failed: {huge}");
        });
        assert!(
            out.len() < 5 * (MAX_VALUE_CHARS + 100),
            "{format:?}: a {} byte line",
            out.len()
        );
        assert!(out.contains("…(1000000 bytes)"), "{format:?}");
        assert!(out.contains("kept"), "{format:?}");
        if format == LogFormat::Json {
            serde_json::from_str::<serde_json::Value>(out.trim()).expect("one JSON line");
        }
    }
}

/// The eight-at-a-time test agrees with a byte-by-byte one for each of the three bytes at every
/// position of values of every length up to three words, beside multi-byte characters and bytes
/// one off from the three.
#[test]
fn needs_quotes_finds_a_space_an_equals_sign_or_a_quote_anywhere() {
    let slow = |v: &[u8]| v.iter().any(|b| matches!(b, b' ' | b'=' | b'"'));
    for len in 0..=24 {
        for fill in ["a", "é", "!", "<", "#", "\u{7f}", "\u{a0}"] {
            let base: Vec<u8> = fill.as_bytes().iter().copied().cycle().take(len).collect();
            assert_eq!(needs_quotes(&base), slow(&base), "{base:?}");
            for at in 0..len {
                for c in [b' ', b'=', b'"', b'!', b'<', b'#', b'\x1f'] {
                    let mut v = base.clone();
                    v[at] = c;
                    assert_eq!(needs_quotes(&v), slow(&v), "{v:?}");
                }
            }
        }
    }
}

#[test]
fn plain_value_is_printable_and_unquoted_in_one_scan() {
    let slow = |v: &[u8]| printable_ascii(v) && !needs_quotes(v);
    for len in 0..=24 {
        for fill in ["a", "é", "!", "<", "#", "~", "\u{7f}", "\u{a0}"] {
            let base: Vec<u8> = fill.as_bytes().iter().copied().cycle().take(len).collect();
            assert_eq!(plain_value(&base), slow(&base), "{base:?}");
            for at in 0..len {
                for c in [
                    b' ', b'=', b'"', b'!', b'<', b'#', b'~', b'\x1f', b'\x7f', b'\x80', 0, b'\\',
                ] {
                    let mut v = base.clone();
                    v[at] = c;
                    assert_eq!(plain_value(&v), slow(&v), "{v:?}");
                }
            }
        }
    }
}

/// What `log` writes through a `format` [`Logger`] at INFO.
fn captured(format: LogFormat, log: impl FnOnce()) -> String {
    let sink = Arc::new(Sink::default());
    let subscriber = Logger::new(LevelFilter::INFO, format, sink.clone());
    tracing::subscriber::with_default(subscriber, log);
    String::from_utf8(sink.lines.lock().unwrap().clone()).unwrap()
}

/// The processor's job span and lines (plain strings under [`JOB_TARGET`], `elapsed` as text)
/// print exactly what the same span and lines with `%` values print, in both formats: bare values,
/// quoted when they hold a space, `=` or `"`, escaped when they hold a control character.
#[test]
fn a_job_span_of_plain_strings_prints_as_its_display_values_would() {
    for format in [LogFormat::Text, LogFormat::Json] {
        for (class, jid) in [
            ("HardWorker", "abc123"),
            ("X jid=1 INFO: done", "j\"q"),
            ("Evil\nINFO: forged\u{1b}[31m", "é☃"),
        ] {
            let elapsed = crate::time::Secs3(0.0071);
            let fast = captured(format, || {
                let span = tracing::info_span!(target: JOB_TARGET, "job", class = class, jid = jid, queue = "q");
                let _in = span.enter();
                tracing::info!(message = "start");
                tracing::info!(elapsed = elapsed.text().as_str(), message = "done");
                tracing::info!(user = "a b", "user line");
            });
            let display = captured(format, || {
                let span = tracing::info_span!("job", class = %class, jid = %jid, queue = %"q");
                let _in = span.enter();
                tracing::info!("start");
                tracing::info!(elapsed = %elapsed, "done");
                tracing::info!(user = "a b", "user line");
            });
            let strip = |t: &str| {
                t.lines()
                    .map(|l| match format {
                        // The time differs from one line to the next: compared from the pid on.
                        LogFormat::Text => l.split_once(" pid=").unwrap().1.to_string(),
                        LogFormat::Json => {
                            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
                            v.as_object_mut().unwrap().remove("time");
                            v.to_string()
                        }
                    })
                    .collect::<Vec<_>>()
            };
            assert_eq!(strip(&fast), strip(&display), "{format:?} {class:?}");
            assert_eq!(strip(&fast).len(), 3);
        }
    }
}

#[test]
fn json_lines_carry_the_job_context_and_escape_what_they_hold() {
    let text = captured(LogFormat::Json, || {
        let span = tracing::info_span!("job", class = %"Evil\nINFO: forged\u{1b}[31m", jid = %"abc", queue = %"q");
        let _in = span.enter();
        tracing::info!(elapsed = format_args!("{:.3}", 0.0071), "done");
        tracing::warn!(count = 3, "line\ntwo");
    });
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    let done = &lines[0];
    assert_eq!(done["class"], "Evil\nINFO: forged\u{1b}[31m");
    assert_eq!(done["jid"], "abc");
    assert_eq!(done["queue"], "q");
    assert_eq!(done["elapsed"], 0.007);
    assert_eq!(done["level"], "INFO");
    assert_eq!(done["message"], "done");
    assert!(done["pid"].is_u64() && done["tid"].is_string() && done["time"].is_string());
    assert_eq!(lines[1]["message"], "line\ntwo");
    assert_eq!(lines[1]["count"], 3);
    let keys: Vec<&str> = done
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "time", "pid", "tid", "level", "class", "jid", "queue", "elapsed", "message"
        ]
    );
}

#[test]
fn text_lines_carry_the_job_context_and_are_escaped_whole() {
    let text = captured(LogFormat::Text, || {
        let span =
            tracing::info_span!("job", class = %"Evil\nINFO: forged", jid = %"abc", queue = %"q");
        {
            let _in = span.enter();
            tracing::info!("start");
            tracing::info!(elapsed = format_args!("{:.3}", 0.0071), "done");
        }
        tracing::debug!("below the level: not written");
        tracing::warn!(count = 3, name = "x", "outside\u{1b}[31m");
        drop(span);
        // The closed span's slot is reused: nothing of the first job's context is left in it.
        let again = tracing::info_span!("job", class = %"B", jid = %"j2", queue = %"q");
        again.in_scope(|| tracing::info!("start"));
    });
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    let prefix = format!(" pid={} tid=", std::process::id());
    for line in &lines {
        let (time, rest) = line.split_at(24);
        assert!(time.ends_with('Z') && time.as_bytes()[10] == b'T' && time.as_bytes()[19] == b'.');
        assert!(time[20..23].bytes().all(|b| b.is_ascii_digit()), "{line}");
        assert!(rest.starts_with(&prefix), "{line}");
    }
    let after_tid = |l: &str| l.splitn(4, ' ').nth(3).unwrap().to_string();
    // A value with a space, `=` or `"` is quoted: it cannot read as fields of its own.
    assert_eq!(
        after_tid(lines[0]),
        "class=\"Evil\\nINFO: forged\" jid=abc queue=q INFO: start"
    );
    assert_eq!(
        after_tid(lines[1]),
        "class=\"Evil\\nINFO: forged\" jid=abc queue=q elapsed=0.007 INFO: done"
    );
    assert_eq!(
        after_tid(lines[2]),
        "count=3 name=x WARN: outside\\u{1b}[31m"
    );
    assert_eq!(after_tid(lines[3]), "class=B jid=j2 queue=q INFO: start");
}

#[test]
fn values_with_spaces_or_equals_are_quoted_and_json_escapes_separators() {
    let text = captured(LogFormat::Text, || {
        let span = tracing::info_span!("job", class = %"X jid=1 INFO: done", jid = %"j", queue = %"q", tag = "s p");
        span.in_scope(|| tracing::warn!(error = %"a \"b\" c", plain = "p", "failed"));
    });
    assert!(
        text.contains(
            r#"class="X jid=1 INFO: done" jid=j queue=q tag="s p" error="a \"b\" c" plain=p WARN: failed"#
        ),
        "{text}"
    );
    let class = "L\u{2028}N\u{85}B\u{202e}R\u{7f}";
    let json = captured(LogFormat::Json, || {
        let span = tracing::info_span!("job", class = %class, jid = %"j", queue = %"q");
        span.in_scope(|| tracing::info!("start"));
    });
    for c in ['\u{2028}', '\u{85}', '\u{202e}', '\u{7f}'] {
        assert!(!json.contains(c), "{json}");
    }
    let line: Value = serde_json::from_str(json.trim()).unwrap();
    assert_eq!(line["class"], class, "the same text, escaped");
}

#[test]
fn control_characters_are_escaped_and_the_rest_is_kept() {
    assert_eq!(escape("class=Hard jid=abc"), "class=Hard jid=abc");
    assert_eq!(escape("a\nb\r\tc"), "a\\nb\\r\\tc");
    assert_eq!(escape("\u{1b}[31mred"), "\\u{1b}[31mred");
    assert_eq!(escape("x\u{7f}\u{85}y"), "x\\u{7f}\\u{85}y");
    assert_eq!(escape("l\u{2028}r\u{202e}"), "l\\u{2028}r\\u{202e}");
    assert_eq!(escape("héllo ☃ \\n"), "héllo ☃ \\n");
}

#[test]
fn the_word_at_a_time_test_agrees_with_a_byte_at_a_time_one() {
    let slow = |b: &[u8]| b.iter().all(|c| (0x20..0x7f).contains(c));
    let mut line =
        b"2026-11-21T20:02:30.411Z pid=4242 tid=2c8 class=HardWorker INFO: done".to_vec();
    assert!(printable_ascii(&line));
    for at in 0..line.len() {
        for bad in [0x00, 0x0a, 0x1b, 0x1f, 0x7f, 0x80, 0xc3, 0xe2, 0xff] {
            let keep = line[at];
            line[at] = bad;
            assert_eq!(printable_ascii(&line), slow(&line), "byte {bad:#x} at {at}");
            line[at] = keep;
        }
    }
    for b in 0..=255u8 {
        let word = [b'a', b'b', b, b' ', b'~', b'!', b'0', b'Z', b'q'];
        assert_eq!(printable_ascii(&word), slow(&word), "{b:#x}");
        assert_eq!(printable_ascii(&word[1..]), slow(&word[1..]), "{b:#x}");
    }
}

/// What `log` writes through a text [`Logger`] at `level`.
fn captured_at(level: LevelFilter, log: impl FnOnce()) -> String {
    let sink = Arc::new(Sink::default());
    let subscriber = Logger::new(level, LogFormat::Text, sink.clone());
    tracing::subscriber::with_default(subscriber, log);
    String::from_utf8(sink.lines.lock().unwrap().clone()).unwrap()
}

/// The processor's start and done lines written by [`job_line`] straight into the text logger are
/// byte for byte the lines its `tracing::info!` events write (the time aside, which is read for each
/// line: its shape is checked): the same context of the job's span and its parent, the same quoting,
/// clipping and escaping; hidden alike below the level; and left to `tracing` in the JSON format.
#[test]
fn job_lines_written_directly_are_the_lines_tracing_writes() {
    let huge = "9".repeat(MAX_VALUE_CHARS + 5);
    // The direct path copies a span's text as is when it was printable ASCII when recorded, and
    // escapes it otherwise: cases of each, in the job's span, its parent, and a field recorded later.
    for (class, jid, elapsed, outer_value, later) in [
        ("HardWorker", "abc123", "0.007", "3", "x"),
        ("X jid=1 INFO: done", "j\"q", "12.250", "3", "x"),
        (
            "Evil\nINFO: forged\u{1b}[31m",
            "é☃\u{202e}",
            "a b=\"c\"",
            "3",
            "x",
        ),
        (
            "Evil\nINFO: forged\u{1b}[31m",
            "é☃\u{202e}",
            "0.5",
            "3",
            "x",
        ),
        ("HardWorker", "abc", "0.5", "w\r\u{2028}", "x"),
        ("HardWorker", "abc", "0.5", "3", "late\n\u{7f}"),
        ("Big", "j", huge.as_str(), "3", "x"),
    ] {
        let lines = |direct: bool| {
            captured_at(LevelFilter::INFO, || {
                let outer = tracing::info_span!("fetch", worker = %outer_value, extra = tracing::field::Empty);
                outer.record("extra", tracing::field::display(later));
                let _out = outer.enter();
                let span = tracing::info_span!(target: JOB_TARGET, "job", class = class, jid = jid, queue = "q");
                let _in = span.enter();
                if direct {
                    assert!(job_line("start", None));
                    assert!(job_line("done", Some(elapsed)));
                } else {
                    tracing::info!(message = "start");
                    tracing::info!(elapsed = elapsed, message = "done");
                }
            })
        };
        let (direct, general) = (lines(true), lines(false));
        let split = |t: &str| -> Vec<String> {
            t.split_inclusive('\n')
                .map(|l| {
                    let (time, rest) = l.split_at(24);
                    let b = time.as_bytes();
                    assert!(b[10] == b'T' && b[19] == b'.' && b[23] == b'Z', "{l}");
                    rest.to_string()
                })
                .collect()
        };
        assert_eq!(
            split(&direct),
            split(&general),
            "{class:?} {outer_value:?} {later:?}"
        );
        assert!(
            !direct.lines().any(|l| l.chars().any(needs_escape)),
            "{direct}"
        );
        assert_eq!(split(&direct).len(), 2, "{direct}");
        assert!(direct.ends_with(" INFO: done\n"), "{direct}");
    }
    // Hidden at WARN, both ways.
    let hidden = |direct: bool| {
        captured_at(LevelFilter::WARN, || {
            let span =
                tracing::info_span!(target: JOB_TARGET, "job", class = "C", jid = "j", queue = "q");
            let _in = span.enter();
            if direct {
                assert!(job_line("start", None));
            } else {
                tracing::info!(message = "start");
            }
        })
    };
    assert_eq!(hidden(true), "");
    assert_eq!(hidden(false), "");
    // JSON: not this path's format; the caller logs through tracing.
    let json = captured(LogFormat::Json, || {
        assert!(!job_line("start", None));
    });
    assert_eq!(json, "");
}

/// The direct lines' time ([`stamp_at`]) takes its date and seconds from a per-thread cache, refreshed
/// when the second changes: across second, minute, day and year boundaries, forwards and back (the
/// clock may be set back), it is chrono's `%Y-%m-%dT%H:%M:%S%.3fZ`, and the line's time
/// ([`write_time`]) has the same shape.
#[test]
fn the_line_time_is_right_across_second_boundaries() {
    let new_year = 1_798_761_599; // 2026-12-31T23:59:59Z
    let mut cases = Vec::new();
    for secs in [
        new_year - 1,
        new_year,
        new_year + 1,
        new_year,
        0,
        59,
        60,
        86_399,
        86_400,
    ] {
        for millis in [0, 1, 99, 500, 998, 999] {
            cases.push((secs, millis));
        }
    }
    cases.push((new_year + 3_600, 7));
    cases.push((new_year + 3_600, 7));
    for (secs, millis) in cases {
        let expected = chrono::DateTime::from_timestamp(secs, millis * 1_000_000)
            .unwrap()
            .format("%Y-%m-%dT%H:%M:%S%.3fZ")
            .to_string();
        let stamp = stamp_at(secs, millis).expect("a four-digit year");
        assert_eq!(
            std::str::from_utf8(&stamp).unwrap(),
            expected,
            "{secs} {millis}"
        );
    }
    // Past year 9999 the date is longer: the direct stamp declines, the line's time is chrono's.
    assert_eq!(stamp_at(253_402_300_800, 0), None);
    let mut line = String::new();
    write_time(&mut line);
    let now = stamp_now().expect("a four-digit year");
    assert_eq!(line.len(), 24);
    assert_eq!(line.as_bytes()[..10], now[..10]);
}

/// The writer of a quiet process sleeps until a line comes (no wake-up every 20 ms), and the line wakes
/// it: it is taken from the buffer long before the idle writer would look again by itself (5 s).
#[test]
fn a_line_on_a_quiet_process_wakes_the_sleeping_writer() {
    let sink = Arc::new(Sink::default());
    writer::spawn_writer(&sink);
    let wait = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    // Read under the buffer's lock, as an appender reads it.
    wait("the writer never went to sleep", &|| {
        let _lines = sink.lines.lock().unwrap();
        sink.idle.load(Ordering::Relaxed)
    });
    let subscriber = Logger::new(LevelFilter::INFO, LogFormat::Text, sink.clone());
    tracing::subscriber::with_default(subscriber, || tracing::info!("a line on a quiet process"));
    wait(
        "the line was not written: the sleeping writer was not woken",
        &|| sink.lines.lock().unwrap().is_empty(),
    );
    // A job's start line, written straight into the buffer (`job_line`, not an event), wakes it too.
    wait("the writer never went back to sleep", &|| {
        let _lines = sink.lines.lock().unwrap();
        sink.idle.load(Ordering::Relaxed)
    });
    let subscriber = Logger::new(LevelFilter::INFO, LogFormat::Text, sink.clone());
    tracing::subscriber::with_default(subscriber, || {
        let span = tracing::info_span!(target: JOB_TARGET, "job", class = "HardWorker", jid = "abc", queue = "q");
        let _in = span.enter();
        assert!(job_line("start", None), "written directly");
    });
    wait(
        "the job's line was not written: the sleeping writer was not woken",
        &|| sink.lines.lock().unwrap().is_empty(),
    );
}
