//! How fast the store writes and reads records, against plain file writes and reads of the
//! same bytes in the same run (`cp-hicache bench --storage DIR`).
//!
//! The store does more per record than a plain file: a checksum over every byte, a write
//! aside then a rename, a byte count under a file lock, and on a read the header checks
//! and a modification time (its LRU stamp). The baseline writes each record's bytes to a
//! file of its own and reads them back, in the same directory tree, so the file system and
//! its page cache are the same for both.

use super::{payload_bytes, DirStore, Lookup, PageStore, RecordKey, StorageError};
use crate::kernels::Deployment;
use crate::tuning::bench::BenchRow;
use std::fs;
use std::path::Path;
use std::time::Instant;

/// Times `records` records of `dep` (`layers` layers) put into and got from a fresh store
/// under `dir`, against plain files of the same bytes, each the median of `repeats`
/// rounds; a row each for put and get. `on_round` is told each round done.
pub fn bench_store(
    dir: &Path,
    dep: &Deployment,
    layers: u32,
    records: usize,
    repeats: usize,
    on_round: &dyn Fn(),
) -> Result<Vec<BenchRow>, StorageError> {
    let io = |what: &str, p: &Path, e: std::io::Error| StorageError::Io {
        what: format!("{what} {}", p.display()),
        source: e,
    };
    if records == 0 {
        return Err(StorageError::Config(
            "a store bench needs at least one record to time".into(),
        ));
    }
    let payload = payload_bytes(dep, layers) as usize;
    let tokens: Vec<u32> = (0..(records as u32) * dep.page_size).collect();
    let fp = super::Fingerprint::of(dep, layers);
    let keys = RecordKey::chain(&fp, &tokens, dep.page_size);
    let payloads: Vec<Vec<u8>> = (0..records)
        .map(|i| {
            (0..payload)
                .map(|j| {
                    (j as u32)
                        .wrapping_mul(2_654_435_761)
                        .wrapping_add(i as u32) as u8
                })
                .collect()
        })
        .collect();
    let record_bytes = super::record::HEADER_BYTES + payload;
    let total = (records * record_bytes) as u64;
    let (mut put, mut get, mut write, mut read) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..repeats.max(1) {
        let root = dir.join(format!("round-{round}"));
        let store_dir = root.join("store");
        let plain = root.join("plain");
        fs::create_dir_all(&plain).map_err(|e| io("create", &plain, e))?;
        let store = DirStore::open(&store_dir, fp.clone(), payload as u64, u64::MAX)?;

        // Which goes first alternates by round: the second writer of a round meets the
        // first one's dirty pages being written back, and the second reader a warmer cache.
        let store_first = round % 2 == 0;
        let put_all = || -> Result<f64, StorageError> {
            let t = Instant::now();
            for (k, p) in keys.iter().zip(&payloads) {
                store.put(k, p)?;
            }
            Ok(t.elapsed().as_secs_f64())
        };
        // The same bytes, one plain file per record.
        let write_all = || -> Result<f64, StorageError> {
            let t = Instant::now();
            for (i, p) in payloads.iter().enumerate() {
                let path = plain.join(format!("{i}.bin"));
                let mut bytes = Vec::with_capacity(record_bytes);
                bytes.extend_from_slice(&[0u8; super::record::HEADER_BYTES]);
                bytes.extend_from_slice(p);
                fs::write(&path, &bytes).map_err(|e| io("write", &path, e))?;
            }
            Ok(t.elapsed().as_secs_f64())
        };
        if store_first {
            put.push(put_all()?);
            write.push(write_all()?);
        } else {
            write.push(write_all()?);
            put.push(put_all()?);
        }

        // Both reads keep what they read until after the clock stops (the same allocation
        // pattern), and the store's bytes are compared with what was put only then.
        let get_all = || -> Result<(f64, Vec<Lookup>), StorageError> {
            let t = Instant::now();
            let got: Vec<Lookup> = keys
                .iter()
                .map(|k| store.get(k))
                .collect::<Result<_, _>>()?;
            Ok((t.elapsed().as_secs_f64(), got))
        };
        let read_all = || -> Result<(f64, Vec<Vec<u8>>), StorageError> {
            let t = Instant::now();
            let plain_read: Vec<Vec<u8>> = (0..records)
                .map(|i| {
                    let path = plain.join(format!("{i}.bin"));
                    fs::read(&path).map_err(|e| io("read", &path, e))
                })
                .collect::<Result<_, _>>()?;
            Ok((t.elapsed().as_secs_f64(), plain_read))
        };
        let ((got_secs, got), (read_secs, plain_read)) = if store_first {
            let g = get_all()?;
            (g, read_all()?)
        } else {
            let r = read_all()?;
            (get_all()?, r)
        };
        get.push(got_secs);
        read.push(read_secs);

        for ((k, p), found) in keys.iter().zip(&payloads).zip(got) {
            let wrong = match found {
                Lookup::Hit(got) if got == *p => continue,
                Lookup::Hit(_) => "other bytes".to_string(),
                Lookup::Miss => "a miss".to_string(),
                Lookup::Refused(e) => format!("refused: {e}"),
            };
            return Err(StorageError::Config(format!(
                "record {k} read back as {wrong}"
            )));
        }
        if plain_read.iter().any(|b| b.len() != record_bytes) {
            return Err(StorageError::Config("a plain file read back short".into()));
        }

        drop(store);
        fs::remove_dir_all(&root).map_err(|e| io("remove", &root, e))?;
        on_round();
    }
    let row = |kernel: &str, secs: &mut Vec<f64>, baseline: &str, base: &mut Vec<f64>| {
        // The ratio is the median of each round's own ratio: a round's two timings share
        // the disk's state (writeback, other tenants), which drifts between rounds.
        let mut ratios: Vec<f64> = secs.iter().zip(base.iter()).map(|(s, b)| b / s).collect();
        let ratio = median(&mut ratios);
        let (s, b) = (median(secs), median(base));
        let gbps = total as f64 / s / 1e9;
        let baseline_gbps = total as f64 / b / 1e9;
        BenchRow {
            kernel: format!("{kernel}({records}x{record_bytes}B)"),
            spec: "storage".into(),
            backend: "host".into(),
            config: "dir".into(),
            shapes: "default".into(),
            deployment: dep.name.clone(),
            bytes: total,
            seconds: s,
            gbps,
            baseline: baseline.into(),
            baseline_gbps,
            ratio,
            submit_seconds: None,
        }
    };
    Ok(vec![
        row("store_put", &mut put, "file_write", &mut write),
        row("store_get", &mut get, "file_read", &mut read),
    ])
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2].max(1e-9)
}
