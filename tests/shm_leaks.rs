//! Finding 6 of the engine-safety review: every rank's pools stayed in /dev/shm while the
//! ranks ran, so a killed rank (`kill -9`, the launcher's `terminate()`) leaked them. Once
//! every peer has mapped them their names are gone. A test binary of its own, so that no
//! other test's ranks (same process id, same name prefix) start while it looks.

mod hicache_support;

use cp_hicache::cluster::ClusterConfig;
use cp_hicache::exec::Executor;
use cp_hicache::group::LocalGroup;
use cp_hicache::kernels::{Deployment, ModelShape};
use cp_hicache::rank::{PeerAccess, RankCache, WritePolicy};
use hicache_support::{host_executor, jit, tokens};
use std::sync::{Arc, Barrier};
use std::time::Duration;

fn ours() -> Vec<String> {
    let prefix = format!("cp-hicache-{}-", std::process::id());
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn serving_ranks_leave_nothing_in_dev_shm() {
    let serving = Arc::new(Barrier::new(3));
    let looked = Arc::new(Barrier::new(3));
    let ranks: Vec<_> = LocalGroup::members(2, Duration::from_secs(60))
        .into_iter()
        .map(|m| {
            let (serving, looked) = (serving.clone(), looked.clone());
            std::thread::spawn(move || {
                let config = ClusterConfig {
                    deployment: Deployment::new(ModelShape::MlaBf16, 16, 2).unwrap(),
                    layers: 1,
                    device_pages: 33,
                    host_pages: 32,
                    policy: WritePolicy::WriteThrough,
                    fault: None,
                    sanitize: cp_hicache::jit::Sanitize::None,
                };
                let exec: Arc<dyn Executor> = Arc::new(host_executor());
                let mut rc =
                    RankCache::new(config, exec, &jit(), Box::new(m), PeerAccess::Mapped).unwrap();
                let s = rc.serve(&tokens(1, 5 * 16)).unwrap();
                assert_eq!(s.mismatched_tokens, 0);
                serving.wait();
                looked.wait();
                // Peers' mappings still work after the names went.
                let s = rc.serve(&tokens(1, 5 * 16)).unwrap();
                assert_eq!((s.device_hit_tokens, s.mismatched_tokens), (80, 0));
                rc.close().unwrap();
            })
        })
        .collect();
    serving.wait();
    let left = ours();
    looked.wait();
    for r in ranks {
        r.join().unwrap();
    }
    assert!(left.is_empty(), "left in /dev/shm while serving: {left:?}");
    assert!(
        ours().is_empty(),
        "left in /dev/shm after close: {:?}",
        ours()
    );
}
