//! File operations relative to an open folder that follow no link and block on nothing:
//! what [`DirStore`](super::DirStore) does inside its directory, which anyone who can write
//! there may have filled with links, FIFOs, folders and junk. Each name is one component
//! opened with `O_NOFOLLOW` from a folder itself opened so, so no link anywhere below the
//! store's root is followed; files are opened `O_NONBLOCK` (a FIFO's open returns at once)
//! and checked to be regular (`fstat`) before anything reads, writes or stamps them.

use std::ffi::{CString, OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;
use std::time::{Duration, SystemTime};

/// How deep [`Dir::remove_tree`] goes: the store makes no folder below `parts/<key>`, so a
/// deeper tree is junk left as it is rather than a way to run out of descriptors.
const MAX_TREE_DEPTH: u32 = 8;

/// An open folder.
#[derive(Debug)]
pub(super) struct Dir(OwnedFd);

/// What a name is, without following it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    File,
    Dir,
    Link,
    Fifo,
    Other,
}

impl Kind {
    /// In words, for refusals and errors.
    pub(super) fn describe(self) -> &'static str {
        match self {
            Kind::File => "a regular file",
            Kind::Dir => "a directory",
            Kind::Link => "a symbolic link",
            Kind::Fifo => "a FIFO",
            Kind::Other => "a device or socket",
        }
    }

    fn of(mode: libc::mode_t) -> Kind {
        match mode & libc::S_IFMT {
            libc::S_IFREG => Kind::File,
            libc::S_IFDIR => Kind::Dir,
            libc::S_IFLNK => Kind::Link,
            libc::S_IFIFO => Kind::Fifo,
            _ => Kind::Other,
        }
    }
}

/// A name's status, not following it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Stat {
    pub kind: Kind,
    pub len: u64,
    pub mtime: SystemTime,
    /// The last change of the inode: set by the kernel, never by a writer's clock.
    pub ctime: SystemTime,
    pub dev: u64,
    pub ino: u64,
}

/// How [`Dir::open_file`] opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Access {
    Read,
    ReadWrite,
    /// Read and write, created if missing.
    ReadWriteCreate,
    /// Written, created here and now (`O_EXCL`).
    CreateNew,
}

/// The error of an open that found something other than a regular file.
#[derive(Debug, thiserror::Error)]
#[error("{} where a regular file should be", .0.describe())]
pub(super) struct NotRegular(pub Kind);

/// The kind of non-regular file `e` reports, if it reports one: from an open with
/// `O_NOFOLLOW` (a link), of a folder for writing, or the `fstat` check after an open.
pub(super) fn not_regular(e: &io::Error) -> Option<Kind> {
    if let Some(n) = e.get_ref().and_then(|i| i.downcast_ref::<NotRegular>()) {
        return Some(n.0);
    }
    match e.raw_os_error() {
        Some(libc::ELOOP) => Some(Kind::Link),
        Some(libc::EISDIR) => Some(Kind::Dir),
        // A FIFO opened for writing alone, nonblocking, with no reader.
        Some(libc::ENXIO) => Some(Kind::Fifo),
        _ => None,
    }
}

/// Whether `e` says this process may not write there (a read-only mount, another user's
/// files).
pub(super) fn denied(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EACCES | libc::EPERM | libc::EROFS)
    )
}

