//! A CPU reference decode step over a dense materialised KV buffer.
//!
//! Verification proves a cache hit byte for byte; this module shows what those bytes are
//! *for*: one attention step of a single query over the cached latent KV, computed on the
//! CPU. Equal buffers give bit-identical outputs, and a buffer with a page loaded into the
//! wrong owner (the seed's bug) gives a different, incoherent output while nothing crashes.
//!
//! Keys and values follow the buffers of docs/KERNELS.md:
//! - NSA `kv`: the key of a token is its 512 fp8-e4m3 latent values, each multiplied by the
//!   f32 scale of its group of 128, followed by its 64 bf16 RoPE values (576 dims); the
//!   value is the dequantised latent (512 dims).
//! - MLA `kv`: the key is all 576 bf16 values; the value is the first 512.
//! - GQA `kv` (`kv_heads × head_dim` bf16 keys and values): one query head per KV head
//!   (MHA; a GQA model's query heads that share a KV head attend to the same keys, so one
//!   of them per group shows the same thing). Head `h` of the query attends over head `h`
//!   of every token's keys, with its own softmax, and the output is the heads' weighted
//!   values side by side (`kv_heads × head_dim` values).
//!
//! The dense buffer is `[layer][seq_page][page bytes]`, as the materialise kernel writes it.

use crate::kernels::{BufferKind, Dtype};
use half::bf16;

/// Key dimensions of the MLA and NSA buffers (latent + RoPE).
pub const KEY_DIM: usize = 576;
/// Value dimensions of the MLA and NSA buffers (the latent).
pub const VALUE_DIM: usize = 512;

/// The attention shape of `buffer`: `(heads, key dims per head, value dims per head)`.
/// A query has `heads × key dims` values and the output `heads × value dims`.
pub fn attention_shape(buffer: BufferKind) -> Result<(usize, usize, usize), DecodeError> {
    match buffer {
        BufferKind::NsaKv | BufferKind::MlaKv => Ok((1, KEY_DIM, VALUE_DIM)),
        BufferKind::GqaKv { kv_heads, head_dim } => {
            buffer
                .check_shape()
                .map_err(|_| DecodeError::Unsupported { buffer })?;
            let (h, d) = (usize::from(kv_heads), usize::from(head_dim));
            Ok((h, d, d))
        }
        BufferKind::NsaIndexK => Err(DecodeError::Unsupported { buffer }),
    }
}

/// Values of a query of `buffer` ([`attention_shape`]).
pub fn query_len(buffer: BufferKind) -> Result<usize, DecodeError> {
    attention_shape(buffer).map(|(h, k, _)| h * k)
}
/// Latent values that share one NSA f32 scale.
pub const SCALE_GROUP: usize = 128;

/// Why a decode step or a dtype check refused its input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    /// The buffer kind holds no attention keys (the NSA indexer keys), or has an
    /// impossible shape (a GQA buffer without heads).
    #[error("buffer {buffer} has no KV to decode from")]
    Unsupported {
        /// The buffer kind.
        buffer: BufferKind,
    },
    /// The dense buffer's size does not match its claimed shape.
    #[error("dense {buffer} buffer of {got} bytes, expected {expected} ({layers} layers × {pages} pages)")]
    Shape {
        /// The buffer kind.
        buffer: BufferKind,
        /// Bytes given.
        got: usize,
        /// Bytes the shape needs (wider than `usize`: an absurd shape is reported, not
        /// overflowed).
        expected: u128,
        /// Layers claimed.
        layers: u32,
        /// Pages implied by the token count.
        pages: usize,
    },
    /// The layer is outside the buffer.
    #[error("layer {layer} out of {layers}")]
    Layer {
        /// Requested layer.
        layer: u32,
        /// Layers in the buffer.
        layers: u32,
    },
    /// The query has the wrong length.
    #[error("query of {got} values, expected {expected}")]
    Query {
        /// Values given.
        got: usize,
        /// Values the buffer's keys need ([`query_len`]).
        expected: usize,
    },
    /// A query value is NaN or infinite: every output would be NaN.
    #[error("query value {index} is {value}, not a finite number")]
    QueryValue {
        /// Position in the query.
        index: usize,
        /// The value.
        value: f32,
    },
    /// There is nothing to attend to.
    #[error("no tokens to attend to")]
    NoTokens,
    /// The page size is zero.
    #[error("page size must be at least 1")]
    PageSize,
    /// A stored value is not a legal value of its dtype (NaN, infinite, or a non-positive
    /// scale).
    #[error("token {token} layer {layer}: {dtype} element {element} of field {field} is invalid (bits {bits:#x})")]
    BadValue {
        /// Token position.
        token: usize,
        /// Layer.
        layer: u32,
        /// Field index.
        field: u32,
        /// Element inside the field.
        element: u32,
        /// Field dtype.
        dtype: Dtype,
        /// Raw bits.
        bits: u32,
    },
}

