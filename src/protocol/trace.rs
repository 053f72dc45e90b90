//! W3C trace context (<https://www.w3.org/TR/trace-context/>), carried and never
//! exported: a script started with a `traceparent` passes its trace on to every
//! `tool.call` and `approval.request`, so that the engine's spans of one agent
//! run form one tree across the sandbox (scriptgate-protocol(7), TRACING).
//! Pure: parsing and formatting; the random span ids come from the caller.

/// The trace context of one script, from `script.start`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// 32 lowercase hex digits, not all zero.
    pub trace_id: String,
    /// The engine's span that started the script: 16 lowercase hex digits.
    pub parent_id: String,
    /// 2 hex digits (bit 0: sampled).
    pub flags: String,
    /// `tracestate`, passed on as it came.
    pub state: Option<String>,
}

/// The longest `tracestate` taken (the W3C limit is 32 members of at most 256
/// characters; 512 bytes is what vendors are advised to propagate at least).
pub const MAX_TRACESTATE_BYTES: usize = 512;

/// What is wrong with a trace context; callers say it in an `invalid params`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    /// Not `00-<trace-id>-<parent-id>-<flags>` in lowercase hex, or an id all zero.
    #[error("`traceparent` must be 00-<32 hex trace-id>-<16 hex parent-id>-<2 hex flags>, lowercase, ids not all zero")]
    Traceparent,
    /// `tracestate` longer than [`MAX_TRACESTATE_BYTES`].
    #[error("`tracestate` is {len} bytes; at most {MAX_TRACESTATE_BYTES}")]
    TracestateTooLong { len: usize },
    /// `tracestate` with a character outside printable ASCII.
    #[error("`tracestate` must be printable ASCII")]
    TracestateNotPrintable,
}

fn hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl TraceContext {
    /// A `traceparent` (version 00) and `tracestate`, or what is wrong with them.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Result<TraceContext, TraceError> {
        let parts: Vec<&str> = traceparent.split('-').collect();
        let [version, trace_id, parent_id, flags] = parts[..] else {
            return Err(TraceError::Traceparent);
        };
        let zero = |s: &str| s.bytes().all(|b| b == b'0');
        if version != "00"
            || !hex(trace_id, 32)
            || !hex(parent_id, 16)
            || !hex(flags, 2)
            || zero(trace_id)
            || zero(parent_id)
        {
            return Err(TraceError::Traceparent);
        }
        if let Some(st) = tracestate {
            if st.len() > MAX_TRACESTATE_BYTES {
                return Err(TraceError::TracestateTooLong { len: st.len() });
            }
            if st.chars().any(|c| !(' '..='~').contains(&c)) {
                return Err(TraceError::TracestateNotPrintable);
            }
        }
        Ok(TraceContext {
            trace_id: trace_id.into(),
            parent_id: parent_id.into(),
            flags: flags.into(),
            state: tracestate.map(str::to_string),
        })
    }

    /// The `traceparent` of the script's requests to the engine: the same
    /// trace, with the span that started the script as their parent.
    pub fn child_traceparent(&self) -> String {
        format!("00-{}-{}-{}", self.trace_id, self.parent_id, self.flags)
    }
}

/// A span id from 8 random bytes: 16 lowercase hex digits, never all zero.
pub fn span_id(bytes: [u8; 8]) -> String {
    let b = if bytes == [0; 8] {
        [0, 0, 0, 0, 0, 0, 0, 1]
    } else {
        bytes
    };
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_is_passed_on_with_its_parent() {
        let t = TraceContext::parse(TP, Some("congo=t61rcWkgMzE")).unwrap();
        assert_eq!(t.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.child_traceparent(), TP);
        assert_eq!(t.state.as_deref(), Some("congo=t61rcWkgMzE"));
    }

    #[test]
    fn malformed_trace_contexts_are_refused() {
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            assert_eq!(
                TraceContext::parse(bad, None),
                Err(TraceError::Traceparent),
                "{bad:?}"
            );
        }
        assert_eq!(
            TraceError::Traceparent.to_string(),
            "`traceparent` must be 00-<32 hex trace-id>-<16 hex parent-id>-<2 hex flags>, lowercase, ids not all zero"
        );
        let e = TraceContext::parse(TP, Some(&"a".repeat(513))).unwrap_err();
        assert_eq!(e, TraceError::TracestateTooLong { len: 513 });
        assert_eq!(e.to_string(), "`tracestate` is 513 bytes; at most 512");
        assert!(TraceContext::parse(TP, Some(&"a".repeat(512))).is_ok());
        let e = TraceContext::parse(TP, Some("a=\n")).unwrap_err();
        assert_eq!(e, TraceError::TracestateNotPrintable);
        assert_eq!(e.to_string(), "`tracestate` must be printable ASCII");
    }

    #[test]
    fn span_ids_are_sixteen_hex_digits_never_zero() {
        assert_eq!(
            span_id([0xde, 0xad, 0, 0, 0, 0, 0, 0x0f]),
            "dead00000000000f"
        );
        assert_eq!(span_id([0; 8]), "0000000000000001");
    }
}
