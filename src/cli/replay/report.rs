//! The end of a replay: whether it verified anything, whether an injected fault fired, the
//! device lane check, and the report (table, `--json`, `--request-log`) with the exit status.

use super::args::{ReplayArgs, ReplayPlan};
use super::drive::Tally;
use super::{cluster_error, Setup};
use crate::cluster::{Fault, Ranks, ReplayReport, RequestStats};
use std::process::ExitCode;

/// Judges and reports the replay `tally` tells of: exit status 0 when every request was
/// verified with no mismatch and the replicas agreed, 1 otherwise, 2 when the input was at
/// fault; an error when nothing was verified.
pub(super) fn conclude(
    cluster: &mut dyn Ranks,
    args: &ReplayArgs,
    plan: ReplayPlan,
    setup: Setup,
    tally: Tally,
) -> Result<ExitCode, crate::Error> {
    let Setup {
        deployment,
        backend,
        tuning_file,
        storage_read_only,
        ..
    } = setup;
    let reports = cluster.reports();
    let wall = tally.wall_seconds;
    // A run that verified nothing must not read as a pass.
    if tally.requests == 0 {
        if let Some(e) = tally.input_error {
            return Err(e.into());
        }
        return Err(crate::Error::Usage(format!(
            "{} has no request: nothing to verify",
            plan.workload_name
        )));
    }
    if tally.skipped == tally.requests {
        if let Some(e) = &tally.input_error {
            eprintln!("error: {e}");
        }
        return Err(crate::Error::Usage(format!(
            "no request fits in the device pool: all {} were skipped, nothing was \
             verified; raise --device-pages",
            tally.skipped
        )));
    }
    let fault_exercised = args
        .inject
        .map(|f| fault_exercised(f, &tally.totals, tally.failed, args.cp, args.device_pages));
    if let (true, Some(f), Some(Err(why))) = (reports, args.inject, &fault_exercised) {
        eprintln!("warning: the injected fault {f} never fired: {why}");
    }
    // The allocator kernels' output is never read on the serving path (the host mirror
    // decides); compare the device lane stacks with the mirrors once now, off that path.
    let device_lanes_agree = match cluster.check_device_lanes() {
        Ok(()) => true,
        Err(e) if e.is_group_broken() => return Err(cluster_error(e)),
        Err(e) => {
            if reports {
                eprintln!("device lane stacks disagree with the allocator's host mirror: {e}");
            }
            false
        }
    };
    let served = tally.requests - tally.failed - tally.skipped;
    let report = ReplayReport {
        requests: tally.requests,
        rounds_per_request: if served > 0 {
            tally.totals.group_rounds as f64 / served as f64
        } else {
            0.0
        },
        tokens_per_second: if wall > 0.0 {
            tally.totals.prompt_tokens as f64 / wall
        } else {
            0.0
        },
        totals: tally.totals,
        replicas_agree: tally.disagreed_at.is_none() && device_lanes_agree,
        device_lanes_agree,
        batch: args.batch,
        steps: tally.steps,
        rounds_per_step: if tally.steps > 0 {
            tally.step_rounds as f64 / tally.steps as f64
        } else {
            0.0
        },
        wall_seconds: wall,
        backend,
        cp: args.cp,
        page_size: args.page_size,
        model: deployment.model.to_string(),
        tp_shard: deployment
            .tp()
            .is_split()
            .then(|| deployment.tp().to_string()),
        layers: args.layers,
        policy: args.policy.to_string(),
        layout: deployment.layout.to_string(),
        chunk_tokens: args.chunk_tokens,
        decode_tokens: args.decode_tokens.map(|d| d.to_string()),
        workload: match &tally.input_error {
            Some(e) => format!("{}, cut short by {e}", plan.workload_name),
            None => plan.workload_name,
        },
        failed_requests: tally.failed,
        requests_skipped: tally.skipped,
        rollback_dropped_device_pages: tally.dropped.device_pages,
        rollback_dropped_host_copies: tally.dropped.host_copies,
        fault: args.inject.map(|f| f.to_string()),
        fault_fired: fault_exercised.as_ref().map(Result::is_ok),
        fault_not_fired_because: fault_exercised.and_then(Result::err),
        tuning_file: tuning_file.map(|p| p.display().to_string()),
        copy_launch: deployment.copy.to_string(),
        group: cluster.group_info(),
        transfer_path: deployment.transfer_path.to_string(),
        synth_threads: deployment.synth_threads,
        storage: args.storage.as_ref().map(|dir| {
            format!(
                "{} · {} · {}{}",
                dir.display(),
                args.storage_policy,
                crate::cluster::stats::human_bytes(args.storage_bytes),
                if storage_read_only {
                    " · read-only (records read, none written)"
                } else {
                    ""
                }
            )
        }),
    };
    if reports {
        outln!("cp-hicache replay");
        out!("{}", report.to_table());
        if let Some(path) = &args.json {
            crate::cli::common::write_json(path, &report)?;
        }
        if let Some(path) = &args.request_log {
            crate::cli::common::write_output(path, &tally.log)?;
        }
    }
    if let Some(e) = tally.input_error {
        if reports {
            eprintln!(
                "error: {e}\n  the replay stopped there: the report covers the {} requests \
             before it",
                tally.requests
            );
        }
        // A failure in what ran is the stronger verdict; otherwise the input is at fault.
        return Ok(if report.ok() && tally.failed == 0 {
            ExitCode::from(2)
        } else {
            ExitCode::FAILURE
        });
    }
    if report.ok() && tally.failed == 0 {
        Ok(ExitCode::SUCCESS)
    } else {
        Ok(ExitCode::FAILURE)
    }
}

