//! The embedded store: one file per record in a directory that every rank's process (and
//! later runs) share. A record is written aside and renamed into place, so a reader sees a
//! whole record or none; the byte budget is kept under a file lock, evicting the least
//! recently used records (a record's modification time is its last use).
//!
//! Nothing found in the directory is trusted: anyone who can write there may leave links,
//! FIFOs, folders or junk where the store's files go (see [`super::fsx`]). The store
//! follows no link below its root, reads and stamps only regular files, counts and evicts
//! only names it writes, and serves a record only after its header and checksum pass.

use super::fsx::{self, Access, Dir, Kind};
use super::record::{self, RecordError, Refusal, HEADER_BYTES};
use super::{
    Assemble, Fingerprint, Lookup, PageStore, PartPut, Put, RecordKey, StorageError, StoreStats,
};
use fs4::fs_std::FileExt;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// A record's parts, read and checked in part order, or why one was refused.
type TakenParts = Result<Vec<Vec<u8>>, RecordError>;

/// A record file as a scan finds it: its last use, folder (`records/xx`) and name, size.
type Found = (SystemTime, String, std::ffi::OsString, u64);

/// Where a store's time comes from: the wall clock, or a test's.
pub type Clock = Box<dyn Fn() -> SystemTime + Send + Sync>;

/// The suffix of a file written aside, unique in this process (with its id, unique on the
/// host): one counter for every store, since several stores of one directory live in one
/// process (the ranks of a cluster) and may write the same record at once.
static ASIDE_NONCE: AtomicU64 = AtomicU64::new(0);

/// A file in `tmp/` whose writer is gone (no process of its id on this host) is removed
/// once it is this old. Not at once: a writer of another host or process namespace sharing
/// the directory has an id that means nothing here, and a record is written in well under
/// a second.
const DEAD_WRITER_GRACE: Duration = Duration::from_secs(60);

/// Anything the store wrote in `tmp/`, and parts of a record that never completed, are
/// removed once this old, whoever wrote them: a record's parts are written within one
/// backup, seconds apart.
const LEFTOVER_AGE: Duration = Duration::from_secs(3600);

/// Bytes of `FINGERPRINT` read at most: the store writes two short lines.
const MARKER_MAX_BYTES: u64 = 64 << 10;

/// A [`PageStore`] over a directory:
/// - `records/<first two hex digits>/<key>.rec`, one file per record;
/// - `parts/<key>/<i>-of-<n>`, parts of a record written in parts, until the last comes;
/// - `tmp/`, where records and parts are written before they are renamed into place;
/// - `lock`, locked exclusively while the byte count (`usage`, 8 bytes: records, held
///   parts and records and parts in `tmp/`, so the budget bounds every file the store
///   writes) is updated, while records and parts are renamed into place, and while records
///   are evicted;
/// - `FINGERPRINT`, the deployment whose records these are, in words (a store holds one
///   deployment's records; a record of another is refused when read).
///
/// A store this process may not write (a read-only mount, another user's store) is opened
/// for reading: its records are served, nothing is written, stamped or evicted, and
/// [`PageStore::read_only`] says so.
pub struct DirStore {
    root: PathBuf,
    fp: Fingerprint,
    payload_bytes: u64,
    budget: u64,
    clock: Clock,
    /// Whether `clock` is the wall clock (then a new file's time needs no setting).
    wall_clock: bool,
    stats: Counters,
    /// The store's folders, opened once without following links.
    dirs: Dirs,
    /// Held while this store updates the usage count (the file lock serialises processes,
    /// this the threads of one); none for a read-only store.
    lock: Option<Mutex<File>>,
    /// How old a file of a dead writer in `tmp/` must be to be reclaimed.
    dead_writer_grace: Duration,
}

/// The folders of a store. A read-only store may lack any of them (none is made).
struct Dirs {
    root: Dir,
    records: Option<Dir>,
    parts: Option<Dir>,
    tmp: Option<Dir>,
}

#[derive(Default)]
struct Counters {
    records_written: AtomicU64,
    bytes_written: AtomicU64,
    already_present: AtomicU64,
    records_read: AtomicU64,
    bytes_read: AtomicU64,
    misses: AtomicU64,
    refused_torn: AtomicU64,
    refused_checksum: AtomicU64,
    refused_fingerprint: AtomicU64,
    evictions: AtomicU64,
    evicted_bytes: AtomicU64,
}

/// `records/xx` and `<key>.rec` of `key`.
fn record_name(key: &RecordKey) -> (String, String) {
    let hex = key.hex();
    (hex[..2].to_string(), format!("{hex}.rec"))
}

/// Whether `name` in `records/<folder>` is a name the store writes: `<key>.rec`, the key
/// 32 lowercase hex digits beginning with `folder`.
fn is_record_name(folder: &str, name: &OsStr) -> bool {
    let Some(hex) = name.to_str().and_then(|n| n.strip_suffix(".rec")) else {
        return false;
    };
    is_key_hex(hex) && hex.starts_with(folder)
}

