//! Walking the tree along a token sequence: paths, prefix matching, and the splits a match
//! ending inside a node makes.

use super::{invariant, MatchResult, Node, NodeId, RadixTree, TreeError};
use crate::layout::PageId;
use std::collections::BTreeMap;

/// Leading whole units (pages, or granules) on which `a` and `b` agree.
fn common_units(a: &[u32], b: &[u32], unit: usize) -> usize {
    a.chunks_exact(unit)
        .zip(b.chunks_exact(unit))
        .take_while(|(x, y)| x == y)
        .count()
}

impl RadixTree {
    /// The nodes from the root's child down to `node` (empty for the root).
    pub fn path(&self, node: NodeId) -> Result<Vec<NodeId>, TreeError> {
        let mut path = Vec::new();
        let mut cur = node;
        while cur != NodeId::ROOT {
            path.push(cur);
            cur = self
                .get(cur)?
                .parent
                .ok_or_else(|| invariant(format!("{cur} has no parent")))?;
        }
        path.reverse();
        Ok(path)
    }

    /// All tokens from the root to the end of `node`.
    pub fn prefix_tokens(&self, node: NodeId) -> Result<Vec<u32>, TreeError> {
        let mut out = Vec::new();
        for id in self.path(node)? {
            out.extend_from_slice(&self.get(id)?.key);
        }
        Ok(out)
    }

    /// Matches the longest whole-granule prefix of `tokens` (whole pages, or whole groups of
    /// `cp` pages under the interleaved layouts), splitting the last node when the match ends
    /// inside it, and touches every node on the matched path.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> Result<MatchResult, TreeError> {
        let ps = self.ps();
        let unit = self.unit();
        let whole = tokens.len() / unit * unit;
        self.clock += 1;
        let (path, matched_pages) = self.descend(&tokens[..whole], self.clock)?;
        let mut device_pages = Vec::new();
        let mut host_nodes = Vec::new();
        let mut last_device_node = NodeId::ROOT;
        let mut on_device = true;
        for &id in &path {
            let n = self.get(id)?;
            if on_device {
                if let Some(d) = &n.device {
                    device_pages.extend_from_slice(d);
                    last_device_node = id;
                    continue;
                }
                on_device = false;
            }
            if n.device.is_none() && n.host.is_some() {
                host_nodes.push(id);
            } else {
                break;
            }
        }
        Ok(MatchResult {
            matched_tokens: matched_pages * ps,
            device_pages,
            host_nodes,
            last_node: path.last().copied().unwrap_or(NodeId::ROOT),
            last_device_node,
        })
    }

    /// Pages of the longest whole-granule prefix of `tokens` the tree holds (on the device or
    /// the host), without changing anything (no split, no stamp).
    pub fn matched_pages(&self, tokens: &[u32]) -> Result<usize, TreeError> {
        Ok(self.existing_device_pages(tokens)?.len())
    }

    /// The device page the tree holds at each page position of the longest matching path,
    /// without changing anything (no split, no stamp).
    pub(super) fn existing_device_pages(
        &self,
        tokens: &[u32],
    ) -> Result<Vec<Option<PageId>>, TreeError> {
        let (unit, granule) = (self.unit(), self.granule());
        let mut out = Vec::new();
        let mut node = NodeId::ROOT;
        let mut pos = 0;
        while pos + unit <= tokens.len() {
            let Some(&child) = self.get(node)?.children.get(&tokens[pos..pos + unit]) else {
                break;
            };
            let c = self.get(child)?;
            let k = common_units(&c.key, &tokens[pos..], unit);
            out.extend((0..k * granule).map(|i| c.device.as_ref().map(|d| d[i])));
            pos += k * unit;
            if k < c.key.len() / unit {
                break;
            }
            node = child;
        }
        Ok(out)
    }

    /// Follows `tokens` (whole granules) from the root, splitting the node where the match ends
    /// inside one, and stamps the path with `now`. Returns the path (root excluded) and the
    /// matched page count.
    pub(super) fn descend(
        &mut self,
        tokens: &[u32],
        now: u64,
    ) -> Result<(Vec<NodeId>, usize), TreeError> {
        let (ps, unit, granule) = (self.ps(), self.unit(), self.granule());
        let mut path = Vec::new();
        let mut node = NodeId::ROOT;
        let mut pos = 0;
        self.get_mut(node)?.stamp = now;
        while pos + unit <= tokens.len() {
            let Some(&child) = self.get(node)?.children.get(&tokens[pos..pos + unit]) else {
                break;
            };
            let c = self.get(child)?;
            let c_units = c.key.len() / unit;
            let k = common_units(&c.key, &tokens[pos..], unit);
            let partial = k < c_units;
            let reached = if partial {
                self.split(child, k * granule)?
            } else {
                child
            };
            self.get_mut(reached)?.stamp = now;
            path.push(reached);
            pos += k * unit;
            node = reached;
            if partial {
                break;
            }
        }
        Ok((path, pos / ps))
    }

    /// Splits `child` after `at_pages` pages. The new node takes the prefix (and the
    /// parent's link); `child` keeps its handle and the suffix, so outstanding handles (and
    /// locks) to it stay valid. Returns the new prefix node.
    fn split(&mut self, child: NodeId, at_pages: usize) -> Result<NodeId, TreeError> {
        let (ps, unit) = (self.ps(), self.unit());
        let at = at_pages * ps;
        let c = self.get(child)?;
        if at == 0 || at >= c.key.len() || at % unit != 0 {
            return Err(invariant(format!("split of {child} at token {at}")));
        }
        let host_halves = match &c.host {
            Some(m) => Some(m.split(at as u64).map_err(|source| TreeError::Metadata {
                node: child,
                source,
            })?),
            None => None,
        };
        let parent = c
            .parent
            .ok_or_else(|| invariant(format!("{child} has no parent")))?;
        let (stamp, lock) = (c.stamp, c.lock);
        let n = self.get_mut(child)?;
        let suffix_key = n.key.split_off(at);
        let prefix_key = std::mem::replace(&mut n.key, suffix_key);
        let prefix_device = n.device.as_mut().map(|d| {
            let rest = d.split_off(at_pages);
            std::mem::replace(d, rest)
        });
        let (prefix_host, suffix_host) = match host_halves {
            Some((l, r)) => (Some(l), Some(r)),
            None => (None, None),
        };
        n.host = suffix_host;
        let suffix_first = n.key[..unit].to_vec();
        let new_id = self.alloc(Node {
            key: prefix_key.clone(),
            children: BTreeMap::from([(suffix_first, child)]),
            parent: Some(parent),
            device: prefix_device,
            host: prefix_host,
            lock,
            stamp,
        });
        self.get_mut(child)?.parent = Some(new_id);
        self.get_mut(parent)?
            .children
            .insert(prefix_key[..unit].to_vec(), new_id);
        Ok(new_id)
    }
}
