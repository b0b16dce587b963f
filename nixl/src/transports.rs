//! Which UCX transport a WRITE took, as UCX itself reports it.
//!
//! With `UCX_PROTO_INFO=y`, UCX prints the protocols it selects for each kind of operation the first
//! time an endpoint performs it, as a table per selection; `UCX_LOG_FILE` sends that print to a file
//! instead of stdout. [`ProtoLog::capture`] points both at an anonymous memory file of this process,
//! and [`ProtoLog::write_transport`] reads what the selection for `ucp_put` (a NIXL WRITE) chose for
//! one agent: `tcp/lo` over loopback TCP, `cma/memory` where UCX moves bytes between processes of one
//! host itself.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;

/// The file UCX writes its protocol selections into.
#[derive(Debug)]
pub struct ProtoLog {
    file: File,
}

/// The title UCX gives the selection table of a NIXL WRITE from host memory.
const PUT_TITLE: &str = "remote memory write by ucp_put";

impl ProtoLog {
    /// Has UCX report its protocol selections into a file of this process. `Ok(None)` where the user
    /// set `UCX_PROTO_INFO` or `UCX_LOG_FILE` (their choice stands, and transports go unreported).
    ///
    /// Call it before any other thread starts (it sets environment variables) and before the first
    /// endpoint (UCX reads them when it loads). UCX's own warnings go to the same file from then on.
    pub fn capture() -> std::io::Result<Option<ProtoLog>> {
        if std::env::var_os("UCX_PROTO_INFO").is_some() || std::env::var_os("UCX_LOG_FILE").is_some() {
            return Ok(None);
        }
        // SAFETY: a C string literal and flags; the call returns a new descriptor or -1.
        let fd = unsafe { libc::memfd_create(c"pdhost-ucx-protocols".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and nothing else owns it.
        let file = unsafe { File::from_raw_fd(fd) };
        std::env::set_var("UCX_PROTO_INFO", "y");
        std::env::set_var("UCX_LOG_FILE", format!("/proc/self/fd/{}", file.as_raw_fd()));
        Ok(Some(ProtoLog { file }))
    }

    /// The transports UCX chose for `agent`'s WRITEs from host memory, as its selection table names
    /// them (`tcp/lo`; several joined with ` + ` where sizes differ), or `None` before its first WRITE.
    pub fn write_transport(&self, agent: &str) -> Option<String> {
        // Positional reads: sessions on other threads may ask at the same time.
        let (mut bytes, mut chunk) = (Vec::new(), vec![0u8; 64 << 10]);
        loop {
            match self.file.read_at(&mut chunk, bytes.len() as u64) {
                Ok(0) => break,
                Ok(n) => bytes.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
        }
        put_transport(&String::from_utf8_lossy(&bytes), agent)
    }
}

/// Finds `agent`'s `ucp_put` selection table in UCX's log `text` and returns its transports.
fn put_transport(text: &str, agent: &str) -> Option<String> {
    // Each line: `[time] [host:pid:thread]   | cell | cell |` or a `+---+` rule.
    let table = |line: &str| line.find(['|', '+']).map(|at| line[at..].trim_end().to_string());
    let lines: Vec<String> = text.lines().filter_map(table).collect();
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
    use super::put_transport;

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
        assert_eq!(put_transport(LOG, "pdhost-node-28102-s1").as_deref(), Some("tcp/lo"));
        assert_eq!(put_transport(LOG, "pdhost-node-28102-s2").as_deref(), Some("posix/memory + cma/memory"));
        assert_eq!(put_transport(LOG, "pdhost-node-28102-s3"), None);
        assert_eq!(put_transport("", "pdhost-node-28102-s1"), None);
    }
}