fn is_key_hex(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `(part, parts)` of a part's file name `<i>-of-<n>`.
fn part_name(name: &OsStr) -> Option<(u32, u32)> {
    let (i, n) = name.to_str()?.split_once("-of-")?;
    let (i, n) = (i.parse().ok()?, n.parse().ok()?);
    (i < n).then_some((i, n))
}

/// The writer's process id of a file the store writes in `tmp/`
/// (`<key>.<pid>.<n>`, `<key>.part<i>.<pid>.<n>`, `FINGERPRINT.<pid>.<n>`), if `name` is
/// one.
fn aside_writer(name: &OsStr) -> Option<i32> {
    let name = name.to_str()?;
    let mut it = name.split('.');
    let head = it.next()?;
    if head != "FINGERPRINT" && !is_key_hex(head) {
        return None;
    }
    let rest: Vec<&str> = it.collect();
    let (pid, n) = match rest.as_slice() {
        [pid, n] => (pid, n),
        [part, pid, n] if head != "FINGERPRINT" => {
            part.strip_prefix("part")?.parse::<u32>().ok()?;
            (pid, n)
        }
        _ => return None,
    };
    n.parse::<u64>().ok()?;
    pid.parse().ok().filter(|&p: &i32| p > 0)
}

impl DirStore {
    /// Opens (creating it if need be) the store in `root` for deployment `fp`, whose
    /// records hold `payload_bytes` bytes, keeping at most `budget` bytes of records.
    pub fn open(
        root: &Path,
        fp: Fingerprint,
        payload_bytes: u64,
        budget: u64,
    ) -> Result<DirStore, StorageError> {
        Self::open_with(
            root,
            fp,
            payload_bytes,
            budget,
            (Box::new(SystemTime::now), true),
            DEAD_WRITER_GRACE,
        )
    }

    /// [`DirStore::open`] for the records of `dep` with `layers` layers.
    pub fn for_deployment(
        root: &Path,
        dep: &crate::kernels::Deployment,
        layers: u32,
        budget: u64,
    ) -> Result<DirStore, StorageError> {
        Self::open(
            root,
            Fingerprint::of(dep, layers),
            super::payload_bytes(dep, layers),
            budget,
        )
    }

    /// [`DirStore::open`] with the time of every use taken from `clock`.
    pub fn with_clock(
        root: &Path,
        fp: Fingerprint,
        payload_bytes: u64,
        budget: u64,
        clock: Clock,
    ) -> Result<DirStore, StorageError> {
        Self::open_with(
            root,
            fp,
            payload_bytes,
            budget,
            (clock, false),
            DEAD_WRITER_GRACE,
        )
    }

    /// [`DirStore::open`] reclaiming files of dead writers in `tmp/` once `grace` old.
    #[cfg(test)]
    pub(super) fn open_reclaiming_after(
        root: &Path,
        fp: Fingerprint,
        payload_bytes: u64,
        budget: u64,
        grace: Duration,
    ) -> Result<DirStore, StorageError> {
        Self::open_with(
            root,
            fp,
            payload_bytes,
            budget,
            (Box::new(SystemTime::now), true),
            grace,
        )
    }

    fn open_with(
        root: &Path,
        fp: Fingerprint,
        payload_bytes: u64,
        budget: u64,
        (clock, wall_clock): (Clock, bool),
        dead_writer_grace: Duration,
    ) -> Result<DirStore, StorageError> {
        let io = |what: &str, name: &str, e: std::io::Error| StorageError::Io {
            what: format!("{what} {}", root.join(name).display()),
            source: e,
        };
        let record = HEADER_BYTES as u64 + payload_bytes;
        if budget < record {
            return Err(StorageError::Config(format!(
                "a storage budget of {budget} bytes holds no record of {record} bytes"
            )));
        }
        match std::fs::create_dir_all(root) {
            Err(e) if !fsx::denied(&e) => return Err(io("create", "", e)),
            _ => {}
        }
        let top = Dir::open(root).map_err(|e| io("open", "", e))?;
        // Writable when `lock` is: every write takes it.
        let lock = match top.open_file("lock", Access::ReadWriteCreate) {
            Ok(f) => Some(f),
            Err(e) if fsx::denied(&e) => None,
            Err(e) => return Err(Self::not_ours(root, &top, "lock", "file", e)),
        };
        let writable = lock.is_some();
        let mut folders = [None, None, None];
        for (slot, name) in folders.iter_mut().zip(["records", "parts", "tmp"]) {
            if writable {
                match top.mkdir(name) {
                    Err(e) if e.kind() != ErrorKind::AlreadyExists => {
                        return Err(io("create", name, e))
                    }
                    _ => {}
                }
            }
            *slot = match top.sub(name) {
                Ok(d) => Some(d),
                // A read-only store without it, or with one it may not read: nothing there.
                Err(e) if !writable && (e.kind() == ErrorKind::NotFound || fsx::denied(&e)) => None,
                Err(e) => return Err(Self::not_ours(root, &top, name, "folder", e)),
            };
        }
        let [records, parts, tmp] = folders;
        let store = DirStore {
            root: root.to_path_buf(),
            fp,
            payload_bytes,
            budget,
            clock,
            wall_clock,
            stats: Counters::default(),
            dirs: Dirs {
                root: top,
                records,
                parts,
                tmp,
            },
            lock: lock.map(Mutex::new),
            dead_writer_grace,
        };
        store.check_marker()?;
        if !writable {
            return Ok(store);
        }
        // Every record folder now, not at its first record: a folder made on a write costs
        // more than the record (a journal commit on most file systems). One that cannot be
        // made is made at its first write, or its keys stay misses.
        if let Some(records) = &store.dirs.records {
            for b in 0..=255u8 {
                let _ = records.mkdir(format!("{b:02x}"));
            }
        }
        // Reclaim what killed writers left, count what is there (a run killed between a
        // rename and its count leaves it off), and keep to this store's budget.
        store.locked(|s, f| {
            s.reclaim_tmp();
            s.sweep_parts();
            let (mut records, total) = s.scan(true)?;
            let (total, _) = s.evict_to(&mut records, total, s.budget)?;
            write_usage(f, total)
        })?;
        Ok(store)
    }

    /// The error for `name` in the root `top`, which is not the `want` (file, folder) the
    /// store keeps there, or could not be opened.
    fn not_ours(
        root: &Path,
        top: &Dir,
        name: &str,
        want: &'static str,
        e: std::io::Error,
    ) -> StorageError {
        let path = root.join(name);
        let wanted = if want == "file" {
            Kind::File
        } else {
            Kind::Dir
        };
        match top.stat(name) {
            Ok(st) if st.kind != wanted => StorageError::NotOurs {
                path,
                found: st.kind.describe(),
                want,
            },
            _ => StorageError::Io {
                what: format!("open {}", path.display()),
                source: e,
            },
        }
    }

    /// Checks `FINGERPRINT` against this deployment, writing it if missing (or replacing
    /// what is there that is not a regular file: it is informational only, records carry
    /// their own fingerprint).
    fn check_marker(&self) -> Result<(), StorageError> {
        let io = |what: &str, e: std::io::Error| StorageError::Io {
            what: format!("{what} {}", self.root.join("FINGERPRINT").display()),
            source: e,
        };
        let read = self
            .dirs
            .root
            .open_file("FINGERPRINT", Access::Read)
            .and_then(|f| {
                let mut text = String::new();
                f.take(MARKER_MAX_BYTES).read_to_string(&mut text)?;
                Ok(text)
            });
        match read {
            Ok(text) => {
                // One deployment's records per store: another's would never hit (its keys are
                // salted with its fingerprint) and would only share the byte budget.
                let mut lines = text.lines();
                if lines.next() != Some(self.fp.to_string().as_str()) {
                    return Err(StorageError::Config(format!(
                        "{} holds records of {}, this deployment's are {}: give each \
                         deployment a directory of its own",
                        self.root.display(),
                        lines.next().unwrap_or("another deployment"),
                        self.fp.describe()
                    )));
                }
                Ok(())
            }
            Err(e) if e.kind() != ErrorKind::NotFound && fsx::not_regular(&e).is_none() => {
                Err(io("read", e))
            }
            // Missing, or not a file: ours is written, unless the store is read-only.
            Err(_) if self.read_only() => Ok(()),
            Err(_) => {
                // A name of its own per opening: threads of one process open stores too.
                static OPENINGS: AtomicU64 = AtomicU64::new(0);
                let aside = format!(
                    "FINGERPRINT.{}.{}",
                    std::process::id(),
                    OPENINGS.fetch_add(1, Ordering::Relaxed)
                );
                let tmp = self.tmp()?;
                let written = tmp
                    .open_file(&aside, Access::CreateNew)
                    .and_then(|mut f| {
                        f.write_all(format!("{}\n{}\n", self.fp, self.fp.describe()).as_bytes())
                    })
                    .and_then(|()| tmp.rename(&aside, &self.dirs.root, "FINGERPRINT"));
                if let Err(e) = written {
                    let _ = tmp.unlink(&aside);
                    return Err(io("write", e));
                }
                Ok(())
            }
        }
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether this process may only read the store (nothing is written, stamped or
    /// evicted).
    pub fn is_read_only(&self) -> bool {
        self.lock.is_none()
    }

    /// Where the record of `key` lives.
    pub fn path_of(&self, key: &RecordKey) -> PathBuf {
        let (folder, name) = record_name(key);
        self.root.join("records").join(folder).join(name)
    }

    /// The folder of the parts of `key`'s record written so far (a record written in
    /// parts: [`PageStore::put_part`]).
    pub fn parts_dir(&self, key: &RecordKey) -> PathBuf {
        self.root.join("parts").join(key.hex())
    }

    fn tmp(&self) -> Result<&Dir, StorageError> {
        self.dirs.tmp.as_ref().ok_or_else(|| self.read_only_error())
    }

    fn read_only_error(&self) -> StorageError {
        StorageError::ReadOnly(self.root.clone())
    }

    /// The folder `records/<folder>`, if it can be opened. When `make`, one that is missing
    /// is made, and anything else at its name (a link, a file) replaced by a folder.
    fn folder(&self, folder: &str, make: bool) -> std::io::Result<Dir> {
        let records = self
            .dirs
            .records
            .as_ref()
            .ok_or_else(|| std::io::Error::from(ErrorKind::NotFound))?;
        match records.sub(folder) {
            Err(e) if make && e.kind() == ErrorKind::NotFound => {
                match records.mkdir(folder) {
                    Err(e) if e.kind() != ErrorKind::AlreadyExists => return Err(e),
                    _ => {}
                }
                records.sub(folder)
            }
            Err(e) if make && matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                // A link goes, never what it points to.
                let _ = records.unlink(folder);
                match records.mkdir(folder) {
                    Err(e) if e.kind() != ErrorKind::AlreadyExists => return Err(e),
                    _ => {}
                }
                records.sub(folder)
            }
            r => r,
        }
    }

    /// Whether the record of `key` is there, as a regular file.
    fn has_record(&self, key: &RecordKey) -> bool {
        let (folder, name) = record_name(key);
        self.folder(&folder, false)
            .and_then(|d| d.stat(&name))
            .is_ok_and(|st| st.kind == Kind::File)
    }

    /// The key a part's own header carries, so a part filed under another record, or as
    /// another part, is refused.
    fn part_key(&self, key: &RecordKey, part: u32, parts: u32) -> RecordKey {
        RecordKey::of_name(&self.fp, &format!("{}/part {part} of {parts}", key.hex()))
    }

    /// Parts of `key`'s record present, and of how many, if any part is.
    fn parts_present(&self, key: &RecordKey) -> Option<(u32, u32)> {
        let dir = self.dirs.parts.as_ref()?.sub(key.hex()).ok()?;
        let mut have = 0;
        let mut of = 0;
        for name in dir.names().ok()? {
            let Some((_, n)) = part_name(&name) else {
                continue;
            };
            if dir.stat(&name).is_ok_and(|st| st.kind == Kind::File) {
                have += 1;
                of = n;
            }
        }
        (have > 0).then_some((have, of))
    }

    /// Removes the parts of `key`'s record, returning their bytes (under the lock).
    fn drop_parts(&self, key: &RecordKey) -> u64 {
        self.dirs
            .parts
            .as_ref()
            .map_or(0, |parts| parts.remove_tree(key.hex()))
    }

    /// Removes files in `tmp/` whose writer is gone (after a grace) or that are old (under
    /// the lock, at open). Only names the store writes there: others are left as they are.
    fn reclaim_tmp(&self) {
        let Some(tmp) = &self.dirs.tmp else { return };
        let now = SystemTime::now();
        for name in tmp.names().unwrap_or_default() {
            let Some(pid) = aside_writer(&name) else {
                continue;
            };
            let Ok(st) = tmp.stat(&name) else { continue };
            // The inode's change time: a writer with a test clock sets the modification
            // time of what it writes, never this.
            let age = now.duration_since(st.ctime).unwrap_or_default();
            let dead = pid != std::process::id() as i32 && !fsx::pid_alive(pid);
            if age >= LEFTOVER_AGE || (dead && age >= self.dead_writer_grace) {
                tmp.remove_tree(&name);
            }
        }
    }

    /// Removes parts of records that are whole (a writer of a part came after the record
    /// was assembled), parts left incomplete for [`LEFTOVER_AGE`] (their writer died), and
    /// anything but a folder at a record's parts name (under the lock, at open).
    fn sweep_parts(&self) {
        let Some(parts) = &self.dirs.parts else {
            return;
        };
        let now = SystemTime::now();
        for name in parts.names().unwrap_or_default() {
            let Some(hex) = name.to_str().filter(|n| is_key_hex(n)) else {
                continue;
            };
            let Ok(st) = parts.stat(&name) else { continue };
            let whole = hex::decode(hex)
                .ok()
                .and_then(|b| <[u8; 16]>::try_from(b).ok())
                .is_some_and(|k| self.has_record(&RecordKey(k)));
            let old = now
                .duration_since(st.mtime)
                .is_ok_and(|age| age > LEFTOVER_AGE);
            if st.kind != Kind::Dir || whole || old {
                parts.remove_tree(&name);
            }
        }
    }

    /// Reads and checks the `parts` parts of `key`'s record in folder `dir`, if all are
    /// there, and removes them (under the lock, so one writer alone finds them complete);
    /// with the bytes removed.
    fn take_parts(&self, key: &RecordKey, dir: &Dir, parts: u32) -> Option<(TakenParts, u64)> {
        let names: Vec<String> = (0..parts).map(|p| format!("{p}-of-{parts}")).collect();
        if !names
            .iter()
            .all(|n| dir.stat(n).is_ok_and(|st| st.kind == Kind::File))
        {
            return None;
        }
        let mut out = Vec::with_capacity(names.len());
        let mut bad = None;
        for (p, name) in names.iter().enumerate() {
            let pk = self.part_key(key, p as u32, parts);
            // A part is as long as its writer's tokens, at most a record: its header's
            // length is checked against the file, its key and checksum against the rest.
            let mut bytes = Vec::new();
            let read = dir.open_file(name, Access::Read).and_then(|f| {
                f.take(HEADER_BYTES as u64 + self.payload_bytes + 1)
                    .read_to_end(&mut bytes)
            });
            let decoded = match read {
                Ok(_) => {
                    let len = (bytes.len() as u64).saturating_sub(HEADER_BYTES as u64);
                    record::decode(&bytes, &self.fp, &pk, len).map(<[u8]>::to_vec)
                }
                // Gone or unreadable since it was seen: the record cannot be assembled.
                Err(_) => Err(RecordError::Incomplete {
                    have: p as u32,
                    parts,
                }),
            };
            match decoded {
                Ok(payload) => out.push(payload),
                Err(e) => {
                    bad = Some(e);
                    break;
                }
            }
        }
        let removed = self.drop_parts(key);
        Some((
            match bad {
                Some(e) => Err(e),
                None => Ok(out),
            },
            removed,
        ))
    }

    /// Bytes of one record on disk.
    pub fn record_bytes(&self) -> u64 {
        HEADER_BYTES as u64 + self.payload_bytes
    }

    /// Runs `f` with the usage file locked against every process sharing the directory.
    fn locked<T>(
        &self,
        f: impl FnOnce(&Self, &mut File) -> Result<T, StorageError>,
    ) -> Result<T, StorageError> {
        let lock = self.lock.as_ref().ok_or_else(|| self.read_only_error())?;
        let mut file = lock.lock().unwrap_or_else(|p| p.into_inner());
        file.lock_exclusive().map_err(|e| StorageError::Io {
            what: format!("lock {}", self.root.join("lock").display()),
            source: e,
        })?;
        let out = f(self, &mut file);
        let _ = FileExt::unlock(&*file);
        out
    }

    /// Every record file (a regular file of a record's name in a record folder) with its
    /// last use and size, and the total size of them, of held parts and of files aside in
    /// `tmp/`. When `heal`, a
    /// record folder that is missing or not a folder is made one.
    fn scan(&self, heal: bool) -> Result<(Vec<Found>, u64), StorageError> {
        let mut out = Vec::new();
        let mut total = 0u64;
        let io = |p: &str, e: std::io::Error| StorageError::Io {
            what: format!("scan {}", self.root.join(p).display()),
            source: e,
        };
        for b in 0..=255u8 {
            let folder = format!("{b:02x}");
            // A folder that cannot be read (or is no folder) is a miss for its keys.
            let Ok(dir) = self.folder(&folder, heal) else {
                continue;
            };
            let names = match dir.names() {
                Ok(n) => n,
                Err(e) if fsx::denied(&e) => continue,
                Err(e) => return Err(io(&format!("records/{folder}"), e)),
            };
            for name in names {
                if !is_record_name(&folder, &name) {
                    continue;
                }
                // A file removed meanwhile (another process evicted it) is skipped.
                let Ok(st) = dir.stat(&name) else { continue };
                if st.kind != Kind::File {
                    continue;
                }
                total += st.len;
                out.push((st.mtime, folder.clone(), name, st.len));
            }
        }
        total += self.held_parts_bytes() + self.aside_bytes();
        Ok((out, total))
    }

    /// Bytes of the records and parts in `tmp/`: in flight (counted at their full length
    /// from the moment they are made), or left by writers that died and not yet reclaimed.
    fn aside_bytes(&self) -> u64 {
        let Some(tmp) = &self.dirs.tmp else {
            return 0;
        };
        let mut total = 0;
        for name in tmp.names().unwrap_or_default() {
            // A key's record or part; not `FINGERPRINT`'s, a few bytes renamed at once.
            let ours = aside_writer(&name).is_some()
                && !name.to_str().is_some_and(|n| n.starts_with("FINGERPRINT"));
            if !ours {
                continue;
            }
            match tmp.stat(&name) {
                Ok(st) if st.kind == Kind::File => total += st.len,
                _ => {}
            }
        }
        total
    }

    /// Bytes of the parts held in `parts/`, waiting for their records' other parts.
    fn held_parts_bytes(&self) -> u64 {
        let Some(parts) = &self.dirs.parts else {
            return 0;
        };
        let mut total = 0;
        for name in parts.names().unwrap_or_default() {
            if !name.to_str().is_some_and(is_key_hex) {
                continue;
            }
            let Ok(dir) = parts.sub(&name) else { continue };
            for part in dir.names().unwrap_or_default() {
                if part_name(&part).is_none() {
                    continue;
                }
                match dir.stat(&part) {
                    Ok(st) if st.kind == Kind::File => total += st.len,
                    _ => {}
                }
            }
        }
        total
    }

    /// Removes the least recently used of `records` until `total` is at most `limit`;
    /// returns the new total and how many records this call removed.
    fn evict_to(
        &self,
        records: &mut [Found],
        mut total: u64,
        limit: u64,
    ) -> Result<(u64, u64), StorageError> {
        let mut removed = 0;
        if total <= limit {
            return Ok((total, removed));
        }
        records.sort();
        for (_, folder, name, bytes) in records.iter() {
            if total <= limit {
                break;
            }
            // Opened again without following a link: what is removed is the name in the
            // store's own folder, never a file elsewhere.
            let gone = self.folder(folder, false).and_then(|d| d.unlink(name));
            match gone {
                Ok(()) => {
                    removed += 1;
                    self.stats.evictions.fetch_add(1, Ordering::Relaxed);
                    self.stats
                        .evicted_bytes
                        .fetch_add(*bytes, Ordering::Relaxed);
                }
                Err(e) if e.kind() == ErrorKind::NotFound || fsx::not_regular(&e).is_some() => {}
                Err(e) => {
                    return Err(StorageError::Io {
                        what: format!(
                            "evict {}",
                            self.root.join("records").join(folder).join(name).display()
                        ),
                        source: e,
                    })
                }
            }
            total = total.saturating_sub(*bytes);
        }
        Ok((total, removed))
    }

    /// Adds `delta` bytes to the shared count (under the lock); over budget, evicts least
    /// recently used records (never `keep`, the one just written) down to it. Returns the
    /// records evicted.
    fn account(
        &self,
        f: &mut File,
        total: u64,
        keep: Option<&RecordKey>,
    ) -> Result<u64, StorageError> {
        if total <= self.budget {
            return write_usage(f, total).map(|()| 0);
        }
        let (mut records, scanned) = self.scan(false)?;
        if let Some(key) = keep {
            let (folder, name) = record_name(key);
            records.retain(|(_, d, n, _)| !(*d == folder && n.as_os_str() == OsStr::new(&name)));
        }
        let (total, evicted) = self.evict_to(&mut records, scanned, self.budget)?;
        write_usage(f, total).map(|()| evicted)
    }

    /// Marks a record used now (its modification time), for the LRU order.
    fn touch(&self, dir: &Dir, name: &str) {
        if let Ok(f) = dir.open_file(name, Access::ReadWrite) {
            self.stamp(&f, None);
        }
    }

    /// Sets an open record's LRU stamp to now, unless it was `last` set within the second:
    /// the order is kept to the second, which spares a metadata write on most hits of a
    /// busy record.
    fn stamp(&self, file: &File, last: Option<SystemTime>) {
        let now = (self.clock)();
        let recent = last
            .and_then(|l| now.duration_since(l).ok())
            .is_some_and(|d| d < Duration::from_secs(1));
        if !recent {
            let _ = file.set_modified(now);
        }
    }

    /// Writes `bytes` (in pieces) to a new file in `tmp/`, named for `key` (and `part`),
    /// returning its name; nothing is left (or counted) on failure. `what` names the file's
    /// destination, for errors.
    ///
    /// The file counts against the budget from the moment it is made: it is made, given
    /// its full length and counted under the lock (evicting records if the store is over
    /// budget), so a scan counts it as it will be; written outside the lock; and later
    /// renamed into place, which changes no count, or removed and taken off the count.
    fn write_aside(
        &self,
        key: &RecordKey,
        part: Option<u32>,
        bytes: &[&[u8]],
        what: &Path,
    ) -> Result<String, StorageError> {
        let io = |e: std::io::Error| StorageError::Io {
            what: format!("write {}", what.display()),
            source: e,
        };
        let tmp = self.tmp()?;
        let n = ASIDE_NONCE.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let name = match part {
            Some(p) => format!("{}.part{p}.{pid}.{n}", key.hex()),
            None => format!("{}.{pid}.{n}", key.hex()),
        };
        let len: u64 = bytes.iter().map(|b| b.len() as u64).sum();
        let file = self.locked(|s, f| {
            let made = tmp.open_file(&name, Access::CreateNew).and_then(|file| {
                // Sparse: the length only, no block is written here.
                file.set_len(len)?;
                Ok(file)
            });
            let counted = made.map_err(io).and_then(|file| {
                let total = read_usage(f)?.saturating_add(len);
                s.account(f, total, None).map(|_| file)
            });
            if counted.is_err() {
                let _ = tmp.unlink(&name);
            }
            counted
        })?;
        let written = (|| {
            let mut file = file;
            // Header and payload as they are: a copy of a page's size costs more than
            // the write.
            for b in bytes {
                file.write_all(b)?;
            }
            // A new file's time is the wall clock's already; a test's clock sets it.
            if !self.wall_clock {
                file.set_modified((self.clock)())?;
            }
            Ok(())
        })();
        match written {
            Ok(()) => Ok(name),
            Err(e) => {
                self.release_aside(&name, len);
                Err(io(e))
            }
        }
    }

    /// Removes the file `name` written aside, of `bytes` bytes, and takes it off the count.
    fn release_aside(&self, name: &str, bytes: u64) {
        let Some(tmp) = &self.dirs.tmp else { return };
        let released = self.locked(|s, f| s.drop_aside(f, name, bytes));
        if released.is_err() {
            // Left on the count (too high, never too low) until the store is next opened.
            let _ = tmp.unlink(name);
        }
    }

    /// Removes the file `name` written aside, of `bytes` bytes, and takes it off the count
    /// (under the lock); if it is gone already, the count is left as it is.
    fn drop_aside(&self, f: &mut File, name: &str, bytes: u64) -> Result<(), StorageError> {
        let Some(tmp) = &self.dirs.tmp else {
            return Ok(());
        };
        if tmp.unlink(name).is_ok() {
            let total = read_usage(f)?.saturating_sub(bytes);
            write_usage(f, total)?;
        }
        Ok(())
    }

    /// Renames the record written aside as `aside` into place as `key`'s, unless a record
    /// of `key` is there (another writer's: then the one aside goes, and off the count),
    /// under the lock, so two writers of one record count it once (each counted its file
    /// aside when it made it; the rename changes no count). Anything at the record's name
    /// that is not a regular file is replaced. Whether it was renamed, and the records
    /// evicted.
    fn place(&self, key: &RecordKey, aside: &str, bytes: u64) -> Result<Option<u64>, StorageError> {
        let (folder, name) = record_name(key);
        let path = self.path_of(key);
        let io = |e: std::io::Error| StorageError::Io {
            what: format!("write {}", path.display()),
            source: e,
        };
        let tmp = self.tmp()?;
        let placed = self.locked(|s, f| {
            let dir = s.folder(&folder, true).map_err(io)?;
            match dir.stat(&name) {
                Ok(st) if st.kind == Kind::File => {
                    return s.drop_aside(f, aside, bytes).map(|()| None)
                }
                // A folder at its name would block the rename: it goes.
                Ok(st) if st.kind == Kind::Dir => {
                    dir.remove_tree(&name);
                }
                // A link, FIFO or socket is replaced by the rename itself.
                _ => {}
            }
            tmp.rename(aside, &dir, &name).map_err(io)?;
            // Parts of it a writer added after it was assembled are of no use now.
            let dropped = s.drop_parts(key);
            let total = read_usage(f)?.saturating_sub(dropped);
            s.account(f, total, Some(key)).map(Some)
        });
        if placed.is_err() {
            self.release_aside(aside, bytes);
        }
        placed
    }
}

fn read_usage(f: &mut File) -> Result<u64, StorageError> {
    let mut b = [0u8; 8];
    match f.read_exact_at(&mut b, 0) {
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => Ok(()),
        r => r,
    }
    .map_err(|e| StorageError::Io {
        what: "read the store's usage".into(),
        source: e,
    })?;
    Ok(u64::from_le_bytes(b))
}

fn write_usage(f: &mut File, total: u64) -> Result<(), StorageError> {
    f.write_all_at(&total.to_le_bytes(), 0)
        .map_err(|e| StorageError::Io {
            what: "write the store's usage".into(),
            source: e,
        })
}

impl PageStore for DirStore {
    fn fingerprint(&self) -> &Fingerprint {
        &self.fp
    }

    fn payload_bytes(&self) -> u64 {
        self.payload_bytes
    }

    fn read_only(&self) -> bool {
        self.is_read_only()
    }

    fn put(&self, key: &RecordKey, payload: &[u8]) -> Result<Put, StorageError> {
        super::check_payload(key, payload, self.payload_bytes)?;
        if self.is_read_only() {
            return Err(self.read_only_error());
        }
        let (folder, name) = record_name(key);
        if let Ok(dir) = self.folder(&folder, false) {
            if dir.stat(&name).is_ok_and(|st| st.kind == Kind::File) {
                self.touch(&dir, &name);
                self.stats.already_present.fetch_add(1, Ordering::Relaxed);
                return Ok(Put::Present);
            }
        }
        let head = record::header(&self.fp, key, payload);
        let bytes = (HEADER_BYTES + payload.len()) as u64;
        let aside = self.write_aside(key, None, &[&head, payload], &self.path_of(key))?;
        match self.place(key, &aside, bytes)? {
            Some(evicted) => {
                self.stats.records_written.fetch_add(1, Ordering::Relaxed);
                self.stats.bytes_written.fetch_add(bytes, Ordering::Relaxed);
                Ok(Put::Written { evicted })
            }
            None => {
                self.stats.already_present.fetch_add(1, Ordering::Relaxed);
                Ok(Put::Present)
            }
        }
    }

    fn put_part(
        &self,
        key: &RecordKey,
        part: u32,
        parts: u32,
        payload: &[u8],
        assemble: Assemble<'_>,
    ) -> Result<PartPut, StorageError> {
        super::check_part(key, part, parts, payload, self.payload_bytes)?;
        if self.is_read_only() {
            return Err(self.read_only_error());
        }
        let pname = format!("{part}-of-{parts}");
        let path = self.parts_dir(key).join(&pname);
        let io = |e: std::io::Error| StorageError::Io {
            what: format!("write {}", path.display()),
            source: e,
        };
        let present = |s: &Self, f: &mut File| {
            // Written whole meanwhile (by a run of another layout, or by the writer that
            // assembled it): parts of it are of no use.
            let dropped = s.drop_parts(key);
            if dropped > 0 {
                let total = read_usage(f)?.saturating_sub(dropped);
                write_usage(f, total)?;
            }
            s.stats.already_present.fetch_add(1, Ordering::Relaxed);
            Ok(None)
        };
        if self.has_record(key) {
            self.locked(present)?;
            return Ok(PartPut::Present);
        }
        // Written aside, then renamed into the record's parts folder under the lock, where
        // parts folders are made and removed: a part is whole or absent, like a record,
        // and never renamed into a folder another writer is removing.
        let head = record::header(&self.fp, &self.part_key(key, part, parts), payload);
        let part_bytes = HEADER_BYTES as u64 + payload.len() as u64;
        let aside = self.write_aside(key, Some(part), &[&head, payload], &path)?;
        let tmp = self.tmp()?;
        let taken = self.locked(|s, f| {
            if s.has_record(key) {
                s.drop_aside(f, &aside, part_bytes)?;
                return present(s, f);
            }
            let all = s.dirs.parts.as_ref().ok_or_else(|| s.read_only_error())?;
            let hex = key.hex();
            let dir = match all.sub(&hex) {
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    all.mkdir(&hex).map_err(io)?;
                    all.sub(&hex)
                }
                Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                    let _ = all.unlink(&hex);
                    all.mkdir(&hex).map_err(io)?;
                    all.sub(&hex)
                }
                r => r,
            }
            .map_err(io)?;
            let replaced = match dir.stat(&pname) {
                Ok(st) if st.kind == Kind::File => st.len,
                Ok(st) if st.kind == Kind::Dir => {
                    dir.remove_tree(&pname);
                    0
                }
                _ => 0,
            };
            // Counted when it was written aside: renamed, it counts as a held part.
            tmp.rename(&aside, &dir, &pname).map_err(io)?;
            let mut total = read_usage(f)?.saturating_sub(replaced);
            let taken = s.take_parts(key, &dir, parts);
            if let Some((_, removed)) = &taken {
                total = total.saturating_sub(*removed);
            }
            write_usage(f, total)?;
            Ok(Some(taken))
        });
        let taken = match taken {
            Ok(t) => t,
            Err(e) => {
                self.release_aside(&aside, part_bytes);
                return Err(e);
            }
        };
        match taken {
            None => Ok(PartPut::Present),
            Some(None) => Ok(PartPut::Held),
            Some(Some((Err(why), _))) => {
                // A damaged part: the record cannot be assembled; its parts are gone, so
                // the next writers start it again.
                self.refused(&why);
                Ok(PartPut::Held)
            }
            Some(Some((Ok(all), _))) => {
                let Some(payload) = assemble(&all) else {
                    let sizes: Vec<usize> = all.iter().map(Vec::len).collect();
                    return Err(StorageError::Config(format!(
                        "the parts of record {key} ({sizes:?} bytes) are not of this \
                         layout's sizes: two layouts write parts of one record"
                    )));
                };
                match self.put(key, &payload)? {
                    Put::Written { evicted } => Ok(PartPut::Completed { evicted }),
                    Put::Present => Ok(PartPut::Present),
                }
            }
        }
    }

    fn get(&self, key: &RecordKey) -> Result<Lookup, StorageError> {
        let path = self.path_of(key);
        let io = |e: std::io::Error| StorageError::Io {
            what: format!("read {}", path.display()),
            source: e,
        };
        let (folder, name) = record_name(key);
        let miss = || {
            // Parts of it without the record: a part never came.
            if let Some((have, parts)) = self.parts_present(key) {
                let why = RecordError::Incomplete { have, parts };
                self.refused(&why);
                return Ok(Lookup::Refused(why));
            }
            self.stats.misses.fetch_add(1, Ordering::Relaxed);
            Ok(Lookup::Miss)
        };
        // A folder that is missing, cannot be read, or is not a folder: a miss.
        let Ok(dir) = self.folder(&folder, false) else {
            return miss();
        };
        // Opened for writing too: the LRU stamp is set through the same handle. A record
        // this process may only read (another user's file) is still read, without stamps.
        let opened = if self.is_read_only() {
            dir.open_file(&name, Access::Read)
        } else {
            match dir.open_file(&name, Access::ReadWrite) {
                Err(e) if fsx::denied(&e) => dir.open_file(&name, Access::Read),
                r => r,
            }
        };
        let mut file = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => return miss(),
            Err(e) => match fsx::not_regular(&e) {
                // Not followed, not read: refused, and replaced when the key is written.
                Some(kind) => {
                    let why = RecordError::NotRegular(kind.describe());
                    self.refused(&why);
                    return Ok(Lookup::Refused(why));
                }
                None => return Err(io(e)),
            },
        };
        let meta = file.metadata().map_err(io)?;
        // The header first, then the payload straight into the buffer handed out: a copy
        // of a page's size costs more than the read (a fresh mapping, faulted in page by
        // page).
        let mut head = [0u8; HEADER_BYTES];
        let checked = match file.read_exact(&mut head) {
            Ok(()) => record::check_header(&head, meta.len(), &self.fp, key, self.payload_bytes),
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => Err(RecordError::Torn {
                have: meta.len(),
                want: HEADER_BYTES as u64,
            }),
            Err(e) => return Err(io(e)),
        };
        let read = checked.and_then(|()| {
            // Read into the buffer's spare capacity, never zeroed first: zeroing a page's
            // size costs as much as the checksum.
            let mut payload = Vec::with_capacity(self.payload_bytes as usize);
            match (&mut file)
                .take(self.payload_bytes)
                .read_to_end(&mut payload)
            {
                Ok(n) if n as u64 == self.payload_bytes => {}
                Ok(_) => {
                    // The file shrank since its length was checked: a torn record.
                    return Err(RecordError::Torn {
                        have: meta.len(),
                        want: HEADER_BYTES as u64 + self.payload_bytes,
                    });
                }
                Err(e) => return Ok(Err(io(e))),
            }
            record::check_payload(&head, &payload).map(|()| Ok(payload))
        });
        match read {
            Ok(Ok(payload)) => {
                if !self.is_read_only() {
                    self.stamp(&file, meta.modified().ok());
                }
                self.stats.records_read.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .bytes_read
                    .fetch_add(meta.len(), Ordering::Relaxed);
                Ok(Lookup::Hit(payload))
            }
            Ok(Err(e)) => Err(e),
            Err(why) => {
                self.refused(&why);
                // The bad file goes, so the record can be written again; its bytes leave
                // the count at the next scan. Only if it is still the file that was read:
                // a writer may have renamed a good record over it meanwhile.
                drop(file);
                use std::os::unix::fs::MetadataExt as _;
                let same = dir
                    .stat(&name)
                    .is_ok_and(|now| now.dev == meta.dev() && now.ino == meta.ino());
                if same && !self.is_read_only() {
                    let _ = dir.unlink(&name);
                }
                Ok(Lookup::Refused(why))
            }
        }
    }

    fn present_run(&self, keys: &[RecordKey]) -> Result<usize, StorageError> {
        Ok(keys
            .iter()
            .position(|k| !self.has_record(k))
            .unwrap_or(keys.len()))
    }

    fn stats(&self) -> StoreStats {
        let s = &self.stats;
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StoreStats {
            records_written: g(&s.records_written),
            bytes_written: g(&s.bytes_written),
            already_present: g(&s.already_present),
            records_read: g(&s.records_read),
            bytes_read: g(&s.bytes_read),
            misses: g(&s.misses),
            refused_torn: g(&s.refused_torn),
            refused_checksum: g(&s.refused_checksum),
            refused_fingerprint: g(&s.refused_fingerprint),
            evictions: g(&s.evictions),
            evicted_bytes: g(&s.evicted_bytes),
        }
    }

    fn usage(&self) -> Result<u64, StorageError> {
        if self.is_read_only() {
            // No count of ours to trust or lock: what is there now.
            return self.scan(false).map(|(_, total)| total);
        }
        self.locked(|_, f| read_usage(f))
    }
}

impl DirStore {
    fn refused(&self, why: &RecordError) {
        let c = match why.refusal() {
            Refusal::Torn => &self.stats.refused_torn,
            Refusal::Fingerprint => &self.stats.refused_fingerprint,
            Refusal::Checksum => &self.stats.refused_checksum,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}
