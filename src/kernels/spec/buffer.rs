//! Buffer shapes: the KV buffer kinds of a model, their per-token fields and element types,
//! and where each field's elements sit in a page (the arithmetic the synthesise and verify
//! kernels share).

use std::fmt;

/// Element type of a synthesised field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    /// fp8 e4m3 (1 byte).
    Fp8E4m3,
    /// IEEE f32 (4 bytes), used for scales.
    F32,
    /// bfloat16 (2 bytes).
    Bf16,
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
        })
    }
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> u32 {
        match self {
            Dtype::Fp8E4m3 => 1,
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }

    /// Elements synthesised from one 64-bit draw: element `e` takes lane `e % per_draw` (of
    /// `64 / per_draw` bits, low lane first) of draw `e / per_draw`. One draw per element
    /// made the synthesis and the check of every token most of a CPU replay's time; each
    /// encoder uses at most its lane's bits (fp8 8, bf16 16, f32 23 of 32).
    pub fn per_draw(self) -> u32 {
        8 / self.size()
    }

    /// The rendered packer (templates/synth_common.cu): the draw word with each of its
    /// `per_draw` lanes encoded, so its little-endian bytes are the elements' bytes.
    pub(crate) fn packer(self) -> &'static str {
        match self {
            Dtype::Fp8E4m3 => "chc_pack_fp8",
            Dtype::F32 => "chc_pack_f32",
            Dtype::Bf16 => "chc_pack_bf16",
        }
    }
}

/// How a buffer's per-token fields are arranged inside one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arrangement {
    /// All fields of token 0, then of token 1, ….
    TokenMajor,
    /// Field 0 of every token, then field 1 of every token, ….
    PageOrganised,
}

/// A KV buffer kind of a model (docs/KERNELS.md "Buffer kinds").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BufferKind {
    /// NSA latent KV: 512 fp8 + 4 f32 scales + 64 bf16 RoPE per token, token-major.
    NsaKv,
    /// NSA indexer keys: 128 fp8 per token then 1 f32 scale per token, page-organised.
    NsaIndexK,
    /// Plain MLA KV: 576 bf16 per token, token-major.
    MlaKv,
    /// GQA/MHA KV of one TP shard: per token `kv_heads × head_dim` bf16 keys, then as many
    /// bf16 values, page-organised (the page's keys of every token, then its values, as
    /// vLLM's separate K and V caches hold a block). Heads and head dim are at least 1, with
    /// at most [`GQA_MAX_HEAD_ELEMENTS`] elements ([`BufferKind::check_shape`]).
    GqaKv {
        /// KV heads this rank holds (the model's KV heads divided by the TP degree).
        kv_heads: u16,
        /// Elements per head.
        head_dim: u16,
    },
}

/// The most elements `kv_heads × head_dim` of a GQA buffer (64 Ki bf16: 256 KiB of K and V
/// per token and layer), so that every byte count of a page fits the kernels' `u32`s.
pub const GQA_MAX_HEAD_ELEMENTS: u32 = 1 << 16;

/// Why a GQA shape is refused ([`BufferKind::check_shape`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// A zero head count or head dimension.
    #[error(
        "GQA needs at least 1 KV head and a head dim of at least 1, got {kv_heads} × {head_dim}"
    )]
    Empty {
        /// KV heads given.
        kv_heads: u16,
        /// Head dim given.
        head_dim: u16,
    },
    /// More elements per token than the kernels' byte counts allow.
    #[error("GQA {kv_heads} × {head_dim} = {elements} elements per token exceeds {GQA_MAX_HEAD_ELEMENTS}")]
    TooLarge {
        /// KV heads given.
        kv_heads: u16,
        /// Head dim given.
        head_dim: u16,
        /// Their product.
        elements: u32,
    },
}

impl fmt::Display for BufferKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BufferKind::NsaKv => "nsa_kv",
            BufferKind::NsaIndexK => "nsa_idx",
            BufferKind::MlaKv => "mla_kv",
            BufferKind::GqaKv { kv_heads, head_dim } => {
                return write!(f, "gqa{kv_heads}x{head_dim}_kv");
            }
        })
    }
}

