//! ActiveJob arguments as typed values, for a worker that wants more than their plain JSON form
//! ([`ActiveJobInfo::typed_arguments`](super::ActiveJobInfo::typed_arguments)): a TimeWithZone keeps
//! its zone name, a Duration its parts, a Range its ends, an app-defined serializer its data, a hash
//! which of its keys were Ruby symbols.
//!
//! Read by the rules of `activejob/lib/active_job/arguments.rb` and `serializers/*.rb` (Rails 6.1 to
//! 8.1; the shapes each version writes are recorded in `fixtures/activejob-*`).

use chrono::{DateTime, FixedOffset, NaiveDate};
use serde_json::{Map, Number, Value};

use super::{
    GLOBALID_KEY, INDIFFERENT_KEY, RUBY2_KEYWORDS_KEY, SERIALIZER_KEY, SYMBOL_KEYS_KEY, kind,
};

/// One ActiveJob argument as Ruby had it.
///
/// ```
/// use oxidekiq::AjValue;
///
/// // `Time.find_zone("Europe/Paris").local(2024, 7, 2, 3, 4, 5)` as ActiveJob >= 7.0.9 writes it.
/// let arg = serde_json::json!({
///     "_aj_serialized": "ActiveJob::Serializers::TimeWithZoneSerializer",
///     "value": "2024-07-02T03:04:05.000000000+02:00",
///     "time_zone": "Europe/Paris"
/// });
/// match AjValue::from_serialized(&arg).unwrap() {
///     AjValue::TimeWithZone { time, zone } => {
///         assert_eq!(time.to_rfc3339(), "2024-07-02T03:04:05+02:00");
///         assert_eq!(zone.as_deref(), Some("Europe/Paris"));
///     }
///     other => panic!("{other:?}"),
/// }
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum AjValue {
    /// `nil`, `true`/`false`, an Integer or Float (its exact JSON text kept), a String.
    Plain(Value),
    /// An Array.
    Array(Vec<AjValue>),
    /// A Hash, its entries in order.
    Hash {
        /// Key (as a string) and value.
        entries: Vec<(String, AjValue)>,
        /// The keys that were Ruby Symbols (`_aj_symbol_keys`, or every key of keyword arguments).
        symbol_keys: Vec<String>,
        /// Which kind of Hash Ruby had.
        kind: HashKind,
    },
    /// A model passed by GlobalID (`gid://app/Model/id`).
    GlobalId(String),
    /// A Symbol, by name.
    Symbol(String),
    /// A `Time` (its UTC offset kept).
    Time(DateTime<FixedOffset>),
    /// A `DateTime` (its offset kept).
    DateTime(DateTime<FixedOffset>),
    /// An `ActiveSupport::TimeWithZone`: the time and, from ActiveJob 7.0.9/7.1.3 on, the zone's name
    /// (`"Europe/Paris"`); `None` when the writer did not say (Rails then uses `Time.zone`).
    TimeWithZone {
        /// The time, with the offset it had in its zone.
        time: DateTime<FixedOffset>,
        /// The zone's name (`time_zone`).
        zone: Option<String>,
    },
    /// A `Date`.
    Date(NaiveDate),
    /// An `ActiveSupport::Duration`: its length in seconds and the parts it was built from
    /// (`1.year + 2.days` is `[("years", 1), ("days", 2)]`).
    Duration {
        /// `value`: seconds (an integer or a float, as written).
        seconds: Number,
        /// `parts`: unit name (`years`, `months`, `weeks`, `days`, `hours`, `minutes`, `seconds`) and amount.
        parts: Vec<(String, Number)>,
    },
    /// A `BigDecimal` (`BigDecimalSerializer`, the default from Rails 7.2), as its exact decimal text.
    /// Earlier Rails pass a BigDecimal as a plain String.
    BigDecimal(String),
    /// A Module or Class, by name.
    Module(String),
    /// A Range (Rails >= 7.0); an open end is `Plain(Null)`.
    Range {
        /// The first value.
        begin: Box<AjValue>,
        /// The last value.
        end: Box<AjValue>,
        /// `...` (true) or `..` (false).
        exclude_end: bool,
    },
    /// An object an app-defined serializer wrote: the serializer's name and the rest of its hash
    /// (the app's own format, for the worker to read; `serde_json::from_value` of
    /// `Value::Object(data)` into the worker's own type is the usual way).
    Custom {
        /// `_aj_serialized`: the serializer class (`"MoneySerializer"`).
        serializer: String,
        /// Every other key the serializer wrote.
        data: Map<String, Value>,
    },
}

