//! Kernel parameters as the specs build them: the constructors of the `extern "C"` parameter
//! list of every kernel and of how far each pointer reaches, and the parameter list as the
//! render spells it. The descriptions themselves, and the launch contract executors check,
//! are the executors' ([`crate::exec::KernelSignature`]): the kernels use them from there.

use crate::exec::PAGE_ALIGN;
pub use crate::exec::{KernelParam, KernelSignature, Reach, ReachError, Strided, TableEntries};

impl Reach {
    /// A fixed number of bytes (the counts are multiplied in with [`Reach::times`]).
    pub(super) const fn of(unit: u64) -> Reach {
        Reach {
            unit,
            counts: [None, None],
        }
    }

    /// The reach times `ceil(name / per)`, in the first free count slot.
    pub(super) const fn times_ceil(mut self, name: &'static str, per: u32) -> Reach {
        if self.counts[0].is_none() {
            self.counts[0] = Some((name, per));
        } else {
            assert!(self.counts[1].is_none(), "a reach has two counts at most");
            self.counts[1] = Some((name, per));
        }
        self
    }

    /// The reach times `name`.
    pub(super) const fn times(self, name: &'static str) -> Reach {
        self.times_ceil(name, 1)
    }
}

impl KernelParam {
    /// A pointer to a typed array (8 bytes on every supported target) whose elements are
    /// `align` bytes, reaching `reach` bytes.
    pub(super) const fn ptr(
        c_type: &'static str,
        name: &'static str,
        align: u64,
        reach: Reach,
    ) -> KernelParam {
        KernelParam {
            name,
            c_type,
            size: 8,
            align,
            reach: Some(reach),
            entries: None,
        }
    }

    /// A pointer to page-organised bytes (a pool, a host pool or a dense buffer).
    pub(super) const fn pages(
        c_type: &'static str,
        name: &'static str,
        reach: Reach,
    ) -> KernelParam {
        KernelParam::ptr(c_type, name, PAGE_ALIGN, reach)
    }

    /// A `u32` parameter.
    pub(super) const fn u32(name: &'static str) -> KernelParam {
        KernelParam {
            name,
            c_type: "u32",
            size: 4,
            align: 1,
            reach: None,
            entries: None,
        }
    }

    /// A page table of `per_layer × layers` pointers (`layers` being the launch's parameter
    /// of that name), each reaching `pages` and 16-byte aligned.
    pub(super) const fn table(
        name: &'static str,
        per_layer: u64,
        pages: Strided,
        writes: bool,
    ) -> KernelParam {
        KernelParam {
            name,
            c_type: "const u64*",
            size: 8,
            align: 8,
            reach: Some(Reach::of(8 * per_layer).times("layers")),
            entries: Some(TableEntries {
                pages,
                writes,
                align: TableEntries::align_of(pages.unit),
            }),
        }
    }
}

/// Widest line of a rendered parameter list; the wrap reproduces the hand-wrapped lists the
/// templates had before the lists came from [`KernelSpec::params`](super::KernelSpec::params),
/// so renders did not change.
const PARAM_LINE_WIDTH: usize = 96;

/// The parameter list as the templates splice it in after `<uri>(`: `type name` items joined
/// by `, `, wrapped greedily at [`PARAM_LINE_WIDTH`] columns with a 4-space indent, closed by
/// `)`. Pointer parameters are `__restrict__`: the executors refuse a launch in which a
/// written pointer shares bytes with another pointer parameter (`exec::signature`), so no
/// two pointers a kernel writes through alias, and the compiler may keep loads in flight
/// across stores.
pub(crate) fn render_params(params: &[KernelParam]) -> String {
    const INDENT: &str = "    ";
    let mut out = String::new();
    let mut line = String::from(INDENT);
    for (i, p) in params.iter().enumerate() {
        let end = if i + 1 == params.len() { ")" } else { "," };
        let restrict = if p.c_type.ends_with('*') {
            " __restrict__"
        } else {
            ""
        };
        let item = format!("{}{restrict} {}{end}", p.c_type, p.name);
        let sep = if line.len() == INDENT.len() { "" } else { " " };
        if line.len() > INDENT.len() && line.len() + sep.len() + item.len() > PARAM_LINE_WIDTH {
            out.push_str(&line);
            out.push('\n');
            line = format!("{INDENT}{item}");
        } else {
            line.push_str(sep);
            line.push_str(&item);
        }
    }
    if params.is_empty() {
        line.push(')');
    }
    out.push_str(&line);
    out
}
