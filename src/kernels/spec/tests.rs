use super::*;

#[test]
fn buffer_sizes_match_the_design() {
    assert_eq!(BufferKind::NsaKv.bytes_per_token(), 656);
    assert_eq!(BufferKind::NsaIndexK.bytes_per_token(), 132);
    assert_eq!(BufferKind::MlaKv.bytes_per_token(), 1152);
    assert_eq!(BufferKind::NsaIndexK.page_bytes(64), 8448);
    let gqa = BufferKind::GqaKv {
        kv_heads: 8,
        head_dim: 128,
    };
    assert_eq!(gqa.bytes_per_token(), 4096);
    assert_eq!(gqa.to_string(), "gqa8x128_kv");
    // Keys of every slot, then values of every slot.
    let f = gqa.field_layouts(16);
    assert_eq!(
        f.iter()
            .map(|f| (f.id, f.dtype, f.count, f.base, f.tok_stride))
            .collect::<Vec<_>>(),
        [
            (0, Dtype::Bf16, 1024, 0, 2048),
            (1, Dtype::Bf16, 1024, 16 * 2048, 2048)
        ]
    );
}

/// A GQA shape with no heads, no head dim or more than `GQA_MAX_HEAD_ELEMENTS` elements
/// is a typed refusal of the spec and of the deployment, never a render.
#[test]
fn impossible_gqa_shapes_are_refused() {
    for (kv_heads, head_dim) in [(0u16, 128u16), (8, 0), (1024, 128)] {
        let buffer = BufferKind::GqaKv { kv_heads, head_dim };
        assert!(buffer.check_shape().is_err(), "{buffer}");
        let spec = KernelSpec::Synthesise(SynthSpec {
            buffer,
            cp: 2,
            page_size: 16,
            threads: 128,
            order: TokenOrder::Paged,
        });
        let err = spec.render().unwrap_err();
        assert!(matches!(err, KernelError::InvalidShape { .. }), "{err}");
        let model = super::super::ModelShape::Gqa { kv_heads, head_dim };
        let err = super::super::Deployment::new(model, 16, 2).unwrap_err();
        assert!(
            matches!(&err, KernelError::InvalidDeployment { name, .. } if name.starts_with("gqa")),
            "{err}"
        );
    }
    // The kernels' accesses stay aligned when heads × head dim is a multiple of 4, or 1 or
    // 2; other shapes are refused as misaligned (docs/KERNELS.md "Buffer kinds").
    for (kv_heads, head_dim, ok) in [
        (1u16, 4u16, true),
        (1, 1, true),
        (2, 1, true),
        (1, 3, false),
        (3, 2, false),
    ] {
        let b = BufferKind::GqaKv { kv_heads, head_dim };
        for ps in [1u32, 16] {
            assert_eq!(b.check_access_alignment(ps).is_ok(), ok, "{b} ps{ps}");
        }
        let dep = super::super::Deployment::new(
            super::super::ModelShape::Gqa { kv_heads, head_dim },
            16,
            2,
        );
        assert_eq!(dep.is_ok(), ok, "{b}");
    }
}

