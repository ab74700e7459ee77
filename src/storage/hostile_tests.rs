//! A directory store meets a hostile directory: links, FIFOs, junk and folders it cannot
//! read where its files should be, leftovers of killed writers, other users' stores, and
//! writers racing each other (issue 44). Nothing found on disk may make it follow a link,
//! block, touch a file it did not write, or stop serving the records it can read.

use super::*;
use crate::kernels::{Deployment, ModelShape};
use std::ffi::CString;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, SystemTime};

fn fp() -> Fingerprint {
    Fingerprint::of(&Deployment::new(ModelShape::MlaBf16, 16, 4).unwrap(), 1)
}

const N: u64 = 4096;
const REC: u64 = record::HEADER_BYTES as u64 + N;

fn payload(seed: u8) -> Vec<u8> {
    (0..N).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
}

fn key(b: u8) -> RecordKey {
    RecordKey([b; 16])
}

fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0, "mkfifo");
}

fn mtime(path: &Path) -> SystemTime {
    std::fs::symlink_metadata(path).unwrap().modified().unwrap()
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Runs `f` on a thread of its own and fails the test if it has not returned in 20 s (a
/// read blocked on a FIFO never returns).
fn within_deadline<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("{what} hung"))
}

/// The environment variable a test's unprivileged child finds its directory in.
const CHILD_DIR: &str = "CP_HICACHE_TEST_UNPRIVILEGED_DIR";

/// Runs `check` on `dir` where permission bits bind: in this process, or under root (whom
/// they do not bind) in a child of this test binary running test `name` alone as `nobody`,
/// which finds `dir` in [`CHILD_DIR`] and runs `check` itself.
fn unprivileged(name: &str, dir: &Path, check: fn(&Path)) {
    // SAFETY: no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return check(dir);
    }
    use std::os::unix::process::CommandExt as _;
    let name = name.strip_prefix("cp_hicache::").unwrap_or(name);
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_DIR, dir)
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "as nobody:\n{text}");
    assert!(text.contains("1 passed"), "the child ran no test:\n{text}");
}

/// Every folder under `dir` (and `dir`) given mode `dirs`, every file `files`: `0o777` and
/// `0o666` for a store anyone may write, `0o555` and `0o444` for one nobody may.
fn chmod_tree(dir: &Path, dirs: u32, files: u32) {
    let meta = std::fs::symlink_metadata(dir).unwrap();
    if meta.is_dir() {
        // Opened first, so a folder made read-only is still listed.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        for e in std::fs::read_dir(dir).unwrap() {
            chmod_tree(&e.unwrap().path(), dirs, files);
        }
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(dirs)).unwrap();
    } else if meta.is_file() {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(files)).unwrap();
    }
}

/// Finding 1: a `records/xx` folder that is a link, a record that is a link, and files the
/// store never writes are neither followed, nor counted, nor evicted.
#[test]
fn eviction_follows_no_link_and_deletes_only_records() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    drop(DirStore::open(dir.path(), fp(), N, 1 << 30).unwrap());
    let records = dir.path().join("records");
    // records/ab -> outside, which holds a well-formed record of key ab.. and a note.
    std::fs::write(
        outside.path().join(format!("{}.rec", key(0xab).hex())),
        record::encode(&fp(), &key(0xab), &payload(0xab)),
    )
    .unwrap();
    std::fs::write(outside.path().join("keep.txt"), vec![7u8; 3 * REC as usize]).unwrap();
    std::fs::remove_dir(records.join("ab")).unwrap();
    std::os::unix::fs::symlink(outside.path(), records.join("ab")).unwrap();
    // A note under records/ (no record's name), larger than the budget.
    std::fs::write(records.join("00/notes.txt"), vec![1u8; 3 * REC as usize]).unwrap();
    let before = names(outside.path());

    let s = DirStore::open(dir.path(), fp(), N, 2 * REC).unwrap();
    for b in 1..6u8 {
        s.put(&key(b), &payload(b)).unwrap();
    }
    s.put(&key(0xab), &payload(0xab)).unwrap();
    assert!(matches!(s.get(&key(0xab)).unwrap(), Lookup::Hit(_)));
    assert_eq!(
        names(outside.path()),
        before,
        "files outside the store changed"
    );
    assert!(records.join("00/notes.txt").exists(), "a note was evicted");
    assert!(s.usage().unwrap() <= 2 * REC, "{}", s.usage().unwrap());
    drop(s);
    let s = DirStore::open(dir.path(), fp(), N, 2 * REC).unwrap();
    assert!(s.usage().unwrap() <= 2 * REC, "the note was counted");
    assert_eq!(names(outside.path()), before);
}

