//! The shared parts of microvm's fuzz targets (`fuzz_targets/`, one per surface a guest or a
//! peer controls; docs/fuzzing.md): the tape every input is read as ([`tape`]), a hostile
//! virtio driver on real guest memory ([`virtq`]), and scratch space ([`scratch`]).

pub mod rt;
pub mod scratch;
pub mod seeds;
pub mod tape;
pub mod virtq;