/// The kinds of Hash ActiveJob tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HashKind {
    /// An ordinary Hash (`_aj_symbol_keys`, or no marker).
    Hash,
    /// Keyword arguments (`_aj_ruby2_keywords`): the last argument of `perform(..., key:)`.
    Keywords,
    /// An `ActiveSupport::HashWithIndifferentAccess` (`_aj_hash_with_indifferent_access`).
    Indifferent,
}

impl AjValue {
    /// Reads one argument as ActiveJob serialized it (an element of `job_data["arguments"]`).
    pub fn from_serialized(v: &Value) -> Result<AjValue, String> {
        typed(v, "argument")
    }
}

/// Every element of `job_data["arguments"]`.
pub(crate) fn typed_list(items: &[Value]) -> Result<Vec<AjValue>, String> {
    items
        .iter()
        .enumerate()
        .map(|(i, v)| typed(v, &format!("arguments[{i}]")))
        .collect()
}

fn typed(v: &Value, path: &str) -> Result<AjValue, String> {
    match v {
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, v)| typed(v, &format!("{path}[{i}]")))
            .collect::<Result<_, _>>()
            .map(AjValue::Array),
        Value::Object(map) if map.contains_key(GLOBALID_KEY) => {
            match (map.len(), map.get(GLOBALID_KEY)) {
                (1, Some(Value::String(gid))) => Ok(AjValue::GlobalId(gid.clone())),
                _ => Err(format!(
                    "{path}: `{GLOBALID_KEY}` must be the only key of its hash, a string"
                )),
            }
        }
        Value::Object(map) if map.contains_key(SERIALIZER_KEY) => serialized(map, path),
        Value::Object(map) => hash(map, path),
        scalar => Ok(AjValue::Plain(scalar.clone())),
    }
}

fn string<'a>(map: &'a Map<String, Value>, key: &str, path: &str) -> Result<&'a str, String> {
    match map.get(key) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(format!(
            "{path}: `{key}` must be a string, found {}",
            kind(other)
        )),
        None => Err(format!("{path}: no `{key}`")),
    }
}

fn time(text: &str, path: &str) -> Result<DateTime<FixedOffset>, String> {
    DateTime::parse_from_rfc3339(text).map_err(|e| format!("{path}: {text:?} is not a time: {e}"))
}