#[test]
fn field_layouts_tile_the_page_exactly() {
    for b in [
        BufferKind::NsaKv,
        BufferKind::NsaIndexK,
        BufferKind::MlaKv,
        BufferKind::GqaKv {
            kv_heads: 8,
            head_dim: 128,
        },
        BufferKind::GqaKv {
            kv_heads: 2,
            head_dim: 12,
        },
    ] {
        for ps in [1u32, 16, 64] {
            let mut covered = vec![0u8; b.page_bytes(ps) as usize];
            for f in b.field_layouts(ps) {
                for slot in 0..ps {
                    for e in 0..f.count {
                        let at = f.offset(slot, e);
                        for byte in &mut covered[at..at + f.dtype.size() as usize] {
                            *byte += 1;
                        }
                    }
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "{b} ps{ps}");
        }
    }
}

/// The synthesise and verify kernels store and compare a draw's 8 bytes as one `u64`:
/// every full draw of every field must be 8-byte aligned in every slot of every page, and
/// a partial last draw aligned to each of its narrower accesses. True for every buffer
/// kind at every page size the kernels accept but one: nsa `index_k` at page size 1 has
/// 132-byte pages, so it is refused with a typed error (NSA deployments use page size 64).
#[test]
fn every_synthesised_access_is_aligned_to_its_width() {
    let gqa = BufferKind::GqaKv {
        kv_heads: 8,
        head_dim: 128,
    };
    for b in [
        BufferKind::NsaKv,
        BufferKind::NsaIndexK,
        BufferKind::MlaKv,
        gqa,
    ] {
        for ps in (0..=10).map(|k| 1u32 << k) {
            let pb = b.page_bytes(ps);
            let got = b.check_access_alignment(ps);
            if b == BufferKind::NsaIndexK && ps == 1 {
                assert_eq!(
                    got,
                    Err(FieldMisalignment {
                        field: 0,
                        width: 8,
                        what: "page bytes",
                        value: 132
                    })
                );
                continue;
            }
            assert_eq!(got, Ok(()), "{b} ps{ps}");
            for f in b.field_layouts(ps) {
                if f.full_draws() > 0 {
                    assert_eq!(f.base % 8, 0, "{b} ps{ps} field {}", f.id);
                    assert_eq!(f.tok_stride % 8, 0, "{b} ps{ps} field {}", f.id);
                    assert_eq!(pb % 8, 0, "{b} ps{ps}");
                }
            }
        }
    }
    // The partial draws: only nsa index_k's scale, one f32 of a draw of two, a u32.
    let mut partial = Vec::new();
    for b in [
        BufferKind::NsaKv,
        BufferKind::NsaIndexK,
        BufferKind::MlaKv,
        gqa,
    ] {
        for f in b.field_layouts(64) {
            if !f.tail_accesses().is_empty() {
                partial.push((b, f.id, f.tail_accesses()));
            }
        }
    }
    assert_eq!(partial, vec![(BufferKind::NsaIndexK, 1, vec![(0, 4)])]);
    // Every reference deployment's synthesise and verify kernels validate.
    for d in super::super::Deployment::reference() {
        for spec in d.specs() {
            assert_eq!(spec.validate().map_err(|e| e.to_string()), Ok(()), "{spec}");
        }
    }
    for spec in [
        KernelSpec::Synthesise(SynthSpec {
            buffer: BufferKind::NsaIndexK,
            cp: 1,
            page_size: 1,
            threads: 128,
            order: TokenOrder::Paged,
        }),
        KernelSpec::Verify(VerifySpec {
            buffer: BufferKind::NsaIndexK,
            page_size: 1,
            threads: 128,
            order: TokenOrder::Paged,
        }),
    ] {
        let err = spec.render().unwrap_err();
        assert!(
            matches!(
                err,
                KernelError::FieldMisaligned {
                    buffer: BufferKind::NsaIndexK,
                    page_size: 1,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.is_invalid_spec());
        assert!(
            err.to_string()
                .contains("page bytes 132 is not a multiple of 8"),
            "{err}"
        );
    }
}

/// The tail accesses cover exactly the bytes of a partial last draw, widest first, each
/// at an offset that is a multiple of its width.
#[test]
fn tail_accesses_cover_a_partial_draw() {
    for (dtype, count, want) in [
        (Dtype::Fp8E4m3, 16, vec![]),
        (Dtype::Fp8E4m3, 7, vec![(0, 4), (4, 2), (6, 1)]),
        (Dtype::Fp8E4m3, 13, vec![(0, 4), (4, 1)]),
        (Dtype::Bf16, 3, vec![(0, 4), (4, 2)]),
        (Dtype::Bf16, 5, vec![(0, 2)]),
        (Dtype::F32, 1, vec![(0, 4)]),
        (Dtype::F32, 4, vec![]),
    ] {
        let f = FieldLayout {
            id: 0,
            dtype,
            count,
            base: 0,
            tok_stride: 64,
        };
        assert_eq!(f.tail_accesses(), want, "{count} x {dtype}");
        assert_eq!(f.draws(), f.full_draws() + u32::from(!want.is_empty()));
    }
}

#[test]
fn uri_spells_every_parameter() {
    let s = KernelSpec::TransferPages(TransferSpec {
        second_bytes_per_token: None,
        stamps: false,
        direction: Direction::HostToDevice,
        layout: HostLayout::PageFirst,
        page_size: 64,
        bytes_per_token: 656,
        launch: CopyLaunch::default(),
    });
    assert_eq!(s.uri(), "transfer_pages_h2d_pf_ps64_b656_t128_ppb1_v16_u4");
    assert_eq!(s.entry_name(), s.uri());
}

#[test]
fn validation_rejects_bad_constants_without_panicking() {
    let alloc = |cp, page_size, threads| {
        KernelSpec::SelectOwnerPages(AllocSpec {
            cp,
            page_size,
            threads,
            output: SelectOutput::PagesAndLocs,
        })
        .validate()
    };
    assert!(alloc(8, 64, 256).is_ok());
    assert!(matches!(
        alloc(0, 64, 256),
        Err(KernelError::InvalidCp { .. })
    ));
    assert!(matches!(
        alloc(17, 64, 256),
        Err(KernelError::InvalidCp { .. })
    ));
    assert!(matches!(
        alloc(8, 48, 256),
        Err(KernelError::InvalidPageSize { .. })
    ));
    assert!(matches!(
        alloc(8, 64, 100),
        Err(KernelError::InvalidLaunch { .. })
    ));
    let t = KernelSpec::TransferPages(TransferSpec {
        second_bytes_per_token: None,
        stamps: false,
        direction: Direction::DeviceToHost,
        layout: HostLayout::LayerFirst,
        page_size: 1,
        bytes_per_token: 132,
        launch: CopyLaunch::default(),
    });
    assert!(matches!(
        t.validate(),
        Err(KernelError::VectorMisaligned { .. })
    ));
    assert!(t.render().is_err());
}

#[test]
fn candidates_are_valid_and_include_a_cpu_shape() {
    let t = KernelSpec::Materialise(MaterialiseSpec {
        cp: 4,
        page_size: 16,
        bytes_per_token: 1152,
        launch: CopyLaunch::default(),
    });
    let c = t.candidates();
    assert!(c.contains(&t));
    assert!(c.iter().any(|s| s.threads() == 1));
    assert!(c
        .iter()
        .all(|s| s.validate().is_ok() && s.family() == Family::Materialise));
}

/// The bytes a C type spelling occupies as a kernel parameter on a 64-bit target.
fn c_size(c_type: &str) -> usize {
    match c_type {
        t if t.ends_with('*') => 8,
        "u32" | "i32" => 4,
        "u64" | "i64" => 8,
        t => panic!("unexpected parameter type {t}"),
    }
}

#[test]
fn param_sizes_follow_their_c_types() {
    let copy = CopyLaunch::default();
    for cp in [1u8, 3, 16] {
        let specs = [
            KernelSpec::SelectOwnerPages(AllocSpec {
                cp,
                page_size: 64,
                threads: 256,
                output: SelectOutput::PagesAndLocs,
            }),
            KernelSpec::SelectOwnerPages(AllocSpec {
                cp,
                page_size: 64,
                threads: 256,
                output: SelectOutput::Pages,
            }),
            KernelSpec::ReleasePages(ReleaseSpec { cp, threads: 256 }),
            KernelSpec::TransferPages(TransferSpec {
                second_bytes_per_token: None,
                stamps: false,
                direction: Direction::HostToDevice,
                layout: HostLayout::LayerFirst,
                page_size: 64,
                bytes_per_token: 656,
                launch: copy,
            }),
            KernelSpec::Materialise(MaterialiseSpec {
                cp,
                page_size: 64,
                bytes_per_token: 656,
                launch: copy,
            }),
            KernelSpec::Synthesise(SynthSpec {
                buffer: BufferKind::NsaKv,
                cp,
                page_size: 64,
                threads: 128,
                order: TokenOrder::Paged,
            }),
            KernelSpec::Verify(VerifySpec {
                buffer: BufferKind::MlaKv,
                page_size: 16,
                threads: 128,
                order: TokenOrder::Paged,
            }),
        ];
        for spec in specs {
            let params = spec.params();
            assert!(!params.is_empty(), "{spec}");
            for p in &params {
                assert_eq!(p.size, c_size(p.c_type), "{spec}: {}", p.name);
            }
            let mut names: Vec<_> = params.iter().map(|p| p.name).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), params.len(), "{spec}: duplicate names");
        }
    }
}

#[test]
fn param_lists_wrap_like_the_hand_written_ones() {
    let select = select_spec_for_tests();
    assert_eq!(
        render_params(&select.params()),
        "    const u8* __restrict__ owners, u32 n, const u32* __restrict__ lane_stacks,\n    \
         u32* __restrict__ lane_tops, u32 lane_cap, u32* __restrict__ out_pages,\n    \
         i64* __restrict__ out_locs, u32* __restrict__ status)"
    );
    assert_eq!(
        render_params(&select_pages_spec_for_tests().params()),
        "    const u8* __restrict__ owners, u32 n, const u32* __restrict__ lane_stacks,\n    \
         u32* __restrict__ lane_tops, u32 lane_cap, u32* __restrict__ out_pages,\n    \
         u32* __restrict__ status)"
    );
    let release = KernelSpec::ReleasePages(ReleaseSpec { cp: 8, threads: 32 });
    assert_eq!(
        render_params(&release.params()),
        "    const u32* __restrict__ pages, u32 n, u32* __restrict__ lane_stacks,\n    \
         u32* __restrict__ lane_tops, u32 lane_cap, u32* __restrict__ status)"
    );
    assert_eq!(render_params(&[]), "    )");
    let long = [KernelParam {
        name: "a_parameter_name_longer_than_the_whole_line_width_allows_for_in_one_go_at_all",
        c_type: "const u8*",
        size: 8,
        align: 1,
        reach: None,
        entries: None,
    }; 2];
    let text = render_params(&long);
    assert_eq!(text.lines().count(), 2, "{text}");
}

#[test]
fn reaches_spell_and_compute_their_bytes() {
    let verify = KernelSpec::Verify(VerifySpec {
        buffer: BufferKind::NsaKv,
        page_size: 64,
        threads: 128,
        order: TokenOrder::Paged,
    });
    let reach = |spec: &KernelSpec, name: &str| {
        spec.params()
            .into_iter()
            .find(|p| p.name == name)
            .and_then(|p| p.reach)
            .unwrap()
    };
    let dense = reach(&verify, "dense");
    assert_eq!(dense.to_string(), "41984 × layers × ceil(n_tokens / 64)");
    let args = |layers: u32, n_tokens: u32| {
        move |name: &str| match name {
            "layers" => Some(layers),
            "n_tokens" => Some(n_tokens),
            _ => None,
        }
    };
    assert_eq!(dense.bytes(args(2, 65)), Ok(41984 * 2 * 2));
    assert_eq!(dense.bytes(args(2, 0)), Ok(0));
    assert_eq!(
        dense.bytes(args(u32::MAX, u32::MAX)),
        Err(ReachError::Overflow)
    );
    assert_eq!(dense.bytes(|_| None), Err(ReachError::NoValue("layers")));
    let bits = reach(&verify, "bad_tokens");
    assert_eq!(bits.to_string(), "4 × ceil(n_tokens / 32)");
    assert_eq!(bits.bytes(args(1, 33)), Ok(8));
    let tops = reach(&select_spec_for_tests(), "lane_tops");
    assert_eq!(
        (tops.to_string(), tops.bytes(|_| None)),
        ("32".into(), Ok(32))
    );
    // CP 8: the refusal count, 8 lane deficits, the bad-owner count.
    let status = reach(&select_spec_for_tests(), "status");
    assert_eq!(
        (status.to_string(), status.bytes(|_| None)),
        ("40".into(), Ok(40))
    );
}

#[test]
fn select_status_words_round_trip_and_name_the_short_lanes() {
    assert_eq!(SelectStatus::words(8), 10);
    let clear = SelectStatus::clear(3);
    assert!(clear.is_clear());
    assert_eq!(clear.to_words(), [0, 0, 0, 0, 0]);
    assert_eq!(clear.to_string(), "no select launch refused");
    let s = SelectStatus::from_words(&[2, 3, 0, 1, 1]).unwrap();
    assert_eq!(s.lane_deficits, [3, 0, 1]);
    assert_eq!((s.refused, s.bad_owners), (2, 1));
    assert!(!s.is_clear());
    assert_eq!(s.short_lanes(), [(0, 3), (2, 1)]);
    assert_eq!(s.to_words(), [2, 3, 0, 1, 1]);
    assert_eq!(
        s.to_string(),
        "2 select launches refused: lane 0 short by 3 pages, lane 2 short by 1 page, \
         1 owner out of range"
    );
    assert!(SelectStatus::from_words(&[1]).is_none());
    // A refused launch that counted no lane and no owner: a grid of more than one block.
    let grid = SelectStatus::from_words(&[1, 0]).unwrap();
    assert!(grid.is_grid_refusal() && !s.is_grid_refusal());
    assert_eq!(
        grid.to_string(),
        "1 select launch refused: no lane or item counted (launched with more than one block)"
    );
}

#[test]
fn release_status_words_round_trip_and_name_the_full_lanes() {
    assert_eq!(ReleaseStatus::words(8), 10);
    let spec = ReleaseSpec { cp: 8, threads: 32 };
    assert_eq!(spec.status_words(), 10);
    let clear = ReleaseStatus::clear(3);
    assert!(clear.is_clear());
    assert_eq!(clear.to_words(), [0, 0, 0, 0, 0]);
    assert_eq!(clear.to_string(), "no release launch refused");
    let s = ReleaseStatus::from_words(&[2, 3, 0, 1, 1]).unwrap();
    assert_eq!(s.lane_overflows, [3, 0, 1]);
    assert_eq!((s.refused, s.bad_pages), (2, 1));
    assert!(!s.is_clear());
    assert_eq!(s.full_lanes(), [(0, 3), (2, 1)]);
    assert_eq!(s.to_words(), [2, 3, 0, 1, 1]);
    assert_eq!(
        s.to_string(),
        "2 release launches refused: lane 0 over its capacity by 3 pages, lane 2 over its \
         capacity by 1 page, 1 invalid page (0, or past the lanes)"
    );
    assert!(ReleaseStatus::from_words(&[1]).is_none());
    assert_eq!(
        ReleaseStatus::from_words(&[1, 0, 4]).unwrap().to_string(),
        "1 release launch refused: 4 invalid pages (0, or past the lanes)"
    );
    let grid = ReleaseStatus::from_words(&[3, 0, 0]).unwrap();
    assert!(grid.is_grid_refusal() && !s.is_grid_refusal());
    assert_eq!(
        grid.to_string(),
        "3 release launches refused: no lane or item counted (launched with more than one block)"
    );
    let status = KernelSpec::ReleasePages(spec)
        .params()
        .into_iter()
        .find(|p| p.name == "status")
        .and_then(|p| p.reach)
        .unwrap();
    assert_eq!(
        (status.to_string(), status.bytes(|_| None)),
        ("40".into(), Ok(40))
    );
}

#[test]
fn every_pointer_of_every_family_has_a_reach_over_its_own_u32_parameters() {
    let specs = [
        select_spec_for_tests(),
        select_pages_spec_for_tests(),
        KernelSpec::ReleasePages(ReleaseSpec { cp: 8, threads: 32 }),
        KernelSpec::TransferPages(TransferSpec {
            second_bytes_per_token: None,
            stamps: false,
            direction: Direction::HostToDevice,
            layout: HostLayout::LayerFirst,
            page_size: 16,
            bytes_per_token: 1152,
            launch: CopyLaunch::default(),
        }),
        KernelSpec::Materialise(MaterialiseSpec {
            cp: 4,
            page_size: 16,
            bytes_per_token: 1152,
            launch: CopyLaunch::default(),
        }),
        KernelSpec::Synthesise(SynthSpec {
            buffer: BufferKind::NsaIndexK,
            cp: 2,
            page_size: 64,
            threads: 128,
            order: TokenOrder::Paged,
        }),
        KernelSpec::Verify(VerifySpec {
            buffer: BufferKind::MlaKv,
            page_size: 1,
            threads: 32,
            order: TokenOrder::Paged,
        }),
    ];
    let families: std::collections::BTreeSet<_> = specs.iter().map(|s| s.family()).collect();
    assert_eq!(
        families.len(),
        6,
        "every family but busy (select both ways)"
    );
    for spec in specs {
        let params = spec.params();
        for p in &params {
            let pointer = p.c_type.ends_with('*');
            assert_eq!(p.reach.is_some(), pointer, "{spec}: {}", p.name);
            // A page table's pointers reach over a page count and a stride, both u32.
            let table = p
                .entries
                .iter()
                .flat_map(|t| [(t.pages.count, 1), (t.pages.stride, 1)]);
            let counts = p
                .reach
                .iter()
                .flat_map(|r| r.counts.iter().flatten().copied());
            for (name, per) in counts.chain(table) {
                assert!(per >= 1, "{spec}: {}", p.name);
                assert!(
                    params.iter().any(|q| q.name == name && q.c_type == "u32"),
                    "{spec}: `{}` reaches over `{name}`, not a u32 parameter",
                    p.name
                );
            }
        }
    }
}

fn select_spec_for_tests() -> KernelSpec {
    KernelSpec::SelectOwnerPages(AllocSpec {
        cp: 8,
        page_size: 64,
        threads: 256,
        output: SelectOutput::PagesAndLocs,
    })
}

fn select_pages_spec_for_tests() -> KernelSpec {
    KernelSpec::SelectOwnerPages(AllocSpec {
        output: SelectOutput::Pages,
        ..select_alloc_spec_for_tests()
    })
}

fn select_alloc_spec_for_tests() -> AllocSpec {
    match select_spec_for_tests() {
        KernelSpec::SelectOwnerPages(s) => s,
        _ => unreachable!("a select spec"),
    }
}

/// The select without token locations: its own uri (the one with them keeps its old one),
/// no `out_locs` parameter, and a render without the locations loop; the rest of the
/// signature is the same, so both launch from the same arguments less `out_locs`.
#[test]
fn the_select_without_locations_drops_out_locs_from_its_uri_params_and_render() {
    let (locs, pages) = (select_spec_for_tests(), select_pages_spec_for_tests());
    assert_eq!(locs.uri(), "select_owner_pages_cp8_ps64_t256");
    assert_eq!(pages.uri(), "select_owner_pages_cp8_ps64_nolocs_t256");
    let names = |s: &KernelSpec| s.params().iter().map(|p| p.name).collect::<Vec<_>>();
    let mut without = names(&locs);
    without.retain(|&n| n != "out_locs");
    assert_eq!(names(&pages), without);
    let (sl, sp) = (locs.signature(), pages.signature());
    assert!(sl.single_block && sp.single_block);
    assert_eq!(sl.threads, sp.threads);
    let (rl, rp) = (locs.render().unwrap(), pages.render().unwrap());
    assert!(rl.contains("out_locs[j]"), "{rl}");
    assert!(!rp.contains("out_locs"), "{rp}");
    assert!(
        rp.contains("select_owner_pages_cp8_ps64_nolocs_t256("),
        "{rp}"
    );
    assert!(pages
        .candidates()
        .iter()
        .all(|c| matches!(c, KernelSpec::SelectOwnerPages(s) if s.output == SelectOutput::Pages)));
}

/// A transfer's grid is sized by the layer count of the launch: one layer of a per-layer
/// load gets a layer's worth of blocks, and the signature carries the range.
#[test]
fn a_capped_copy_grid_is_at_most_its_cap_and_named_by_it() {
    let spec = |max_blocks| {
        KernelSpec::TransferPages(TransferSpec {
            second_bytes_per_token: None,
            stamps: false,
            direction: Direction::HostToDevice,
            layout: HostLayout::PageFirst,
            page_size: 64,
            bytes_per_token: 656,
            launch: CopyLaunch {
                max_blocks,
                ..CopyLaunch::gpu_transfer()
            },
        })
    };
    // 2,048 NSA pages × 61 layers: 7,808 blocks of 16 warp groups uncapped, 4 capped; 16
    // times the pages reach the grid limit.
    assert_eq!(spec(0).launch_dims(2048, 61).grid, 7808);
    assert_eq!(spec(0).launch_dims(16 * 2048, 61).grid, 65536);
    let d = spec(4).launch_dims(2048, 61);
    assert_eq!((d.grid, d.block), (4, 512));
    // Less work than the cap: a block per item up to the cap (the groups are numbered
    // block-minor, so 3 items take 3 SMs, not 3 warps of one block).
    assert_eq!(spec(4).launch_dims(1, 1).grid, 1);
    assert_eq!(spec(4).launch_dims(3, 1).grid, 3);
    assert_eq!(spec(4).launch_dims(40, 1).grid, 4);
    assert_eq!(spec(4).launch_dims(0, 0).grid, 1);
    assert!(
        spec(4).uri().ends_with("_t512_ppb1_v16_u8_g4"),
        "{}",
        spec(4).uri()
    );
    assert!(spec(0).uri().ends_with("_u8"));
    // The cap changes the launch, not the code: the renders differ only in the name.
    let (a, b) = (spec(0).render().unwrap(), spec(4).render().unwrap());
    assert_eq!(
        a.replace(&spec(0).uri(), "K"),
        b.replace(&spec(4).uri(), "K")
    );
    assert!(spec(65537).validate().is_err());
    // Transfers get capped candidates, materialise none.
    assert!(spec(0).candidates().iter().any(|c| c.uri().contains("_g1")));
    let m = KernelSpec::Materialise(MaterialiseSpec {
        cp: 4,
        page_size: 64,
        bytes_per_token: 656,
        launch: CopyLaunch::default(),
    });
    assert!(!m.candidates().iter().any(|c| c.uri().contains("_g")));
}

#[test]
fn layer_wise_loads_of_few_pages_share_a_launch_across_layers() {
    let spec = |second: Option<u32>, launch: CopyLaunch| {
        KernelSpec::TransferPages(TransferSpec {
            second_bytes_per_token: second,
            stamps: false,
            direction: Direction::HostToDevice,
            layout: HostLayout::PageFirst,
            page_size: 64,
            bytes_per_token: 656,
            launch,
        })
    };
    // The default GPU launch: 4 blocks of 16 warps, 64 groups.
    let nsa = spec(Some(132), CopyLaunch::gpu_transfer());
    // 8 NSA pages, two buffers: 16 items a layer, 4 layers fill the groups.
    assert_eq!(nsa.layers_per_launch(8), MAX_LAYERS_PER_LAUNCH);
    assert_eq!(nsa.layers_per_launch(1), MAX_LAYERS_PER_LAUNCH);
    assert_eq!(nsa.layers_per_launch(16), 2);
    // 20 items: 3 of them fit, then a launch per layer from half the groups on.
    assert_eq!(nsa.layers_per_launch(10), 3);
    assert_eq!(nsa.layers_per_launch(17), 1);
    assert_eq!(nsa.layers_per_launch(4096), 1);
    assert_eq!(nsa.layers_per_launch(0), 1);
    let mla = spec(None, CopyLaunch::gpu_transfer());
    assert_eq!(mla.layers_per_launch(20), 3);
    // Uncapped grids grow with the work, and a layer loop in the group walks the layers
    // in turn: a launch per layer.
    let uncapped = CopyLaunch {
        max_blocks: 0,
        ..CopyLaunch::gpu_transfer()
    };
    assert_eq!(spec(None, uncapped).layers_per_launch(1), 1);
    let in_block = CopyLaunch {
        layers_in_block: true,
        ..CopyLaunch::gpu_transfer()
    };
    assert_eq!(spec(None, in_block).layers_per_launch(1), 1);
    let m = KernelSpec::Materialise(MaterialiseSpec {
        cp: 4,
        page_size: 64,
        bytes_per_token: 656,
        launch: CopyLaunch::gpu_transfer(),
    });
    assert_eq!(m.layers_per_launch(1), 1);
}

#[test]
fn transfer_grids_follow_the_launch_layer_count() {
    let t = |layers_in_block| {
        KernelSpec::TransferPages(TransferSpec {
            second_bytes_per_token: None,
            stamps: false,
            direction: Direction::HostToDevice,
            layout: HostLayout::LayerFirst,
            page_size: 16,
            bytes_per_token: 1152,
            launch: CopyLaunch {
                pages_per_block: 2,
                layers_in_block,
                ..CopyLaunch::default()
            },
        })
    };
    // 5 pair groups per layer, a warp group each, 4 groups a block.
    assert_eq!(t(false).launch_dims(10, 61).grid, (5 * 61_u32).div_ceil(4));
    assert_eq!(t(false).launch_dims(10, 1).grid, 2);
    assert_eq!(t(false).launch_dims(10, 0).grid, 1);
    assert_eq!(t(true).launch_dims(10, 61).grid, 2);
    assert_eq!(t(true).launch_dims(10, 1).grid, 2);
    let names: Vec<&str> = t(false).params().iter().map(|p| p.name).collect();
    assert_eq!(
        names,
        [
            "device",
            "host",
            "src_pages",
            "dst_pages",
            "n",
            "layers",
            "first_layer",
            "layer_count",
            "device_pages",
            "host_pages",
            "page_stride"
        ]
    );
}

#[test]
fn launch_dims_are_never_empty() {
    let v = KernelSpec::Verify(VerifySpec {
        buffer: BufferKind::MlaKv,
        page_size: 16,
        threads: 32,
        order: TokenOrder::Paged,
    });
    assert_eq!(v.launch_dims(0, 4), LaunchDims { grid: 1, block: 32 });
    assert_eq!(v.launch_dims(u32::MAX, 4).grid, 1024);
    let s = KernelSpec::Synthesise(SynthSpec {
        buffer: BufferKind::MlaKv,
        cp: 4,
        page_size: 16,
        threads: 32,
        order: TokenOrder::Paged,
    });
    assert_eq!(s.launch_dims(u32::MAX, 4).grid, 1 << 16);
}

#[test]
fn materialise_asks_for_a_full_sm_unless_it_needs_the_registers() {
    let m = |threads, unroll| MaterialiseSpec {
        cp: 8,
        page_size: 64,
        bytes_per_token: 656,
        launch: CopyLaunch {
            threads,
            unroll,
            ..CopyLaunch::default()
        },
    };
    assert_eq!(m(128, 4).min_blocks_per_sm(), 16);
    assert_eq!(m(512, 2).min_blocks_per_sm(), 4);
    assert_eq!(m(1, 1).min_blocks_per_sm(), SM_MAX_BLOCKS);
    assert_eq!(m(256, 8).min_blocks_per_sm(), 1);
}

#[test]
fn a_two_buffer_transfer_needs_a_vector_that_divides_both_pages() {
    let t = |second, vec| {
        KernelSpec::TransferPages(TransferSpec {
            direction: Direction::HostToDevice,
            layout: HostLayout::PageFirst,
            page_size: 1,
            bytes_per_token: 656,
            second_bytes_per_token: second,
            stamps: false,
            launch: CopyLaunch {
                vec,
                ..CopyLaunch::default()
            },
        })
    };
    assert!(t(None, VecWidth::V16).validate().is_ok());
    assert!(matches!(
        t(Some(33), VecWidth::V16).validate(),
        Err(KernelError::VectorMisaligned { page_bytes: 33, .. })
    ));
    assert!(t(Some(33), VecWidth::V1).validate().is_ok());
    let KernelSpec::TransferPages(s) = t(Some(33), VecWidth::V1) else {
        unreachable!()
    };
    assert_eq!(s.common_page_bytes(), 1);
    assert_eq!(s.total_page_bytes(), 656 + 33);
}

/// A transfer's copy groups are warps, or the whole block below a warp; a block of a partial
/// warp group is refused.
#[test]
fn transfer_groups_are_warps() {
    let spec = |threads| {
        KernelSpec::TransferPages(TransferSpec {
            second_bytes_per_token: Some(132),
            stamps: false,
            direction: Direction::HostToDevice,
            layout: HostLayout::PageFirst,
            page_size: 64,
            bytes_per_token: 656,
            launch: CopyLaunch {
                threads,
                ..CopyLaunch::gpu_transfer()
            },
        })
    };
    for (threads, lanes, groups) in [
        (1, 1, 1),
        (17, 17, 1),
        (32, 32, 1),
        (64, 32, 2),
        (512, 32, 16),
    ] {
        let l = CopyLaunch {
            threads,
            ..CopyLaunch::default()
        };
        assert_eq!(
            (l.group_lanes(), l.groups_per_block()),
            (lanes, groups),
            "t{threads}"
        );
        assert!(spec(threads).validate().is_ok(), "t{threads}");
    }
    for threads in [33, 48, 1000] {
        assert!(matches!(
            spec(threads).validate(),
            Err(KernelError::InvalidLaunch {
                what: "threads",
                ..
            })
        ));
    }
    // Materialise keeps the block-wide run: any block size.
    let m = KernelSpec::Materialise(MaterialiseSpec {
        cp: 4,
        page_size: 64,
        bytes_per_token: 656,
        launch: CopyLaunch {
            threads: 48,
            ..CopyLaunch::default()
        },
    });
    assert!(m.validate().is_ok());
    // 2,048 NSA pages of one layer, both buffers: 4,096 items, 256 blocks of 16 groups.
    let uncapped = |threads| {
        let KernelSpec::TransferPages(s) = spec(threads) else {
            unreachable!()
        };
        KernelSpec::TransferPages(TransferSpec {
            launch: CopyLaunch {
                max_blocks: 0,
                ..s.launch
            },
            ..s
        })
    };
    assert_eq!(uncapped(512).launch_dims(2048, 1).grid, 256);
    assert_eq!(uncapped(1).launch_dims(2048, 1).grid, 4096);
}

#[test]
fn capped_candidates_have_64_to_512_threads_at_every_cap() {
    let c = CopyLaunch::capped_candidates(8448);
    assert_eq!(c.len(), 4 * TRANSFER_GRID_CAPS.len());
    for threads in [64, 128, 256, 512] {
        for cap in TRANSFER_GRID_CAPS {
            assert!(
                c.iter()
                    .any(|l| l.threads == threads && l.max_blocks == cap && l.unroll == 8),
                "t{threads} g{cap}"
            );
        }
    }
}

/// The issue-29 figures: the GPU default (4 blocks × 512 threads × 8 × 16 B) kept 168 KB in
/// flight on NSA `kv` pages, 34 KB on `index_k` and 74 KB on MLA page-16 pages under the
/// block-wide run; a warp per item keeps the full 256 KiB on each.
#[test]
fn bytes_in_flight_of_the_default_transfer() {
    let l = CopyLaunch::gpu_transfer();
    let old = |page_bytes| l.bytes_in_flight(page_bytes, CopyMapping::BlockRun);
    let new = |page_bytes| l.bytes_in_flight(page_bytes, CopyMapping::Groups);
    for (page_bytes, old_launch) in [
        (41_984, 167_936),
        (8_448, 33_792),
        (18_432, 73_728),
        (73_728, 262_144),
    ] {
        assert_eq!(old(page_bytes).per_launch, Some(old_launch), "{page_bytes}");
        assert_eq!(
            old(page_bytes).per_warp,
            old_launch / 4 / 16,
            "{page_bytes}"
        );
        assert_eq!(
            new(page_bytes),
            InFlight {
                per_warp: 4096,
                per_block: 65_536,
                per_launch: Some(262_144),
            },
            "{page_bytes}"
        );
    }
    // A page under a warp's round (32 lanes × 8 × 16 B) keeps only the page in flight.
    assert_eq!(new(2048).per_warp, 2048);
    // One thread: the group is the block, one vector in flight per round at u1.
    let cpu = CopyLaunch {
        threads: 1,
        unroll: 1,
        ..CopyLaunch::default()
    };
    for mapping in [CopyMapping::BlockRun, CopyMapping::Groups] {
        assert_eq!(
            cpu.bytes_in_flight(8448, mapping),
            InFlight {
                per_warp: 16,
                per_block: 16,
                per_launch: None,
            }
        );
    }
    // Materialise's default (128 threads, 4 in flight) on an NSA `index_k` page: 528 of
    // the block's 512 vectors, then 16; 128 per warp.
    let m = CopyLaunch::default().bytes_in_flight(8448, CopyMapping::BlockRun);
    assert_eq!((m.per_warp, m.per_block), (2048, 8192));
}

/// BENCHMARKS.md "Bytes in flight per warp and per launch": every reference deployment's
/// transfer buffers under its default transfer shape, old (block-wide run) and new (a warp
/// per item). `cargo test --release --lib bytes_in_flight_table -- --nocapture` prints it.
#[test]
fn bytes_in_flight_table() {
    let mut out = String::from(
        "| deployment | buffer | page bytes | shape | old per warp | old per launch | new per warp | new per launch |\n|---|---|---:|---|---:|---:|---:|---:|\n",
    );
    for dep in crate::kernels::Deployment::reference() {
        let t = dep.transfer(Direction::HostToDevice);
        for (buffer, d) in dep.model.buffers().iter().zip(t.descriptors()) {
            let l = d.launch;
            let old = l.bytes_in_flight(d.page_bytes(), CopyMapping::BlockRun);
            let new = l.bytes_in_flight(d.page_bytes(), CopyMapping::Groups);
            let launch = |f: InFlight| f.per_launch.map_or("-".to_string(), |b| b.to_string());
            out += &format!(
                "| {} | `{buffer}` | {} | `{l}` | {} | {} | {} | {} |\n",
                dep.name,
                d.page_bytes(),
                old.per_warp,
                launch(old),
                new.per_warp,
                launch(new),
            );
            assert!(new.per_launch >= old.per_launch, "{}", dep.name);
        }
    }
    println!("{out}");
}
