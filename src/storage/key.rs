//! What a record is named by: the deployment's fingerprint and a hash chain over the tokens
//! up to and including its page. Neither depends on the CP degree, the rank or the layout,
//! so a store written under one topology is read under any other.

use crate::kernels::{BufferKind, Deployment};
use sha2::{Digest, Sha256};
use std::fmt;

/// The deployment a record's bytes belong to: the model's buffers (their fields, dtypes and
/// arrangement in a page), the TP head shard of a split model, the layers and the page
/// size. Two deployments whose records could be exchanged byte for byte have the same
/// fingerprint; the CP degree, the CP rank and the layout are left out, since a record
/// holds a sequence page whoever owned it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    /// What was hashed, for error messages and the store's marker file.
    text: String,
    digest: [u8; 16],
}

impl Fingerprint {
    /// The fingerprint of `dep` with `layers` layers per buffer kind. A TP head shard of a
    /// split model (`tp=1/2`) is part of the model's name: two shards' records have the
    /// same shape but other heads. An unsplit deployment's model is named alone, so its
    /// fingerprint is what it was before shards were named.
    pub fn of(dep: &Deployment, layers: u32) -> Fingerprint {
        let tp = dep.tp();
        let model = if tp.is_split() {
            format!("{};tp={tp}", dep.model)
        } else {
            dep.model.to_string()
        };
        Self::from_parts(&model, &dep.model.buffers(), layers, dep.page_size)
    }

    /// The fingerprint of `buffers` (in the model's order) of model `model`.
    pub fn from_parts(model: &str, buffers: &[BufferKind], layers: u32, page_size: u32) -> Self {
        let buffers: Vec<String> = buffers
            .iter()
            .map(|b| {
                let fields: Vec<String> =
                    b.fields().iter().map(|(d, n)| format!("{d}x{n}")).collect();
                format!(
                    "{b}:{}B/token:{:?}:{}",
                    b.bytes_per_token(),
                    b.arrangement(),
                    fields.join("+")
                )
            })
            .collect();
        let text = format!(
            "model={model};layers={layers};page_size={page_size};buffers={}",
            buffers.join(",")
        );
        let digest = Sha256::digest(format!("cp-hicache fingerprint v1\n{text}").as_bytes());
        Fingerprint {
            digest: digest[..16].try_into().expect("32 bytes"),
            text,
        }
    }

    /// The fingerprint of records whose layout `description` names in full, for a store
    /// whose pages are another engine's (SGLang's host pool pages: its model, dtype, layers,
    /// page size and layout); the same words give the same fingerprint.
    pub fn named(description: &str) -> Fingerprint {
        let digest =
            Sha256::digest(format!("cp-hicache fingerprint v1 (named)\n{description}").as_bytes());
        Fingerprint {
            digest: digest[..16].try_into().expect("32 bytes"),
            text: description.to_string(),
        }
    }

    /// A fingerprint given by its digest alone (as a record header carries it).
    pub fn from_digest(digest: [u8; 16]) -> Fingerprint {
        Fingerprint {
            text: format!("fingerprint {}", hex::encode(digest)),
            digest,
        }
    }

    /// The 16 bytes every record header carries.
    pub fn digest(&self) -> [u8; 16] {
        self.digest
    }

    /// What the digest is of.
    pub fn describe(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.digest))
    }
}

/// The key of one sequence page's record: a hash of the deployment's fingerprint and of
/// every token up to and including the page (a chain: page `i`'s key hashes page `i - 1`'s
/// key with page `i`'s tokens), so equal keys mean equal prefixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordKey(pub [u8; 16]);

impl RecordKey {
    /// The keys of the whole pages of `tokens` (a partial last page has none), for the
    /// deployment `fp` with `page_size` tokens per page.
    pub fn chain(fp: &Fingerprint, tokens: &[u32], page_size: u32) -> Vec<RecordKey> {
        let mut out = Vec::with_capacity(tokens.len() / page_size.max(1) as usize);
        Self::extend_chain(&mut out, fp, tokens, page_size);
        out
    }

    /// Appends the keys of the whole pages of `tokens` that follow the pages `keys` holds
    /// (`tokens` starts at page `keys.len()`).
    pub fn extend_chain(
        keys: &mut Vec<RecordKey>,
        fp: &Fingerprint,
        tokens: &[u32],
        page_size: u32,
    ) {
        let ps = page_size.max(1) as usize;
        let mut prev = keys.last().map_or([0u8; 16], |k| k.0);
        for page in tokens.chunks_exact(ps) {
            let mut h = Sha256::new();
            h.update(b"cp-hicache page v1");
            h.update(fp.digest);
            h.update(prev);
            for t in page {
                h.update(t.to_le_bytes());
            }
            prev = h.finalize()[..16].try_into().expect("32 bytes");
            keys.push(RecordKey(prev));
        }
    }

    /// The key of a page another engine names with its own chained hash `name` (SGLang's
    /// per-page prefix hashes, which already cover every token before and in the page),
    /// salted with the deployment's fingerprint.
    pub fn of_name(fp: &Fingerprint, name: &str) -> RecordKey {
        let mut h = Sha256::new();
        h.update(b"cp-hicache named page v1");
        h.update(fp.digest);
        h.update(name.as_bytes());
        RecordKey(h.finalize()[..16].try_into().expect("32 bytes"))
    }

    /// The key as 32 hex digits (the record's file name).
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for RecordKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}
