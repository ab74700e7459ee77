//! One record on disk: a fixed header (magic, version, fingerprint, key, payload length,
//! checksum) then the payload, every layer of every buffer kind of one sequence page. Any
//! bytes decode to a record or a typed refusal, never a panic.

use super::{Fingerprint, RecordKey};
use std::hash::Hasher;
use twox_hash::XxHash3_64;

/// The first 8 bytes of every record.
pub const MAGIC: [u8; 8] = *b"CPHCPAGE";
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;
/// Bytes of the header: magic 8, version 4, header length 4, fingerprint 16, key 16,
/// payload length 8, checksum 8.
pub const HEADER_BYTES: usize = 64;

/// Why a record's bytes were refused. Each is served as a miss and counted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Fewer bytes than the header says (a write cut short: a torn record).
    #[error("torn: {have} bytes, the header needs {want}")]
    Torn {
        /// Bytes present.
        have: u64,
        /// Bytes the header (or the header itself) needs.
        want: u64,
    },
    /// No record yet, but `have` of its `parts` parts: a record written in parts whose
    /// last part has not come (its writer died, or is still writing). Counted as torn.
    #[error("incomplete: {have} of its {parts} parts written")]
    Incomplete {
        /// Parts present.
        have: u32,
        /// Parts the record is written in.
        parts: u32,
    },
    /// Not a record of this format.
    #[error("not a cp-hicache page record (magic {0:02x?})")]
    Magic([u8; 8]),
    /// A record of another format version.
    #[error("format version {0}, this build reads {VERSION}")]
    Version(u32),
    /// A record of another deployment (same key, other model, layers or page size).
    #[error("written for deployment {theirs}, this one is {ours}")]
    Fingerprint {
        /// The record's.
        theirs: String,
        /// The reader's.
        ours: String,
    },
    /// A record filed under another key.
    #[error("holds key {theirs}, filed as {ours}")]
    Key {
        /// The record's.
        theirs: RecordKey,
        /// The one it was read as.
        ours: RecordKey,
    },
    /// A payload of another size than this deployment's page.
    #[error("a {have}-byte payload, this deployment's pages are {want} bytes")]
    Length {
        /// The record's payload length.
        have: u64,
        /// The deployment's.
        want: u64,
    },
    /// Not a regular file where a record should be (a link, a FIFO, a folder): neither
    /// followed nor read. Counted with the checksum refusals (not what was written).
    #[error("{0} where a record should be")]
    NotRegular(&'static str),
    /// The bytes are not the ones written (a flipped bit).
    #[error("checksum {have:016x}, the header says {want:016x}")]
    Checksum {
        /// Of the bytes read.
        have: u64,
        /// Recorded at write time.
        want: u64,
    },
}

/// The counters refusals go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// A record cut short.
    Torn,
    /// Another deployment's record, or another format's.
    Fingerprint,
    /// Anything else that is not what was written (a flipped bit, a misfiled record).
    Checksum,
}

impl RecordError {
    /// The counter this refusal goes to.
    pub fn refusal(&self) -> Refusal {
        match self {
            RecordError::Torn { .. } | RecordError::Incomplete { .. } => Refusal::Torn,
            RecordError::Fingerprint { .. } | RecordError::Version(_) => Refusal::Fingerprint,
            _ => Refusal::Checksum,
        }
    }
}

/// The checksum of a record: over the header's bytes before the checksum field, then the
/// payload, so a flipped bit anywhere but in the checksum itself changes it.
pub(super) fn checksum(head: &[u8], payload: &[u8]) -> u64 {
    checksum_parts(head, &[payload])
}

/// [`checksum`] of a payload held in `parts`, in order.
fn checksum_parts(head: &[u8], parts: &[&[u8]]) -> u64 {
    // XXH3-64; this crate picks AVX2 at run time where the CPU has it, which a read of a
    // record from the page cache needs to keep up with the copy.
    let mut h = XxHash3_64::new();
    h.write(&head[..HEADER_BYTES - 8]);
    for p in parts {
        h.write(p);
    }
    h.finish()
}

/// A record's header followed by `payload`.
pub fn encode(fp: &Fingerprint, key: &RecordKey, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + payload.len());
    out.extend_from_slice(&header(fp, key, payload));
    out.extend_from_slice(payload);
    out
}

