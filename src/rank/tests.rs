//! Transfers refused outside the pools or with a destination twice, the mismatch bitmap,
//! and the one-rank cache other tests of the module build on.

use super::*;
use crate::kernels::TransferPath;

#[test]
fn transfers_outside_the_pools_are_refused() {
    let (d2h, h2d) = (Direction::DeviceToHost, Direction::HostToDevice);
    // 8 device pages per rank, 16 host pages.
    let pools = PoolShape {
        layers: 1,
        device_pages: 8,
        host_pages: 16,
    };
    let ok = |dir, src: &[u32], dst: &[u32]| check_transfer_pages(dir, 1, src, dst, &pools);
    ok(d2h, &[0, 7], &[15, 3]).unwrap();
    ok(h2d, &[15, 3], &[0, 7]).unwrap();
    for (dir, src, dst, want) in [
        (
            d2h,
            &[8u32][..],
            &[0u32][..],
            "d2h transfer names device page 8, outside the device pool of 8 pages",
        ),
        (d2h, &[0], &[16], "host page 16"),
        (h2d, &[u32::MAX], &[0], "host page 4294967295"),
        (h2d, &[0], &[8], "device page 8"),
        (
            h2d,
            &[0, 1],
            &[0],
            "h2d transfer of 2 source pages to 1 destination pages",
        ),
        (
            d2h,
            &[0, 1, 2],
            &[3, 5, 3],
            "d2h transfer: pairs 0 and 2 both write destination page 3",
        ),
        (
            h2d,
            &[4, 9],
            &[7, 7],
            "pairs 0 and 1 both write destination page 7",
        ),
    ] {
        let err = ok(dir, src, dst).unwrap_err();
        let shown = err.to_string();
        assert!(
            shown.starts_with("rank 1: ") && shown.contains(want),
            "{shown}"
        );
    }
}

/// A one-rank cache on a fresh host executor (the integration tests' JIT cache, so the
/// kernels are usually compiled already).
pub(super) fn one_rank(path: TransferPath) -> RankCache {
    let jit = Jit::new(crate::jit::JitConfig::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/target/tmp/jit-cache"
    )));
    let mut deployment =
        crate::kernels::Deployment::new(crate::kernels::ModelShape::MlaBf16, 16, 1).unwrap();
    deployment.transfer_path = path;
    let config = ClusterConfig {
        deployment,
        layers: 1,
        device_pages: 9,
        host_pages: 4,
        policy: WritePolicy::WriteThrough,
        fault: None,
        sanitize: crate::jit::Sanitize::None,
    };
    let exec = Arc::new(crate::exec::HostExecutor::new(
        crate::exec::HostOptions::default(),
    ));
    let member = crate::group::LocalGroup::members(1, std::time::Duration::from_secs(60))
        .pop()
        .unwrap();
    RankCache::new(config, exec, &jit, Box::new(member), PeerAccess::Mapped).unwrap()
}

/// Two pairs with one destination page are refused before anything is uploaded,
/// launched or copied, on the kernel path and on the DMA path.
#[test]
fn a_transfer_naming_one_destination_twice_moves_nothing() {
    for path in [
        TransferPath::Kernel,
        TransferPath::Dma,
        TransferPath::DmaEach,
    ] {
        let mut r = one_rank(path);
        let before = r.exec.counters();
        let err = r
            .transfer(Direction::HostToDevice, &[0, 1], &[2, 2], 0..1, None)
            .unwrap_err();
        assert!(
            matches!(&err, ClusterError::BadTransfer { rank: 0, what }
                if what.contains("pairs 0 and 1 both write destination page 2")),
            "{path}: {err}"
        );
        let d = r.exec.counters().since(&before);
        assert_eq!((d.uploads, d.launches, d.copies), (0, 0, 0), "{path}");
        // Distinct pages move.
        r.transfer(Direction::HostToDevice, &[0, 1], &[2, 3], 0..1, None)
            .unwrap();
    }
}

#[test]
fn mismatches_count_bits_once_and_find_the_first() {
    let words: [u32; 3] = [0, 0b1010_0000, 1 << 31];
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    assert_eq!(
        Mismatches::from_bitmap(&bytes),
        Mismatches {
            count: 3,
            first: Some(32 + 5)
        }
    );
    assert_eq!(Mismatches::from_bitmap(&[0; 8]), Mismatches::default());
}
