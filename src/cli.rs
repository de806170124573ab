//! TODO(#2): replaced by the command-line parser.
use crate::config::{Config, QueueWeight};
use crate::error::{Error, Result};

/// Placeholder parser: `-c N`, `-q name[,weight]`, `-t secs` only.
pub fn load<I: IntoIterator<Item = String>>(args: I) -> Result<Config> {
    let mut c = Config::default();
    let mut queues = Vec::new();
    let mut it = args.into_iter().skip(1);
    while let Some(a) = it.next() {
        let v = it
            .next()
            .ok_or_else(|| Error::Config(format!("{a} needs a value")))?;
        match a.as_str() {
            "-c" => c.concurrency = v.parse().map_err(|_| Error::Config("bad -c".into()))?,
            "-t" => {
                c.timeout = std::time::Duration::from_secs_f64(
                    v.parse().map_err(|_| Error::Config("bad -t".into()))?,
                )
            }
            "-q" => {
                let mut p = v.split(',');
                queues.push(QueueWeight {
                    name: p.next().unwrap_or_default().into(),
                    weight: p.next().and_then(|w| w.parse().ok()).unwrap_or(0),
                });
            }
            _ => return Err(Error::Config(format!("unknown flag {a}"))),
        }
    }
    if !queues.is_empty() {
        c.queues = queues;
    }
    Ok(c)
}
