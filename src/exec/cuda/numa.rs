//! Which NUMA node a GPU hangs off, so that its pinned host pool is allocated there: every
//! load and backup crosses PCIe from the GPU's socket, and host memory on another socket
//! adds the inter-socket link to each copy (issue 42, P6). Linux only; where the node is not
//! known (no sysfs entry, `-1`, one node) nothing is bound.

use std::path::Path;

/// The NUMA node of the PCI device `bus_id` (as `cuDeviceGetPCIBusId` spells it,
/// `0000:3B:00.0`), read from `<sysfs>/bus/pci/devices/<bus id>/numa_node`; `None` where the
/// file is missing or says `-1` (a machine without NUMA, or a device the firmware gives no
/// node).
pub(crate) fn node_of(bus_id: &str, sysfs: &Path) -> Option<u32> {
    let path = sysfs
        .join("bus/pci/devices")
        .join(bus_id.trim().to_ascii_lowercase())
        .join("numa_node");
    std::fs::read_to_string(path)
        .ok()?
        .trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// While alive, this thread's allocations prefer NUMA node `node` (`set_mempolicy` with
/// `MPOL_PREFERRED`: pages land there when it has room, elsewhere when not); dropping it
/// restores the default policy. `cuMemHostAlloc` touches and pins its pages at once, so the
/// policy in force during the call decides where the pool lives.
pub(crate) struct Preferred(());

const MPOL_DEFAULT: i32 = 0;
const MPOL_PREFERRED: i32 = 1;

/// Prefers `node` for this thread's allocations, or `None` where the kernel refuses (a node
/// that does not exist, no NUMA support).
pub(crate) fn prefer(node: u32) -> Option<Preferred> {
    if node >= 64 {
        return None;
    }
    let mask: u64 = 1 << node;
    // SAFETY: `mask` is one u64 of node bits, `maxnode` says how many bits it holds; the call
    // changes only this thread's memory policy.
    let r = unsafe {
        libc::syscall(
            libc::SYS_set_mempolicy,
            MPOL_PREFERRED,
            &mask as *const u64,
            64u64,
        )
    };
    (r == 0).then_some(Preferred(()))
}

impl Drop for Preferred {
    fn drop(&mut self) {
        // SAFETY: MPOL_DEFAULT takes no node mask.
        unsafe {
            libc::syscall(
                libc::SYS_set_mempolicy,
                MPOL_DEFAULT,
                std::ptr::null::<u64>(),
                0u64,
            )
        };
    }
}

/// This thread's memory policy mode (for tests).
#[cfg(test)]
fn policy_mode() -> i32 {
    let mut mode: i32 = -1;
    // SAFETY: only the mode is asked for (no mask, no address).
    let r = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut i32,
            std::ptr::null_mut::<u64>(),
            0u64,
            std::ptr::null_mut::<libc::c_void>(),
            0u64,
        )
    };
    assert_eq!(r, 0, "get_mempolicy");
    mode
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_comes_from_sysfs_by_lower_case_bus_id() {
        let root = tempfile::tempdir().unwrap();
        let dev = root.path().join("bus/pci/devices/0000:3b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), "1\n").unwrap();
        assert_eq!(node_of("0000:3B:00.0", root.path()), Some(1));
        std::fs::write(dev.join("numa_node"), "-1\n").unwrap();
        assert_eq!(node_of("0000:3B:00.0", root.path()), None, "no node");
        assert_eq!(node_of("0000:99:00.0", root.path()), None, "no device");
        std::fs::write(dev.join("numa_node"), "x").unwrap();
        assert_eq!(node_of("0000:3B:00.0", root.path()), None, "garbage");
    }

    #[test]
    fn preferring_a_node_is_undone_on_drop() {
        assert_eq!(policy_mode(), MPOL_DEFAULT);
        // Node 0 exists wherever NUMA is enabled at all.
        if let Some(p) = prefer(0) {
            assert_eq!(policy_mode(), MPOL_PREFERRED);
            drop(p);
        }
        assert_eq!(policy_mode(), MPOL_DEFAULT);
        assert!(prefer(64).is_none(), "past the mask");
    }
}
