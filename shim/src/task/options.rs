//! The runtime options containerd hands the shim: a protobuf `Any` holding
//! `runtimeoptions.v1.Options` (`type_url = 1`, `config_path = 2`, `config_body = 3`), on the
//! stdin of `start` and in `CreateTaskRequest.options`. Only `config_path` (the handler's
//! `ConfigPath`) is used. The message is decoded here by hand: it is three fields, and the
//! containerd-shim crates do not ship its generated type.

use std::path::PathBuf;

use containerd_shim_protos::protobuf::{well_known_types::any::Any, Message};

/// The `type_url` containerd gives the options of a handler configured with `ConfigPath`.
pub const RUNTIME_OPTIONS_TYPE: &str = "runtimeoptions.v1.Options";

/// runc's options type. containerd 2.1 gives a task of a Sandbox API pod (`sandboxer = "shim"`)
/// this type whatever the handler (its `WithTaskAPIEndpoint` puts the pod's endpoint there), and
/// fails when the handler has options of another type: such a handler has no `options` table,
/// so these carry no `ConfigPath` (docs/testing-containerd.md).
pub const RUNC_OPTIONS_TYPE: &str = "containerd.runc.v1.Options";

/// Why the options could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OptionsError {
    /// The bytes are not a protobuf `Any`.
    #[error("runtime options are not a protobuf Any: {0}")]
    NotAny(String),
    /// The `Any` holds another message type.
    #[error("runtime options of type {0:?}; expected {RUNTIME_OPTIONS_TYPE}")]
    WrongType(String),
    /// The inner message is malformed.
    #[error("malformed runtimeoptions.v1.Options: {0}")]
    Malformed(&'static str),
}

/// The `ConfigPath` in encoded `Any` bytes (as on `start`'s stdin). Empty input: no options.
pub fn config_path_from_any_bytes(bytes: &[u8]) -> Result<Option<PathBuf>, OptionsError> {
    if bytes.is_empty() {
        return Ok(None);
    }
    let any = Any::parse_from_bytes(bytes).map_err(|e| OptionsError::NotAny(e.to_string()))?;
    config_path_from_any(&any)
}

/// The `ConfigPath` in a decoded `Any` (as in `CreateTaskRequest.options`).
pub fn config_path_from_any(any: &Any) -> Result<Option<PathBuf>, OptionsError> {
    if any.type_url.is_empty() && any.value.is_empty() {
        return Ok(None);
    }
    // containerd uses the bare name; a "type.googleapis.com/" prefix is accepted too.
    let name = any.type_url.rsplit('/').next().unwrap_or_default();
    if name == RUNC_OPTIONS_TYPE {
        return Ok(None);
    }
    if name != RUNTIME_OPTIONS_TYPE {
        return Err(OptionsError::WrongType(any.type_url.clone()));
    }
    let path = config_path_field(&any.value)?;
    Ok(path.filter(|p| !p.is_empty()).map(PathBuf::from))
}

/// Field 2 (`config_path`, a string) of the encoded `Options` message; other fields skipped.
fn config_path_field(mut buf: &[u8]) -> Result<Option<String>, OptionsError> {
    let mut found = None;
    while !buf.is_empty() {
        let tag = read_varint(&mut buf)?;
        let (field, wire_type) = (tag >> 3, tag & 7);
        match wire_type {
            0 => {
                read_varint(&mut buf)?;
            }
            1 => buf = skip(buf, 8)?,
            5 => buf = skip(buf, 4)?,
            2 => {
                let len = usize::try_from(read_varint(&mut buf)?)
                    .map_err(|_| OptionsError::Malformed("length out of range"))?;
                let value = buf
                    .get(..len)
                    .ok_or(OptionsError::Malformed("length past the end"))?;
                if field == 2 {
                    let s = std::str::from_utf8(value)
                        .map_err(|_| OptionsError::Malformed("config_path is not UTF-8"))?;
                    found = Some(s.to_string());
                }
                buf = &buf[len..];
            }
            _ => return Err(OptionsError::Malformed("unsupported wire type")),
        }
    }
    Ok(found)
}

fn skip(buf: &[u8], n: usize) -> Result<&[u8], OptionsError> {
    buf.get(n..)
        .ok_or(OptionsError::Malformed("fixed-size field past the end"))
}

fn read_varint(buf: &mut &[u8]) -> Result<u64, OptionsError> {
    let mut value: u64 = 0;
    for i in 0..10 {
        let (&byte, rest) = buf
            .split_first()
            .ok_or(OptionsError::Malformed("truncated varint"))?;
        *buf = rest;
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(OptionsError::Malformed("varint longer than 10 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_shim_protos::protobuf::CodedOutputStream;

    fn options(type_url: &str, config_path: &str) -> Any {
        let mut value = Vec::new();
        {
            let mut out = CodedOutputStream::vec(&mut value);
            out.write_string(1, "io.containerd.microvm.v1.config")
                .unwrap();
            out.write_string(2, config_path).unwrap();
            out.write_bytes(3, b"ignored = 1").unwrap();
            out.write_int64(9, -5).unwrap();
            out.flush().unwrap();
        }
        Any {
            type_url: type_url.to_string(),
            value,
            ..Default::default()
        }
    }

    #[test]
    fn reads_config_path_from_stdin_bytes_and_any() {
        let any = options(RUNTIME_OPTIONS_TYPE, "/etc/microvm/test.toml");
        let bytes = any.write_to_bytes().unwrap();
        assert_eq!(
            config_path_from_any_bytes(&bytes).unwrap(),
            Some(PathBuf::from("/etc/microvm/test.toml"))
        );
        let prefixed = options("type.googleapis.com/runtimeoptions.v1.Options", "/x");
        assert_eq!(
            config_path_from_any(&prefixed).unwrap(),
            Some(PathBuf::from("/x"))
        );
    }

    #[test]
    fn no_options_and_empty_path_mean_default() {
        assert_eq!(config_path_from_any_bytes(&[]).unwrap(), None);
        assert_eq!(config_path_from_any(&Any::default()).unwrap(), None);
        let any = options(RUNTIME_OPTIONS_TYPE, "");
        assert_eq!(config_path_from_any(&any).unwrap(), None);
        // runc's options (containerd 2.1's task of a Sandbox API pod) carry no ConfigPath.
        let any = Any {
            type_url: RUNC_OPTIONS_TYPE.to_string(),
            value: vec![0x5a, 0x03, b'/', b'x', b'y'],
            ..Default::default()
        };
        assert_eq!(config_path_from_any(&any).unwrap(), None);
    }

    #[test]
    fn rejects_other_types_and_malformed_bytes() {
        let any = options("containerd.shim.v1.Other", "/x");
        assert!(matches!(
            config_path_from_any(&any),
            Err(OptionsError::WrongType(_))
        ));
        let mut any = options(RUNTIME_OPTIONS_TYPE, "/x");
        any.value.truncate(any.value.len() - 1);
        assert!(matches!(
            config_path_from_any(&any),
            Err(OptionsError::Malformed(_))
        ));
        let bad = Any {
            type_url: RUNTIME_OPTIONS_TYPE.to_string(),
            value: vec![0x12, 0xff, 0xff, 0xff, 0xff, 0x0f],
            ..Default::default()
        };
        assert!(config_path_from_any(&bad).is_err());
        assert!(config_path_from_any_bytes(&[0xff; 3]).is_err());
    }
}
