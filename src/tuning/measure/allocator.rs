//! The allocator bench (select and release of owner pages): lane stacks, owners and status
//! words on the device, their host copies, and the Rust reference as the baseline.

use super::timing::{time_device, time_with, Sizes, Timing};
use super::workload::{u32_bytes, Owned, SplitMix};
use crate::exec::{BufferId, ExecError, Executor, KernelArg, KernelId, LaunchConfig, MemKind};
use crate::kernels::{KernelSpec, ReleaseStatus, SelectOutput, SelectStatus};
use crate::tuning::TuningError;

/// Buffers of the allocator kernels for `n` requests: fresh lane stacks, round-robin owners,
/// and the pages the selection returns (for release).
pub struct AllocBench<'e> {
    mem: Owned<'e>,
    cp: u8,
    n: u32,
    lane_cap: u32,
    owners: BufferId,
    /// `u32[CP * lane_cap]`.
    pub stacks: BufferId,
    /// `u32[CP]`.
    pub tops: BufferId,
    /// Output pages of select; input of release.
    pub pages: BufferId,
    /// `i64[n * page_size]`, for a select that writes token locations
    /// ([`SelectOutput::PagesAndLocs`]); `None` otherwise.
    pub locs: Option<BufferId>,
    /// `u32[CP + 2]`, the select kernel's status words (zero before every select).
    pub status: BufferId,
    /// `u32[CP + 2]`, the release kernel's status words (zero before every release).
    pub release_status: BufferId,
    /// Host copies for the references.
    pub host: AllocInputs,
}

/// The allocator inputs on the host (for the references and `--check`).
#[derive(Debug, Clone)]
pub struct AllocInputs {
    /// One owner per request.
    pub owners: Vec<u8>,
    /// Fresh lane stacks.
    pub stacks: Vec<u32>,
    /// Full tops.
    pub tops_full: Vec<u32>,
    /// Tops after selecting `owners`.
    pub tops_after: Vec<u32>,
    /// The pages the selection returns.
    pub selected: Vec<u32>,
    /// Lane capacity.
    pub lane_cap: u32,
}

