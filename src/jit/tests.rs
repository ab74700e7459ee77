//! Unit tests of the JIT front end: target names, uri checks, `Jit` thread-safety.

use super::*;

#[test]
fn target_dir_names() {
    assert_eq!(Target::default().to_string(), "sm_90");
    assert_eq!(Target::Nvrtc { arch: Arch::Sm100 }.to_string(), "sm_100");
    assert_eq!(
        Target::Host {
            sanitize: Sanitize::None
        }
        .to_string(),
        "host"
    );
    assert_eq!(
        Target::Host {
            sanitize: Sanitize::Address
        }
        .to_string(),
        "host-asan"
    );
}

#[test]
fn uri_validation() {
    assert!(validate_uri("transfer_pages_ps64_b41984").is_ok());
    assert!(validate_uri("").is_err());
    assert!(validate_uri("9abc").is_err());
    assert!(validate_uri("a/b").is_err());
    assert!(validate_uri("a-b").is_err());
    assert!(validate_uri(&"a".repeat(161)).is_err());
}

#[test]
fn jit_is_send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Jit>();
}
