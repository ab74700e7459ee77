//! The references' own arithmetic: encoders, prefix hashes, allocator round trips and refusals,
//! transfers of layer ranges in both host layouts, and geometry that overflows.

use super::*;
use half::bf16;

const ALL: [BufferKind; 4] = [
    BufferKind::NsaKv,
    BufferKind::NsaIndexK,
    BufferKind::MlaKv,
    BufferKind::GqaKv {
        kv_heads: 2,
        head_dim: 12,
    },
];

/// e4m3 decoding (no infinities; NaN is S.1111.111).
fn fp8_e4m3(c: u8) -> f32 {
    let (s, e, m) = ((c >> 7) & 1, (c >> 3) & 15, c & 7);
    assert!(!(e == 15 && m == 7), "NaN {c:#x}");
    let v = if e == 0 {
        f32::from(m) / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + f32::from(m) / 8.0) * 2f32.powi(i32::from(e) - 7)
    };
    if s == 1 {
        -v
    } else {
        v
    }
}

// A geometry whose size overflows 64 bits is an error, not a wrapped size that passes
// the length check and then indexes out of bounds.
#[test]
fn overflowing_geometry_is_an_error() {
    let big = 1u64 << 40;
    let err = transfer_pages(
        Direction::DeviceToHost,
        HostLayout::PageFirst,
        big,
        &[],
        &mut [],
        &[0],
        &[0],
        1,
        1 << 12,
        0,
        1 << 12,
        1 << 12,
        1,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            ReferenceError::Overflow {
                what: "device pool",
                ..
            }
        ),
        "{err}"
    );
    let pools: [&[u8]; 2] = [&[], &[]];
    let err = materialise(2, big, &pools, &[1], 1, u32::MAX, u32::MAX, &mut []).unwrap_err();
    assert!(
        matches!(err, ReferenceError::Overflow { what: "pool", .. }),
        "{err}"
    );
}

#[test]
fn encoders_yield_finite_values() {
    for i in 0..200_000u64 {
        let r = mix64(i);
        assert!(fp8_e4m3(enc_fp8(r)).is_finite());
        let f = f32::from_bits(enc_f32(r));
        assert!(
            f.is_finite() && (2f32.powi(-8)..2f32.powi(-7)).contains(&f),
            "{f}"
        );
        assert!(bf16::from_bits(enc_bf16(r)).to_f32().is_finite());
    }
    for c in 0..=255u8 {
        let r = u64::from(c);
        assert_ne!(enc_fp8(r) & 0x7f, 0x7f);
    }
}

#[test]
fn prefix_hash_depends_on_the_whole_prefix() {
    let a = prefix_hashes(&[1, 2, 3]);
    let b = prefix_hashes(&[9, 2, 3]);
    assert_eq!(a.len(), 3);
    assert!(a.iter().zip(&b).all(|(x, y)| x != y));
    assert_eq!(prefix_hashes(&[1, 2]), a[..2]);
}

#[test]
fn synth_depends_only_on_hash_layer_and_slot_position() {
    for b in ALL {
        let ps = 16;
        let pb = b.page_bytes(ps) as usize;
        let (mut p1, mut p2) = (vec![0xA5u8; pb], vec![0x00u8; pb]);
        synth_token(b, ps, 42, 3, 5, &mut p1).unwrap();
        synth_token(b, ps, 42, 3, 5, &mut p2).unwrap();
        let fields = b.field_layouts(ps);
        let token_bytes = |p: &[u8]| -> Vec<u8> {
            fields
                .iter()
                .flat_map(|f| {
                    (0..f.count).flat_map(|e| {
                        let o = f.offset(5, e);
                        p[o..o + f.dtype.size() as usize].to_vec()
                    })
                })
                .collect()
        };
        assert_eq!(token_bytes(&p1), token_bytes(&p2), "{b}");
        let mut p3 = vec![0u8; pb];
        synth_token(b, ps, 42, 4, 5, &mut p3).unwrap();
        assert_ne!(token_bytes(&p1), token_bytes(&p3), "{b}: layer must matter");
        let mut p4 = vec![0u8; pb];
        synth_token(b, ps, 43, 3, 5, &mut p4).unwrap();
        assert_ne!(token_bytes(&p1), token_bytes(&p4), "{b}: hash must matter");
        // Only the token's own bytes were written.
        let written = p1.iter().filter(|&&x| x != 0xA5).count();
        assert!(written <= b.bytes_per_token() as usize);
    }
}