/// Whether an injected fault did anything in this run, judged from what it must cause;
/// otherwise why not. A fault that never fired tested nothing, and a clean report would
/// read as if the failure path had been exercised.
pub(super) fn fault_exercised(
    fault: Fault,
    totals: &RequestStats,
    failed: u64,
    cp: u8,
    device_pages: u32,
) -> Result<(), String> {
    let fired = match fault {
        // Only a page loaded into another owner's page tests anything: at CP 1, or when
        // the plain allocation happens to give the recorded owners, the bug is invisible.
        Fault::PlainAllocOnLoad | Fault::GranuleShiftOnLoad => totals.pages_loaded_misowned > 0,
        Fault::LaneExhaustion => totals.evictions_lane + totals.load_degraded_to_miss > 0,
        Fault::HostPoolFull => totals.backups_skipped + totals.host_evictions_for_backup > 0,
        // The kernels are built before the first request, so a run that got here failed.
        Fault::CompileError => true,
        Fault::LaunchError => failed > 0,
        Fault::StorageTorn | Fault::StoragePartMissing => totals.storage_refused_torn > 0,
        Fault::StorageFlip => totals.storage_refused_checksum > 0,
        Fault::StorageForeign => totals.storage_refused_fingerprint > 0,
        // Verification is what must catch it.
        Fault::StorageUnchecked => totals.mismatched_tokens > 0,
        Fault::StorageIo => totals.storage_io_errors > 0,
    };
    if fired {
        return Ok(());
    }
    Err(match fault {
        Fault::PlainAllocOnLoad | Fault::GranuleShiftOnLoad if totals.pages_loaded == 0 => format!(
            "no page was loaded back from the host, every prefix hit was still on the \
             device; a smaller --device-pages (now {device_pages}) forces load-backs"
        ),
        Fault::GranuleShiftOnLoad if cp == 1 => format!(
            "at CP 1 a granule is one page, so the {} pages loaded back could not move to \
             another rank's page; a CP above 1 makes the bug visible",
            totals.pages_loaded
        ),
        Fault::GranuleShiftOnLoad => format!(
            "the {} pages loaded back all kept their owners",
            totals.pages_loaded
        ),
        Fault::PlainAllocOnLoad if cp == 1 => format!(
            "at CP 1 every page has the one owner, so the {} pages loaded back could not \
             land on another owner's page; a CP above 1 makes the bug visible",
            totals.pages_loaded
        ),
        Fault::PlainAllocOnLoad => format!(
            "each of the {} pages loaded back happened to get the owner it was backed up \
             from, so the plain allocation matched the owner-preserving one",
            totals.pages_loaded
        ),
        Fault::LaneExhaustion => format!(
            "no allocation ran short of a lane: no lane-targeted eviction, no load-back \
             degraded to a miss; a smaller --device-pages (now {device_pages}) or more \
             requests make one"
        ),
        Fault::HostPoolFull => "no backup found the host pool full (none was skipped, no host \
             copy was evicted for one); longer or more requests make it"
            .into(),
        Fault::CompileError => "the kernels compiled".into(),
        Fault::LaunchError => "no request from the middle of the workload on launched a \
             kernel (each was skipped as too large, or empty)"
            .into(),
        Fault::StorageTorn
        | Fault::StorageFlip
        | Fault::StorageForeign
        | Fault::StoragePartMissing
            if totals.storage_records_read == 0 =>
        {
            "no record was read from the store: a run before this one with the same \
             --storage writes the records a later run reads"
                .into()
        }
        Fault::StorageTorn
        | Fault::StorageFlip
        | Fault::StorageForeign
        | Fault::StoragePartMissing => format!(
            "none of the {} records read was one the fault damaged",
            totals.storage_records_read
        ),
        Fault::StorageIo => "no record was read from or written to the store".into(),
        Fault::StorageUnchecked => format!(
            "no damaged record was served into a hit that was verified ({} records read)",
            totals.storage_records_read
        ),
    })
}
