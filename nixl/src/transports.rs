//! Which UCX transport a WRITE took, as UCX itself reports it.
//!
//! With `UCX_PROTO_INFO=y`, UCX prints the protocols it selects for each kind of operation the first
//! time an endpoint performs it, as a table per selection; `UCX_LOG_FILE` sends its log to a file
//! instead of stdout. [`ProtoLog::capture`] points both at a pipe of this process, whose reader keeps
//! the tables and passes every other line (UCX's warnings) on to stderr, and
//! [`ProtoLog::write_transport`] reads what the selection for `ucp_put` (a NIXL WRITE) chose for one
//! agent: `tcp/lo` over loopback TCP, `cma/memory` where UCX moves bytes between processes of one host
//! itself.

use std::io::{BufRead, BufReader, PipeWriter};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

/// Where UCX's protocol selections go.
#[derive(Debug)]
pub struct ProtoLog {
    /// The selection tables UCX printed, the oldest dropped past [`KEPT`] bytes.
    tables: Arc<Mutex<String>>,
    /// Kept open for the process's life: UCX opens the pipe by this descriptor's path.
    _writer: PipeWriter,
}

/// The title UCX gives the selection table of a NIXL WRITE from host memory.
const PUT_TITLE: &str = "remote memory write by ucp_put";
/// How many bytes of tables are kept: each session prints about 4 KiB, read at once.
const KEPT: usize = 1 << 20;

impl ProtoLog {
    /// Has UCX report its protocol selections to this process. `Ok(None)` where the user set
    /// `UCX_PROTO_INFO` or `UCX_LOG_FILE` (their choice stands, and transports go unreported).
    ///
    /// Call it before any other thread starts (it sets environment variables) and before the first
    /// endpoint (UCX reads them when it loads).
    pub fn capture() -> std::io::Result<Option<ProtoLog>> {
        if std::env::var_os("UCX_PROTO_INFO").is_some() || std::env::var_os("UCX_LOG_FILE").is_some() {
            return Ok(None);
        }
        let (reader, writer) = std::io::pipe()?;
        std::env::set_var("UCX_PROTO_INFO", "y");
        std::env::set_var("UCX_LOG_FILE", format!("/proc/self/fd/{}", writer.as_raw_fd()));
        let tables = Arc::new(Mutex::new(String::new()));
        let kept = Arc::clone(&tables);
        std::thread::Builder::new().name("ucx-log".into()).spawn(move || {
            for line in BufReader::new(reader).lines().map_while(Result::ok) {
                match table_part(&line) {
                    Some(row) => {
                        let mut tables = kept.lock().unwrap_or_else(|e| e.into_inner());
                        if tables.len() > KEPT {
                            let half = tables.len() / 2;
                            let cut = tables[half..].find('\n').map_or(tables.len(), |at| half + at + 1);
                            tables.drain(..cut);
                        }
                        tables.push_str(row);
                        tables.push('\n');
                    }
                    None => eprintln!("{line}"),
                }
            }
        })?;
        Ok(Some(ProtoLog { tables, _writer: writer }))
    }

