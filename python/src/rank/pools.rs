//! The device pools as DLPack producers (`pool`), and where pages (`locate`) and tokens
//! (`place_tokens`) live in them under the deployment's layout.

use super::convert::{id_bytes, ids};
use super::{RankCache, ViewToken};
use crate::dlpack::Pool;
use crate::errors::usage;
use cp_hicache::kernels::BufferKind;
use cp_hicache::layout::{PageId, Placement};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::atomic::Ordering;

#[pymethods]
impl RankCache {
    /// A device pool of `buffer` (`mla_kv`; NSA: `nsa_kv`, `nsa_idx`) as a DLPack producer,
    /// `uint8[layers, local_pages, page_bytes]`, read and written in place: this rank's own
    /// (`owner=None`), or this rank's mapping of rank `owner`'s pool (how CP attention reads
    /// every page from its owner).
    #[pyo3(signature = (buffer, owner = None))]
    fn pool(slf: &Bound<'_, Self>, buffer: &str, owner: Option<u8>) -> PyResult<Pool> {
        let me = slf.get();
        let kinds = me.deployment.inner.model.buffers();
        let kind: BufferKind =
            *kinds
                .iter()
                .find(|k| k.to_string() == buffer)
                .ok_or_else(|| {
                    let names: Vec<String> = kinds.iter().map(ToString::to_string).collect();
                    usage(format!(
                        "no `{buffer}` pool: this deployment's buffers are {}",
                        names.join(", ")
                    ))
                })?;
        let cp = me.deployment.inner.cp;
        if let Some(o) = owner.filter(|&o| o >= cp) {
            return Err(usage(format!("owner {o} is not a rank of a CP {cp} group")));
        }
        if me.closed.load(Ordering::Acquire) {
            return Err(me.closed_error());
        }
        let g = me.geometry;
        let views = &me
            .pools
            .iter()
            .find(|(k, _)| *k == kind)
            .expect("every buffer kind has its pools")
            .1;
        let Some((address, mapped)) = views[usize::from(owner.unwrap_or(me.rank))] else {
            return Err(usage(format!(
                "the `{buffer}` pool is the engine's own memory: read it through the tensors \
                 the cache adopted"
            )));
        };
        let page_bytes = kind.page_bytes(me.deployment.inner.page_size);
        // The view never claims more than the mapping holds: its pages come from the size
        // the pool was mapped with (start-up refused a peer's smaller than this rank's).
        let row = page_bytes * u64::from(g.layers);
        let local_pages = (mapped as u64 / row.max(1)).min(u64::from(g.local_pages));
        Ok(Pool::new(
            slf.clone().into_any().unbind(),
            ViewToken::new(&me.inner, &me.views, &me.closed),
            buffer.to_string(),
            address,
            [i64::from(g.layers), local_pages as i64, page_bytes as i64],
        ))
    }

    /// Where each of the first `n_tokens` tokens of a sequence on `pages` lives, under the
    /// deployment's layout: its owner rank and its slot in the owner's pool,
    /// `local_page * page_size + slot` (u32 bytes each).
    fn place_tokens<'py>(
        &self,
        py: Python<'py>,
        pages: &[u8],
        n_tokens: u64,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let pages = ids(pages, "pages")?;
        let layout = self.layout;
        let ps = layout.page_size();
        let place: Placement = self.deployment.inner.layout.placement(layout.cp(), ps);
        if place.pages_holding(n_tokens) > pages.len() as u64 {
            return Err(usage(format!(
                "{n_tokens} tokens need {} pages under {}, not {}",
                place.pages_holding(n_tokens),
                self.deployment.inner.layout,
                pages.len()
            )));
        }
        if let Some(p) = pages.iter().find(|&&p| p >= layout.pages()) {
            return Err(usage(format!(
                "page {p} is outside the {} logical pages",
                layout.pages()
            )));
        }
        let (mut owners, mut slots) = (Vec::new(), Vec::new());
        for t in 0..n_tokens {
            let (i, j) = place.place(t);
            let page = PageId(pages[i as usize]);
            owners.push(u32::from(layout.owner(page).0));
            slots.push(layout.local(page).0 * ps + j);
        }
        Ok((id_bytes(py, owners), id_bytes(py, slots)))
    }

    /// Each page's owner rank and local page in its owner's pool (u32 bytes each).
    fn locate<'py>(
        &self,
        py: Python<'py>,
        pages: &[u8],
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let pages = ids(pages, "pages")?;
        let layout = self.layout;
        if let Some(p) = pages.iter().find(|&&p| p >= layout.pages()) {
            return Err(usage(format!(
                "page {p} is outside the {} logical pages",
                layout.pages()
            )));
        }
        Ok((
            id_bytes(
                py,
                pages.iter().map(|&p| u32::from(layout.owner(PageId(p)).0)),
            ),
            id_bytes(py, pages.iter().map(|&p| layout.local(PageId(p)).0)),
        ))
    }
}