/// Where the elements of one field live inside a page: element `e` of the token in slot
/// `j` starts at byte `base + j * tok_stride + e * dtype.size()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FieldLayout {
    /// Field index `f` in the synthesis hash.
    pub id: u32,
    /// Element type.
    pub dtype: Dtype,
    /// Elements per token.
    pub count: u32,
    /// Byte offset of slot 0, element 0.
    pub base: u32,
    /// Bytes between consecutive token slots.
    pub tok_stride: u32,
}

impl FieldLayout {
    /// Byte offset of element `e` of the token in page slot `slot`.
    pub fn offset(&self, slot: u32, e: u32) -> usize {
        self.base as usize
            + slot as usize * self.tok_stride as usize
            + (e * self.dtype.size()) as usize
    }

    /// Draws per token: `ceil(count / per_draw)` (docs/KERNELS.md "Synthesised KV").
    pub fn draws(&self) -> u32 {
        self.count.div_ceil(self.dtype.per_draw())
    }

    /// Draws whose `per_draw` elements all exist. Their encoded elements fill all 8 bytes
    /// of the draw word, so the synthesise and verify kernels store or compare each as one
    /// `u64` (element `e` of the draw in its bytes `e * size ..`, little-endian).
    pub fn full_draws(&self) -> u32 {
        self.count / self.dtype.per_draw()
    }

    /// The accesses that cover the last, partial draw when `count` is not a multiple of
    /// `per_draw` (empty otherwise): `(byte offset in the draw, width)`, widest first
    /// (4, 2, 1), each taking the draw word's bytes at that offset. The kernels never touch a
    /// byte past the field's last element, so a partial draw cannot be one 8-byte store
    /// (nsa `index_k`'s single f32 scale per token is half a draw).
    pub fn tail_accesses(&self) -> Vec<(u32, u32)> {
        let mut left = (self.count % self.dtype.per_draw()) * self.dtype.size();
        let mut off = 0;
        let mut out = Vec::new();
        for width in [4, 2, 1] {
            if left >= width {
                out.push((off, width));
                off += width;
                left -= width;
            }
        }
        out
    }

    /// Checks that every access of the synthesise and verify kernels to this field is
    /// aligned to its width (a GPU faults on a misaligned access that the CPU runs without
    /// complaint), in every slot of every page of `page_bytes` bytes. Buffers start 16-byte
    /// aligned ([`KernelParam::align`](super::KernelParam::align)) and pages follow each
    /// other, so the page size, the token stride and the access's offset in slot 0 must all
    /// be multiples of the width: 8 for the full draws, the width of each access of a partial
    /// last draw.
    pub fn check_access_alignment(&self, page_bytes: u64) -> Result<(), FieldMisalignment> {
        let full = (self.full_draws() > 0).then_some((0u32, 8u32));
        let tail_start = self.full_draws() * 8;
        let tail = self
            .tail_accesses()
            .into_iter()
            .map(|(off, width)| (tail_start + off, width));
        for (off, width) in full.into_iter().chain(tail) {
            let at = u64::from(self.base) + u64::from(off);
            let checks = [
                ("page bytes", page_bytes),
                ("token stride", u64::from(self.tok_stride)),
                ("offset in the page", at),
            ];
            if let Some(&(what, value)) = checks.iter().find(|(_, v)| v % u64::from(width) != 0) {
                return Err(FieldMisalignment {
                    field: self.id,
                    width,
                    what,
                    value,
                });
            }
        }
        Ok(())
    }
}

/// Why an access of the synthesise or verify kernels to a field would be misaligned
/// ([`FieldLayout::check_access_alignment`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldMisalignment {
    /// The field index.
    pub field: u32,
    /// Bytes of the access (8 for a full draw).
    pub width: u32,
    /// Which quantity is not a multiple of the width: `page bytes`, `token stride` or
    /// `offset in the page`.
    pub what: &'static str,
    /// Its value.
    pub value: u64,
}