/// [`encode`] into `out` (cleared first; a buffer kept between records costs no page
/// faults), copying the payload and taking its checksum in one pass: a piece at a time,
/// hashed while it is still in the cache, so the payload is read from memory once, not
/// twice (the copy's pass and the checksum's).
pub fn encode_into(fp: &Fingerprint, key: &RecordKey, payload: &[u8], out: &mut Vec<u8>) {
    /// Bytes per piece: well inside a core's first-level cache.
    const PIECE: usize = 16 << 10;
    out.clear();
    out.reserve(HEADER_BYTES + payload.len());
    let mut head = [0u8; HEADER_BYTES];
    head[..8].copy_from_slice(&MAGIC);
    head[8..12].copy_from_slice(&VERSION.to_le_bytes());
    head[12..16].copy_from_slice(&(HEADER_BYTES as u32).to_le_bytes());
    head[16..32].copy_from_slice(&fp.digest());
    head[32..48].copy_from_slice(&key.0);
    head[48..56].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&head);
    let mut h = XxHash3_64::new();
    h.write(&head[..HEADER_BYTES - 8]);
    for piece in payload.chunks(PIECE) {
        out.extend_from_slice(piece);
        h.write(piece);
    }
    out[56..64].copy_from_slice(&h.finish().to_le_bytes());
}

/// The header of the record of `payload`: what [`encode`] puts before it, for a writer that
/// writes the two without copying the payload.
pub fn header(fp: &Fingerprint, key: &RecordKey, payload: &[u8]) -> [u8; HEADER_BYTES] {
    let mut out = [0u8; HEADER_BYTES];
    out[..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&(HEADER_BYTES as u32).to_le_bytes());
    out[16..32].copy_from_slice(&fp.digest());
    out[32..48].copy_from_slice(&key.0);
    out[48..56].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let sum = checksum(&out, payload);
    out[56..64].copy_from_slice(&sum.to_le_bytes());
    out
}

/// The payload of `bytes`, read as the record of `key` for deployment `fp` whose pages are
/// `payload_bytes` long; every header field and the checksum are checked first.
pub fn decode<'a>(
    bytes: &'a [u8],
    fp: &Fingerprint,
    key: &RecordKey,
    payload_bytes: u64,
) -> Result<&'a [u8], RecordError> {
    let head = bytes.get(..HEADER_BYTES).ok_or(RecordError::Torn {
        have: bytes.len() as u64,
        want: HEADER_BYTES as u64,
    })?;
    check_header(head, bytes.len() as u64, fp, key, payload_bytes)?;
    let payload = &bytes[HEADER_BYTES..];
    check_payload(head, payload)?;
    Ok(payload)
}

/// Checks a record's header (its first [`HEADER_BYTES`]) for a record of `have` bytes in
/// all, read as the record of `key` for deployment `fp` whose pages are `payload_bytes`
/// long: everything but the checksum, which [`check_payload`] checks once the payload is
/// read. A reader can so read the payload straight into a buffer of its own.
pub fn check_header(
    head: &[u8],
    have: u64,
    fp: &Fingerprint,
    key: &RecordKey,
    payload_bytes: u64,
) -> Result<(), RecordError> {
    let head = head.get(..HEADER_BYTES).ok_or(RecordError::Torn {
        have: head.len() as u64,
        want: HEADER_BYTES as u64,
    })?;
    let u32_at = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().expect("8 bytes"));
    let magic: [u8; 8] = head[..8].try_into().expect("8 bytes");
    if magic != MAGIC {
        return Err(RecordError::Magic(magic));
    }
    let version = u32_at(8);
    if version != VERSION || u32_at(12) as usize != HEADER_BYTES {
        return Err(RecordError::Version(version));
    }
    let theirs: [u8; 16] = head[16..32].try_into().expect("16 bytes");
    if theirs != fp.digest() {
        return Err(RecordError::Fingerprint {
            theirs: hex::encode(theirs),
            ours: fp.to_string(),
        });
    }
    let filed = RecordKey(head[32..48].try_into().expect("16 bytes"));
    if filed != *key {
        return Err(RecordError::Key {
            theirs: filed,
            ours: *key,
        });
    }
    let len = u64_at(48);
    if len != payload_bytes {
        return Err(RecordError::Length {
            have: len,
            want: payload_bytes,
        });
    }
    let want = HEADER_BYTES as u64 + len;
    if have < want {
        return Err(RecordError::Torn { have, want });
    }
    if have > want {
        // More than the header says: not what was written either.
        return Err(RecordError::Length {
            have: have - HEADER_BYTES as u64,
            want: len,
        });
    }
    Ok(())
}

/// Checks `payload` against the checksum of `head`, a header [`check_header`] accepted.
pub fn check_payload(head: &[u8], payload: &[u8]) -> Result<(), RecordError> {
    check_payload_parts(head, &[payload])
}

/// [`check_payload`] of a payload read into `parts`, in order.
pub fn check_payload_parts(head: &[u8], parts: &[&[u8]]) -> Result<(), RecordError> {
    let head = head.get(..HEADER_BYTES).ok_or(RecordError::Torn {
        have: head.len() as u64,
        want: HEADER_BYTES as u64,
    })?;
    let want = u64::from_le_bytes(head[56..64].try_into().expect("8 bytes"));
    let have = checksum_parts(head, parts);
    if have != want {
        return Err(RecordError::Checksum { have, want });
    }
    Ok(())
}