fn serialized(map: &Map<String, Value>, path: &str) -> Result<AjValue, String> {
    let name = string(map, SERIALIZER_KEY, path)?;
    let value = || string(map, "value", path);
    Ok(match name.strip_prefix("ActiveJob::Serializers::") {
        Some("SymbolSerializer") => AjValue::Symbol(value()?.to_owned()),
        Some("ModuleSerializer") => AjValue::Module(value()?.to_owned()),
        Some("BigDecimalSerializer") => AjValue::BigDecimal(value()?.to_owned()),
        Some("TimeSerializer") => AjValue::Time(time(value()?, path)?),
        Some("DateTimeSerializer") => AjValue::DateTime(time(value()?, path)?),
        Some("TimeWithZoneSerializer") => AjValue::TimeWithZone {
            time: time(value()?, path)?,
            zone: match map.get("time_zone") {
                Some(Value::String(z)) => Some(z.clone()),
                None | Some(Value::Null) => None,
                Some(other) => {
                    return Err(format!(
                        "{path}: `time_zone` must be a zone name, found {}",
                        kind(other)
                    ));
                }
            },
        },
        Some("DateSerializer") => {
            let text = value()?;
            AjValue::Date(
                NaiveDate::parse_from_str(text, "%Y-%m-%d")
                    .map_err(|e| format!("{path}: {text:?} is not a date: {e}"))?,
            )
        }
        Some("DurationSerializer") => {
            let seconds = match map.get("value") {
                Some(Value::Number(n)) => n.clone(),
                _ => return Err(format!("{path}: a Duration's `value` must be a number")),
            };
            let parts = match map.get("parts") {
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|part| duration_part(part, path))
                    .collect::<Result<_, _>>()?,
                None => Vec::new(),
                Some(other) => {
                    return Err(format!(
                        "{path}: a Duration's `parts` must be an array, found {}",
                        kind(other)
                    ));
                }
            };
            AjValue::Duration { seconds, parts }
        }
        Some("RangeSerializer") => AjValue::Range {
            begin: Box::new(typed(
                map.get("begin").unwrap_or(&Value::Null),
                &format!("{path}.begin"),
            )?),
            end: Box::new(typed(
                map.get("end").unwrap_or(&Value::Null),
                &format!("{path}.end"),
            )?),
            exclude_end: match map.get("exclude_end") {
                Some(Value::Bool(b)) => *b,
                _ => return Err(format!("{path}: a Range's `exclude_end` must be a boolean")),
            },
        },
        _ => {
            let mut data = map.clone();
            data.remove(SERIALIZER_KEY);
            AjValue::Custom {
                serializer: name.to_owned(),
                data,
            }
        }
    })
}

/// `[unit, amount]`, the unit a serialized Symbol (Rails >= 6.1) or a plain string.
fn duration_part(part: &Value, path: &str) -> Result<(String, Number), String> {
    let bad = || format!("{path}: a Duration part must be [unit, amount], found {part}");
    let [unit, amount] = part.as_array().map(Vec::as_slice).ok_or_else(bad)? else {
        return Err(bad());
    };
    let unit = match typed(unit, path)? {
        AjValue::Symbol(s) | AjValue::Plain(Value::String(s)) => s,
        _ => return Err(bad()),
    };
    match amount {
        Value::Number(n) => Ok((unit, n.clone())),
        _ => Err(bad()),
    }
}

fn hash(map: &Map<String, Value>, path: &str) -> Result<AjValue, String> {
    let marker = [SYMBOL_KEYS_KEY, RUBY2_KEYWORDS_KEY, INDIFFERENT_KEY]
        .into_iter()
        .filter(|k| map.contains_key(*k))
        .collect::<Vec<_>>();
    let (kind, symbol_keys) = match marker.as_slice() {
        [] => (HashKind::Hash, Vec::new()),
        [INDIFFERENT_KEY] => (HashKind::Indifferent, Vec::new()),
        [m] => {
            let keys = match map.get(*m) {
                Some(Value::Array(keys)) => keys
                    .iter()
                    .map(|k| k.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>(),
                _ => None,
            }
            .ok_or_else(|| format!("{path}: `{m}` must be an array of key names"))?;
            let kind = if *m == RUBY2_KEYWORDS_KEY {
                HashKind::Keywords
            } else {
                HashKind::Hash
            };
            (kind, keys)
        }
        _ => return Err(format!("{path}: a hash carries more than one marker")),
    };
    let entries = map
        .iter()
        .filter(|(k, _)| marker.first() != Some(&k.as_str()))
        .map(|(k, v)| Ok((k.clone(), typed(v, &format!("{path}.{k}"))?)))
        .collect::<Result<_, String>>()?;
    Ok(AjValue::Hash {
        entries,
        symbol_keys,
        kind,
    })
}
