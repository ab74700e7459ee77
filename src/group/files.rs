//! [`FileGroup`]: a [`Collective`] for ranks in separate processes of one machine, over
//! files in a shared folder, with nothing else to install: `cp-hicache replay --processes`
//! (where an engine would use its `torch.distributed` group) and the stand-in driver's
//! multi-process tests. Round `k` of rank `r` is the file `<k>.<r>` (written to a temporary
//! name, then renamed, so a reader never sees half of it); a rank's call returns once every
//! rank's file of that round exists. An `abort` file ends the group for every rank. It
//! keeps the trait's contract: steps are compared (divergence), a failure stands in for the
//! round's call, no call waits longer than the timeout, and a failure is final. Polling
//! files costs a millisecond or so a round: a control plane for a few ranks on one
//! machine, not a transport for KV.

use super::{Collective, GroupError};
use crate::layout::Rank;
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// One rank's membership of a group over the files of one folder.
pub struct FileGroup {
    dir: PathBuf,
    rank: u8,
    size: usize,
    timeout: Duration,
    round: Cell<u64>,
    last: std::cell::RefCell<String>,
}

impl FileGroup {
    /// Rank `rank` of `size`, over the files of `dir` (the same folder for every rank,
    /// empty at the start); no call waits longer than `timeout` for a peer.
    pub fn new(dir: PathBuf, rank: u8, size: usize, timeout: Duration) -> FileGroup {
        FileGroup {
            dir,
            rank,
            size,
            timeout,
            round: Cell::new(0),
            last: std::cell::RefCell::new("start-up".into()),
        }
    }

    fn transport(&self, what: &str, message: String) -> GroupError {
        GroupError::Transport {
            rank: self.rank,
            what: what.to_string(),
            message,
        }
    }

    fn aborted(&self) -> Option<GroupError> {
        let text = std::fs::read_to_string(self.dir.join("abort")).ok()?;
        let mut parts = text.splitn(3, '\n');
        let by = parts.next()?.parse().ok()?;
        let what = parts.next()?.to_string();
        let why = parts.next()?.to_string();
        Some(GroupError::Aborted { by, what, why })
    }

    fn write_atomically(&self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
        write_atomically(&self.dir, self.rank, name, bytes)
    }

    /// Ends the group over `dir` for every member, in the name of rank `rank`, which never
    /// joined it (its process could not be started): each member's next call, or the one it
    /// is waiting in, fails with [`GroupError::Aborted`] naming `rank`, at once instead of at
    /// the timeout. Nothing happens where the group was aborted already.
    pub fn abort_unstarted(dir: &Path, rank: u8, why: &str) -> std::io::Result<()> {
        if dir.join("abort").exists() {
            return Ok(());
        }
        let text = format!("{rank}\nbeing started\n{why}");
        write_atomically(dir, rank, "abort", text.as_bytes())
    }
}

/// Writes `name` in `dir` under a temporary name of `rank`'s, then renames it into place.
fn write_atomically(dir: &Path, rank: u8, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{name}.{rank}.tmp"));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(tmp, dir.join(name))
}

/// One rank's round: its step, and its bytes or why it failed.
type Contribution = (String, Result<Vec<u8>, String>);

/// A round's file: the step's length (u32 LE), the step, 1 and the payload, or 0 and why.
fn encode(what: &str, mine: Result<&[u8], &str>) -> Vec<u8> {
    let mut out = (what.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(what.as_bytes());
    match mine {
        Ok(b) => {
            out.push(1);
            out.extend_from_slice(b);
        }
        Err(why) => {
            out.push(0);
            out.extend_from_slice(why.as_bytes());
        }
    }
    out
}

fn decode(bytes: &[u8]) -> Option<Contribution> {
    let n = u32::from_le_bytes(bytes.get(..4)?.try_into().ok()?) as usize;
    let what = String::from_utf8(bytes.get(4..4 + n)?.to_vec()).ok()?;
    let rest = bytes.get(4 + n + 1..)?.to_vec();
    match bytes.get(4 + n)? {
        1 => Some((what, Ok(rest))),
        _ => Some((what, Err(String::from_utf8_lossy(&rest).into_owned()))),
    }
}

impl Collective for FileGroup {
    fn rank(&self) -> Rank {
        Rank(self.rank)
    }

    fn size(&self) -> usize {
        self.size
    }

    fn kind(&self) -> &'static str {
        "files"
    }

    fn exchange(&self, what: &str, mine: Result<&[u8], &str>) -> Result<Vec<Vec<u8>>, GroupError> {
        if let Some(e) = self.aborted() {
            return Err(e);
        }
        let k = self.round.get();
        self.round.set(k + 1);
        *self.last.borrow_mut() = what.to_string();
        self.write_atomically(&format!("{k}.{}", self.rank), &encode(what, mine))
            .map_err(|e| self.transport(what, e.to_string()))?;
        let start = Instant::now();
        let mut got: Vec<Option<Contribution>> = vec![None; self.size];
        loop {
            for (r, slot) in got.iter_mut().enumerate().filter(|(_, s)| s.is_none()) {
                if let Ok(bytes) = std::fs::read(self.dir.join(format!("{k}.{r}"))) {
                    let parsed = decode(&bytes).ok_or_else(|| {
                        self.transport(what, format!("rank {r}'s round {k} is malformed"))
                    })?;
                    *slot = Some(parsed);
                }
            }
            if got.iter().all(Option::is_some) {
                break;
            }
            if let Some(e) = self.aborted() {
                return Err(e);
            }
            if start.elapsed() > self.timeout {
                let missing = (0..self.size)
                    .filter(|&r| got[r].is_none())
                    .map(|r| (r as u8, format!("before round {k}")))
                    .collect();
                let e = GroupError::Timeout {
                    rank: self.rank,
                    what: what.to_string(),
                    timeout: self.timeout,
                    missing,
                };
                self.abort(&e.to_string());
                return Err(e);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // Every rank wrote round `k` after reading all of round `k - 1`: nobody reads this
        // rank's file of it any more.
        if let Some(prev) = k.checked_sub(1) {
            let _ = std::fs::remove_file(self.dir.join(format!("{prev}.{}", self.rank)));
        }
        let all: Vec<Contribution> = got.into_iter().flatten().collect();
        let failures: Vec<(u8, String)> = all
            .iter()
            .enumerate()
            .filter_map(|(r, (_, c))| c.as_ref().err().map(|why| (r as u8, why.clone())))
            .collect();
        if !failures.is_empty() {
            return Err(GroupError::PeerFailed { failures });
        }
        if let Some((other, (theirs, _))) = all.iter().enumerate().find(|(_, (w, _))| w != what) {
            let e = GroupError::Diverged {
                rank: self.rank,
                mine: what.to_string(),
                other: other as u8,
                theirs: theirs.clone(),
            };
            self.abort(&e.to_string());
            return Err(e);
        }
        Ok(all.into_iter().filter_map(|(_, c)| c.ok()).collect())
    }

    fn abort(&self, why: &str) {
        if self.dir.join("abort").exists() {
            return;
        }
        let text = format!("{}\n{}\n{why}", self.rank, self.last.borrow());
        let _ = self.write_atomically("abort", text.as_bytes());
    }
}

/// A rank whose process panics (a failed assertion) aborts the group as it unwinds, so its
/// peers fail at once, naming it, instead of waiting out the timeout.
impl Drop for FileGroup {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.abort("the rank's process panicked");
        }
    }
}
