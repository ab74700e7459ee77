//! The embedded store: one file per record in a directory that every rank's process (and
//! later runs) share. A record is written aside and renamed into place, so a reader sees a
//! whole record or none; the byte budget is kept under a file lock, evicting the least
//! recently used records (a record's modification time is its last use).

use super::record::{self, RecordError, Refusal, HEADER_BYTES};
use super::{
    Assemble, Fingerprint, Lookup, PageStore, PartPut, Put, RecordKey, StorageError, StoreStats,
};
use fs4::fs_std::FileExt;

/// A record's parts, read and checked in part order, or why one was refused.
type TakenParts = Result<Vec<Vec<u8>>, RecordError>;
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{FileExt as _, MetadataExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::SystemTime;

/// A record file as a scan finds it: its last use, path and size.
type Found = (SystemTime, PathBuf, u64);

/// Where a store's time comes from: the wall clock, or a test's.
pub type Clock = Box<dyn Fn() -> SystemTime + Send + Sync>;

/// The suffix of a file written aside, unique in this process (with its id, unique on the
/// host): one counter for every store, since several stores of one directory live in one
/// process (the ranks of a cluster) and may write the same record at once.
static ASIDE_NONCE: AtomicU64 = AtomicU64::new(0);

/// A [`PageStore`] over a directory:
/// - `records/<first two hex digits>/<key>.rec`, one file per record;
/// - `tmp/`, where records are written before they are renamed into place;
/// - `lock`, locked exclusively while the byte count (`usage`, 8 bytes) is updated and
///   while records are evicted;
/// - `FINGERPRINT`, the deployment whose records these are, in words (a store holds one
///   deployment's records; a record of another is refused when read).
pub struct DirStore {
    root: PathBuf,
    fp: Fingerprint,
    payload_bytes: u64,
    budget: u64,
    clock: Clock,
    /// Whether `clock` is the wall clock (then a new file's time needs no setting).
    wall_clock: bool,
    stats: Counters,
    /// Held while this store updates the usage count (the file lock serialises processes,
    /// this the threads of one).
    lock: Mutex<File>,
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

impl DirStore {
    /// Opens (creating it if need be) the store in `root` for deployment `fp`, whose
    /// records hold `payload_bytes` bytes, keeping at most `budget` bytes of records.
    pub fn open(
        root: &Path,
        fp: Fingerprint,
        payload_bytes: u64,
        budget: u64,
    ) -> Result<DirStore, StorageError> {
        let mut store =
            Self::with_clock(root, fp, payload_bytes, budget, Box::new(SystemTime::now))?;
        store.wall_clock = true;
        Ok(store)
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
        let io = |what: &str, path: &Path, e: std::io::Error| StorageError::Io {
            what: format!("{what} {}", path.display()),
            source: e,
        };
        let record = HEADER_BYTES as u64 + payload_bytes;
        if budget < record {
            return Err(StorageError::Config(format!(
                "a storage budget of {budget} bytes holds no record of {record} bytes"
            )));
        }
        for d in [root.to_path_buf(), root.join("records"), root.join("tmp")] {
            fs::create_dir_all(&d).map_err(|e| io("create", &d, e))?;
        }
        // Every record folder now, not at its first record: a folder made on a write costs
        // more than the record (a journal commit on most file systems).
        for b in 0..=255u8 {
            let d = root.join("records").join(format!("{b:02x}"));
            match fs::create_dir(&d) {
                Err(e) if e.kind() != ErrorKind::AlreadyExists => return Err(io("create", &d, e)),
                _ => {}
            }
        }
        let marker = root.join("FINGERPRINT");
        match fs::read_to_string(&marker) {
            Ok(text) => {
                // One deployment's records per store: another's would never hit (its keys are
                // salted with its fingerprint) and would only share the byte budget.
                let mut lines = text.lines();
                if lines.next() != Some(fp.to_string().as_str()) {
                    return Err(StorageError::Config(format!(
                        "{} holds records of {}, this deployment's are {}: give each \
                         deployment a directory of its own",
                        root.display(),
                        lines.next().unwrap_or("another deployment"),
                        fp.describe()
                    )));
                }
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                // Informational only (records carry their own fingerprint): written aside.
                // A name of its own per opening: threads of one process open stores too.
                static OPENINGS: AtomicU64 = AtomicU64::new(0);
                let tmp = root.join("tmp").join(format!(
                    "FINGERPRINT.{}.{}",
                    std::process::id(),
                    OPENINGS.fetch_add(1, Ordering::Relaxed)
                ));
                let written = fs::write(&tmp, format!("{}\n{}\n", fp, fp.describe()))
                    .and_then(|()| fs::rename(&tmp, &marker));
                if let Err(e) = written {
                    let _ = fs::remove_file(&tmp);
                    return Err(io("write", &marker, e));
                }
            }
            Err(e) => return Err(io("read", &marker, e)),
        }
        let lock_path = root.join("lock");
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(|e| io("open", &lock_path, e))?;
        let store = DirStore {
            root: root.to_path_buf(),
            fp,
            payload_bytes,
            budget,
            clock,
            wall_clock: false,
            stats: Counters::default(),
            lock: Mutex::new(lock),
        };
        // Count what is there (a run killed between a rename and its count leaves it off),
        // and keep to this store's budget.
        store.sweep_parts();
        store.locked(|s, f| {
            let (mut records, total) = s.scan()?;
            let (total, _) = s.evict_to(&mut records, total, s.budget)?;
            write_usage(f, total)
        })?;
        Ok(store)
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the record of `key` lives.
    pub fn path_of(&self, key: &RecordKey) -> PathBuf {
        let hex = key.hex();
        self.root
            .join("records")
            .join(&hex[..2])
            .join(format!("{hex}.rec"))
    }

    /// The folder of the parts of `key`'s record written so far (a record written in
    /// parts: [`PageStore::put_part`]).
    pub fn parts_dir(&self, key: &RecordKey) -> PathBuf {
        self.root.join("parts").join(key.hex())
    }

    /// The key a part's own header carries, so a part filed under another record, or as
    /// another part, is refused.
    fn part_key(&self, key: &RecordKey, part: u32, parts: u32) -> RecordKey {
        RecordKey::of_name(&self.fp, &format!("{}/part {part} of {parts}", key.hex()))
    }

    /// Parts of `key`'s record present, and of how many, if any part is.
    fn parts_present(&self, key: &RecordKey) -> Option<(u32, u32)> {
        let entries = fs::read_dir(self.parts_dir(key)).ok()?;
        let mut have = 0;
        let mut of = 0;
        for e in entries.flatten() {
            let name = e.file_name();
            let Some((_, n)) = name.to_str().and_then(|n| n.split_once("-of-")) else {
                continue;
            };
            if let Ok(n) = n.parse::<u32>() {
                have += 1;
                of = n;
            }
        }
        (have > 0).then_some((have, of))
    }

    /// Removes the parts of records left incomplete for an hour (their writer died): a
    /// record's parts are written within one backup, seconds apart.
    fn sweep_parts(&self) {
        let Ok(entries) = fs::read_dir(self.root.join("parts")) else {
            return;
        };
        let now = SystemTime::now();
        for e in entries.flatten() {
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .is_some_and(|age| age > std::time::Duration::from_secs(3600));
            if old {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }

    /// Reads and checks the `parts` parts of `key`'s record, if all are there, and removes
    /// them; under the store's lock, so one writer alone finds them complete.
    fn take_parts(&self, key: &RecordKey, parts: u32) -> Result<Option<TakenParts>, StorageError> {
        self.locked(|s, _| {
            let dir = s.parts_dir(key);
            let paths: Vec<PathBuf> = (0..parts)
                .map(|p| dir.join(format!("{p}-of-{parts}")))
                .collect();
            if !paths.iter().all(|p| p.exists()) {
                return Ok(None);
            }
            let mut out = Vec::with_capacity(paths.len());
            let mut bad = None;
            for (p, path) in paths.iter().enumerate() {
                let bytes = fs::read(path).map_err(|e| StorageError::Io {
                    what: format!("read {}", path.display()),
                    source: e,
                })?;
                let pk = s.part_key(key, p as u32, parts);
                // A part is as long as its writer's tokens: its header's length is checked
                // against the file, its key and checksum against the rest.
                let len = (bytes.len() as u64).saturating_sub(HEADER_BYTES as u64);
                match record::decode(&bytes, &s.fp, &pk, len) {
                    Ok(payload) => out.push(payload.to_vec()),
                    Err(e) => {
                        bad = Some(e);
                        break;
                    }
                }
            }
            let _ = fs::remove_dir_all(&dir);
            Ok(Some(match bad {
                Some(e) => Err(e),
                None => Ok(out),
            }))
        })
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
        let mut file = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        file.lock_exclusive().map_err(|e| StorageError::Io {
            what: format!("lock {}", self.root.join("lock").display()),
            source: e,
        })?;
        let out = f(self, &mut file);
        let _ = FileExt::unlock(&*file);
        out
    }

    /// Every record file with its last use and size, and their total size.
    fn scan(&self) -> Result<(Vec<Found>, u64), StorageError> {
        let mut out = Vec::new();
        let mut total = 0u64;
        let records = self.root.join("records");
        let io = |p: &Path, e: std::io::Error| StorageError::Io {
            what: format!("scan {}", p.display()),
            source: e,
        };
        for dir in fs::read_dir(&records).map_err(|e| io(&records, e))? {
            let dir = dir.map_err(|e| io(&records, e))?.path();
            if !dir.is_dir() {
                continue;
            }
            for f in fs::read_dir(&dir).map_err(|e| io(&dir, e))? {
                let f = f.map_err(|e| io(&dir, e))?;
                // A file removed meanwhile (another process evicted it) is skipped.
                let Ok(meta) = f.metadata() else { continue };
                if !meta.is_file() {
                    continue;
                }
                let used = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                total += meta.len();
                out.push((used, f.path(), meta.len()));
            }
        }
        Ok((out, total))
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
        for (_, path, bytes) in records.iter() {
            if total <= limit {
                break;
            }
            match fs::remove_file(path) {
                Ok(()) => {
                    removed += 1;
                    self.stats.evictions.fetch_add(1, Ordering::Relaxed);
                    self.stats
                        .evicted_bytes
                        .fetch_add(*bytes, Ordering::Relaxed);
                }
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(StorageError::Io {
                        what: format!("evict {}", path.display()),
                        source: e,
                    })
                }
            }
            total = total.saturating_sub(*bytes);
        }
        Ok((total, removed))
    }

    /// Adds `delta` bytes to the shared count; over budget, evicts least recently used
    /// records (never `keep`, the one just written) down to it. Returns the records evicted.
    fn account(&self, delta: u64, keep: &Path) -> Result<u64, StorageError> {
        self.locked(|s, f| {
            let total = read_usage(f)?.saturating_add(delta);
            if total <= s.budget {
                return write_usage(f, total).map(|()| 0);
            }
            let (mut records, scanned) = s.scan()?;
            records.retain(|(_, p, _)| p != keep);
            let (total, evicted) = s.evict_to(&mut records, scanned, s.budget)?;
            write_usage(f, total).map(|()| evicted)
        })
    }

    /// Marks a record used now (its modification time), for the LRU order.
    fn touch(&self, path: &Path) {
        if let Ok(f) = File::options().write(true).open(path) {
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
            .is_some_and(|d| d < std::time::Duration::from_secs(1));
        if !recent {
            let _ = file.set_modified(now);
        }
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

    fn put(&self, key: &RecordKey, payload: &[u8]) -> Result<Put, StorageError> {
        if payload.len() as u64 != self.payload_bytes {
            return Err(StorageError::Config(format!(
                "a {}-byte payload for record {key}, this deployment's pages are {} bytes",
                payload.len(),
                self.payload_bytes
            )));
        }
        let path = self.path_of(key);
        if path.exists() {
            self.touch(&path);
            self.stats.already_present.fetch_add(1, Ordering::Relaxed);
            return Ok(Put::Present);
        }
        let io = |what: &str, p: &Path, e: std::io::Error| StorageError::Io {
            what: format!("{what} {}", p.display()),
            source: e,
        };
        let head = record::header(&self.fp, key, payload);
        let bytes = (HEADER_BYTES + payload.len()) as u64;
        let n = ASIDE_NONCE.fetch_add(1, Ordering::Relaxed);
        let aside = self
            .root
            .join("tmp")
            .join(format!("{}.{}.{n}", key.hex(), std::process::id()));
        let written = File::create(&aside)
            .and_then(|mut f| {
                // Header and payload as they are: a copy of a page's size costs more than
                // the write.
                f.write_all(&head)?;
                f.write_all(payload)?;
                // A new file's time is the wall clock's already; a test's clock sets it.
                if !self.wall_clock {
                    f.set_modified((self.clock)())?;
                }
                Ok(())
            })
            .and_then(|()| match fs::rename(&aside, &path) {
                // Its folder (`records/xx`), made at open, was removed since.
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    fs::create_dir_all(path.parent().expect("records/xx"))?;
                    fs::rename(&aside, &path)
                }
                r => r,
            });
        if let Err(e) = written {
            let _ = fs::remove_file(&aside);
            return Err(io("write", &path, e));
        }
        self.stats.records_written.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes_written.fetch_add(bytes, Ordering::Relaxed);
        let evicted = self.account(bytes, &path)?;
        Ok(Put::Written { evicted })
    }

    fn put_part(
        &self,
        key: &RecordKey,
        part: u32,
        parts: u32,
        payload: &[u8],
        assemble: Assemble<'_>,
    ) -> Result<PartPut, StorageError> {
        if payload.is_empty() || payload.len() as u64 > self.payload_bytes || part >= parts {
            return Err(StorageError::Config(format!(
                "part {part} of {parts} of record {key} with a {}-byte payload, this \
                 deployment's pages are {} bytes (a part holds some of a page's tokens)",
                payload.len(),
                self.payload_bytes
            )));
        }
        if self.path_of(key).exists() {
            // Written whole meanwhile (by a run of another layout): parts that came before
            // are of no use.
            let _ = fs::remove_dir_all(self.parts_dir(key));
            self.stats.already_present.fetch_add(1, Ordering::Relaxed);
            return Ok(PartPut::Present);
        }
        // Written aside, then renamed into the record's parts folder: a part is whole or
        // absent, like a record.
        let dir = self.parts_dir(key);
        let path = dir.join(format!("{part}-of-{parts}"));
        let n = ASIDE_NONCE.fetch_add(1, Ordering::Relaxed);
        let aside = self.root.join("tmp").join(format!(
            "{}.part{part}.{}.{n}",
            key.hex(),
            std::process::id()
        ));
        let bytes = record::encode(&self.fp, &self.part_key(key, part, parts), payload);
        let written = fs::write(&aside, &bytes).and_then(|()| match fs::rename(&aside, &path) {
            Err(e) if e.kind() == ErrorKind::NotFound => {
                fs::create_dir_all(&dir)?;
                fs::rename(&aside, &path)
            }
            r => r,
        });
        if let Err(e) = written {
            let _ = fs::remove_file(&aside);
            return Err(StorageError::Io {
                what: format!("write {}", path.display()),
                source: e,
            });
        }
        match self.take_parts(key, parts)? {
            None if self.path_of(key).exists() => {
                let _ = fs::remove_dir_all(&dir);
                Ok(PartPut::Present)
            }
            None => Ok(PartPut::Held),
            Some(Err(why)) => {
                // A damaged part: the record cannot be assembled; its parts are gone, so
                // the next writers start it again.
                self.refused(&why);
                Ok(PartPut::Held)
            }
            Some(Ok(all)) => {
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
        // Opened for writing too: the LRU stamp is set through the same handle. A store
        // this process may only read (a read-only mount, another user's files) is still
        // read, without stamps.
        let opened = match File::options().read(true).write(true).open(&path) {
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::PermissionDenied | ErrorKind::ReadOnlyFilesystem
                ) =>
            {
                File::open(&path)
            }
            r => r,
        };
        let mut file = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                // Parts of it without the record: a part never came.
                if let Some((have, parts)) = self.parts_present(key) {
                    let why = RecordError::Incomplete { have, parts };
                    self.refused(&why);
                    return Ok(Lookup::Refused(why));
                }
                self.stats.misses.fetch_add(1, Ordering::Relaxed);
                return Ok(Lookup::Miss);
            }
            Err(e) => return Err(io(e)),
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
                self.stamp(&file, meta.modified().ok());
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
                let same = fs::symlink_metadata(&path)
                    .is_ok_and(|now| now.dev() == meta.dev() && now.ino() == meta.ino());
                if same {
                    let _ = fs::remove_file(&path);
                }
                Ok(Lookup::Refused(why))
            }
        }
    }

    fn present_run(&self, keys: &[RecordKey]) -> Result<usize, StorageError> {
        Ok(keys
            .iter()
            .position(|k| !self.path_of(k).exists())
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
