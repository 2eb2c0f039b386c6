//! The undo record: what setup created, written before it creates anything, so that teardown
//! (in this process or a fresh one after a crash) removes exactly that.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::NetworkError;
use crate::state;

/// Whether setup added the CNI interface's ingress qdisc (teardown deletes it, and our filter
/// with it) or found one there (an `ingress` or `clsact` of someone else's: teardown deletes
/// only our filter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IngressQdisc {
    Added,
    Existing,
}

/// What setup creates for one CNI interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UndoLink {
    pub cni_interface: String,
    pub tap: String,
    pub cni_ingress: IngressQdisc,
}

/// Written (JSON) before setup creates anything; enough for [`teardown`](super::teardown) in a
/// fresh process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UndoRecord {
    pub netns: PathBuf,
    pub links: Vec<UndoLink>,
}

/// Reads an undo record; `None` when there is none.
pub fn read_record(path: &Path) -> Result<Option<UndoRecord>, NetworkError> {
    Ok(state::read_record(path)?)
}

pub(super) fn write_record(path: &Path, undo: &UndoRecord) -> Result<(), NetworkError> {
    Ok(state::write_record(path, undo)?)
}

pub(super) fn remove_record(path: &Path) -> Result<(), NetworkError> {
    Ok(state::remove_record(path)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::network::tap_name;

    #[test]
    fn undo_record_round_trips_and_a_missing_one_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("network.json");
        assert!(read_record(&path).unwrap().is_none());
        let undo = UndoRecord {
            netns: "/var/run/netns/cni-1".into(),
            links: vec![UndoLink {
                cni_interface: "eth0".into(),
                tap: tap_name(0),
                cni_ingress: IngressQdisc::Existing,
            }],
        };
        write_record(&path, &undo).unwrap();
        assert_eq!(read_record(&path).unwrap(), Some(undo));
        let json = std::fs::read_to_string(&path).unwrap();
        assert!(json.contains("\"cni_ingress\": \"existing\""), "{json}");
        remove_record(&path).unwrap();
        remove_record(&path).unwrap();
        std::fs::write(&path, b"{not json").unwrap();
        let err = read_record(&path).unwrap_err().to_string();
        assert!(err.contains("network.json"), "{err}");
    }
}