    /// The transports UCX chose for `agent`'s WRITEs from host memory, as its selection table names
    /// them (`tcp/lo`; several joined with ` + ` where sizes differ), or `None` before its first WRITE.
    pub fn write_transport(&self, agent: &str) -> Option<String> {
        // UCX prints a table before the WRITE that needed it completes, but the reader may not have
        // it yet: a moment's grace.
        for _ in 0..50 {
            let found = put_transport(&self.tables.lock().unwrap_or_else(|e| e.into_inner()), agent);
            if found.is_some() {
                return found;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        None
    }
}

/// A log line's table part (`| cell | cell |` or a `+---+` rule) after UCX's `[time] [host:pid:thread]`
/// prefix, or `None` for any other line.
fn table_part(line: &str) -> Option<&str> {
    let rest = line.strip_prefix('[')?;
    let rest = &rest[rest.find("] [")? + 3..];
    let rest = rest[rest.find(']')? + 1..].trim_start();
    rest.starts_with(['|', '+']).then(|| rest.trim_end())
}

/// Finds `agent`'s `ucp_put` selection table in `tables` (the table lines of UCX's log, one per line)
/// and returns its transports.
fn put_transport(tables: &str, agent: &str) -> Option<String> {
    let lines: Vec<&str> = tables.lines().collect();
    let titled =
        |i: usize| lines[i].contains(&format!(" {agent} ")) && lines.get(i + 1).is_some_and(|l| l.contains(PUT_TITLE));
    let start = (0..lines.len()).find(|&i| titled(i))?;
    let mut transports: Vec<String> = Vec::new();
    let mut rules = 0;
    for line in &lines[start..] {
        if line.starts_with('+') {
            rules += 1;
            // Title, rule, header, rule, rows, rule: the rows end at the third rule after the title.
            if rules == 3 {
                break;
            }
            continue;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).filter(|c| !c.is_empty()).collect();
        if rules == 2 && cells.len() >= 3 {
            let transport = cells[2].to_string();
            if !transports.contains(&transport) {
                transports.push(transport);
            }
        }
    }
    (!transports.is_empty()).then(|| transports.join(" + "))
}

#[cfg(test)]
mod tests {
    use super::{put_transport, table_part};

    const LOG: &str = "\
[1796278953.212307] [vm:28102:0]   +--------+-------------+-----------------------------------+
[1796278953.212307] [vm:28102:0]   | pdhost-node-28102-s1 self cfg#0                          |
[1796278953.212307] [vm:28102:0]   | remote memory write by ucp_put* from host memory to host |
[1796278953.212307] [vm:28102:0]   +--------+-------------+-----------------------------------+
[1796278953.212307] [vm:28102:0]   | Range  | Description |              Config               |
[1796278953.212307] [vm:28102:0]   +--------+-------------+-----------------------------------+
[1796278953.212307] [vm:28102:0]   | 0..inf | zero-copy   | tcp/lo                            |
[1796278953.212307] [vm:28102:0]   +--------+-------------+-----------------------------------+
[1796278953.213961] [vm:28102:0]   +------------+--------------------+---------------+
[1796278953.213961] [vm:28102:0]   | pdhost-node-28102-s2 self cfg#0                 |
[1796278953.213961] [vm:28102:0]   | remote memory write by ucp_put* from host memory to host |
[1796278953.213961] [vm:28102:0]   +------------+--------------------+---------------+
[1796278953.213961] [vm:28102:0]   |   Range    |    Description     |    Config     |
[1796278953.213961] [vm:28102:0]   +------------+--------------------+---------------+
[1796278953.213961] [vm:28102:0]   |    0..8184 | short              | posix/memory  |
[1796278953.213961] [vm:28102:0]   |  8185..inf | zero-copy          | cma/memory    |
[1796278953.213961] [vm:28102:0]   +------------+--------------------+---------------+
";

    #[test]
    fn the_put_table_of_the_named_agent_gives_its_transports() {
        let mut tables = String::new();
        let warning = "[1796278953.2] [vm:28102:0]   ucp_context.c:1 UCX  WARN  a warning";
        for line in LOG.lines().chain([warning]) {
            if let Some(row) = table_part(line) {
                tables.push_str(row);
                tables.push('\n');
            }
        }
        assert!(!tables.contains("WARN"), "only table lines are kept");
        assert_eq!(put_transport(&tables, "pdhost-node-28102-s1").as_deref(), Some("tcp/lo"));
        assert_eq!(put_transport(&tables, "pdhost-node-28102-s2").as_deref(), Some("posix/memory + cma/memory"));
        assert_eq!(put_transport(&tables, "pdhost-node-28102-s3"), None);
        assert_eq!(put_transport("", "pdhost-node-28102-s1"), None);
    }
}