#[test]
fn select_then_release_round_trips() {
    let (cp, cap) = (4u8, 8u32);
    // Fresh lanes: pages of owner o in descending order, page 0 excluded.
    let mut stacks = vec![0u32; 4 * cap as usize];
    let mut tops = vec![0u32; 4];
    for o in 0..4u32 {
        let mut pages: Vec<u32> = (0..cap * 4).filter(|p| p % 4 == o && *p != 0).collect();
        pages.reverse();
        for (k, p) in pages.iter().enumerate() {
            stacks[(o * cap) as usize + k] = *p;
        }
        tops[o as usize] = pages.len() as u32;
    }
    let (stacks0, tops0) = (stacks.clone(), tops.clone());
    let owners = [0u8, 1, 1, 3, 0, 2, 1];
    let mut status = [0u32; 6];
    let (pages, locs) =
        select_owner_pages(cp, 4, &owners, &stacks, &mut tops, cap, &mut status).unwrap();
    assert_eq!(pages, [4, 1, 5, 3, 8, 2, 9]);
    assert!(pages.iter().zip(owners).all(|(p, o)| p % 4 == u32::from(o)));
    assert_eq!(&locs[..5], &[16, 17, 18, 19, 4]);
    assert_eq!(tops, [5, 5, 7, 7]);
    assert_eq!(status, [0; 6], "a granted launch leaves the status alone");
    // Releasing in reverse order restores the stacks exactly.
    let rev: Vec<u32> = pages.iter().rev().copied().collect();
    release_pages(cp, &rev, &mut stacks, &mut tops, cap, &mut status).unwrap();
    assert_eq!((stacks, tops), (stacks0, tops0));
    assert_eq!(status, [0; 6], "a granted release leaves the status alone");
}

#[test]
fn an_overflowing_lane_or_an_invalid_page_refuses_the_whole_release() {
    // Two lanes of 2 slots: lane 0 holds page 2 (one slot free), lane 1 is empty.
    let stacks0 = vec![2u32, 7, 9, 9];
    let tops0 = vec![1u32, 0];
    let mut status = vec![0u32; 4];
    // Lane 0 gets page 2 twice (a double free: it already holds it) and has room for
    // one: lane 1's page is not pushed either.
    let (mut stacks, mut tops) = (stacks0.clone(), tops0.clone());
    release_pages(2, &[2, 1, 2], &mut stacks, &mut tops, 2, &mut status).unwrap();
    assert_eq!((&stacks, &tops), (&stacks0, &tops0));
    assert_eq!(status, [1, 1, 0, 0]);
    // Page 0, and page 4 (local index 2 of a 2-slot lane), are invalid even where every
    // lane has room; the words add up, saturating.
    status[3] = u32::MAX - 1;
    release_pages(2, &[3, 0, 4], &mut stacks, &mut tops, 2, &mut status).unwrap();
    assert_eq!((&stacks, &tops), (&stacks0, &tops0));
    assert_eq!(status, [2, 1, 0, u32::MAX]);
    // What fits is pushed in input order, and the status stays as it was.
    release_pages(2, &[1, 3], &mut stacks, &mut tops, 2, &mut status).unwrap();
    assert_eq!(stacks, [2, 7, 1, 3]);
    assert_eq!(tops, [1, 2]);
    assert_eq!(status, [2, 1, 0, u32::MAX]);
    // Tops beyond the capacity are clamped first: a full lane refuses one more page.
    let mut tops = vec![5u32, 0];
    release_pages(2, &[2], &mut stacks, &mut tops, 2, &mut status).unwrap();
    assert_eq!(tops, [5, 0], "a refused release changes no top");
    assert_eq!(status, [3, 2, 0, u32::MAX]);
}

