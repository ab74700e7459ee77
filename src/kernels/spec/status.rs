//! The status words the select and release kernels leave in device memory when they refuse a
//! launch, decoded and described.

use std::fmt;

/// The select kernel's status words, `u32 status[CP + 2]` in device memory
/// (docs/KERNELS.md "select_owner_pages"): what every launch that came up short added up since
/// the host last cleared them. A launch is refused, all or nothing, when a lane holds fewer
/// pages than it was asked for or an owner is not below CP; it then changes no lane top and
/// writes page 0 for every request. The counts saturate at `u32::MAX`.
///
/// | word | meaning |
/// | --- | --- |
/// | `0` | launches refused |
/// | `1 + o`, `o < CP` | pages lane `o` lacked, summed over those launches |
/// | `CP + 1` | requests naming an owner `>= CP`, summed over those launches |
///
/// All zero means no launch was refused.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct SelectStatus {
    /// Launches refused (word 0).
    pub refused: u32,
    /// Pages each lane lacked, summed over the refused launches (words `1..=CP`).
    pub lane_deficits: Vec<u32>,
    /// Requests whose owner was not below CP, summed over the refused launches (word `CP + 1`).
    pub bad_owners: u32,
}

impl SelectStatus {
    /// Words of the array at CP `cp`: `cp + 2`.
    pub const fn words(cp: u8) -> usize {
        cp as usize + 2
    }

    /// A clear status (no launch refused) at CP `cp`.
    pub fn clear(cp: u8) -> SelectStatus {
        SelectStatus {
            refused: 0,
            lane_deficits: vec![0; usize::from(cp)],
            bad_owners: 0,
        }
    }

    /// Decodes the words of a kernel's status array (`cp + 2` of them, so at least 2);
    /// `None` for fewer than 2.
    pub fn from_words(words: &[u32]) -> Option<SelectStatus> {
        let (&refused, rest) = words.split_first()?;
        let (&bad_owners, lanes) = rest.split_last()?;
        Some(SelectStatus {
            refused,
            lane_deficits: lanes.to_vec(),
            bad_owners,
        })
    }

    /// The words as the kernel lays them out.
    pub fn to_words(&self) -> Vec<u32> {
        let mut w = Vec::with_capacity(self.lane_deficits.len() + 2);
        w.push(self.refused);
        w.extend_from_slice(&self.lane_deficits);
        w.push(self.bad_owners);
        w
    }

    /// Whether no launch was refused (every word zero).
    pub fn is_clear(&self) -> bool {
        self.refused == 0 && self.bad_owners == 0 && self.lane_deficits.iter().all(|&d| d == 0)
    }

    /// Whether the launches refused counted nothing else: what a launch of more than one
    /// block leaves (the kernel refuses such a grid before reading anything).
    pub fn is_grid_refusal(&self) -> bool {
        self.refused > 0 && self.bad_owners == 0 && self.lane_deficits.iter().all(|&d| d == 0)
    }

    /// `(lane, pages it lacked)` for every lane that came up short.
    pub fn short_lanes(&self) -> Vec<(u8, u32)> {
        self.lane_deficits
            .iter()
            .enumerate()
            .filter(|&(_, &d)| d > 0)
            .map(|(o, &d)| (o as u8, d))
            .collect()
    }
}

impl fmt::Display for SelectStatus {
    /// `2 select launches refused: lane 0 short by 3 pages, lane 2 short by 1 page, 1 owner
    /// out of range`, or `no select launch refused`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_clear() {
            return f.write_str("no select launch refused");
        }
        write!(
            f,
            "{} select {} refused",
            self.refused,
            plural(self.refused, "launch", "launches")
        )?;
        let mut what: Vec<String> = self
            .short_lanes()
            .into_iter()
            .map(|(o, d)| format!("lane {o} short by {d} {}", plural(d, "page", "pages")))
            .collect();
        if self.bad_owners > 0 {
            what.push(format!(
                "{} {} out of range",
                self.bad_owners,
                plural(self.bad_owners, "owner", "owners")
            ));
        }
        if what.is_empty() {
            what.push("no lane or item counted (launched with more than one block)".into());
        }
        write!(f, ": {}", what.join(", "))
    }
}

