//! The on/off switches the crate reads from the environment, parsed in one place so that
//! every variable accepts the same spellings.

/// `1`, `on`, `true`, `yes` → `Some(true)`; `0`, `off`, `false`, `no` and empty →
/// `Some(false)`; anything else → `None` (case-insensitive, surrounding spaces ignored).
pub(crate) fn parse_switch(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "on" | "true" | "yes" => Some(true),
        "" | "0" | "off" | "false" | "no" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_accept_the_usual_spellings_and_nothing_else() {
        for on in ["1", "on", "TRUE", " yes "] {
            assert_eq!(parse_switch(on), Some(true), "{on}");
        }
        for off in ["", "0", "Off", "false", "no"] {
            assert_eq!(parse_switch(off), Some(false), "{off}");
        }
        for bad in ["2", "enabled", "of"] {
            assert_eq!(parse_switch(bad), None, "{bad}");
        }
    }
}