#[test]
fn a_short_lane_or_a_bad_owner_refuses_the_whole_launch() {
    // Lane 0 holds one page (2; slot 1 is free), lane 1 two (3, then 1): pops come from
    // the top.
    let stacks = vec![2u32, 4, 1, 3];
    let tops0 = vec![1u32, 2];
    // Lane 0 asked for 2, has 1: nothing is taken from lane 1 either.
    let (mut tops, mut status) = (tops0.clone(), vec![0u32; 4]);
    let (pages, locs) =
        select_owner_pages(2, 2, &[0, 1, 0], &stacks, &mut tops, 2, &mut status).unwrap();
    assert_eq!(pages, [0, 0, 0]);
    assert_eq!(locs, [0, 1, 0, 1, 0, 1], "page 0's slots");
    assert_eq!(tops, tops0);
    assert_eq!(status, [1, 1, 0, 0]);
    // A bad owner alone refuses too; the words add up (saturating).
    status[0] = u32::MAX;
    let (pages, _) =
        select_owner_pages(2, 2, &[1, 7, 9], &stacks, &mut tops, 2, &mut status).unwrap();
    assert_eq!(pages, [0, 0, 0]);
    assert_eq!(tops, tops0);
    assert_eq!(status, [u32::MAX, 1, 0, 2]);
    // Tops beyond the capacity are clamped before the check, and written back clamped.
    let mut tops = vec![5u32, 2];
    let (pages, _) = select_owner_pages(2, 1, &[0, 0], &stacks, &mut tops, 2, &mut status).unwrap();
    assert_eq!(
        pages,
        [4, 2],
        "lane 0 has 2 slots, not 5: the first pop is slot 1"
    );
    assert_eq!(tops, [0, 2]);
    assert_eq!(status, [u32::MAX, 1, 0, 2], "granted: unchanged");
    let mut tops = tops0.clone();
    assert!(select_owner_pages(2, 1, &[0], &stacks[..3], &mut tops, 2, &mut status).is_err());
    assert!(select_owner_pages(0, 1, &[0], &stacks, &mut tops, 2, &mut status).is_err());
    assert!(select_owner_pages(2, 1, &[0], &stacks, &mut tops, 2, &mut status[..3]).is_err());
}

/// The select without token locations is the select with them, less the locations: the
/// same pages, tops and status words, granted or refused; the locations follow from the
/// pages alone.
#[test]
fn select_pages_is_select_owner_pages_without_the_locations() {
    let stacks = vec![2u32, 4, 1, 3];
    for owners in [&[1u8, 0, 1][..], &[0, 1, 0], &[1, 7]] {
        let (mut tops_a, mut status_a) = (vec![1u32, 2], vec![0u32; 4]);
        let (mut tops_b, mut status_b) = (tops_a.clone(), status_a.clone());
        let (pages, locs) =
            select_owner_pages(2, 4, owners, &stacks, &mut tops_a, 2, &mut status_a).unwrap();
        let only = select_pages(2, owners, &stacks, &mut tops_b, 2, &mut status_b).unwrap();
        assert_eq!(only, pages, "{owners:?}");
        assert_eq!((tops_b, status_b), (tops_a, status_a), "{owners:?}");
        assert_eq!(page_locs(4, &only).unwrap(), locs, "{owners:?}");
    }
    assert!(page_locs(3, &[1]).is_err());
}

#[test]
fn transfer_round_trips_in_both_layouts() {
    let (pb, layers, dev_pages, host_pages) = (32u64, 3u32, 5u32, 4u32);
    let dev: Vec<u8> = (0..(pb * 3 * 5)).map(|i| (i * 7 % 251) as u8).collect();
    for layout in [HostLayout::PageFirst, HostLayout::LayerFirst] {
        let mut host = vec![0xA5u8; (pb * 3 * 4) as usize];
        let (d, h) = ([1u32, 4, 2, 9], [3u32, 0, 1, 2]);
        transfer_pages(
            Direction::DeviceToHost,
            layout,
            pb,
            &dev,
            &mut host,
            &d,
            &h,
            4,
            layers,
            0,
            layers,
            dev_pages,
            host_pages,
        )
        .unwrap();
        let mut back = vec![0xA5u8; dev.len()];
        transfer_pages(
            Direction::HostToDevice,
            layout,
            pb,
            &host,
            &mut back,
            &h,
            &d,
            4,
            layers,
            0,
            layers,
            dev_pages,
            host_pages,
        )
        .unwrap();
        for l in 0..layers {
            for p in 0..dev_pages {
                let o = device_offset(p, l, dev_pages, pb) as usize;
                let moved = [1, 4, 2].contains(&p);
                let want = if moved {
                    &dev[o..o + 32]
                } else {
                    &[0xA5u8; 32][..]
                };
                assert_eq!(&back[o..o + 32], want, "{layout} l{l} p{p}");
            }
        }
    }
}