/// The release kernel's status words, `u32 status[CP + 2]` in device memory
/// (docs/KERNELS.md "release_pages"), laid out like [`SelectStatus`]: what every refused
/// release launch added up since the host last cleared them. A launch is refused, all or
/// nothing, when a lane would hold more than `lane_cap` pages or a page is invalid (page 0,
/// or a local index `page / CP >= lane_cap` that no lane of `lane_cap` slots owns); it then
/// changes no lane top and no stack slot, so a drift between the host mirror and the device
/// (a double free, a launch on the lanes behind the allocator's back) cannot overflow a lane
/// or lose pages silently. The counts saturate at `u32::MAX`.
///
/// | word | meaning |
/// | --- | --- |
/// | `0` | launches refused |
/// | `1 + o`, `o < CP` | pages lane `o` had no room for, summed over those launches |
/// | `CP + 1` | invalid pages, summed over those launches |
///
/// All zero means no launch was refused.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ReleaseStatus {
    /// Launches refused (word 0).
    pub refused: u32,
    /// Pages each lane had no room for, summed over the refused launches (words `1..=CP`).
    pub lane_overflows: Vec<u32>,
    /// Invalid pages (0, or a local index past `lane_cap`), summed over the refused launches
    /// (word `CP + 1`).
    pub bad_pages: u32,
}

impl ReleaseStatus {
    /// Words of the array at CP `cp`: `cp + 2`.
    pub const fn words(cp: u8) -> usize {
        cp as usize + 2
    }

    /// A clear status (no launch refused) at CP `cp`.
    pub fn clear(cp: u8) -> ReleaseStatus {
        ReleaseStatus {
            refused: 0,
            lane_overflows: vec![0; usize::from(cp)],
            bad_pages: 0,
        }
    }

    /// Decodes the words of a kernel's status array (`cp + 2` of them, so at least 2);
    /// `None` for fewer than 2.
    pub fn from_words(words: &[u32]) -> Option<ReleaseStatus> {
        let (&refused, rest) = words.split_first()?;
        let (&bad_pages, lanes) = rest.split_last()?;
        Some(ReleaseStatus {
            refused,
            lane_overflows: lanes.to_vec(),
            bad_pages,
        })
    }

    /// The words as the kernel lays them out.
    pub fn to_words(&self) -> Vec<u32> {
        let mut w = Vec::with_capacity(self.lane_overflows.len() + 2);
        w.push(self.refused);
        w.extend_from_slice(&self.lane_overflows);
        w.push(self.bad_pages);
        w
    }

    /// Whether no launch was refused (every word zero).
    pub fn is_clear(&self) -> bool {
        self.refused == 0 && self.bad_pages == 0 && self.lane_overflows.iter().all(|&d| d == 0)
    }

    /// Whether the launches refused counted nothing else: what a launch of more than one
    /// block leaves (the kernel refuses such a grid before reading anything).
    pub fn is_grid_refusal(&self) -> bool {
        self.refused > 0 && self.bad_pages == 0 && self.lane_overflows.iter().all(|&d| d == 0)
    }

    /// `(lane, pages it had no room for)` for every lane that would have overflowed.
    pub fn full_lanes(&self) -> Vec<(u8, u32)> {
        self.lane_overflows
            .iter()
            .enumerate()
            .filter(|&(_, &d)| d > 0)
            .map(|(o, &d)| (o as u8, d))
            .collect()
    }
}

impl fmt::Display for ReleaseStatus {
    /// `2 release launches refused: lane 0 over its capacity by 3 pages, lane 2 over its
    /// capacity by 1 page, 1 invalid page (0, or past the lanes)`, or `no release launch
    /// refused`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_clear() {
            return f.write_str("no release launch refused");
        }
        write!(
            f,
            "{} release {} refused",
            self.refused,
            plural(self.refused, "launch", "launches")
        )?;
        let mut what: Vec<String> = self
            .full_lanes()
            .into_iter()
            .map(|(o, d)| {
                format!(
                    "lane {o} over its capacity by {d} {}",
                    plural(d, "page", "pages")
                )
            })
            .collect();
        if self.bad_pages > 0 {
            what.push(format!(
                "{} invalid {} (0, or past the lanes)",
                self.bad_pages,
                plural(self.bad_pages, "page", "pages")
            ));
        }
        if what.is_empty() {
            what.push("no lane or item counted (launched with more than one block)".into());
        }
        write!(f, ": {}", what.join(", "))
    }
}

/// `one` for a count of 1, else `many`.
fn plural(n: u32, one: &'static str, many: &'static str) -> &'static str {
    if n == 1 {
        one
    } else {
        many
    }
}