fn c_name(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn time(secs: i64, nsecs: i64) -> SystemTime {
    let d = Duration::new(secs.unsigned_abs(), nsecs.clamp(0, 999_999_999) as u32);
    if secs >= 0 {
        SystemTime::UNIX_EPOCH + d
    } else {
        SystemTime::UNIX_EPOCH - d
    }
}

impl Dir {
    /// Opens folder `path`, following links on the way: the store's root is the caller's
    /// choice, whatever it names.
    pub(super) fn open(path: &Path) -> io::Result<Dir> {
        let c = c_name(path.as_os_str())?;
        // SAFETY: a valid NUL-terminated path; the descriptor returned is owned here.
        let fd = check(unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        })?;
        // SAFETY: `fd` is a new descriptor nothing else owns.
        Ok(Dir(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Opens the folder `name` in this one; a link there is an error (`ELOOP`, or `ENOTDIR`
    /// for anything else that is not a folder).
    pub(super) fn sub(&self, name: impl AsRef<OsStr>) -> io::Result<Dir> {
        let c = c_name(name.as_ref())?;
        // SAFETY: an open folder, a valid name; the descriptor returned is owned here.
        let fd = check(unsafe {
            libc::openat(
                self.0.as_raw_fd(),
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        })?;
        // SAFETY: `fd` is a new descriptor nothing else owns.
        Ok(Dir(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Makes folder `name` here.
    pub(super) fn mkdir(&self, name: impl AsRef<OsStr>) -> io::Result<()> {
        let c = c_name(name.as_ref())?;
        // SAFETY: an open folder, a valid name.
        check(unsafe { libc::mkdirat(self.0.as_raw_fd(), c.as_ptr(), 0o777) }).map(drop)
    }

    /// Opens the regular file `name` here: never through a link, never blocking, and an
    /// error ([`NotRegular`]) for anything but a regular file.
    pub(super) fn open_file(&self, name: impl AsRef<OsStr>, access: Access) -> io::Result<File> {
        let c = c_name(name.as_ref())?;
        let how = match access {
            Access::Read => libc::O_RDONLY,
            Access::ReadWrite => libc::O_RDWR,
            Access::ReadWriteCreate => libc::O_RDWR | libc::O_CREAT,
            Access::CreateNew => libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL,
        };
        let flags = how | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
        // SAFETY: an open folder, a valid name; the descriptor returned is owned here.
        let fd = check(unsafe {
            libc::openat(self.0.as_raw_fd(), c.as_ptr(), flags, 0o666 as libc::c_uint)
        })?;
        // SAFETY: `fd` is a new descriptor nothing else owns.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: an open descriptor and room for its status.
        check(unsafe { libc::fstat(file.as_raw_fd(), st.as_mut_ptr()) })?;
        // SAFETY: fstat succeeded, so it filled `st`.
        let kind = Kind::of(unsafe { st.assume_init() }.st_mode);
        if kind != Kind::File {
            return Err(io::Error::other(NotRegular(kind)));
        }
        // O_NONBLOCK means nothing for a regular file's reads and writes.
        Ok(file)
    }

    /// The status of `name` here, not following it.
    pub(super) fn stat(&self, name: impl AsRef<OsStr>) -> io::Result<Stat> {
        let c = c_name(name.as_ref())?;
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: an open folder, a valid name and room for its status.
        check(unsafe {
            libc::fstatat(
                self.0.as_raw_fd(),
                c.as_ptr(),
                st.as_mut_ptr(),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })?;
        // SAFETY: fstatat succeeded, so it filled `st`.
        let st = unsafe { st.assume_init() };
        Ok(Stat {
            kind: Kind::of(st.st_mode),
            len: st.st_size as u64,
            mtime: time(st.st_mtime, st.st_mtime_nsec),
            ctime: time(st.st_ctime, st.st_ctime_nsec),
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }

    /// Removes the name `name` here (a link goes, never its target); not a folder.
    pub(super) fn unlink(&self, name: impl AsRef<OsStr>) -> io::Result<()> {
        let c = c_name(name.as_ref())?;
        // SAFETY: an open folder, a valid name.
        check(unsafe { libc::unlinkat(self.0.as_raw_fd(), c.as_ptr(), 0) }).map(drop)
    }

    /// Renames `from` here to `to` in `into`, replacing what is there unless it is a
    /// folder.
    pub(super) fn rename(
        &self,
        from: impl AsRef<OsStr>,
        into: &Dir,
        to: impl AsRef<OsStr>,
    ) -> io::Result<()> {
        let (f, t) = (c_name(from.as_ref())?, c_name(to.as_ref())?);
        // SAFETY: open folders, valid names.
        check(unsafe {
            libc::renameat(
                self.0.as_raw_fd(),
                f.as_ptr(),
                into.0.as_raw_fd(),
                t.as_ptr(),
            )
        })
        .map(drop)
    }

    /// The names in this folder (not `.` and `..`).
    pub(super) fn names(&self) -> io::Result<Vec<OsString>> {
        // The folder opened again (not duplicated): a stream of its own, whose offset no
        // other listing of the same folder moves.
        // SAFETY: an open folder and a constant name; on success the stream owns `fd`.
        let fd = check(unsafe {
            libc::openat(
                self.0.as_raw_fd(),
                c".".as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        })?;
        // SAFETY: `fd` is a folder's descriptor; on success the stream owns it.
        let stream = unsafe { libc::fdopendir(fd) };
        if stream.is_null() {
            let e = io::Error::last_os_error();
            // SAFETY: fdopendir failed, so `fd` is still ours to close.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        let mut out = Vec::new();
        loop {
            // SAFETY: an open stream; errno is cleared to tell the end from an error.
            let entry = unsafe {
                *libc::__errno_location() = 0;
                libc::readdir(stream)
            };
            if entry.is_null() {
                let e = io::Error::last_os_error();
                // SAFETY: the stream is open, and closed once.
                unsafe { libc::closedir(stream) };
                return match e.raw_os_error() {
                    Some(0) | None => Ok(out),
                    _ => Err(e),
                };
            }
            // SAFETY: readdir returned an entry whose name is NUL-terminated, valid until
            // the next call on this stream.
            let name = unsafe { std::ffi::CStr::from_ptr((*entry).d_name.as_ptr()) };
            let name = name.to_bytes();
            if name != b"." && name != b".." {
                out.push(OsString::from_vec(name.to_vec()));
            }
        }
    }

    /// Removes `name` here and, if it is a folder, everything in it, following no link;
    /// returns the bytes of the regular files removed. Best effort: what cannot be removed
    /// (too deep, not permitted) stays.
    pub(super) fn remove_tree(&self, name: impl AsRef<OsStr>) -> u64 {
        self.remove_tree_at(name.as_ref(), MAX_TREE_DEPTH)
    }

    fn remove_tree_at(&self, name: &OsStr, depth: u32) -> u64 {
        let Ok(st) = self.stat(name) else { return 0 };
        if st.kind != Kind::Dir {
            return match self.unlink(name) {
                Ok(()) if st.kind == Kind::File => st.len,
                _ => 0,
            };
        }
        let mut bytes = 0;
        if depth > 0 {
            if let Ok(sub) = self.sub(name) {
                for n in sub.names().unwrap_or_default() {
                    bytes += sub.remove_tree_at(&n, depth - 1);
                }
            }
        }
        if let Ok(c) = c_name(name) {
            // SAFETY: an open folder, a valid name.
            unsafe { libc::unlinkat(self.0.as_raw_fd(), c.as_ptr(), libc::AT_REMOVEDIR) };
        }
        bytes
    }
}

/// Whether process `pid` (of this host's process namespace) is alive.
pub(super) fn pid_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 checks only; `pid` is positive, so one process is named.
    unsafe { libc::kill(pid, 0) == 0 || *libc::__errno_location() == libc::EPERM }
}