#[test]
fn transfer_of_a_layer_range_moves_only_those_layers() {
    let (pb, layers, dev_pages, host_pages) = (16u64, 3u32, 4u32, 4u32);
    let dev: Vec<u8> = (0..(pb * 3 * 4)).map(|i| (i * 7 % 251) as u8 | 1).collect();
    for layout in [HostLayout::PageFirst, HostLayout::LayerFirst] {
        for (first, count) in [(1u32, 1u32), (2, 5), (0, 0), (3, 1), (u32::MAX, 2)] {
            let mut host = vec![0u8; (pb * 3 * 4) as usize];
            transfer_pages(
                Direction::DeviceToHost,
                layout,
                pb,
                &dev,
                &mut host,
                &[1, 3],
                &[2, 0],
                2,
                layers,
                first,
                count,
                dev_pages,
                host_pages,
            )
            .unwrap();
            let range = crate::kernels::clamp_layer_range(first, count, layers);
            for l in 0..layers {
                for (d, h) in [(1u32, 2u32), (3, 0)] {
                    let o = host_offset(layout, h, l, layers, host_pages, pb) as usize;
                    let s = device_offset(d, l, dev_pages, pb) as usize;
                    let page = &host[o..o + pb as usize];
                    if range.contains(&l) {
                        assert_eq!(
                            page,
                            &dev[s..s + pb as usize],
                            "{layout} {first}+{count} l{l}"
                        );
                    } else {
                        assert!(
                            page.iter().all(|&b| b == 0),
                            "{layout} {first}+{count} l{l}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn transfer_refuses_one_destination_page_twice() {
    let (pb, layers, pages) = (32u64, 1u32, 4u32);
    let dev = vec![1u8; (pb * 4) as usize];
    let mut host = vec![0xA5u8; (pb * 4) as usize];
    let run = |n: u32, host: &mut [u8]| {
        transfer_pages(
            Direction::DeviceToHost,
            HostLayout::PageFirst,
            pb,
            &dev,
            host,
            &[0, 1, 2],
            &[3, 0, 3],
            n,
            layers,
            0,
            layers,
            pages,
            pages,
        )
    };
    let err = run(3, &mut host).unwrap_err();
    assert!(
        matches!(
            err,
            ReferenceError::DuplicateDestination(crate::kernels::DuplicateDestination {
                page: 3,
                first: 0,
                second: 2
            })
        ),
        "{err}"
    );
    assert!(host.iter().all(|&b| b == 0xA5), "nothing moved");
    // Only the first n pairs count: two distinct pages move.
    run(2, &mut host).unwrap();
    let moved = host
        .chunks(pb as usize)
        .map(|p| p[0] == 1)
        .collect::<Vec<_>>();
    assert_eq!(moved, [true, false, false, true]);
}

#[test]
fn synthesise_materialise_verify_agree() {
    for b in ALL {
        let (cp, ps, layers, local) = (4u8, 16u32, 2u32, 6u32);
        let pb = b.page_bytes(ps);
        let tokens: Vec<u32> = (0..70).map(|i| i * 31 + 7).collect();
        let hashes = prefix_hashes(&tokens);
        let seq_pages = [5u32, 2, 11, 8, 3];
        let mut pools: Vec<Vec<u8>> = (0..cp)
            .map(|_| vec![0xA5u8; (u64::from(layers * local) * pb) as usize])
            .collect();
        for (rank, pool) in pools.iter_mut().enumerate() {
            synthesise(
                b,
                cp,
                ps,
                TokenOrder::Paged,
                pool,
                &hashes,
                &seq_pages,
                70,
                0,
                rank as u32,
                layers,
                local,
            )
            .unwrap();
        }
        let views: Vec<&[u8]> = pools.iter().map(|p| p.as_slice()).collect();
        let mut dense = vec![0u8; (u64::from(layers) * 5 * pb) as usize];
        materialise(cp, pb, &views, &seq_pages, 5, layers, local, &mut dense).unwrap();
        let bad_tokens = |words: Vec<u32>| -> Vec<u32> {
            assert_eq!(words.len(), 3, "70 tokens take 3 words");
            (0..96)
                .filter(|&t| words[t / 32] >> (t % 32) & 1 == 1)
                .map(|t| t as u32)
                .collect()
        };
        assert_eq!(
            bad_tokens(verify(b, ps, TokenOrder::Paged, &dense, &hashes, 70, 0, layers).unwrap()),
            Vec::<u32>::new(),
            "{b}"
        );
        // Poison rank 3: its pages 11 (tokens 32..48) and 3 (tokens 64..70) mismatch.
        let mut broken = pools.clone();
        broken[3] = vec![0xA5u8; broken[3].len()];
        let views: Vec<&[u8]> = broken.iter().map(|p| p.as_slice()).collect();
        materialise(cp, pb, &views, &seq_pages, 5, layers, local, &mut dense).unwrap();
        assert_eq!(
            bad_tokens(verify(b, ps, TokenOrder::Paged, &dense, &hashes, 70, 0, layers).unwrap()),
            (32..48).chain(64..70).collect::<Vec<u32>>(),
            "{b}"
        );
        assert_eq!(
            bad_tokens(verify(b, ps, TokenOrder::Paged, &dense, &hashes, 70, 3, layers).unwrap()),
            (64..70).collect::<Vec<u32>>(),
            "{b}"
        );
    }
}

/// Token-interleaved: each rank's pages hold its runs; materialised pages equal the
/// reference dense buffer, and a rank's lost pool flags exactly its tokens.
#[test]
fn interleaved_synthesise_materialise_verify_agree() {
    let (cp, ps, layers, local, run) = (4u8, 8u32, 2u32, 4u32, 2u32);
    let order = TokenOrder::Interleaved { cp, run };
    for b in [BufferKind::MlaKv, BufferKind::NsaIndexK] {
        let pb = b.page_bytes(ps);
        let n = 45u32; // one whole granule of 32 tokens and 13 more
        let tokens: Vec<u32> = (0..n).map(|i| i * 13 + 1).collect();
        let hashes = prefix_hashes(&tokens);
        // Two aligned groups: local pages 2 and 1 of every rank.
        let seq_pages = [8u32, 9, 10, 11, 4, 5, 6, 7];
        let mut pools: Vec<Vec<u8>> = (0..cp)
            .map(|_| vec![0xA5u8; (u64::from(layers * local) * pb) as usize])
            .collect();
        for (rank, pool) in pools.iter_mut().enumerate() {
            synthesise(
                b,
                cp,
                ps,
                order,
                pool,
                &hashes,
                &seq_pages,
                n,
                0,
                rank as u32,
                layers,
                local,
            )
            .unwrap();
        }
        let views: Vec<&[u8]> = pools.iter().map(|p| p.as_slice()).collect();
        let mut got = vec![0u8; (u64::from(layers) * 8 * pb) as usize];
        materialise(cp, pb, &views, &seq_pages, 8, layers, local, &mut got).unwrap();
        assert_eq!(got, dense(b, ps, order, &hashes, n, layers).unwrap(), "{b}");
        let ok = verify(b, ps, order, &got, &hashes, n, 0, layers).unwrap();
        assert!(ok.iter().all(|&w| w == 0), "{b}");
        let mut broken = pools.clone();
        broken[1] = vec![0xA5u8; broken[1].len()];
        let views: Vec<&[u8]> = broken.iter().map(|p| p.as_slice()).collect();
        materialise(cp, pb, &views, &seq_pages, 8, layers, local, &mut got).unwrap();
        let bad = verify(b, ps, order, &got, &hashes, n, 0, layers).unwrap();
        let flagged: Vec<u32> = (0..n)
            .filter(|&t| bad[(t / 32) as usize] >> (t % 32) & 1 == 1)
            .collect();
        // Rank 1 holds runs 1, 5, 9, ... of each granule: tokens 2,3 10,11 ... 34,35 42,43.
        let want: Vec<u32> = (0..n).filter(|t| (t / run) % u32::from(cp) == 1).collect();
        assert_eq!(flagged, want, "{b}");
    }
}
