//! What `/proc` says about processes: the one reading of a process's children that the producer's
//! sandbox, the soak benchmark and the tests share.

/// A process whose parent is the one asked about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChildProcess {
    /// Its process id.
    pub pid: i32,
    /// It has exited and waits for its parent's reap.
    pub zombie: bool,
}

/// The processes whose parent is `pid`, in increasing pid order, zombies included (they still need a
/// reap). A process that exits while `/proc` is read may or may not be listed.
pub fn children_of(pid: i32) -> std::io::Result<Vec<ChildProcess>> {
    let mut children = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let Some(p) = entry?.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        if let Some((state, ppid)) = stat(p) {
            if ppid == pid {
                children.push(ChildProcess { pid: p, zombie: state == 'Z' });
            }
        }
    }
    children.sort_unstable_by_key(|c| c.pid);
    Ok(children)
}

/// The state letter of process `pid` (`R`, `S`, `Z`, ...), or `None` once it is gone.
pub fn state(pid: i32) -> Option<char> {
    stat(pid).map(|(state, _)| state)
}

/// Process `pid`'s state letter and parent, from `/proc/PID/stat`: `pid (comm) state ppid ...`, the fields
/// after the last `)` (a comm may hold one). `None` for a process that is gone.
fn stat(pid: i32) -> Option<(char, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace();
    let state = fields.next()?.chars().next()?;
    Some((state, fields.next()?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_listed_alive_then_as_a_zombie_until_reaped() {
        let me = std::process::id() as i32;
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as i32;
        assert!(children_of(me).unwrap().contains(&ChildProcess { pid, zombie: false }));
        child.kill().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !children_of(me).unwrap().contains(&ChildProcess { pid, zombie: true }) {
            assert!(std::time::Instant::now() < deadline, "no zombie for {pid}");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(!children_of(me).unwrap().iter().any(|c| c.pid == pid));
    }
}
