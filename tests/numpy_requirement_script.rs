//! `scripts/numpy-requirement.sh`, the numpy requirement `scripts/python-dev.sh` gives pip for
//! `.venv`: never a later major version than the numpy Debian's python3-torch runs with, also
//! when python-dev.sh runs before python3-torch (and with it python3-numpy) is installed. It
//! once asked for `numpy>=1.22` alone, so a run before Debian's torch put numpy 2 in `.venv`,
//! which hid Debian's numpy and broke its torch (built against numpy 1.x). Each case runs the
//! script with a stand-in system Python (which has numpy of some major, or none) and a
//! stand-in `apt-cache` (some candidate version of python3-numpy, or none) first on `PATH`.

use std::path::Path;
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The script's requirement where the system Python's numpy has major `numpy` (`None`: not
/// installed) and apt would install python3-numpy `candidate` (`None`: no such package
/// known).
fn requirement(numpy: Option<&str>, candidate: Option<&str>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: String| {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    write(
        "python3",
        match numpy {
            Some(major) => format!("#!/bin/sh\necho {major}\n"),
            None => "#!/bin/sh\necho 'ModuleNotFoundError: numpy' >&2\nexit 1\n".to_string(),
        },
    );
    write(
        "apt-cache",
        format!(
            "#!/bin/sh\n[ \"$1 $2\" = 'policy python3-numpy' ] || exit 100\n{}",
            match candidate {
                Some(v) => format!(
                    "echo 'python3-numpy:'\necho '  Installed: (none)'\necho '  Candidate: {v}'\n"
                ),
                None => String::new(),
            }
        ),
    );
    let path = format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new(Path::new(ROOT).join("scripts/numpy-requirement.sh"))
        .env("PATH", path)
        .env("CP_HICACHE_SYSTEM_PYTHON", dir.path().join("python3"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn the_numpy_of_venv_never_outruns_debians() {
    // Debian 12 with python3-torch installed: its numpy 1.24 caps it.
    assert_eq!(
        requirement(Some("1"), Some("1:1.24.2-1+deb12u1")),
        "numpy>=1.22,<2"
    );
    // Before python3-torch is installed: the numpy apt would install with it caps it.
    assert_eq!(
        requirement(None, Some("1:1.24.2-1+deb12u1")),
        "numpy>=1.22,<2"
    );
    // A later Debian whose torch is built against numpy 2.
    assert_eq!(requirement(None, Some("1:2.2.4+ds-1")), "numpy>=1.22,<3");
    assert_eq!(requirement(Some("2"), None), "numpy>=1.22,<3");
    // No version without an epoch is misread.
    assert_eq!(requirement(None, Some("1.26.4-1")), "numpy>=1.22,<2");
    // Not Debian, or no source offers python3-numpy: no cap.
    assert_eq!(requirement(None, None), "numpy>=1.22");
    assert_eq!(requirement(None, Some("(none)")), "numpy>=1.22");
}

#[test]
fn python_dev_asks_for_that_requirement() {
    let script = std::fs::read_to_string(Path::new(ROOT).join("scripts/python-dev.sh")).unwrap();
    let pip: Vec<&str> = script
        .lines()
        .filter(|l| l.contains("pip install") && l.contains("maturin"))
        .collect();
    assert_eq!(pip.len(), 1, "{pip:?}");
    assert!(
        pip[0].contains("\"$(scripts/numpy-requirement.sh)\"") && !pip[0].contains("\"numpy"),
        "{}",
        pip[0]
    );
}