/// Finding 2: a FIFO at a record's path, or as `FINGERPRINT`, is refused, never read.
#[test]
fn a_fifo_is_refused_never_read() {
    let dir = tempfile::tempdir().unwrap();
    let s = DirStore::open(dir.path(), fp(), N, 1 << 30).unwrap();
    mkfifo(&s.path_of(&key(1)));
    let s = std::sync::Arc::new(s);
    let t = s.clone();
    let got = within_deadline("a read of a FIFO", move || {
        t.get(&key(1)).map_err(|e| e.to_string())
    });
    assert!(matches!(got, Ok(Lookup::Refused(_))), "{got:?}");
    let t = s.clone();
    let run = within_deadline("present_run over a FIFO", move || {
        t.present_run(&[key(1)]).map_err(|e| e.to_string())
    });
    assert_eq!(run, Ok(0));

    let other = tempfile::tempdir().unwrap();
    mkfifo(&other.path().join("FINGERPRINT"));
    let root = other.path().to_path_buf();
    let opened = within_deadline("opening a store whose FINGERPRINT is a FIFO", move || {
        DirStore::open(&root, fp(), N, 1 << 30)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    assert_eq!(opened, Ok(()));
}

/// Finding 3: a record that is a link is neither served, nor stamped, nor opened for
/// writing; its target is left as it was.
#[test]
fn a_linked_record_is_refused_and_its_target_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let s = DirStore::open(dir.path(), fp(), N, 1 << 30).unwrap();
    let target = outside.path().join("target.rec");
    std::fs::write(&target, record::encode(&fp(), &key(1), &payload(1))).unwrap();
    let old = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
    std::fs::File::options()
        .write(true)
        .open(&target)
        .unwrap()
        .set_modified(old)
        .unwrap();
    std::os::unix::fs::symlink(&target, s.path_of(&key(1))).unwrap();
    assert!(
        matches!(s.get(&key(1)).unwrap(), Lookup::Refused(_)),
        "a linked record was served"
    );
    assert_eq!(mtime(&target), old, "the link's target was stamped");
    assert!(s.stats().refused_checksum >= 1);
    // A put over the link writes a record of the store's own, stamping nothing outside.
    let _ = std::fs::remove_file(s.path_of(&key(1)));
    std::os::unix::fs::symlink(&target, s.path_of(&key(1))).unwrap();
    assert_eq!(s.present_run(&[key(1)]).unwrap(), 0);
    assert!(matches!(
        s.put(&key(1), &payload(1)).unwrap(),
        Put::Written { .. }
    ));
    assert_eq!(mtime(&target), old, "the link's target was stamped");
    assert!(!s.path_of(&key(1)).is_symlink());
    assert_eq!(s.get(&key(1)).unwrap(), Lookup::Hit(payload(1)));
}

/// Finding 4: a `records/xx` folder this process cannot read is a miss for its keys; the
/// store opens and serves the rest.
#[test]
fn an_unreadable_folder_is_a_miss_for_its_keys() {
    fn check(dir: &Path) {
        let s = DirStore::open(dir, fp(), N, 1 << 30).unwrap();
        assert_eq!(s.get(&key(1)).unwrap(), Lookup::Hit(payload(1)));
        assert_eq!(s.get(&key(0xab)).unwrap(), Lookup::Miss);
        assert_eq!(s.present_run(&[key(1), key(0xab)]).unwrap(), 1);
    }
    if let Some(dir) = std::env::var_os(CHILD_DIR) {
        return check(Path::new(&dir));
    }
    let dir = tempfile::tempdir().unwrap();
    let s = DirStore::open(dir.path(), fp(), N, 1 << 30).unwrap();
    s.put(&key(1), &payload(1)).unwrap();
    s.put(&key(0xab), &payload(0xab)).unwrap();
    drop(s);
    chmod_tree(dir.path(), 0o777, 0o666);
    let ab = dir.path().join("records/ab");
    std::fs::set_permissions(&ab, std::fs::Permissions::from_mode(0o000)).unwrap();
    unprivileged(
        &format!(
            "{}::an_unreadable_folder_is_a_miss_for_its_keys",
            module_path!()
        ),
        dir.path(),
        check,
    );
    std::fs::set_permissions(&ab, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Finding 5: a store this process may only read (another user's) opens for reading: its
/// records are served, nothing in it is written or stamped, and it says it is read-only.
#[test]
fn a_read_only_store_opens_for_reading() {
    fn check(dir: &Path) {
        let rec = DirStore::open(dir, fp(), N, 1 << 30)
            .map(|_| ())
            .map_err(|e| e.to_string());
        assert_eq!(rec, Ok(()), "a read-only store was refused");
        let s = DirStore::open(dir, fp(), N, 1 << 30).unwrap();
        let before = mtime(&s.path_of(&key(1)));
        let lock = std::fs::read(dir.join("lock")).unwrap();
        assert_eq!(s.get(&key(1)).unwrap(), Lookup::Hit(payload(1)));
        assert_eq!(s.get(&key(3)).unwrap(), Lookup::Miss);
        assert_eq!(s.present_run(&[key(1), key(2), key(3)]).unwrap(), 2);
        assert_eq!(
            mtime(&s.path_of(&key(1))),
            before,
            "a read-only store stamped"
        );
        assert_eq!(std::fs::read(dir.join("lock")).unwrap(), lock);
        assert_eq!(s.usage().unwrap(), 2 * REC);
        assert!(s.is_read_only() && s.read_only());
        assert!(matches!(
            s.put(&key(3), &payload(3)),
            Err(StorageError::ReadOnly(_))
        ));
        assert_eq!(s.stats().records_written, 0);
    }
    if let Some(dir) = std::env::var_os(CHILD_DIR) {
        return check(Path::new(&dir));
    }
    let dir = tempfile::tempdir().unwrap();
    let clock = Box::new(|| SystemTime::UNIX_EPOCH + Duration::from_secs(5_000));
    let s = DirStore::with_clock(dir.path(), fp(), N, 1 << 30, clock).unwrap();
    s.put(&key(1), &payload(1)).unwrap();
    s.put(&key(2), &payload(2)).unwrap();
    drop(s);
    // Readable by all, writable by none (not even its owner, for a run that is not root).
    chmod_tree(dir.path(), 0o555, 0o444);
    unprivileged(
        &format!("{}::a_read_only_store_opens_for_reading", module_path!()),
        dir.path(),
        check,
    );
    chmod_tree(dir.path(), 0o755, 0o644);
}

/// Finding 6: files a killed writer left in `tmp/`, and parts of records written whole
/// since, are reclaimed when the store is opened; parts still waiting count against the
/// budget.
#[test]
fn leftovers_are_reclaimed_at_open_and_held_parts_counted() {
    let dir = tempfile::tempdir().unwrap();
    let s = DirStore::open(dir.path(), fp(), N, 1 << 30).unwrap();
    s.put(&key(1), &payload(1)).unwrap();
    let join = |parts: &[Vec<u8>]| Some(parts.concat());
    let held = s.put_part(&key(2), 0, 2, &payload(2)[..N as usize / 2], &join);
    assert_eq!(held.unwrap(), PartPut::Held);
    let held_bytes = REC - N / 2;
    drop(s);
    // A writer killed mid-record (its process is gone), and parts of key 1, whose record
    // is whole.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let tmp = dir.path().join("tmp");
    std::fs::write(
        tmp.join(format!("{}.{dead}.0", key(3).hex())),
        vec![0u8; REC as usize],
    )
    .unwrap();
    std::fs::write(
        tmp.join(format!("{}.part1.{dead}.1", key(3).hex())),
        vec![0u8; REC as usize / 2],
    )
    .unwrap();
    // One of a live writer (this process), and a file the store never writes.
    let live = tmp.join(format!("{}.{}.99", key(4).hex(), std::process::id()));
    std::fs::write(&live, b"in flight").unwrap();
    std::fs::write(tmp.join("notes.txt"), b"not the store's").unwrap();
    let orphan = dir.path().join("parts").join(key(1).hex());
    std::fs::create_dir_all(&orphan).unwrap();
    std::fs::write(orphan.join("1-of-2"), vec![0u8; REC as usize / 2]).unwrap();

    // Reclaimed at once once the writer is gone (the grace is for writers of other hosts).
    let s = DirStore::open_reclaiming_after(dir.path(), fp(), N, 1 << 30, Duration::ZERO).unwrap();
    assert_eq!(
        names(&tmp)
            .into_iter()
            .filter(|n| !n.starts_with("FINGERPRINT"))
            .collect::<Vec<_>>(),
        vec![
            live.file_name().unwrap().to_string_lossy().into_owned(),
            "notes.txt".into()
        ],
        "leftovers of a dead writer stayed"
    );
    assert!(!orphan.exists(), "parts of a whole record stayed");
    assert!(s.parts_dir(&key(2)).exists(), "a held part was reclaimed");
    assert_eq!(
        s.usage().unwrap(),
        REC + held_bytes + b"in flight".len() as u64,
        "held parts or the live writer's file aside are not counted"
    );
}

/// Bytes of every regular file below `dir`.
fn bytes_below(dir: &Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let meta = std::fs::symlink_metadata(e.path()).unwrap();
        if meta.is_dir() {
            total += bytes_below(&e.path());
        } else if meta.is_file() {
            total += meta.len();
        }
    }
    total
}

/// Finding 6: files in `tmp/` that are not reclaimed (a writer dead within the grace, whose
/// id may be another host's) count against the budget, as do files in flight: eviction
/// keeps every file the store holds within it, and a file renamed into place (a record, a
/// part) is counted once.
#[test]
fn files_aside_count_against_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    drop(DirStore::open(dir.path(), fp(), N, 1 << 30).unwrap());
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let tmp = dir.path().join("tmp");
    let leftover = tmp.join(format!("{}.{dead}.0", key(9).hex()));
    std::fs::write(&leftover, vec![0u8; REC as usize]).unwrap();
    std::fs::write(
        tmp.join(format!("{}.part1.{dead}.1", key(9).hex())),
        vec![0u8; REC as usize / 2],
    )
    .unwrap();
    let left = REC + REC / 2;
    // Room for four records, the leftovers taking one and a half of it.
    let budget = 4 * REC;
    let s = DirStore::open(dir.path(), fp(), N, budget).unwrap();
    assert!(leftover.exists(), "a file within the grace was reclaimed");
    assert_eq!(
        s.usage().unwrap(),
        left,
        "leftovers in tmp/ are not counted"
    );
    let held = || {
        bytes_below(&dir.path().join("records"))
            + bytes_below(&dir.path().join("parts"))
            + bytes_below(&tmp)
    };
    for b in 1..=6u8 {
        assert!(matches!(
            s.put(&key(b), &payload(b)).unwrap(),
            Put::Written { .. }
        ));
        let on_disk = held();
        assert!(
            on_disk <= budget,
            "{on_disk} bytes held, over the budget of {budget}"
        );
        assert_eq!(s.usage().unwrap(), on_disk, "after the record of key {b}");
    }
    assert_eq!(s.get(&key(6)).unwrap(), Lookup::Hit(payload(6)));
    assert_eq!(
        s.stats().evictions,
        4,
        "two records and the leftovers fill the budget"
    );
    // A record in parts: held, then assembled, each file counted once.
    let join = |parts: &[Vec<u8>]| Some(parts.concat());
    let half = N as usize / 2;
    let p = payload(7);
    assert_eq!(
        s.put_part(&key(7), 0, 2, &p[..half], &join).unwrap(),
        PartPut::Held
    );
    assert_eq!(s.usage().unwrap(), held());
    assert!(matches!(
        s.put_part(&key(7), 1, 2, &p[half..], &join).unwrap(),
        PartPut::Completed { .. }
    ));
    assert_eq!(s.usage().unwrap(), held());
    assert!(held() <= budget);
    assert_eq!(s.get(&key(7)).unwrap(), Lookup::Hit(p));
    // A second writer of a record already there: its file aside goes, and off the count.
    let other = DirStore::open(dir.path(), fp(), N, budget).unwrap();
    assert_eq!(other.usage().unwrap(), held(), "the count at open");
    assert_eq!(s.put(&key(7), &payload(7)).unwrap(), Put::Present);
    assert_eq!(s.usage().unwrap(), held());
}

/// Finding 7: writers of the parts of the same records, two runs at once, never lose a
/// part: every record is assembled, no write fails.
#[test]
fn concurrent_part_writers_lose_no_part() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<RecordKey> = (0..=255u8).map(key).collect();
    let parts = 4u32;
    let quarter = N as usize / parts as usize;
    let failures = std::sync::Mutex::new(Vec::new());
    for round in 0..2 {
        let root = dir.path().join(format!("r{round}"));
        let barrier = std::sync::Barrier::new(2 * parts as usize);
        std::thread::scope(|sc| {
            for w in 0..2 * parts {
                let (root, keys, failures, barrier) = (&root, &keys, &failures, &barrier);
                sc.spawn(move || {
                    let s = DirStore::open(root, fp(), N, 1 << 30).unwrap();
                    let p = w % parts;
                    let join = |ps: &[Vec<u8>]| (ps.len() == 4).then(|| ps.concat());
                    for k in keys {
                        let mine = &payload(k.0[0])[p as usize * quarter..][..quarter];
                        // Every writer of the key at once.
                        barrier.wait();
                        if let Err(e) = s.put_part(k, p, parts, mine, &join) {
                            failures.lock().unwrap().push(e.to_string());
                        }
                    }
                });
            }
        });
        // The count as the writers left it: each record once, no part left counted.
        let counted = std::fs::read(root.join("lock")).unwrap();
        let counted = u64::from_le_bytes(counted[..8].try_into().unwrap());
        assert_eq!(counted, keys.len() as u64 * REC);
        let s = DirStore::open(&root, fp(), N, 1 << 30).unwrap();
        for k in &keys {
            assert_eq!(s.get(k).unwrap(), Lookup::Hit(payload(k.0[0])), "{k}");
        }
        assert_eq!(s.usage().unwrap(), keys.len() as u64 * REC);
        assert_eq!(names(&root.join("parts")), Vec::<String>::new());
    }
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} failed: {:?}",
        failures.len(),
        &failures[..1]
    );
}