impl BufferKind {
    /// The buffer index `b` of the synthesis hash.
    pub fn id(self) -> u32 {
        match self {
            BufferKind::NsaKv | BufferKind::MlaKv | BufferKind::GqaKv { .. } => 0,
            BufferKind::NsaIndexK => 1,
        }
    }

    /// Checks a GQA shape (other kinds are fixed and always pass): at least one head of at
    /// least one element, at most [`GQA_MAX_HEAD_ELEMENTS`] elements. (Whether the kernels'
    /// accesses are aligned at a page size is [`BufferKind::check_access_alignment`]'s.)
    pub fn check_shape(self) -> Result<(), ShapeError> {
        let BufferKind::GqaKv { kv_heads, head_dim } = self else {
            return Ok(());
        };
        let elements = u32::from(kv_heads) * u32::from(head_dim);
        if elements == 0 {
            Err(ShapeError::Empty { kv_heads, head_dim })
        } else if elements > GQA_MAX_HEAD_ELEMENTS {
            Err(ShapeError::TooLarge {
                kv_heads,
                head_dim,
                elements,
            })
        } else {
            Ok(())
        }
    }

    /// The per-token fields, in order: `(dtype, elements)`. GQA's are its keys (field 0)
    /// and its values (field 1), `kv_heads × head_dim` bf16 each, head-major.
    pub fn fields(self) -> Vec<(Dtype, u32)> {
        match self {
            BufferKind::NsaKv => vec![(Dtype::Fp8E4m3, 512), (Dtype::F32, 4), (Dtype::Bf16, 64)],
            BufferKind::NsaIndexK => vec![(Dtype::Fp8E4m3, 128), (Dtype::F32, 1)],
            BufferKind::MlaKv => vec![(Dtype::Bf16, 576)],
            BufferKind::GqaKv { kv_heads, head_dim } => {
                let n = u32::from(kv_heads) * u32::from(head_dim);
                vec![(Dtype::Bf16, n), (Dtype::Bf16, n)]
            }
        }
    }

    /// Field arrangement inside a page.
    pub fn arrangement(self) -> Arrangement {
        match self {
            BufferKind::NsaKv | BufferKind::MlaKv => Arrangement::TokenMajor,
            BufferKind::NsaIndexK | BufferKind::GqaKv { .. } => Arrangement::PageOrganised,
        }
    }

    /// Bytes per token (656, 132, 1152; GQA `4 × kv_heads × head_dim`).
    pub fn bytes_per_token(self) -> u32 {
        self.fields().iter().map(|(d, c)| d.size() * c).sum()
    }

    /// Bytes of one page of `page_size` tokens.
    pub fn page_bytes(self, page_size: u32) -> u64 {
        u64::from(self.bytes_per_token()) * u64::from(page_size)
    }

    /// Checks [`FieldLayout::check_access_alignment`] for every field at `page_size`. Every
    /// buffer kind passes at every page size the kernels accept, except nsa `index_k` at page
    /// size 1 (132-byte pages: every other page starts 4 bytes off an 8-byte boundary).
    pub fn check_access_alignment(self, page_size: u32) -> Result<(), FieldMisalignment> {
        let page_bytes = self.page_bytes(page_size);
        self.field_layouts(page_size)
            .iter()
            .try_for_each(|f| f.check_access_alignment(page_bytes))
    }

    /// Byte placement of every field in a page of `page_size` tokens.
    pub fn field_layouts(self, page_size: u32) -> Vec<FieldLayout> {
        let bpt = self.bytes_per_token();
        let mut before = 0u32;
        self.fields()
            .into_iter()
            .enumerate()
            .map(|(id, (dtype, count))| {
                let field_bytes = dtype.size() * count;
                let (base, tok_stride) = match self.arrangement() {
                    Arrangement::TokenMajor => (before, bpt),
                    Arrangement::PageOrganised => (before.saturating_mul(page_size), field_bytes),
                };
                before += field_bytes;
                FieldLayout {
                    id: id as u32,
                    dtype,
                    count,
                    base,
                    tok_stride,
                }
            })
            .collect()
    }
}