/// Decodes one fp8-e4m3 (FN variant: no infinities, `S.1111.111` is NaN) byte.
pub fn fp8_e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((code >> 3) & 0x0f);
    let mant = f32::from(code & 0x07);
    if exp == 0x0f && code & 0x07 == 0x07 {
        return f32::NAN;
    }
    let mag = if exp == 0 {
        mant / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + mant / 8.0) * 2f32.powi(exp - 7)
    };
    sign * mag
}

/// A validated view of a dense buffer.
struct Dense<'a> {
    buffer: BufferKind,
    bytes: &'a [u8],
    page_size: u32,
    pages: usize,
    page_bytes: usize,
}

impl<'a> Dense<'a> {
    fn new(
        buffer: BufferKind,
        bytes: &'a [u8],
        page_size: u32,
        layers: u32,
        n_tokens: usize,
    ) -> Result<Self, DecodeError> {
        if page_size == 0 {
            return Err(DecodeError::PageSize);
        }
        let pages = n_tokens.div_ceil(page_size as usize);
        let page_bytes = buffer.page_bytes(page_size) as usize;
        // A shape claimed by the caller can be absurd (a huge token or layer count): compute
        // its size without overflow; only a size equal to the buffer's is accepted, so the
        // page arithmetic below stays in range.
        let expected = page_bytes as u128 * pages as u128 * u128::from(layers);
        if bytes.len() as u128 != expected {
            return Err(DecodeError::Shape {
                buffer,
                got: bytes.len(),
                expected,
                layers,
                pages,
            });
        }
        Ok(Dense {
            buffer,
            bytes,
            page_size,
            pages,
            page_bytes,
        })
    }

    /// The page holding token `t` of `layer`, and the token's slot in it.
    fn page(&self, layer: u32, t: usize) -> (&'a [u8], u32) {
        let ps = self.page_size as usize;
        let at = (layer as usize * self.pages + t / ps) * self.page_bytes;
        (&self.bytes[at..at + self.page_bytes], (t % ps) as u32)
    }

    /// Raw bits of element `e` of field `f` of token `t`.
    fn bits(&self, layer: u32, t: usize, f: &crate::kernels::FieldLayout, e: u32) -> u32 {
        let (page, slot) = self.page(layer, t);
        let at = f.offset(slot, e);
        match f.dtype {
            Dtype::Fp8E4m3 => u32::from(page[at]),
            Dtype::Bf16 => u32::from(u16::from_le_bytes([page[at], page[at + 1]])),
            Dtype::F32 => u32::from_le_bytes([page[at], page[at + 1], page[at + 2], page[at + 3]]),
        }
    }
}

fn value_of(dtype: Dtype, bits: u32) -> f32 {
    match dtype {
        Dtype::Fp8E4m3 => fp8_e4m3_to_f32(bits as u8),
        Dtype::Bf16 => bf16::from_bits(bits as u16).to_f32(),
        Dtype::F32 => f32::from_bits(bits),
    }
}

