//! Unit tests of the measurement building blocks: the median statistic and the transfer
//! workload's refusals before it allocates.

use super::*;
use crate::exec::Executor;
use crate::kernels::{Direction, PoolShape, TransferSpec};
use crate::tuning::TuningError;

#[test]
fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
    assert_eq!(
        Timing::of(vec![4.0, 1.0, 3.0, 2.0]),
        Timing {
            median: 2.5,
            min: 1.0
        }
    );
    assert_eq!(Timing::of(vec![3.0, 1.0, 2.0]).median, 2.0);
    assert_eq!(Timing::of(vec![5.0]).median, 5.0);
}

/// The harness refuses transfer pairs with one destination page twice before it
/// allocates anything, so neither the kernel nor the DMA path of `tune`, `bench` or
/// `bench --check` can launch them.
#[test]
fn a_transfer_workload_with_one_destination_twice_is_refused() {
    use crate::exec::{HostExecutor, HostOptions};
    use crate::kernels::{CopyLaunch, HostLayout};
    let exec = HostExecutor::new(HostOptions::default());
    let spec = TransferSpec {
        second_bytes_per_token: None,
        stamps: false,
        direction: Direction::HostToDevice,
        layout: HostLayout::PageFirst,
        page_size: 4,
        bytes_per_token: 8,
        launch: CopyLaunch::default(),
    };
    let pools = PoolShape {
        layers: 2,
        device_pages: 8,
        host_pages: 8,
    };
    let before = exec.counters();
    let err = CopyBench::transfer(&exec, &spec, pools, vec![0, 1, 2], vec![5, 3, 5], 0..2)
        .err()
        .expect("refused");
    assert!(
        matches!(
            err,
            TuningError::Transfer(crate::kernels::DuplicateDestination {
                page: 5,
                first: 0,
                second: 2
            })
        ),
        "{err}"
    );
    assert_eq!(exec.counters().since(&before).allocs, 0);
    let err = CopyBench::transfer(&exec, &spec, pools, vec![0, 1], vec![5], 0..2)
        .err()
        .expect("refused");
    assert!(
        err.to_string()
            .contains("2 source pages for 1 destination pages"),
        "{err}"
    );
    assert_eq!(exec.counters().since(&before).allocs, 0);
    // Distinct destinations build the workload, and both paths run.
    let (b, pages) =
        CopyBench::transfer(&exec, &spec, pools, vec![0, 1, 2], vec![5, 3, 4], 0..2).unwrap();
    assert_eq!(pages.second, [5, 3, 4]);
    b.copy_dma().unwrap();
}
