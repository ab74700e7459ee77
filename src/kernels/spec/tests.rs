use super::*;

#[test]
fn buffer_sizes_match_the_design() {
    assert_eq!(BufferKind::NsaKv.bytes_per_token(), 656);
    assert_eq!(BufferKind::NsaIndexK.bytes_per_token(), 132);
    assert_eq!(BufferKind::MlaKv.bytes_per_token(), 1152);
    assert_eq!(BufferKind::NsaIndexK.page_bytes(64), 8448);
}

#[test]
fn field_layouts_tile_the_page_exactly() {
    for b in [BufferKind::NsaKv, BufferKind::NsaIndexK, BufferKind::MlaKv] {
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
    for b in [BufferKind::NsaKv, BufferKind::NsaIndexK, BufferKind::MlaKv] {
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
    for b in [BufferKind::NsaKv, BufferKind::NsaIndexK, BufferKind::MlaKv] {
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
            }),
            KernelSpec::ReleasePages(ReleaseSpec { cp, threads: 256 }),
            KernelSpec::TransferPages(TransferSpec {
                second_bytes_per_token: None,
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
    let select = KernelSpec::SelectOwnerPages(AllocSpec {
        cp: 8,
        page_size: 64,
        threads: 256,
    });
    assert_eq!(
        render_params(&select.params()),
        "    const u8* __restrict__ owners, u32 n, const u32* __restrict__ lane_stacks,\n    \
         u32* __restrict__ lane_tops, u32 lane_cap, u32* __restrict__ out_pages,\n    \
         i64* __restrict__ out_locs, u32* __restrict__ status)"
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
        KernelSpec::ReleasePages(ReleaseSpec { cp: 8, threads: 32 }),
        KernelSpec::TransferPages(TransferSpec {
            second_bytes_per_token: None,
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
    assert_eq!(families.len(), 6, "one spec per family");
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
    })
}

/// A transfer's grid is sized by the layer count of the launch: one layer of a per-layer
/// load gets a layer's worth of blocks, and the signature carries the range.
#[test]
fn a_capped_copy_grid_is_at_most_its_cap_and_named_by_it() {
    let spec = |max_blocks| {
        KernelSpec::TransferPages(TransferSpec {
            second_bytes_per_token: None,
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
    // 2,048 NSA pages × 61 layers: 65,536 blocks uncapped (the grid limit), 4 capped.
    assert_eq!(spec(0).launch_dims(2048, 61).grid, 65536);
    let d = spec(4).launch_dims(2048, 61);
    assert_eq!((d.grid, d.block), (4, 512));
    // Less work than the cap: one block per item.
    assert_eq!(spec(4).launch_dims(3, 1).grid, 3);
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
fn transfer_grids_follow_the_launch_layer_count() {
    let t = |layers_in_block| {
        KernelSpec::TransferPages(TransferSpec {
            second_bytes_per_token: None,
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
    assert_eq!(t(false).launch_dims(10, 61).grid, 5 * 61);
    assert_eq!(t(false).launch_dims(10, 1).grid, 5);
    assert_eq!(t(false).launch_dims(10, 0).grid, 1);
    assert_eq!(t(true).launch_dims(10, 61).grid, 5);
    assert_eq!(t(true).launch_dims(10, 1).grid, 5);
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