/// Finding 8: a directory, a link to junk or a FIFO at a record's path is replaced when the
/// store writes that key.
#[test]
fn junk_at_a_record_path_is_replaced_by_the_next_write() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let s = DirStore::open(dir.path(), fp(), N, 1 << 30).unwrap();
    std::fs::create_dir(s.path_of(&key(1))).unwrap();
    std::fs::write(s.path_of(&key(1)).join("inside"), b"x").unwrap();
    let junk = outside.path().join("junk");
    std::fs::write(&junk, b"junk").unwrap();
    std::os::unix::fs::symlink(&junk, s.path_of(&key(2))).unwrap();
    std::os::unix::fs::symlink(outside.path().join("nothing"), s.path_of(&key(3))).unwrap();
    mkfifo(&s.path_of(&key(4)));
    for b in 1..=4 {
        let _ = s.get(&key(b));
        s.put(&key(b), &payload(b)).unwrap();
        assert_eq!(s.get(&key(b)).unwrap(), Lookup::Hit(payload(b)), "key {b}");
    }
    assert_eq!(std::fs::read(&junk).unwrap(), b"junk");
    assert_eq!(s.usage().unwrap(), 4 * REC);
}

/// Finding 10: two writers of the same records at once count each record once.
#[test]
fn identical_writers_at_once_count_each_record_once() {
    let dir = tempfile::tempdir().unwrap();
    let big = 1u64 << 20;
    let bytes = record::HEADER_BYTES as u64 + big;
    let keys: Vec<RecordKey> = (0..24u8).map(key).collect();
    let barrier = std::sync::Barrier::new(2);
    std::thread::scope(|sc| {
        for _ in 0..2 {
            let (root, keys, barrier) = (dir.path(), &keys, &barrier);
            sc.spawn(move || {
                let s = DirStore::open(root, fp(), big, 1 << 30).unwrap();
                for k in keys {
                    let p = vec![k.0[0]; big as usize];
                    barrier.wait();
                    s.put(k, &p).unwrap();
                }
            });
        }
    });
    // The count as the writers left it (opening the store again would rescan).
    let counted = u64::from_le_bytes(
        std::fs::read(dir.path().join("lock")).unwrap()[..8]
            .try_into()
            .unwrap(),
    );
    assert_eq!(counted, keys.len() as u64 * bytes);
}

/// A link or a FIFO where the store keeps its own folders or lock refuses the store, naming
/// what is there, without following or reading it.
#[test]
fn a_link_or_fifo_for_the_stores_own_folder_or_lock_refuses_it() {
    let dir = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), dir.path().join("records")).unwrap();
    let err = DirStore::open(dir.path(), fp(), N, 1 << 30).err().unwrap();
    assert!(
        matches!(
            err,
            StorageError::NotOurs {
                found: "a symbolic link",
                ..
            }
        ),
        "{err}"
    );
    assert!(names(outside.path()).is_empty(), "the link was followed");

    let dir = tempfile::tempdir().unwrap();
    mkfifo(&dir.path().join("lock"));
    let root = dir.path().to_path_buf();
    let err = within_deadline("opening a store whose lock is a FIFO", move || {
        DirStore::open(&root, fp(), N, 1 << 30)
            .err()
            .map(|e| e.to_string())
    });
    let err = err.expect("a FIFO as the lock refuses the store");
    assert!(err.contains("a FIFO") && err.contains("lock"), "{err}");
}