/// Checks that every element of the first `n_tokens` tokens in every layer is a legal value
/// of its dtype: fp8-e4m3 codes and bf16 values finite, f32 scales positive and finite. The
/// synthesised KV is built to pass this, so a failure means bytes from somewhere else.
pub fn check_dtypes(
    buffer: BufferKind,
    dense: &[u8],
    page_size: u32,
    layers: u32,
    n_tokens: usize,
) -> Result<(), DecodeError> {
    let d = Dense::new(buffer, dense, page_size, layers, n_tokens)?;
    let fields = buffer.field_layouts(page_size);
    for layer in 0..layers {
        for t in 0..n_tokens {
            for f in &fields {
                for e in 0..f.count {
                    let bits = d.bits(layer, t, f, e);
                    let v = value_of(f.dtype, bits);
                    let ok = v.is_finite() && (f.dtype != Dtype::F32 || v > 0.0);
                    if !ok {
                        return Err(DecodeError::BadValue {
                            token: t,
                            layer,
                            field: f.id,
                            element: e,
                            dtype: f.dtype,
                            bits,
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

/// The key (576 values, or `kv_heads × head_dim` for GQA) and value (512 values, or
/// `kv_heads × head_dim`) of token `t` in `layer`, heads side by side.
fn token_kv(d: &Dense<'_>, layer: u32, t: usize) -> Result<(Vec<f32>, Vec<f32>), DecodeError> {
    let fields = d.buffer.field_layouts(d.page_size);
    let bad = |f: &crate::kernels::FieldLayout, e: u32, bits: u32| DecodeError::BadValue {
        token: t,
        layer,
        field: f.id,
        element: e,
        dtype: f.dtype,
        bits,
    };
    let read = |f: &crate::kernels::FieldLayout, e: u32| -> Result<f32, DecodeError> {
        let bits = d.bits(layer, t, f, e);
        let v = value_of(f.dtype, bits);
        if v.is_finite() {
            Ok(v)
        } else {
            Err(bad(f, e, bits))
        }
    };
    let mut key = Vec::with_capacity(KEY_DIM);
    match d.buffer {
        BufferKind::NsaKv => {
            let (latent, scales, rope) = (&fields[0], &fields[1], &fields[2]);
            let s: Vec<f32> = (0..scales.count)
                .map(|e| read(scales, e))
                .collect::<Result<_, _>>()?;
            for e in 0..latent.count {
                key.push(read(latent, e)? * s[e as usize / SCALE_GROUP]);
            }
            for e in 0..rope.count {
                key.push(read(rope, e)?);
            }
        }
        BufferKind::MlaKv => {
            let all = &fields[0];
            for e in 0..all.count {
                key.push(read(all, e)?);
            }
        }
        BufferKind::GqaKv { .. } => {
            let (k, v) = (&fields[0], &fields[1]);
            for e in 0..k.count {
                key.push(read(k, e)?);
            }
            let value = (0..v.count)
                .map(|e| read(v, e))
                .collect::<Result<Vec<f32>, _>>()?;
            return Ok((key, value));
        }
        BufferKind::NsaIndexK => return Err(DecodeError::Unsupported { buffer: d.buffer }),
    }
    let value = key[..VALUE_DIM].to_vec();
    Ok((key, value))
}

/// One decode step of `query` ([`query_len`] finite values: 576 for MLA and NSA,
/// `kv_heads × head_dim` for GQA) over the `n_tokens` tokens of `layer` in `dense` (a
/// materialised buffer of exactly `ceil(n_tokens / page_size)` pages per layer): per head,
/// scaled dot products with every key, a softmax, and the weighted sum of the values (512
/// values for MLA and NSA, `kv_heads × head_dim` for GQA). Deterministic: the same bytes
/// always give the same bits.
///
/// Like an engine, it computes with whatever finite bytes it is given (a negative scale
/// included) and refuses only values it cannot compute with: under the seed's bug the poison
/// a rank never overwrote decodes, silently, to another output. [`check_dtypes`] is the
/// validator.
pub fn decode_step(
    buffer: BufferKind,
    dense: &[u8],
    page_size: u32,
    layers: u32,
    layer: u32,
    n_tokens: usize,
    query: &[f32],
) -> Result<Vec<f32>, DecodeError> {
    let (heads, key_dim, value_dim) = attention_shape(buffer)?;
    if query.len() != heads * key_dim {
        return Err(DecodeError::Query {
            got: query.len(),
            expected: heads * key_dim,
        });
    }
    if let Some((index, &value)) = query.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(DecodeError::QueryValue { index, value });
    }
    if n_tokens == 0 {
        return Err(DecodeError::NoTokens);
    }
    if layer >= layers {
        return Err(DecodeError::Layer { layer, layers });
    }
    let d = Dense::new(buffer, dense, page_size, layers, n_tokens)?;
    let scale = 1.0 / (key_dim as f64).sqrt();
    // scores[h][t]: head h's scaled dot product with token t's key.
    let mut scores = vec![Vec::with_capacity(n_tokens); heads];
    let mut values = Vec::with_capacity(n_tokens);
    for t in 0..n_tokens {
        let (k, v) = token_kv(&d, layer, t)?;
        for (h, s) in scores.iter_mut().enumerate() {
            let dot: f64 = k[h * key_dim..(h + 1) * key_dim]
                .iter()
                .zip(&query[h * key_dim..(h + 1) * key_dim])
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            s.push(dot * scale);
        }
        values.push(v);
    }
    let mut out = vec![0f64; heads * value_dim];
    for (h, s) in scores.iter().enumerate() {
        let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let o = &mut out[h * value_dim..(h + 1) * value_dim];
        for (w, v) in weights.iter().zip(&values) {
            for (o, &x) in o.iter_mut().zip(&v[h * value_dim..(h + 1) * value_dim]) {
                *o += w / total * f64::from(x);
            }
        }
    }
    Ok(out.into_iter().map(|x| x as f32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::reference::{prefix_hashes, synth_token};

    #[test]
    fn absurd_shapes_are_shape_errors_not_overflows() {
        let q = vec![0.0f32; KEY_DIM];
        let buf = vec![0u8; 64];
        for (n_tokens, layers) in [
            (usize::MAX, u32::MAX),
            (usize::MAX / 2, 2),
            (1 << 60, 1 << 20),
        ] {
            let err =
                decode_step(BufferKind::MlaKv, &buf, 16, layers, 0, n_tokens, &q).unwrap_err();
            match &err {
                DecodeError::Shape { got, expected, .. } => {
                    assert_eq!(*got, 64);
                    assert!(*expected > usize::MAX as u128 / 1024, "{err}");
                }
                other => panic!("{other}"),
            }
            assert!(matches!(
                check_dtypes(BufferKind::MlaKv, &buf, 16, layers, n_tokens),
                Err(DecodeError::Shape { .. })
            ));
        }
    }

    #[test]
    fn fp8_decoding_matches_known_codes() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
        assert_eq!(fp8_e4m3_to_f32(0xb8), -1.0);
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
        assert!(fp8_e4m3_to_f32(0x7f).is_nan());
        assert!(fp8_e4m3_to_f32(0xff).is_nan());
    }

    fn dense(buffer: BufferKind, ps: u32, layers: u32, tokens: &[u32]) -> Vec<u8> {
        let pages = tokens.len().div_ceil(ps as usize);
        let pb = buffer.page_bytes(ps) as usize;
        let mut out = vec![0xA5u8; pb * pages * layers as usize];
        for (t, &h) in prefix_hashes(tokens).iter().enumerate() {
            for l in 0..layers {
                let at = (l as usize * pages + t / ps as usize) * pb;
                synth_token(
                    buffer,
                    ps,
                    h,
                    l,
                    (t % ps as usize) as u32,
                    &mut out[at..at + pb],
                )
                .unwrap();
            }
        }
        out
    }

    const GQA: BufferKind = BufferKind::GqaKv {
        kv_heads: 4,
        head_dim: 16,
    };

    #[test]
    fn synthesised_kv_decodes_and_rejects_bad_input() {
        let tokens: Vec<u32> = (0..40).collect();
        for b in [
            BufferKind::NsaKv,
            BufferKind::MlaKv,
            BufferKind::NsaIndexK,
            GQA,
        ] {
            let d = dense(b, 16, 2, &tokens);
            check_dtypes(b, &d, 16, 2, tokens.len()).unwrap();
            if b == BufferKind::NsaIndexK {
                let q = vec![0.0; KEY_DIM];
                assert!(matches!(
                    decode_step(b, &d, 16, 2, 0, 40, &q),
                    Err(DecodeError::Unsupported { .. })
                ));
                continue;
            }
            let (heads, _, value_dim) = attention_shape(b).unwrap();
            let q: Vec<f32> = (0..query_len(b).unwrap())
                .map(|i| (i as f32 * 0.37).sin())
                .collect();
            let out = decode_step(b, &d, 16, 2, 1, 40, &q).unwrap();
            assert_eq!(out.len(), heads * value_dim);
            assert!(out.iter().all(|x| x.is_finite()));
            assert!(decode_step(b, &d, 16, 2, 2, 40, &q).is_err());
            assert!(decode_step(b, &d, 16, 2, 0, 40, &q[1..]).is_err());
            assert!(decode_step(b, &d[1..], 16, 2, 0, 40, &q).is_err());
            for bad in [f32::NAN, f32::INFINITY] {
                let mut q = q.clone();
                q[7] = bad;
                assert!(matches!(
                    decode_step(b, &d, 16, 2, 0, 40, &q),
                    Err(DecodeError::QueryValue { index: 7, .. })
                ));
            }
            let mut nan = d.clone();
            nan[0] = 0xff;
            nan[1] = 0xff;
            assert!(matches!(
                decode_step(b, &nan, 16, 2, 0, 40, &q),
                Err(DecodeError::BadValue { token: 0, .. })
            ));
        }
    }

    /// GQA: each query head attends over its own KV head only, and the output's head `h` is
    /// a mix of head `h`'s values (so changing another head's keys leaves it unchanged).
    #[test]
    fn gqa_heads_attend_separately() {
        let tokens: Vec<u32> = (0..20).collect();
        let d = dense(GQA, 8, 1, &tokens);
        assert_eq!(query_len(GQA).unwrap(), 64);
        let q: Vec<f32> = (0..64).map(|i| (i as f32 * 0.11).cos() * 0.05).collect();
        let out = decode_step(GQA, &d, 8, 1, 0, 20, &q).unwrap();
        assert_eq!(out.len(), 64);
        // A single token: the output is exactly its values, head by head.
        let one = decode_step(GQA, &d[..GQA.page_bytes(8) as usize], 8, 1, 0, 1, &q).unwrap();
        let f = GQA.field_layouts(8);
        let v0: Vec<f32> = (0..64)
            .map(|e| {
                let at = f[1].offset(0, e);
                bf16::from_bits(u16::from_le_bytes([d[at], d[at + 1]])).to_f32()
            })
            .collect();
        assert_eq!(one, v0);
        // Head 3's keys of every token changed: heads 0..3 of the output stay the same.
        let mut other = d.clone();
        for page in 0..3usize {
            for slot in 0..8u32 {
                let at = page * GQA.page_bytes(8) as usize + f[0].offset(slot, 3 * 16);
                other[at] ^= 0x01;
            }
        }
        let changed = decode_step(GQA, &other, 8, 1, 0, 20, &q).unwrap();
        assert_eq!(changed[..48], out[..48]);
        assert_ne!(changed[48..], out[48..]);
        assert!(matches!(
            decode_step(GQA, &d, 8, 1, 0, 20, &q[..63]),
            Err(DecodeError::Query { expected: 64, .. })
        ));
        assert!(matches!(
            query_len(BufferKind::GqaKv {
                kv_heads: 0,
                head_dim: 128
            }),
            Err(DecodeError::Unsupported { .. })
        ));
    }
}
