//! Records of a layout that splits a sequence page across ranks (`token-interleave`): each
//! rank writes its tokens of a record as one part, packed, and the record is assembled and
//! becomes visible when its last part comes ([`PageStore::put_part`](super::PageStore::put_part)).
//! A reader under such a layout reads the whole records its page's tokens come from and
//! takes its own tokens out of them.
//!
//! A page's payload (a record's, or a host page's) is every layer of every buffer kind, in
//! the model's order, each a page of `page_size` token slots laid out as the buffer kind
//! says ([`BufferKind::field_layouts`](crate::kernels::BufferKind::field_layouts)). A part is
//! the same for a page of as many slots as the rank holds tokens of the record.

use crate::kernels::Deployment;

/// Where each token slot's bytes lie in a page payload of `slots` slots.
#[derive(Clone, Debug)]
pub struct PageSlots {
    /// `(offset of slot 0, bytes between slots, bytes)` of each field of each layer of each
    /// buffer kind.
    fields: Vec<(usize, usize, usize)>,
    bytes: usize,
}

impl PageSlots {
    /// The slots of a payload of `slots` token slots of `dep` with `layers` layers.
    pub fn new(dep: &Deployment, layers: u32, slots: u32) -> PageSlots {
        let mut fields = Vec::new();
        let mut at = 0usize;
        for b in dep.model.buffers() {
            let page = b.page_bytes(slots) as usize;
            for _ in 0..layers {
                for f in b.field_layouts(slots) {
                    let len = (f.dtype.size() * f.count) as usize;
                    fields.push((at + f.base as usize, f.tok_stride as usize, len));
                }
                at += page;
            }
        }
        PageSlots { fields, bytes: at }
    }

    /// Bytes of such a payload.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Copies the token in slot `from` of `src` (laid out as `self`) to slot `to` of `dst`
    /// (laid out as `into`).
    pub fn copy(&self, src: &[u8], from: u32, into: &PageSlots, dst: &mut [u8], to: u32) {
        for (a, b) in self.fields.iter().zip(&into.fields) {
            let s = a.0 + from as usize * a.1;
            let d = b.0 + to as usize * b.1;
            dst[d..d + a.2].copy_from_slice(&src[s..s + a.2]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ModelShape;

    /// Packing tokens into a smaller page and back gives the same bytes, for every buffer
    /// arrangement (NSA's `index_k` keeps its scales apart from its values, GQA its values apart
    /// from its keys).
    #[test]
    fn tokens_move_between_pages_of_any_slot_count() {
        for model in [
            ModelShape::MlaBf16,
            ModelShape::Nsa,
            ModelShape::GQA_DEFAULT,
        ] {
            let dep = Deployment::new(model, 64, 4).unwrap();
            let full = PageSlots::new(&dep, 2, 64);
            assert_eq!(full.bytes() as u64, super::super::payload_bytes(&dep, 2));
            let part = PageSlots::new(&dep, 2, 16);
            let src: Vec<u8> = (0..full.bytes()).map(|i| (i * 7 % 251) as u8).collect();
            let mut packed = vec![0u8; part.bytes()];
            for j in 0..16 {
                full.copy(&src, 4 * j + 1, &part, &mut packed, j);
            }
            let mut back = vec![0u8; full.bytes()];
            for j in 0..16 {
                part.copy(&packed, j, &full, &mut back, 4 * j + 1);
            }
            let mut want = vec![0u8; full.bytes()];
            for s in (0..16).map(|j| 4 * j + 1) {
                full.copy(&src, s, &full, &mut want, s);
            }
            assert_eq!(back, want, "{model:?}");
            assert!(want.iter().any(|&b| b != 0));
        }
    }
}