impl<'e> AllocBench<'e> {
    /// Allocates and uploads everything for `n` requests at CP `cp`, with an `out_locs`
    /// buffer of `locs_page_size` tokens per page when the select to run writes token
    /// locations ([`AllocBench::locs_page_size`]).
    pub fn new(
        exec: &'e dyn Executor,
        cp: u8,
        locs_page_size: Option<u32>,
        n: u32,
        seed: u64,
    ) -> Result<AllocBench<'e>, TuningError> {
        let mut mem = Owned {
            exec,
            ids: Vec::new(),
        };
        let c = u32::from(cp.max(1));
        let n = n.max(1);
        let lane_cap = n.div_ceil(c) + 8;
        let mut rng = SplitMix(seed);
        // Owners rotate from a random start, so every lane's demand fits its capacity.
        let start = rng.below(u64::from(c)) as u32;
        let owners: Vec<u8> = (0..n).map(|i| ((i + start) % c) as u8).collect();
        // Lane `o` owns pages `o + c * k`, `k < lane_cap` (a larger local index is invalid to
        // the release kernel), page 0 excluded; each starts full.
        let mut stacks = vec![0u32; (c * lane_cap) as usize];
        let mut tops_full = Vec::with_capacity(c as usize);
        for o in 0..c {
            let lane: Vec<u32> = (0..lane_cap)
                .map(|k| o + c * k)
                .filter(|&p| p != 0)
                .collect();
            for (slot, &p) in lane.iter().rev().enumerate() {
                stacks[(o * lane_cap) as usize + slot] = p;
            }
            tops_full.push(lane.len() as u32);
        }
        let mut tops_after = tops_full.clone();
        let mut status = vec![0u32; SelectStatus::words(cp)];
        let selected = crate::kernels::reference::select_pages(
            cp,
            &owners,
            &stacks,
            &mut tops_after,
            lane_cap,
            &mut status,
        )
        .map_err(|e| TuningError::Reference {
            what: "select_owner_pages",
            message: e.to_string(),
        })?;
        let owners_buf = mem.alloc(MemKind::Device, u64::from(n), 0)?;
        let stacks_buf = mem.alloc(MemKind::Device, 4 * u64::from(c * lane_cap), 0)?;
        let tops = mem.alloc(MemKind::Device, 4 * u64::from(c), 0)?;
        let pages = mem.alloc(MemKind::Device, 4 * u64::from(n), 0xA5)?;
        let locs = locs_page_size
            .map(|ps| mem.alloc(MemKind::Device, 8 * u64::from(n) * u64::from(ps), 0xA5))
            .transpose()?;
        let status = mem.alloc(MemKind::Device, 4 * SelectStatus::words(cp) as u64, 0)?;
        let release_status = mem.alloc(MemKind::Device, 4 * ReleaseStatus::words(cp) as u64, 0)?;
        exec.upload(owners_buf, 0, &owners)?;
        exec.upload(stacks_buf, 0, &u32_bytes(&stacks))?;
        Ok(AllocBench {
            mem,
            cp,
            n,
            lane_cap,
            owners: owners_buf,
            stacks: stacks_buf,
            tops,
            pages,
            locs,
            status,
            release_status,
            host: AllocInputs {
                owners,
                stacks,
                tops_full,
                tops_after,
                selected,
                lane_cap,
            },
        })
    }

    /// The tokens per page of `spec`'s `out_locs` when it is a select that writes token
    /// locations: what [`AllocBench::new`] needs to run it.
    pub fn locs_page_size(spec: &KernelSpec) -> Option<u32> {
        match spec {
            KernelSpec::SelectOwnerPages(s) if s.output == SelectOutput::PagesAndLocs => {
                Some(s.page_size)
            }
            _ => None,
        }
    }

    /// Requests per launch.
    pub fn n(&self) -> u32 {
        self.n
    }

    /// CP degree.
    pub fn cp(&self) -> u8 {
        self.cp
    }

    /// Launches select (not synchronised): `out_locs` is passed when this bench has it, so
    /// a select that writes token locations needs a bench built with
    /// [`AllocBench::locs_page_size`] (the executor refuses the launch otherwise).
    pub fn run_select(&self, kernel: KernelId, spec: &KernelSpec) -> Result<(), ExecError> {
        let exec = self.mem.exec;
        let d = spec.launch_dims(self.n, 1);
        let mut args = vec![
            KernelArg::Ptr(self.owners, 0),
            KernelArg::U32(self.n),
            KernelArg::Ptr(self.stacks, 0),
            KernelArg::Ptr(self.tops, 0),
            KernelArg::U32(self.lane_cap),
            KernelArg::Ptr(self.pages, 0),
        ];
        args.extend(self.locs.map(|l| KernelArg::Ptr(l, 0)));
        args.push(KernelArg::Ptr(self.status, 0));
        exec.launch(kernel, &LaunchConfig::linear(d.grid, d.block), &args)
    }

    /// Launches release of the selected pages (not synchronised).
    pub fn run_release(&self, kernel: KernelId, spec: &KernelSpec) -> Result<(), ExecError> {
        let exec = self.mem.exec;
        let d = spec.launch_dims(self.n, 1);
        exec.launch(
            kernel,
            &LaunchConfig::linear(d.grid, d.block),
            &[
                KernelArg::Ptr(self.pages, 0),
                KernelArg::U32(self.n),
                KernelArg::Ptr(self.stacks, 0),
                KernelArg::Ptr(self.tops, 0),
                KernelArg::U32(self.lane_cap),
                KernelArg::Ptr(self.release_status, 0),
            ],
        )
    }

    /// Restores the state select starts from (fresh stacks, full tops, a clear status).
    pub fn reset_for_select(&self) -> Result<(), ExecError> {
        let exec = self.mem.exec;
        exec.upload(self.stacks, 0, &u32_bytes(&self.host.stacks))?;
        exec.upload(self.tops, 0, &u32_bytes(&self.host.tops_full))?;
        exec.upload(self.status, 0, &vec![0u8; 4 * SelectStatus::words(self.cp)])
    }

    /// Restores the state release starts from (tops after select, selected pages, a clear
    /// status).
    pub fn reset_for_release(&self) -> Result<(), ExecError> {
        let exec = self.mem.exec;
        exec.upload(self.pages, 0, &u32_bytes(&self.host.selected))?;
        exec.upload(self.tops, 0, &u32_bytes(&self.host.tops_after))?;
        exec.upload(
            self.release_status,
            0,
            &vec![0u8; 4 * ReleaseStatus::words(self.cp)],
        )
    }

    /// Times select or release (`spec`'s family decides), each repeat from a fresh state; the
    /// state upload is outside the timed section.
    pub fn time(
        &self,
        kernel: KernelId,
        spec: &KernelSpec,
        sizes: &Sizes,
    ) -> Result<Timing, ExecError> {
        let exec = self.mem.exec;
        let select = matches!(spec, KernelSpec::SelectOwnerPages(_));
        time_device(
            exec,
            sizes.warmup,
            sizes.repeats,
            || {
                if select {
                    self.reset_for_select()
                } else {
                    self.reset_for_release()
                }?;
                exec.synchronize()
            },
            || {
                if select {
                    self.run_select(kernel, spec)
                } else {
                    self.run_release(kernel, spec)
                }
            },
        )
    }

    /// Times the Rust reference of select or release on the same inputs (the allocator
    /// baseline: what the host-side allocator does per request), the select with token
    /// locations exactly when `spec` writes them.
    pub fn time_reference(&self, spec: &KernelSpec, sizes: &Sizes) -> Result<Timing, TuningError> {
        let h = &self.host;
        let locs_page_size = AllocBench::locs_page_size(spec);
        let mut stacks = h.stacks.clone();
        let mut tops = h.tops_full.clone();
        let mut status = vec![0u32; SelectStatus::words(self.cp)];
        let reference = |e: crate::kernels::reference::ReferenceError| TuningError::Reference {
            what: "allocator",
            message: e.to_string(),
        };
        if matches!(spec, KernelSpec::SelectOwnerPages(_)) {
            time_with(
                sizes.warmup,
                sizes.repeats,
                || Ok(()),
                || {
                    // Resetting CP tops is negligible next to the selection itself.
                    tops.copy_from_slice(&h.tops_full);
                    let pages = crate::kernels::reference::select_pages(
                        self.cp,
                        &h.owners,
                        &h.stacks,
                        &mut tops,
                        h.lane_cap,
                        &mut status,
                    )
                    .map_err(reference)?;
                    if let Some(ps) = locs_page_size {
                        let locs =
                            crate::kernels::reference::page_locs(ps, &pages).map_err(reference)?;
                        std::hint::black_box(locs);
                    }
                    std::hint::black_box(pages);
                    Ok(())
                },
            )
        } else {
            time_with(
                sizes.warmup,
                sizes.repeats,
                || Ok(()),
                || {
                    tops.copy_from_slice(&h.tops_after);
                    crate::kernels::reference::release_pages(
                        self.cp,
                        &h.selected,
                        &mut stacks,
                        &mut tops,
                        h.lane_cap,
                        &mut status,
                    )
                    .map_err(reference)?;
                    std::hint::black_box(&stacks);
                    Ok(())
                },
            )
        }
    }
}
